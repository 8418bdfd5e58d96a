"""aharley/segaware's NormConvMeanfield (dc45b8a, norm_conv_meanfield_layer.cpp / _iteration.cpp / .cu;
the "res" DeepLab nets): CRF-RNN's mean-field inference with its two permutohedral filters replaced by
two segmentation-aware NormConv filters.

Bottoms: unaries U (N, C, H, W), the first scores Q (same shape), the bilateral features F_b and the
spatial features F_s (any channels, H x W).  Blobs: the spatial weights W_s, the bilateral weights W_b and
the compatibility M, each (1, 1, C, C) (I, I and -I unless a caffemodel gives them).  Each of
num_iterations (at least 2) steps computes
  P = softmax of Q over the channels,
  S = NormConv(P, F_s), B = NormConv(P, F_b),
  Q = U - M (W_s S + W_b B)            (C x C matrices over the channels, per pixel)
and the last Q is the top (N, C, H, W), not normalized.  NormConv(P, F) at each pixel weights the
kernel's taps by the softmax over the taps of -scale x Im2dist(F) (the L2 distance 0.5 sum (F_c - F'_c)^2
of each tap's features from the centre's; FLT_MAX / 100 at the centre with remove_center and off the map
with remove_bounds, both true by default) and sums P's zero-padded windows with those weights.
norm_conv_meanfield_param's repeated kernel_size, pad, dilation, stride, scale, remove_center and
remove_bounds give the bilateral filter's value first, then the spatial filter's (kernel_size twice; the
others twice or not at all).  Where not given: pad 0, stride 1, dilation 0 and scale 0 (the fork's
integer constants: its `const int kDefaultScale = 0.1`), remove_center and remove_bounds true.  Each filter
must keep H x W, which the fork assumes without checking.  The filters' own weights (1) and scale are
never stored: the prototxt's scale is the one used.  TEST and TRAIN compute the same.
"""
import numpy as np
import torch

from .conv import conv_out_size
from .registry import Layer, LayerError, need_blobs, register_layer
from .segaware import FAR, im2dist, im2dist_masks, onnx_im2dist, onnx_window_views, window_masks, window_views

PARAM = "norm_conv_meanfield_param"
BILATERAL, SPATIAL = 0, 1


def norm_conv(p, features, kernel: int, pad: int, dilation: int, scale: float, remove_center: bool,
              remove_bounds: bool, far: float):
    """segaware's NormConv with unit weights: P's windows summed with the softmax over the taps of
    -scale x the features' distances (far: the fork's FLT_MAX / 100)."""
    geometry = ([kernel, kernel], [pad, pad], [1, 1], [dilation, dilation])
    dist = im2dist(features, *geometry, True, remove_center, remove_bounds, far)
    weights = torch.softmax(dist * -scale, dim=1)                        # (N, K, H, W)
    _, views = window_views(p, *geometry)
    out = views[0] * weights[:, 0:1]
    for k in range(1, len(views)):
        out = out + views[k] * weights[:, k:k + 1]
    return out


def channel_mix(matrix, x):
    """A (1, 1, C, C) matrix times each pixel's C values of x (N, C, H, W)."""
    return torch.einsum("ij,njhw->nihw", matrix.reshape(matrix.shape[-2], matrix.shape[-1]), x)


def norm_conv_meanfield(u, q, bilateral_features, spatial_features, w_spatial, w_bilateral, compatibility,
                        iterations: int, filters: list[list], far: float):
    """NormConvMeanfield's forward; filters: [bilateral, spatial] (kernel, pad, dilation, scale,
    remove_center, remove_bounds)."""
    for _ in range(iterations):
        p = torch.softmax(q, dim=1)
        s = norm_conv(p, spatial_features, *filters[1], far)
        b = norm_conv(p, bilateral_features, *filters[0], far)
        message = channel_mix(w_spatial, s) + channel_mix(w_bilateral, b)
        q = u - channel_mix(compatibility, message)
    return q


def _pair(p, field, default, cast, at_least):
    values = [cast(v) for v in getattr(p, field)]
    if not values:
        return [default, default]
    if len(values) != 2:
        raise LayerError(f"{PARAM}.{field} needs two values (bilateral, spatial) or none, got {len(values)}")
    if any(v < at_least for v in values):
        raise LayerError(f"{PARAM}.{field} must be at least {at_least}, got {values}")
    return values


