"""nqanh/affordance-net's ROIAlignment (caffe-affordance-net roi_alignment_layer.cpp / .cu, 8db1b3f),
and the gradient layers of its domain-adaptation fork (ivalab/affordanceNet_DA).

GradientScaler (gradient_scaler_layer.cpp; gradient_scaler_param scale_factor [0]; ddtm/caffe's RevGrad
copy, read by its schedule fields, multiplies by -coeff(iteration): training here uses the value it
reaches at max_iter, see revgrad_final_coeff) and GradientSilent
(gradient_silent_layer.cpp / .cu): the top shares bottom 0's data; backward multiplies the gradient
by scale_factor (a negative one reverses it, as domain-adversarial training does), or, for
GradientSilent, passes it where the optional second bottom's first value (need_backprop) is non-zero
and zeroes it otherwise (the GPU code, which the fork trains with; its CPU code always zeroes it).
Here the forward is the identity and torch's backward scales the same way.

ROIAlignment:

rois are (R, 5) = [batch, x1, y1, x2, y2] in input pixels.  Each corner is scaled by spatial_scale
(float32, no rounding); the roi is max(y2 - y1 + 1, 1) high (width likewise) and bin (i, j) spans
[i * bin_h + y1, (i + 1) * bin_h + y1], both ends clamped to [0, H - 1] (C's fmaxf/fminf, so a NaN
end becomes 0).  The output is one bilinear sample at the clamped window's centre, between
floor(centre) and ceil(centre) clamped to the map, weight centre - floor(centre); the fork multiplies
value * (1 - wy) * (1 - wx) and sums the four corners in that order, as done here.  The fork zeroes a
bin whose clamped end lies before its start, which finite rois never give (bin sizes are > 0).
Top: (R, C, pooled_h, pooled_w), like ROIPooling.

The sample points are computed on the CPU in float32, the gathers on the input's device.
ONNX: written out with elementwise ops and GatherND in the same float32 order (ONNX RoiAlign samples
unclamped windows, so it would differ at the border).
"""
import math

import numpy as np
import torch

from ..errors import ExportError
from .registry import Layer, LayerError, need_blobs, register_layer, torch_sources
from .roi_pooling import ROIS_WANTED, RoiLayerSpec, _check_roi_shapes, pooled_grid_attrs, roi_rows

# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------


def alignment_points(start, bin_size, pooled: int, size: int):
    """The fork's sample positions along one axis for (R,) float32 roi starts and bin sizes ->
    (low index, high index, weight of the high one), each (R, pooled)."""
    f32 = torch.float32
    k = torch.arange(pooled, dtype=f32)[None, :]
    zero = torch.zeros((), dtype=f32)
    last = torch.tensor(float(size - 1), dtype=f32)
    lo = torch.fmin(torch.fmax(k * bin_size[:, None] + start[:, None], zero), last)
    hi = torch.fmin(torch.fmax((k + 1.0) * bin_size[:, None] + start[:, None], zero), last)
    centre = (lo + hi) / 2.0
    low = torch.floor(centre)
    ratio = centre - low
    return low.long().clamp(0, size - 1), torch.ceil(centre).long().clamp(0, size - 1), ratio


def roi_alignment(x, rois, ph: int, pw: int, spatial_scale: float):
    """affordance-net's ROIAlignment -> (R, C, ph, pw)."""
    f32 = torch.float32
    r = roi_rows(rois, "ROIAlignment")
    n, _c, h, w = x.shape
    batch = r[:, 0].long()   # C's (int) cast truncates, as .long() does
    bad = [int(b) for b in batch if not 0 <= int(b) < n]
    if bad:
        raise ValueError(f"ROIAlignment: roi batch index {bad[0]} is outside the batch of {n}")
    corners = r[:, 1:5] * torch.tensor(spatial_scale, dtype=f32)   # x1, y1, x2, y2
    one = torch.ones((), dtype=f32)
    height = torch.fmax(corners[:, 3] - corners[:, 1] + 1.0, one)
    width = torch.fmax(corners[:, 2] - corners[:, 0] + 1.0, one)
    top, bottom, wy = alignment_points(corners[:, 1], height / float(ph), ph, h)
    left, right, wx = alignment_points(corners[:, 0], width / float(pw), pw, w)
    dev = x.device
    b = batch.to(dev)[:, None, None]
    top, bottom, left, right = (t.to(dev) for t in (top, bottom, left, right))
    wy = wy.to(dev, x.dtype)[:, None, :, None]   # (R, 1, ph, 1)
    wx = wx.to(dev, x.dtype)[:, None, None, :]   # (R, 1, 1, pw)

    def corner(rows, cols):   # (R, C, ph, pw)
        return x[b, :, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2)

    return (corner(top, left) * (1.0 - wy) * (1.0 - wx)
            + corner(top, right) * (1.0 - wy) * wx
            + corner(bottom, left) * wy * (1.0 - wx)
            + corner(bottom, right) * wy * wx)


