"""SSAW14/LearnableDilationNetwork's layers (4838c44, caffe-dynamic-dilation/src/caffe/layers).

- Truncation (truncation_layer.cpp, a NeuronLayer): y = min(max(x, truncation_min), truncation_max),
  the bounds floats (defaults 0 and 1).  With min > max every value becomes max, as that order gives.
- Duplicate (duplicate_layer.cu): top (N, C, int(height), int(width)), N and C those of the bottom at
  setup; top[n, c, h, w] = bottom's flat element n * C + c (the first N * C values of the bottom; for the
  (N, C, 1, 1) maps the network feeds it, each channel's value spread over the plane).  This is the GPU
  forward the network trains and tests with; the fork's CPU forward is an empty function (its loop is
  commented out), which would leave the top's memory as it was (zeros on a fresh net): caffeq computes
  the GPU's values.  height and width are floats in the proto, converted to int (truncation).
- Convolution with two bottoms and one top (conv_layer.cpp / conv_layer.cu Forward, base_conv_layer.cpp
  forward_gpu_dynamic_dilation_gemm, util/im2col.cu im2col_dynamic_gpu_kernel): bottom[1] holds a dilation
  per input channel and output pixel.  BVLC's Convolution makes one top per bottom, so "2 bottoms, 1 top"
  is this fork.  caffeq computes the GPU kernel the network trains and tests with:
  * the column grid is height_col = (H + 2 pad_h - (kh + (kh - 1)(pad_h - 1))) / stride_h + 1 (and so for
    w with pad_w): pad stands in for the dilation there; the gemm reads the top's (Ho, Wo) from
    convolution_param.dilation as usual, so caffeq refuses a layer whose two grids differ (pad != dilation
    for a 3x3 kernel): the fork's buffers would not line up;
  * D = sample n's map read flat at (c H + h) W + w (H, W the input's; h, w the output pixel; the map's
    per-sample offset is n times its count(1)); floor = (int)D (truncation), ceil = floor + 1, both one less
    when floor == pad_h; dist = ceil - D (may leave [0, 1]: then it extrapolates);
  * tap (i, j) of output (h, w) at rows h stride_h + (i - 1) R, columns w stride_w + (j - 1) R (R ceil or
    floor; the kernel's first tap is one R before the centre whatever its size): 0 when the ceil tap
    (both axes) is outside the image, else x[ceil row, ceil col] (1 - dist)^2 + x[ceil row, floor col]
    (1 - dist) dist + x[floor row, ceil col] dist (1 - dist) + x[floor row, floor col] dist^2 (the fork sums
    in double, caffeq in float32).  Floor taps are read by flat offset within the sample (c H + row) W + col,
    as the kernel's pointer arithmetic does; one outside the sample (for D < 0, D in [0, 1) with pad_h 0,
    or a 1-wide kernel with pad) reads the neighbouring sample, or memory outside the blob, in the fork,
    and 0 in caffeq;
  * then the usual grouped gemm with the weights and the bias.  A 1x1 kernel of stride 1 and pad 0 skips
    im2col (is_1x1_): a plain 1x1 convolution, the map unread.
  The fork's CPU forward (im2col.cpp im2col_dynamic_cpu) differs: it rounds D (> .5 up) with no
  interpolation and reads channel 0's map for every channel; caffeq follows the GPU, as for Duplicate.
  force_back_propagation and dilation_back_threshold (caffe.proto 19, 20) act in training only.
"""
import numpy as np
import torch

from . import registry
from .conv import Convolution, parse_conv
from .registry import Layer, LayerError, claim_layers, count, need_blobs, register_layer


def truncation(x, lo: float, hi: float):
    return torch.minimum(torch.maximum(x, torch.tensor(lo, dtype=x.dtype, device=x.device)),
                         torch.tensor(hi, dtype=x.dtype, device=x.device))


