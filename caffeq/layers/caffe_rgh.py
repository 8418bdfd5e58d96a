"""Sundrops/caffe-rgh's flow-guided parsing layers (9817946; src/caffe/proto/caffe.proto,
src/caffe/layers/interpolation_layer.cpp and .cu, conf_layer.cpp, mask.cpp).

- Interpolation (interpolation_layer.cpp / .cu, no parameters): bottoms (data, size reference); the top is
  the data's N and C at the reference's height and width.  factor_h = float32((H_ref - 1) / (H - 1)) in
  double (W likewise); Reshape checks 0.1 <= factor <= 18 in float32, so the data needs 2 or more rows and
  columns.  Output row y reads the source coordinate s = float32(y) / factor_h (a float32 division) and
  the rows n from max(floor(s - 1) + 1, 0) while n < s + 1 and n < H (float32 comparisons) with weight
  1 - |s - n|; top = sum over those rows n, then columns m, of x[n, m] * wx * wy, in that order, in float32:
  align-corners bilinear interpolation with the fork's own rounding (caffeq's Interp multiplies by
  (H - 1) / (H_ref - 1) instead).  The GPU kernel computes the same; the CPU loop's unqualified `abs`
  of a float is read as the float absolute value that the kernel's is (a build whose headers left only
  C's int abs in scope would give every tap the weight 1).  A tap with no weight is read with weight 0.
- Conf (conf_layer.cpp; CPU only, NeuronLayer's GPU forward calls it; conf_channels_param.conf_ch [13]):
  bottoms (warped image, image), each (N, 3, H, W); the top is (N, conf_ch, H, W).  Per item:
  d = |a0 - b0| + |a1 - b1| + |a2 - b2| (float32, the same reading of `abs`); the pixels where the warped
  image is not 0 in all three channels are valid; reg = float32(sum of d over them * 2.0 / count) in
  double; channel 0 = exp(float32(d * float32(-1.0 / reg))), 0 at invalid pixels; every channel a copy.
  The fork sums d in one float32 loop, caffeq by torch's float32 reduction (rounding only).  An item with
  no valid pixel is all zero; one whose valid pixels all match (reg 0) gives NaN there, as the fork's.
- MASK (mask.cpp; CPU only; mask_param.background, repeated int): y = 0 where x equals float32(b) for a
  listed b, else 1, elementwise.  With no background listed the fork never writes its top: refused.
"""
import numpy as np
import torch

from .norm import onnx_reduce
from .registry import Layer, LayerError, four_axes, need_blobs, positive_field, register_layer

F32 = np.float32

# ---- Interpolation --------------------------------------------------------------------------------


def rgh_interpolation_factor(n_in: int, n_out: int) -> float:
    """Reshape's factor (n_out - 1) / (n_in - 1) in double, kept as float32 (float('inf') or nan for n_in 1)."""
    if n_in == 1:
        return float("inf") if n_out > 1 else float("nan")
    return float(np.float32((n_out - 1.0) / (n_in - 1.0)))


def rgh_interpolation_taps(n_in: int, n_out: int, device: torch.device | None = None):
    """The two taps of each output along one axis: (first index, second index, first weight, second
    weight), float32 as the fork's loop (a second tap outside its range gets index first and weight 0)."""
    factor = torch.tensor(float(n_out - 1) / float(n_in - 1), dtype=torch.float64).float()
    s = torch.arange(n_out, dtype=torch.float32) / factor
    first = torch.clamp(torch.floor(s - 1) + 1, min=0)
    second = first + 1
    has_second = (second < s + 1) & (second < n_in)
    w_first = 1 - torch.abs(s - first)
    w_second = torch.where(has_second, 1 - torch.abs(s - second), torch.zeros_like(s))
    i_first = first.long()
    i_second = torch.where(has_second, second.long(), i_first)
    if device is not None:
        return i_first.to(device), i_second.to(device), w_first.to(device), w_second.to(device)
    return i_first, i_second, w_first, w_second