TORCH_ROI_ALIGNMENT = torch_sources(alignment_points, roi_alignment)


# ---- the spec ----------------------------------------------------------------------------

@register_layer("ROIAlignment")
class ROIAlignmentLayer(RoiLayerSpec):
    roi_fn, roi_source = staticmethod(roi_alignment), TORCH_ROI_ALIGNMENT

    def parse(self, lp):
        need_blobs(lp, "ROIAlignment", 2, roles="data, rois")
        return pooled_grid_attrs(lp.roi_alignment_param, "roi_alignment_param")

    def infer(self, attrs, in_shapes):
        _check_roi_shapes("ROIAlignment", in_shapes)
        s, r = in_shapes
        return [(r[0], s[1], attrs["ph"], attrs["pw"])]

    def roi_args(self, attrs):
        return (attrs["ph"], attrs["pw"]), {"spatial_scale": attrs["scale"]}

    def onnx(self, ctx, node):
        a = node.attrs
        x, rois = node.inputs
        if math.prod(ctx.shape(rois)[1:]) != 5:
            raise ExportError(f"layer '{node.name}' (ROIAlignment): {ROIS_WANTED}, the net declares "
                              f"{list(ctx.shape(rois))}; give their shape with --input-shape")
        _n, _c, h, w = ctx.shape(x)
        g = _OnnxGraph(ctx)
        flat = g.op("Reshape", rois, g.i64([-1, 5]))
        batch = g.op("Cast", g.op("Slice", flat, g.i64([0]), g.i64([1]), g.i64([1])), to=7)   # (R, 1) int64
        corners = g.op("Mul", g.op("Slice", flat, g.i64([1]), g.i64([5]), g.i64([1])), g.f32(a["scale"]))
        col = lambda k: g.op("Slice", corners, g.i64([k]), g.i64([k + 1]), g.i64([1]))   # (R, 1)
        x1, y1, x2, y2 = (col(k) for k in range(4))
        top, bottom, wy = _onnx_points(g, y1, y2, a["ph"], h)
        left, right, wx = _onnx_points(g, x1, x2, a["pw"], w)
        data = g.op("Transpose", x, perm=[0, 2, 3, 1])   # (N, H, W, C) for GatherND
        r_ph = lambda t: g.op("Unsqueeze", t, g.i64([2]))   # (R, ph) -> (R, ph, 1)
        r_pw = lambda t: g.op("Unsqueeze", t, g.i64([1]))   # (R, pw) -> (R, 1, pw)
        shape = g.op("Concat", g.op("Shape", top), g.i64([a["pw"], 1]), axis=0)   # (R, ph, pw, 1)
        b3 = g.op("Expand", g.op("Unsqueeze", batch, g.i64([2, 3])), shape)

        def corner(rows, cols):   # (R, ph, pw, C)
            idx = g.op("Concat", b3, g.op("Expand", g.op("Unsqueeze", r_ph(rows), g.i64([3])), shape),
                       g.op("Expand", g.op("Unsqueeze", r_pw(cols), g.i64([3])), shape), axis=3)
            return g.op("GatherND", data, idx)

        wy4 = g.op("Unsqueeze", wy, g.i64([2, 3]))   # (R, ph, 1, 1)
        wx4 = g.op("Unsqueeze", wx, g.i64([1, 3]))   # (R, 1, pw, 1)
        uy = g.op("Sub", g.f32(1.0), wy4)
        ux = g.op("Sub", g.f32(1.0), wx4)
        terms = [g.op("Mul", g.op("Mul", corner(top, left), uy), ux),
                 g.op("Mul", g.op("Mul", corner(top, right), uy), wx4),
                 g.op("Mul", g.op("Mul", corner(bottom, left), wy4), ux),
                 g.op("Mul", g.op("Mul", corner(bottom, right), wy4), wx4)]
        total = g.op("Add", g.op("Add", g.op("Add", terms[0], terms[1]), terms[2]), terms[3])
        ctx.add_node("Transpose", [total], [node.outputs[0]], name=node.name, perm=[0, 3, 1, 2])