@register_layer("Truncation")
class Truncation(Layer):
    def parse(self, lp):
        need_blobs(lp, "Truncation", 1, 1)
        p = lp.truncation_param
        return {"min": float(np.float32(p.truncation_min)), "max": float(np.float32(p.truncation_max))}

    def forward(self, attrs, params, x):
        return truncation(x, attrs["min"], attrs["max"])

    def onnx(self, ctx, node):
        a, name = node.attrs, node.name
        low = ctx.add_node("Max", [node.inputs[0], ctx.const(np.array(a["min"], np.float32), name + "_min")],
                           ctx.tmp(name + "_low"), name=name)
        ctx.add_node("Min", [low, ctx.const(np.array(a["max"], np.float32), name + "_max")], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        a = node.attrs
        return f"{emit.helper(truncation)}({emit.inputs[0]}, {emit.lit(a['min'])}, {emit.lit(a['max'])})"


def duplicate(x, h: int, w: int):
    n = x.shape[0] if x.dim() > 0 else 1
    c = x.shape[1] if x.dim() > 1 else 1
    return x.reshape(-1)[:n * c].reshape(n, c, 1, 1).expand(n, c, h, w).contiguous()


def _legacy_nc(shape):
    """Blob::num() and channels(): the first two axes, 1 where the blob has fewer."""
    if len(shape) > 4:
        raise LayerError(f"Duplicate reads num() and channels(), which need a blob of at most 4 axes, "
                         f"got {list(shape)}")
    padded = tuple(shape) + (1,) * (2 - len(shape))
    return int(padded[0]), int(padded[1])


@register_layer("Duplicate")
class Duplicate(Layer):
    def parse(self, lp):
        need_blobs(lp, "Duplicate", 1, 1)
        p = lp.duplicate_param
        h, w = int(np.float32(p.height)), int(np.float32(p.width))   # float -> int, as the layer stores them
        if h < 1 or w < 1:
            raise LayerError(f"duplicate_param.height and width must be >= 1, got {p.height:g} and {p.width:g}")
        return {"height": h, "width": w}

    def infer(self, attrs, in_shapes):
        n, c = _legacy_nc(in_shapes[0])
        if count(in_shapes[0]) < n * c:   # only an empty blob: num() * channels() <= count()
            raise LayerError(f"Duplicate reads num x channels values, more than {list(in_shapes[0])} holds")
        return [(n, c, attrs["height"], attrs["width"])]

    def forward(self, attrs, params, x):
        return duplicate(x, attrs["height"], attrs["width"])

    def onnx(self, ctx, node):
        n, c = _legacy_nc(ctx.shape(node.inputs[0]))
        name = node.name
        flat = ctx.add_node("Reshape", [node.inputs[0], ctx.i64([-1])], ctx.tmp(name + "_flat"), name=name)
        head = ctx.add_node("Slice", [flat, ctx.i64([0]), ctx.i64([n * c]), ctx.i64([0])], ctx.tmp(name + "_head"))
        nc = ctx.add_node("Reshape", [head, ctx.i64([n, c, 1, 1])], ctx.tmp(name + "_nc"))
        ctx.add_node("Expand", [nc, ctx.i64([n, c, node.attrs["height"], node.attrs["width"]])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        a = node.attrs
        return f"{emit.helper(duplicate)}({emit.inputs[0]}, {a['height']}, {a['width']})"


# ---- the fork's Convolution with a dilation bottom ------------------------------------------------------

def dynamic_dilation_conv(x, dmap, weight, bias, stride: tuple, pad_h: int, grid: tuple, group: int):
    """The fork's GPU im2col_dynamic (see the module docstring) and grouped gemm; grid = (height_col, width_col)."""
    n, c, h, w = x.shape
    o, cg, kh, kw = weight.shape
    hc, wc = grid
    dev = x.device
    ar = torch.arange
    # sample n's map, read flat at (c H + h) W + w
    at = (ar(c, device=dev).view(c, 1, 1) * (h * w) + ar(hc, device=dev).view(1, hc, 1) * w
          + ar(wc, device=dev).view(1, 1, wc)).reshape(-1)
    d = dmap.reshape(n, -1)[:, at].reshape(n, c, 1, 1, hc, wc)
    fl = torch.trunc(d)
    fl = fl - (fl == pad_h).to(d.dtype)
    ce = fl + 1.0
    dist = ce - d
    ce_i, fl_i = ce.long(), fl.long()
    ti = (ar(kh, device=dev) - 1).view(1, 1, kh, 1, 1, 1)
    tj = (ar(kw, device=dev) - 1).view(1, 1, 1, kw, 1, 1)
    y0 = (ar(hc, device=dev) * stride[0]).view(1, 1, 1, 1, hc, 1)
    x0 = (ar(wc, device=dev) * stride[1]).view(1, 1, 1, 1, 1, wc)
    row_c, col_c = y0 + ti * ce_i, x0 + tj * ce_i
    row_f, col_f = y0 + ti * fl_i, x0 + tj * fl_i
    valid = (row_c >= 0) & (row_c < h) & (col_c >= 0) & (col_c < w)
    flat_x = x.reshape(n, c * h * w)
    base = (ar(c, device=dev) * (h * w)).view(1, c, 1, 1, 1, 1)

    def read(rows, cols):
        at = base + rows * w + cols
        inside = (at >= 0) & (at < c * h * w)
        got = torch.gather(flat_x, 1, at.clamp(0, c * h * w - 1).reshape(n, -1)).reshape(at.shape)
        return torch.where(inside, got, torch.zeros_like(got))

    a = 1.0 - dist
    s = (read(row_c, col_c) * a * a + read(row_c, col_f) * a * dist + read(row_f, col_c) * dist * a
         + read(row_f, col_f) * dist * dist)
    col = torch.where(valid, s, torch.zeros_like(s)).reshape(n, group, cg * kh * kw, hc * wc)
    y = torch.matmul(weight.reshape(group, o // group, cg * kh * kw), col).reshape(n, o, hc, wc)
    if bias is not None:
        y = y + bias.view(1, o, 1, 1)
    return y


def _c_div(a, b):
    """C's integer division (truncation toward zero)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


def _two_bottoms_one_top(lp):
    """2 bottoms, 1 top, a kernel wider than 1x1, and no other fork's Convolution claim (greentea's fused conv
    + eltwise also takes 2).  A 1x1 kernel never reads the map in the fork (is_1x1_), so a 2-bottom 1x1 layer is
    more likely another fork's fused residual (Intel's merged ResNets) and is left to Caffe's own refusal."""
    if len(lp.bottom) != 2 or len(lp.top) != 1:
        return False
    p = lp.convolution_param
    sizes = list(p.kernel_size) + [p.kernel_h, p.kernel_w]
    if all(k <= 1 for k in sizes):
        return False
    return not any(t == "Convolution" and not isinstance(spec, DynamicDilationConvolution) and looks_like(lp)
                   for t, looks_like, spec in registry._CLAIMS)


@claim_layers("Convolution", _two_bottoms_one_top)
class DynamicDilationConvolution(Convolution):
    """SSAW14/LearnableDilationNetwork's Convolution(data, dilation map) -> one top (module docstring)."""

    def parse(self, lp):
        p = lp.convolution_param
        if p.engine == p.CUDNN:
            raise LayerError("convolution_param.engine CUDNN: the fork's dilation bottom runs in the CAFFE "
                             "engine only (CuDNNConvolution makes one top per bottom)")
        attrs = parse_conv(lp)
        for key in ("first_conv", "orn"):
            if attrs.get(key):
                raise LayerError(f"a Convolution with a dilation bottom does not read {key} fields")
        return attrs

    def _geometry(self, attrs, in_shapes):
        x, m = tuple(in_shapes[0]), tuple(in_shapes[1])
        if len(x) != 4 or attrs["_axis"] != 1:
            raise LayerError(f"the fork's dilation bottom works on (N, C, H, W) data with axis 1, got {list(x)}")
        if attrs.get("edge_pads") is not None:
            raise LayerError("pad_l/r/t/b do not apply to a Convolution with a dilation bottom")
        kh, kw = attrs["kernel"]
        sh, sw = attrs["stride"]
        ph, pw = attrs["pad"]
        one = (kh, kw, sh, sw, ph, pw) == (1, 1, 1, 1, 0, 0)
        n, c, h, w = x
        hc = _c_div(h + 2 * ph - (kh + (kh - 1) * (ph - 1)), sh) + 1
        wc = _c_div(w + 2 * pw - (kw + (kw - 1) * (pw - 1)), sw) + 1
        attrs["_dyn"] = {"one": one, "grid": (hc, wc)}
        if one:
            return
        ho, wo = (conv_size(v, k, s, p, d) for v, k, s, p, d in
                  zip((h, w), attrs["kernel"], attrs["stride"], attrs["pad"], attrs["dilation"]))
        if (hc, wc) != (ho, wo):
            raise LayerError(f"the fork's dynamic im2col fills a {hc}x{wc} grid (pad {ph}, {pw} standing in for the "
                             f"dilation) but the top is {ho}x{wo} (dilation {attrs['dilation'][0]}, "
                             f"{attrs['dilation'][1]}): set pad equal to dilation")
        if not 1 <= len(m) <= 4 or m[0] != n:
            raise LayerError(f"the dilation bottom must be a blob of batch {n} and at most 4 axes, got {list(m)}")
        last = ((c - 1) * h + hc - 1) * w + wc - 1
        if last >= count(m[1:]):
            raise LayerError(f"the dilation bottom {list(m)} holds {count(m[1:])} values a sample, but the fork "
                             f"reads C x H x W = {c}x{h}x{w} of them (one dilation per channel and pixel)")

    def infer(self, attrs, in_shapes):
        top = super().infer(attrs, in_shapes[:1])
        self._geometry(attrs, in_shapes)
        return top

    def param_shapes(self, attrs, in_shapes):
        return super().param_shapes(attrs, in_shapes[:1])

    def macs(self, attrs, in_shapes, out_shapes):
        return super().macs(attrs, in_shapes[:1], out_shapes)

    def forward(self, attrs, params, x, dmap):
        bias = params[1] if attrs["bias_term"] else None
        dyn = attrs["_dyn"]
        if dyn["one"]:
            return torch.nn.functional.conv2d(x, params[0], bias, groups=attrs["group"])
        return dynamic_dilation_conv(x, dmap, params[0], bias, tuple(attrs["stride"]), attrs["pad"][0],
                                     dyn["grid"], attrs["group"])

    def onnx(self, ctx, node):
        _onnx_dynamic_dilation(ctx, node)

    def pytorch_source(self, node, emit):
        a = node.attrs
        o, cg, kh, kw = (int(v) for v in emit.blob(0).shape)
        bias = "" if a["bias_term"] else ", bias=False"
        m = emit.module(f"nn.Conv2d({cg * a['group']}, {o}, ({kh}, {kw}), groups={a['group']}{bias})")
        emit.param("weight", 0)
        if a["bias_term"]:
            emit.param("bias", 1)
        x, dmap = emit.inputs
        if a["_dyn"]["one"]:
            return f"{m}({x})"
        b = f"{m}.bias" if a["bias_term"] else "None"
        return (f"{emit.helper(dynamic_dilation_conv)}({x}, {dmap}, {m}.weight, {b}, {tuple(a['stride'])}, "
                f"{a['pad'][0]}, {tuple(a['_dyn']['grid'])}, {a['group']})")


def conv_size(size, k, s, p, d):
    return _c_div(size + 2 * p - (d * (k - 1) + 1), s) + 1


def _onnx_dynamic_dilation(ctx, node):
    """dynamic_dilation_conv in ONNX: the map and the taps through Gather / GatherElements, int64 offsets."""
    import onnx
    a = node.attrs
    x, dmap = node.inputs
    _, c, h, w = (int(v) for v in ctx.shape(x))
    o, cg, kh, kw = (int(v) for v in np.shape(node.blobs[0]))
    g = a["group"]
    bias = ctx.weight(node, 1) if a["bias_term"] else None
    if a["_dyn"]["one"]:
        ctx.add_node("Conv", [x, ctx.weight(node, 0)] + ([bias] if bias else []), [node.outputs[0]], name=node.name,
                     kernel_shape=[1, 1], group=g)
        return
    hc, wc = a["_dyn"]["grid"]
    sh, sw = a["stride"]
    f32, i64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64

    def ints(values, shape):
        return ctx.const(np.asarray(values, np.int64).reshape(shape))

    rows = np.arange(c)[:, None, None] * h + np.arange(hc)[None, :, None]
    at = (rows * w + np.arange(wc)[None, None, :]).reshape(-1)
    flat_map = ctx.op("Flatten", [dmap], "map_flat", name=node.name, axis=1)
    d = ctx.op("Reshape", [ctx.op("Gather", [flat_map, ints(at, (-1,))], "map_read", axis=1),
                           ctx.i64([0, c, 1, 1, hc, wc])], "dilation")
    fl = ctx.trunc(d, "trunc")
    at_pad = ctx.op("Cast", [ctx.op("Equal", [fl, ctx.f32(float(a["pad"][0]))], "at_pad")], "at_pad_f", to=f32)
    fl = ctx.op("Sub", [fl, at_pad], "floor")
    ce = ctx.op("Add", [fl, ctx.f32(1.0)], "ceil")
    dist = ctx.op("Sub", [ce, d], "dist")
    ce_i = ctx.op("Cast", [ce], "ceil_i", to=i64)
    fl_i = ctx.op("Cast", [fl], "floor_i", to=i64)
    ti, tj = ints(np.arange(kh) - 1, (1, 1, kh, 1, 1, 1)), ints(np.arange(kw) - 1, (1, 1, 1, kw, 1, 1))
    y0, x0 = ints(np.arange(hc) * sh, (1, 1, 1, 1, hc, 1)), ints(np.arange(wc) * sw, (1, 1, 1, 1, 1, wc))

    def taps(start, step, r, hint):
        return ctx.op("Add", [start, ctx.op("Mul", [step, r], hint + "_off")], hint)

    row_c, col_c = taps(y0, ti, ce_i, "row_c"), taps(x0, tj, ce_i, "col_c")
    row_f, col_f = taps(y0, ti, fl_i, "row_f"), taps(x0, tj, fl_i, "col_f")

    def within(v, size, hint):   # 0 <= v < size
        return ctx.op("And", [ctx.op("Greater", [v, ctx.i64(-1)], hint + "_lo"),
                              ctx.op("Less", [v, ctx.i64(size)], hint + "_hi")], hint)

    valid = ctx.op("And", [within(row_c, h, "row_in"), within(col_c, w, "col_in")], "valid")
    flat_x = ctx.op("Flatten", [x], "x_flat", axis=1)
    base = ints(np.arange(c) * h * w, (1, c, 1, 1, 1, 1))
    zero = ctx.f32(0.0)

    def read(rows, cols, hint):
        offset = ctx.op("Add", [base, ctx.op("Add", [ctx.op("Mul", [rows, ctx.i64(w)], hint + "_rw"), cols],
                                             hint + "_rc")], hint + "_at")
        inside = within(offset, c * h * w, hint + "_inside")
        safe = ctx.op("Where", [inside, offset, ctx.i64(0)], hint + "_safe")
        got = ctx.op("GatherElements", [flat_x, ctx.op("Reshape", [safe, ctx.i64([0, -1])], hint + "_idx")],
                     hint + "_got", axis=1)
        got = ctx.op("Reshape", [got, ctx.i64([0, c, kh, kw, hc, wc])], hint + "_taps")
        return ctx.op("Where", [inside, got, zero], hint)

    one_minus = ctx.op("Sub", [ctx.f32(1.0), dist], "one_minus")

    def term(v, p, q, hint):
        return ctx.op("Mul", [ctx.op("Mul", [v, p], hint + "_p"), q], hint)

    s = term(read(row_c, col_c, "cc"), one_minus, one_minus, "t_cc")
    s = ctx.op("Add", [s, term(read(row_c, col_f, "cf"), one_minus, dist, "t_cf")], "s_cf")
    s = ctx.op("Add", [s, term(read(row_f, col_c, "fc"), dist, one_minus, "t_fc")], "s_fc")
    s = ctx.op("Add", [s, term(read(row_f, col_f, "ff"), dist, dist, "t_ff")], "s_ff")
    col = ctx.op("Reshape", [ctx.op("Where", [valid, s, zero], "col"), ctx.i64([0, g, cg * kh * kw, hc * wc])],
                 "col_g")
    wg = ctx.op("Reshape", [ctx.weight(node, 0), ctx.i64([g, o // g, cg * kh * kw])], "w_g")
    y = ctx.op("Reshape", [ctx.op("MatMul", [wg, col], "gemm"), ctx.i64([0, o, hc, wc])], "y")
    if bias is None:
        ctx.add_node("Identity", [y], [node.outputs[0]])
    else:
        ctx.add_node("Add", [y, ctx.op("Reshape", [bias, ctx.i64([1, o, 1, 1])], "b")], [node.outputs[0]])