def rgh_interpolation(x, h_out: int, w_out: int):
    """caffe-rgh's Interpolation of x (N, C, H, W) to h_out x w_out: the four taps summed in the fork's order."""
    ya, yb, wya, wyb = rgh_interpolation_taps(x.shape[2], h_out, x.device)
    xa, xb, wxa, wxb = rgh_interpolation_taps(x.shape[3], w_out, x.device)
    wya, wyb = wya.to(x.dtype)[:, None], wyb.to(x.dtype)[:, None]
    wxa, wxb = wxa.to(x.dtype), wxb.to(x.dtype)
    row_a, row_b = x.index_select(2, ya), x.index_select(2, yb)
    top = row_a.index_select(3, xa) * wxa * wya
    top = top + row_a.index_select(3, xb) * wxb * wya
    top = top + row_b.index_select(3, xa) * wxa * wyb
    return top + row_b.index_select(3, xb) * wxb * wyb


@register_layer("Interpolation")
class RghInterpolation(Layer):
    bottoms, tops, bottom_roles = 2, 1, "data, size reference"

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "Interpolation", "data bottom")
        _, _, ho, wo = four_axes(in_shapes[1], "Interpolation", "size reference bottom")
        for axis, a, b in (("height", h, ho), ("width", w, wo)):
            f = rgh_interpolation_factor(a, b)
            if not F32(0.1) <= f <= 18:   # Reshape's CHECK_GE / CHECK_LE against MIN_FACTOR and MAX_FACTOR
                raise LayerError(f"Interpolation's {axis} factor ({b} - 1) / ({a} - 1) = {f:g} must lie in "
                                 f"[0.1, 18] (the size reference's {axis} {b}, the data's {a})")
        return [(n, c, ho, wo)]

    def forward(self, attrs, params, x, ref):
        return rgh_interpolation(x, ref.shape[2], ref.shape[3])

    def onnx(self, ctx, node):
        x = node.inputs[0]
        h, w = ctx.shape(x)[2:]
        ho, wo = ctx.shape(node.inputs[1])[2:]
        ya, yb, wya, wyb = (t.numpy() for t in rgh_interpolation_taps(h, ho))
        xa, xb, wxa, wxb = (t.numpy() for t in rgh_interpolation_taps(w, wo))
        rows = {k: ctx.op("Gather", [x, ctx.const(i)], f"rows_{k}", axis=2) for k, i in (("a", ya), ("b", yb))}
        terms = []
        for ky, wy in (("a", wya), ("b", wyb)):
            for kx, i, wx in (("a", xa, wxa), ("b", xb, wxb)):
                tap = ctx.op("Gather", [rows[ky], ctx.const(i)], f"tap_{ky}{kx}", axis=3)
                tap = ctx.op("Mul", [tap, ctx.const(wx)], f"wx_{ky}{kx}")
                terms.append(ctx.op("Mul", [tap, ctx.const(wy[:, None])], f"wy_{ky}{kx}"))
        total = ctx.op("Add", [ctx.op("Add", terms[:2], "sum1"), terms[2]], "sum2")
        ctx.add_node("Add", [total, terms[3]], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        ho, wo = emit.out_shape(0)[2:]
        emit.helper(rgh_interpolation_taps)
        return f"{emit.helper(rgh_interpolation)}({emit.inputs[0]}, {ho}, {wo})"


# ---- Conf -------------------------------------------------------------------------------------------


def rgh_conf(warped, image, channels: int):
    """caffe-rgh's Conf: exp(-d / reg) over the pixels where `warped` is not all zero, 0 elsewhere, copied
    to `channels` channels (d the summed absolute difference of the 3 channels)."""
    diff = torch.abs(warped - image)
    d = diff[:, 0:1] + diff[:, 1:2] + diff[:, 2:3]
    valid = ~(warped == 0).all(dim=1, keepdim=True)
    total = torch.where(valid, d, torch.zeros_like(d)).sum(dim=(1, 2, 3), keepdim=True)
    count = valid.to(torch.float64).sum(dim=(1, 2, 3), keepdim=True)
    reg = (total.to(torch.float64) * 2.0 / count).to(d.dtype)
    alpha = (-1.0 / reg.to(torch.float64)).to(d.dtype)
    conf = torch.where(valid, torch.exp(d * alpha), torch.zeros_like(d))
    return conf.expand(-1, channels, -1, -1).contiguous()


@register_layer("Conf")
class RghConf(Layer):
    def parse(self, lp):
        need_blobs(lp, "Conf", 2, 1, "warped image, image", in_place=False)
        return {"channels": positive_field(lp.conf_channels_param.conf_ch, "conf_channels_param.conf_ch")}

    def infer(self, attrs, in_shapes):
        a = four_axes(in_shapes[0], "Conf", "warped image bottom")
        b = four_axes(in_shapes[1], "Conf", "image bottom")
        if a[1] != 3 or a != b:   # Reshape's CHECK_EQs
            raise LayerError(f"Conf needs two (N, 3, H, W) bottoms of one shape, got {list(a)} and {list(b)}")
        return [(a[0], attrs["channels"], a[2], a[3])]

    def forward(self, attrs, params, warped, image):
        return rgh_conf(warped, image, attrs["channels"])

    def onnx(self, ctx, node):
        warped, image = node.inputs
        name = node.name
        diff = ctx.op("Abs", [ctx.op("Sub", [warped, image], "diff")], "absdiff")
        zero = ctx.f32(0.0)
        chans = [ctx.op("Slice", [diff, ctx.i64([c]), ctx.i64([c + 1]), ctx.i64([1])], f"d{c}") for c in range(3)]
        zeros = [ctx.op("Equal", [ctx.op("Slice", [warped, ctx.i64([c]), ctx.i64([c + 1]), ctx.i64([1])], f"w{c}"),
                                  zero], f"zero{c}") for c in range(3)]
        d = ctx.op("Add", [ctx.op("Add", chans[:2], "d01"), chans[2]], "d")
        valid = ctx.op("Not", [ctx.op("And", [ctx.op("And", zeros[:2], "zero01"), zeros[2]], "invalid")], "valid")
        total = onnx_reduce(ctx, "ReduceSum", ctx.op("Where", [valid, d, zero], "valid_d"), [1, 2, 3], True,
                            ctx.tmp(name + "_total"))
        count = onnx_reduce(ctx, "ReduceSum", ctx.op("Cast", [valid], "valid_f64", to=11), [1, 2, 3], True,
                            ctx.tmp(name + "_count"))
        reg = ctx.op("Div", [ctx.op("Mul", [ctx.op("Cast", [total], "total_f64", to=11),
                                            ctx.const(np.array(2.0, np.float64))], "twice"), count], "reg_f64")
        reg = ctx.op("Cast", [ctx.op("Cast", [reg], "reg", to=1)], "reg_back", to=11)
        alpha = ctx.op("Cast", [ctx.op("Div", [ctx.const(np.array(-1.0, np.float64)), reg], "alpha_f64")], "alpha",
                       to=1)
        conf = ctx.op("Where", [valid, ctx.op("Exp", [ctx.op("Mul", [d, alpha], "scaled")], "exp"), zero], "conf")
        ctx.add_node("Tile", [conf, ctx.i64([1, node.attrs["channels"], 1, 1])], [node.outputs[0]], name=name)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(rgh_conf)}({emit.inputs[0]}, {emit.inputs[1]}, {node.attrs['channels']})"