@register_layer("NormConvMeanfield")
class NormConvMeanfield(Layer):
    blob_names = ("spatial_weights", "bilateral_weights", "compatibility")

    def parse(self, lp):
        need_blobs(lp, "NormConvMeanfield", 4, 1, roles="unaries, scores, bilateral features, spatial features")
        p = lp.norm_conv_meanfield_param
        if not p.HasField("num_iterations"):
            raise LayerError(f"{PARAM}.num_iterations is required (the fork's proto declares it so)")
        if p.num_iterations < 2:
            raise LayerError(f"{PARAM}.num_iterations must be at least 2 (the fork's check), got {p.num_iterations}")
        if len(p.kernel_size) != 2:
            raise LayerError(f"{PARAM}.kernel_size needs two values (bilateral, spatial), got {len(p.kernel_size)}")
        kernel = _pair(p, "kernel_size", 0, int, 1)
        pad = _pair(p, "pad", 0, int, 0)
        stride = _pair(p, "stride", 1, int, 1)
        dilation = _pair(p, "dilation", 0, int, 0)
        scale = _pair(p, "scale", 0.0, float, -np.inf)
        centre = _pair(p, "remove_center", True, bool, False)
        bounds = _pair(p, "remove_bounds", True, bool, False)
        if stride != [1, 1]:
            raise LayerError(f"{PARAM}.stride other than 1 would make the filters' outputs smaller than the map, "
                             f"which the fork reads past")
        filters = [[kernel[i], pad[i], dilation[i], float(np.float32(scale[i])), centre[i], bounds[i]]
                   for i in (BILATERAL, SPATIAL)]
        return {"iterations": int(p.num_iterations), "filters": filters}

    def infer(self, attrs, in_shapes):
        u, q, fb, fs = (tuple(s) for s in in_shapes)
        if len(u) != 4 or q != u:
            raise LayerError(f"NormConvMeanfield needs unaries and scores of one (N, C, H, W) shape, got {list(u)} "
                             f"and {list(q)}")
        for what, f in (("bilateral", fb), ("spatial", fs)):
            if len(f) != 4 or f[0] != u[0] or f[2:] != u[2:]:
                raise LayerError(f"NormConvMeanfield: the {what} features must be (N, E, {u[2]}, {u[3]}), "
                                 f"got {list(f)}")
        for what, (k, pad, d, *_rest) in zip(("bilateral", "spatial"), attrs["filters"]):
            out = [conv_out_size(size, k, 1, pad, d) for size in u[2:]]
            if out != list(u[2:]):
                raise LayerError(f"NormConvMeanfield: the {what} filter (kernel {k}, pad {pad}, dilation {d}) "
                                 f"turns the {u[2]}x{u[3]} map into {out[0]}x{out[1]}; the fork assumes it keeps it")
        return [u]

    def param_shapes(self, attrs, in_shapes):
        c = in_shapes[0][1]
        return [(1, 1, c, c)] * 3

    def init_params(self, attrs, shapes, rng):
        eye = np.eye(shapes[0][-1], dtype=np.float32).reshape(shapes[0])
        return [eye.copy(), eye.copy(), -eye]

    def macs(self, attrs, in_shapes, out_shapes):
        n, c, h, w = in_shapes[0]
        taps = sum(f[0] * f[0] for f in attrs["filters"])
        return attrs["iterations"] * n * h * w * (c * taps + 3 * c * c)

    def forward(self, attrs, params, u, q, fb, fs):
        return norm_conv_meanfield(u, q, fb, fs, *params, attrs["iterations"], attrs["filters"], FAR)

    def onnx(self, ctx, node):
        a = node.attrs
        u, q, fb, fs = node.inputs
        _, c, h, w = ctx.shape(u)
        weights = []   # per filter, the softmax tap weights (N, K, H, W), computed once: the features are fixed
        for index, f in ((BILATERAL, fb), (SPATIAL, fs)):
            k, pad, d, scale, centre, bounds = a["filters"][index]
            geometry = ([k, k], [pad, pad], [1, 1], [d, d])
            dist = onnx_im2dist(ctx, f, h, w, *geometry, True, centre, bounds, name=node.name)
            weights.append(ctx.op("Softmax", [ctx.op("Mul", [dist, ctx.f32(-scale)], "neg")], "taps", axis=1))
        mats = [ctx.op("Reshape", [ctx.weight(node, i), ctx.i64([c, c])], "mat") for i in range(3)]

        def mix(m, x):
            flat = ctx.op("Reshape", [x, ctx.i64([0, c, -1])], "flat")
            return ctx.op("Reshape", [ctx.op("MatMul", [m, flat], "mixed"), ctx.i64([0, c, h, w])], "mix")

        def filtered(p, index):
            k, pad, d = a["filters"][index][:3]
            _, views = onnx_window_views(ctx, p, h, w, [k, k], [pad, pad], [1, 1], [d, d])
            out = None
            for t, view in enumerate(views):
                tap = ctx.op("Slice", [weights[index], ctx.i64([t]), ctx.i64([t + 1]), ctx.i64([1])], "tap")
                term = ctx.op("Mul", [view, tap], "term")
                out = term if out is None else ctx.op("Add", [out, term], "acc")
            return out
        for i in range(a["iterations"]):
            p = ctx.op("Softmax", [q], "p", axis=1)
            message = ctx.op("Add", [mix(mats[0], filtered(p, SPATIAL)), mix(mats[1], filtered(p, BILATERAL))], "msg")
            pairwise = mix(mats[2], message)
            last = i == a["iterations"] - 1
            q = ctx.add_node("Sub", [u, pairwise], [node.outputs[0] if last else ctx.tmp("q")])[0]

    def pytorch_source(self, node, emit):
        emit.uses("F")
        for helper in (conv_out_size, window_masks, im2dist_masks, window_views, im2dist, norm_conv, channel_mix):
            emit.helper(helper)
        m = emit.blob_parameters(self.blob_names)
        a = node.attrs
        blobs = ", ".join(f"{m}['{name}']" for name in self.blob_names)
        return (f"{emit.helper(norm_conv_meanfield)}({', '.join(emit.inputs)}, {blobs}, {a['iterations']}, "
                f"{a['filters']!r}, {FAR!r})")