class _OnnxGraph:
    """The context's helpers (OnnxContext.op/i64/f32), op taking its inputs as arguments and naming its
    output after the op type."""

    def __init__(self, ctx):
        self.ctx, self.i64, self.f32 = ctx, ctx.i64, ctx.f32

    def op(self, kind, *inputs, **attrs):
        return self.ctx.op(kind, list(inputs), kind.lower(), **attrs)


def _onnx_points(g, start, end, pooled, size):
    """ONNX form of alignment_points for (R, 1) scaled corners: (low, high) int64 and the weight, (R, pooled)."""
    extent = g.op("Max", g.op("Add", g.op("Sub", end, start), g.f32(1.0)), g.f32(1.0))
    bin_size = g.op("Div", extent, g.f32(float(pooled)))
    k = g.f32(np.arange(pooled, dtype=np.float32)[None, :])
    k1 = g.f32(np.arange(1, pooled + 1, dtype=np.float32)[None, :])
    clamp = lambda t: g.op("Min", g.op("Max", t, g.f32(0.0)), g.f32(float(size - 1)))
    lo = clamp(g.op("Add", g.op("Mul", k, bin_size), start))
    hi = clamp(g.op("Add", g.op("Mul", k1, bin_size), start))
    centre = g.op("Div", g.op("Add", lo, hi), g.f32(2.0))
    low = g.op("Floor", centre)
    ratio = g.op("Sub", centre, low)
    as_index = lambda t: g.op("Cast", g.op("Min", g.op("Max", t, g.f32(0.0)), g.f32(float(size - 1))), to=7)
    return as_index(low), as_index(g.op("Ceil", centre)), ratio


# ---- GradientScaler / GradientSilent ------------------------------------------------------------

class ScaledGradient(torch.autograd.Function):
    """The identity forward; backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


_REVGRAD_FIELDS = ("lower_bound", "upper_bound", "alpha", "max_iter", "threshold_iter")


def revgrad_final_coeff(lower_bound, upper_bound, alpha, max_iter):
    """ddtm/caffe's (RevGrad) gradient reversal coefficient once iter reaches max_iter (progress 1):
    2 h / (1 + exp(-alpha)) - h + lower_bound, h = upper_bound - lower_bound, in float32 as its C++."""
    if not lower_bound <= upper_bound or alpha < 0 or max_iter < 1:
        raise LayerError(f"gradient_scaler_param needs lower_bound <= upper_bound, alpha >= 0 and max_iter >= 1 "
                         f"(the fork's checks), got {lower_bound:g}, {upper_bound:g}, {alpha:g}, {max_iter:g}")
    f = np.float32
    height = f(upper_bound) - f(lower_bound)
    return float(f(2) * height / (f(1) + np.exp(-f(alpha), dtype=f)) - height + f(lower_bound))


@register_layer("GradientScaler", "GradientSilent")
class GradientScaler(Layer):
    def parse(self, lp):
        need_blobs(lp, lp.type, 1 if lp.type == "GradientScaler" else (1, 2))
        if lp.type == "GradientSilent":
            return {"scale": 0.0}
        p = lp.gradient_scaler_param
        if not any(p.HasField(f) for f in _REVGRAD_FIELDS):
            return {"scale": float(p.scale_factor)}
        if p.HasField("scale_factor"):
            raise LayerError("gradient_scaler_param mixes affordanceNet_DA's scale_factor with ddtm/caffe's "
                             "schedule (lower_bound, upper_bound, alpha, max_iter): set one or the other")
        coeff = revgrad_final_coeff(p.lower_bound, p.upper_bound, p.alpha, p.max_iter)
        return {"scale": -coeff, "reading_notes": [
            f"GradientScaler reverses the gradient by ddtm/caffe's schedule; caffeq trains with its value "
            f"from max_iter on, -{coeff:.6g} (the fork starts at -1 and follows the solver's iteration)"]}

    def forward(self, attrs, params, x, need_backprop=None):
        if not (torch.is_grad_enabled() and x.requires_grad):
            return x
        scale = attrs["scale"]
        if need_backprop is not None:
            scale = float(need_backprop.reshape(-1)[0] != 0)
        return ScaledGradient.apply(x, scale)

    def onnx(self, ctx, node):
        ctx.add_node("Identity", [node.inputs[0]], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        return emit.inputs[0]   # model.py infers: the gradient's scale does not matter there