# ---- MASK -------------------------------------------------------------------------------------------


def rgh_mask(x, background: list[float]):
    """caffe-rgh's MASK: 0 where x equals one of `background` (float32 values), else 1."""
    hit = x == background[0]
    for b in background[1:]:
        hit = hit | (x == b)
    return torch.where(hit, torch.zeros_like(x), torch.ones_like(x))


@register_layer("MASK")
class RghMask(Layer):
    def parse(self, lp):
        need_blobs(lp, "MASK", 1, 1)
        background = [float(F32(b)) for b in lp.mask_param.background]
        if not background:
            raise LayerError("MASK needs mask_param.background (one value or more): without one the fork never "
                             "writes its top")
        return {"background": background}

    def forward(self, attrs, params, x):
        return rgh_mask(x, attrs["background"])

    def onnx(self, ctx, node):
        x = node.inputs[0]
        hit = None
        for k, b in enumerate(node.attrs["background"]):
            eq = ctx.op("Equal", [x, ctx.f32(b)], f"eq{k}")
            hit = eq if hit is None else ctx.op("Or", [hit, eq], f"hit{k}")
        ctx.add_node("Where", [hit, ctx.f32(0.0), ctx.f32(1.0)], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(rgh_mask)}({emit.inputs[0]}, {node.attrs['background']!r})"
