"""limuhit's image-compression Caffe: the trimmed convolution and the layers of its compression nets.

Sources (facts only): limuhit/TrimmedConvolution aee695e (README.md, cudnn_conv_layer.cu, multobin_layer.cu,
mtranspose_layer.cu), limuhit/CCN bf0b27b (caffe/src/caffe/proto/caffe.proto, caffe/src/caffe/layers/
cudnn_conv_layer.cu, conv_layer.cpp/.cu, base_conv_layer.cpp, multobin_layer.cu, mtranspose_layer.cu; caffe/src/
caffe/layer_factory.cpp).  limuhit/ImageCompression 5ff1083 ships only compiled pycaffe; its Round, ImpMap and
EntropyPack are read from the copies in satchelwu/my_caffe 9701c8b (src/caffe/layers/round_layer.cpp/.cu,
imp_map_layer.cpp/.cu, entropy_pack_layer.cpp/.cu), whose messages are CCN's (CCN's ImpMapParameter adds alpha).

- ConvolutionParameter.constrain (with group_in, group_out): before each forward the fork's cuDNN layer (the
  default engine) zeroes taps of its own weight blob (N, C, kh, kw).  Over the flat index i of the blob, with
  sz = kw (the kernel is read as square), tw = i % sz, th = i / sz % sz, tc = i / sz^2 % C / group_in (the
  input channel's group), tn = i / sz^2 / C / group_out (the output channel's group), h = sz / 2, a tap is kept:
  1: tn > tc, or tn == tc and (th < h or th == h and tw < h)  (strictly causal in its own group);
  2: the same with tw <= h  (the centre kept);  3: tn > tc and th <= h and tw <= h, or tn == tc and
  (th < h and tw <= h or th == h and tw < h);  4: tn >= tc and th <= h and tw <= h;  5: tw + th + tc <
  tn + sz - 1;  6: <=;  9: tw + th < sz - 1;  10: <=;  13: th + tc < tn + h;  14: <=;  17: tn > tc;
  15 / 16: 6's rule with the anti-diagonal tw + th + tc == tn + sz - 1 split by quarter groups (CCN's kernels).
  caffeq multiplies the weight by that 0/1 mask before the convolution (torch, ONNX and model.py).
  TrimmedConvolution knows only 1 and 2 (any other value is 2 there); 7 (freeze copies), 11 / 12 (tables) and
  the values with no CCN kernel are refused, as is the CAFFE engine with 9 or more (its GPU kernel set stops at 7;
  layer_factory.cpp also gives a dilated convolution of the default engine to CAFFE).  The trimmed taps of a
  weights file's (or random) weight are set to 0 when read, as the fork's blob holds them after a forward.
- Round (round_param method): ZERO_ONE y = x > 0.5 ? 1 : 0; ONE_MINUS_ONE y = x > 0 ? 1 : -1; MULTI
  y = table[int(clamp(x, 0, 1) * groups)], table[i] = p i + p (float32, p = 1 / groups), table[groups] = 1.
  Its one (1, 1, 1, 1) blob is written by the backward only.
- ImpMap (imp_map_param groups, channel_out, lquantize): k = int(x groups + 0.00001) (the product in float32,
  the sum in double); the top (N, channel_out, H, W) is 1 on channels c < min(k + (lquantize ? 0 : 1), groups)
  * channel_out / groups, else 0.  method, cmp_ratio and weight steer the backward only.  Its one (1, 1, 1, 1)
  blob (the share of ones, written at each forward) is never read.  k is clamped to [0, groups]: a map outside
  [0, 1] reads past the fork's table.
- EntropyPack (entropy_pack_param kernel ks, channels D, samples S; bottoms code [, importance mask]): takes
  the S images from b = int(blob + 0.001) (its one blob, which the fork then advances by S modulo the batch on
  every forward; caffeq runs the forward the stored value selects).  Top 0 (S C H W, D, ks, ks): for each
  position (n, c, y, x) the causal context cube v[n, c + d - D + 1, y + i - ks/2, x + j - ks/2] + 1 (0 outside,
  and on channel d = D - 1 at i > ks/2 or i == ks/2, j >= ks/2); with the mask, 0 where the centre's mask is
  < 0.5 or the neighbour's is not > 0.  Top 1 (S C H W, 1, 1, 1): code + 1, or code + mask.
- MulToBin (multobin_param levels L, mod m, inverse, imp): u = (unsigned) (int) x (CUDA's saturating cast);
  channel c L + j (L - 1 - j with inverse) holds digit j of u in base 2^m.  imp (CCN): f = u > 0, digits of
  u - f, times f, plus f.
- MTranspose (mtranspose_param groups G, inverse, width, height, channel): (N, C, H, W) to (N C H W / G, G):
  row (n, c / G, y, x), column c % G; inverse (CCN) reads the rows back to (count / (channel H W), channel,
  height, width).
"""
import math

import numpy as np
import torch
import torch.nn.functional as F

from .registry import (
    Layer,
    LayerError,
    cached_constant,
    legacy_nchw,
    need_blobs,
    positive_field,
    register_layer,
    torch_sources,
)

# ---- the trimmed convolution's weight mask (used by caffeq/layers/conv.py) ---------------------------

TRIMMED = (1, 2, 3, 4, 5, 6, 9, 10, 13, 14, 15, 16, 17)


def trimmed_conv_mask(shape: list[int], constrain: int, group_in: int, group_out: int):
    """The 0/1 float32 mask of the taps limuhit's trimmed convolution keeps in a weight blob of `shape`."""
    channels, sz = shape[1], shape[-1]
    i = torch.arange(math.prod(shape), dtype=torch.int64)
    tw = i % sz
    th = i // sz % sz
    tc = i // sz // sz % channels // group_in
    tn = i // sz // sz // channels // group_out
    h = sz // 2
    if constrain in (1, 2):
        row = (tw < h) if constrain == 1 else (tw <= h)
        keep = (tn > tc) | ((tn == tc) & ((th < h) | ((th == h) & row)))
    elif constrain == 3:
        keep = ((tn > tc) & (th <= h) & (tw <= h)) | \
               ((tn == tc) & (((th < h) & (tw <= h)) | ((th == h) & (tw < h))))
    elif constrain == 4:
        keep = (tn >= tc) & (th <= h) & (tw <= h)
    elif constrain in (5, 6, 15, 16):
        diag = tw + th + tc - (tn + sz - 1)
        keep = (diag < 0) if constrain == 5 else (diag <= 0)
        if constrain in (15, 16):
            tcg = i // sz // sz % channels % group_in // (group_in // 4)
            tng = i // sz // sz // channels % group_out // (group_out // 4)
            mid = (tng == 1) | (tng == 2)
            if constrain == 15:
                cut = (tng == 0) | (mid & (tcg >= 1)) | ((tng >= 3) & (tcg == 3))
            else:
                cut = ((tng == 0) & (tcg > 0)) | (mid & (tcg > 2))
            keep = keep & ~((diag == 0) & cut)
    elif constrain in (9, 10):
        keep = (tw + th < sz - 1) if constrain == 9 else (tw + th <= sz - 1)
    elif constrain in (13, 14):
        keep = (th + tc < tn + h) if constrain == 13 else (th + tc <= tn + h)
    else:
        keep = tn > tc
    return keep.reshape(shape).to(torch.float32)


class TrimmedConv2d(torch.nn.Conv2d):
    """nn.Conv2d whose weight is multiplied by limuhit's trimmed-convolution mask before each forward."""

    def __init__(self, *args, constrain=(1, 1, 1), **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("trim", trimmed_conv_mask(list(self.weight.shape), *constrain), persistent=False)

    def forward(self, x):
        return self._conv_forward(x, self.weight * self.trim, self.bias)


TORCH_TRIMMED_CONV = torch_sources(trimmed_conv_mask, TrimmedConv2d)


def parse_constrain(lp, attrs):
    """attrs["constrain"] = (constrain, group_in, group_out) where convolution_param.constrain is set."""
    p = lp.convolution_param
    if "constrain" not in p.DESCRIPTOR.fields_by_name or not p.constrain:
        return attrs
    c = int(p.constrain)
    if c not in TRIMMED:
        raise LayerError(f"convolution_param.constrain {c} is not supported (limuhit's trimmed convolution: "
                         f"{', '.join(map(str, TRIMMED))}; 7 copies frozen filters, 11 / 12 read a group table)")
    gi = positive_field(p.group_in, "convolution_param.group_in")
    go = positive_field(p.group_out, "convolution_param.group_out")
    if c in (15, 16) and (gi < 4 or go < 4):
        raise LayerError(f"convolution_param.constrain {c} splits group_in and group_out in quarters: both must "
                         f"be >= 4, got {gi} and {go}")
    if c >= 9 and (p.engine == p.CAFFE or p.engine == p.DEFAULT and any(d > 1 for d in p.dilation)):
        why = "engine CAFFE" if p.engine == p.CAFFE else "dilation (the default engine is then CAFFE's)"
        raise LayerError(f"convolution_param.constrain {c} with {why}: limuhit/CCN's Caffe-engine convolution "
                         f"leaves it unapplied on the GPU (CuDNN applies it)")
    attrs["constrain"] = (c, gi, go)
    return attrs


def check_constrain(attrs, weight_shape):
    if attrs.get("constrain") and len(weight_shape) != 4:
        raise LayerError(f"convolution_param.constrain needs a 2-D convolution (the fork's cuDNN layer), got "
                         f"a {len(weight_shape) - 2}-D kernel")


def zero_trimmed_taps(attrs, arrays):
    """A weights file's (or random) blobs with the trimmed taps of the weight set to 0: the fork's forward
    writes 0 there in its own blob before each convolution, so that the stored values never count (nor
    reach BatchNorm folding or a quantizer's per-channel scale here).  Blobs of another shape are left to
    the shape check; the bias is read as (num_output,) (a V1 file keeps it (1, 1, 1, num_output))."""
    c, kernel = attrs.get("constrain"), attrs.get("kernel")
    if not c or not arrays or kernel is None or len(kernel) != 2:
        return arrays
    w = np.asarray(arrays[0])
    n = attrs["num_output"]
    per = n * kernel[0] * kernel[1]
    if w.dtype.kind != "f" or not w.size or w.size % per or tuple(w.shape) != (n, w.size // per) + tuple(kernel):
        return arrays
    keep = trimmed_conv_mask(list(w.shape), *c).numpy() > 0
    rest = [np.asarray(a).reshape(-1) if np.size(a) == n else a for a in arrays[1:]]
    return [np.where(keep, w, np.zeros((), w.dtype))] + rest


def trimmed_weight(attrs, weight):
    """The weight as the fork's forward sees it: masked where constrain is set."""
    c = attrs.get("constrain")
    if not c:
        return weight
    mask = cached_constant(trimmed_conv_mask, tuple(weight.shape), *c, device=weight.device, dtype=weight.dtype)
    return weight * mask


def onnx_trimmed_weight(ctx, node, w):
    c = node.attrs.get("constrain")
    if not c:
        return w
    shape = list(np.shape(node.blobs[0]))
    mask = trimmed_conv_mask(shape, *c).numpy()
    return ctx.op("Mul", [w, ctx.const(mask, f"{node.name}_trim")], "trimmed_weight")


# ---- Round ----------------------------------------------------------------------------------------

ZERO_ONE, ONE_MINUS_ONE, MULTI = 0, 1, 2


def round_multi(x, table: list[float]):
    """Round's MULTI: table[int(clamp(x, 0, 1) * groups)] (groups = len(table) - 1)."""
    groups = len(table) - 1
    t = torch.where(x < 0, torch.zeros_like(x), torch.where(x > 1, torch.ones_like(x), x))
    k = (t * groups).to(torch.int64).clamp(0, groups)
    return torch.tensor(table, dtype=x.dtype, device=x.device)[k]


@register_layer("Round")
class Round(Layer):
    blob_names = ("ratio",)

    def parse(self, lp):
        need_blobs(lp, "Round", 1, 1)
        p = lp.round_param
        attrs = {"method": int(p.method)}
        if p.method == MULTI:
            g = positive_field(p.groups, "round_param.groups")
            step = np.float32(1.0 / g)
            attrs["table"] = [float(step * np.float32(i) + step) for i in range(g)] + [1.0]
        return attrs

    def param_shapes(self, attrs, in_shapes):
        return [(1, 1, 1, 1)]

    def init_params(self, attrs, shapes, rng):
        return [np.zeros((1, 1, 1, 1), np.float32)]

    def forward(self, attrs, params, x):
        if attrs["method"] == MULTI:
            return round_multi(x, attrs["table"])
        if attrs["method"] == ZERO_ONE:
            return (x > 0.5).to(x.dtype)
        return torch.where(x > 0, torch.ones_like(x), -torch.ones_like(x))

    def onnx(self, ctx, node):
        x, y, m = node.inputs[0], node.outputs[0], node.attrs["method"]
        if m == ZERO_ONE:
            ctx.add_node("Cast", [ctx.op("Greater", [x, ctx.f32(0.5)], "above", name=node.name)], [y], to=1)
        elif m == ONE_MINUS_ONE:
            ctx.add_node("Where", [ctx.op("Greater", [x, ctx.f32(0.0)], "above", name=node.name), ctx.f32(1.0),
                                   ctx.f32(-1.0)], [y])
        else:
            table = node.attrs["table"]
            g = len(table) - 1
            low = ctx.op("Where", [ctx.op("Less", [x, ctx.f32(0.0)], "below", name=node.name), ctx.f32(0.0), x], "low")
            t = ctx.op("Where", [ctx.op("Greater", [x, ctx.f32(1.0)], "above"), ctx.f32(1.0), low], "clamped")
            k = ctx.op("Cast", [ctx.trunc(ctx.op("Mul", [t, ctx.f32(float(g))], "scaled"))], "k", to=7)
            k = ctx.op("Max", [ctx.op("Min", [k, ctx.i64(g)], "kmax"), ctx.i64(0)], "kclamp")
            ctx.add_node("Gather", [ctx.f32(table), k], [y], axis=0)

    def pytorch_source(self, node, emit):
        m = emit.module("torch.nn.Parameter(torch.zeros(1, 1, 1, 1), requires_grad=False)")
        emit.param("", 0, attr=m[len("self."):])
        x, a = emit.inputs[0], node.attrs
        if a["method"] == MULTI:
            return f"{emit.helper(round_multi)}({x}, {emit.lit(a['table'])})"
        if a["method"] == ZERO_ONE:
            return f"({x} > 0.5).to({x}.dtype)"
        return f"torch.where({x} > 0, torch.ones_like({x}), -torch.ones_like({x}))"


# ---- ImpMap ---------------------------------------------------------------------------------------

def importance_map(x, groups: int, channel_out: int, extra: int):
    """ImpMap's top: channel c is 1 where c < min(int(x groups + 1e-5) + extra, groups) * channel_out / groups."""
    k = torch.floor(((x * groups).to(torch.float64) + 0.00001).clamp(0, groups))
    count = torch.clamp(k + extra, max=groups) * (channel_out // groups)
    ch = torch.arange(channel_out, dtype=torch.float64, device=x.device).reshape(1, channel_out, 1, 1)
    return (ch < count).to(x.dtype)


@register_layer("ImpMap")
class ImpMap(Layer):
    blob_names = ("ones_share",)

    def parse(self, lp):
        need_blobs(lp, "ImpMap", 1, 1)
        p = lp.imp_map_param
        g = positive_field(p.groups, "imp_map_param.groups")
        c = positive_field(p.channel_out, "imp_map_param.channel_out")
        if c % g:
            raise LayerError(f"imp_map_param.channel_out {c} must be a multiple of groups {g} (the fork's check)")
        return {"groups": g, "channels": c, "extra": 0 if p.lquantize else 1}

    def infer(self, attrs, in_shapes):
        n, c, h, w = legacy_nchw(in_shapes[0], "ImpMap")
        if c != 1:
            raise LayerError(f"ImpMap takes a one-channel map (the fork's check), got {c} channels")
        attrs["_legacy"] = [n, c, h, w]
        return [(n, attrs["channels"], h, w)]

    def param_shapes(self, attrs, in_shapes):
        return [(1, 1, 1, 1)]

    def init_params(self, attrs, shapes, rng):
        return [np.zeros((1, 1, 1, 1), np.float32)]

    def forward(self, attrs, params, x):
        return importance_map(x.reshape(attrs["_legacy"]), attrs["groups"], attrs["channels"], attrs["extra"])

    def onnx(self, ctx, node):
        a = node.attrs
        x = ctx.op("Reshape", [node.inputs[0], ctx.i64(a["_legacy"])], "x4", name=node.name)
        scaled = ctx.op("Cast", [ctx.op("Mul", [x, ctx.f32(float(a["groups"]))], "scaled")], "scaled64", to=11)
        v = ctx.op("Add", [scaled, ctx.const(np.array(0.00001, np.float64))], "biased")
        v = ctx.op("Min", [ctx.op("Max", [v, ctx.const(np.array(0.0, np.float64))], "vlow"),
                           ctx.const(np.array(float(a["groups"]), np.float64))], "vclamp")
        k = ctx.op("Add", [ctx.op("Floor", [v], "k"), ctx.const(np.array(float(a["extra"]), np.float64))], "kx")
        k = ctx.op("Min", [k, ctx.const(np.array(float(a["groups"]), np.float64))], "kmin")
        count = ctx.op("Mul", [k, ctx.const(np.array(float(a["channels"] // a["groups"]), np.float64))], "count")
        ch = ctx.const(np.arange(a["channels"], dtype=np.float64).reshape(1, -1, 1, 1))
        ctx.add_node("Cast", [ctx.op("Less", [ch, count], "on")], [node.outputs[0]], to=1)

    def pytorch_source(self, node, emit):
        m = emit.module("torch.nn.Parameter(torch.zeros(1, 1, 1, 1), requires_grad=False)")
        emit.param("", 0, attr=m[len("self."):])
        a = node.attrs
        return (f"{emit.helper(importance_map)}({emit.inputs[0]}.reshape({a['_legacy']}), {a['groups']}, "
                f"{a['channels']}, {a['extra']})")


# ---- EntropyPack ----------------------------------------------------------------------------------

def entropy_pack(x, imp: torch.Tensor | None, start: int, samples: int, ks: int, depth: int):
    """EntropyPack's two tops for the `samples` images from `start` (see the module docstring)."""
    xs = x[start:start + samples]
    s, c, h, w = xs.shape
    half = ks // 2
    pads = (half, ks - 1 - half, half, ks - 1 - half, depth - 1, 0)
    vp = F.pad(xs + 1, pads)
    if imp is not None:
        m = imp[start:start + samples]
        centre = ~(m < 0.5)
        mp = F.pad((m > 0).to(xs.dtype), pads)
    pieces = []
    for d in range(depth):
        for i in range(ks):
            for j in range(ks):
                if d == depth - 1 and (i > half or (i == half and j >= half)):
                    pieces.append(torch.zeros_like(xs))
                    continue
                v = vp[:, d:d + c, i:i + h, j:j + w]
                if imp is not None:
                    ok = centre & (mp[:, d:d + c, i:i + h, j:j + w] > 0)
                    v = torch.where(ok, v, torch.zeros_like(v))
                pieces.append(v)
    cubes = torch.stack(pieces, dim=-1).reshape(s * c * h * w, depth, ks, ks)
    label = xs + (m if imp is not None else 1)
    return cubes, label.reshape(s * c * h * w, 1, 1, 1)


@register_layer("EntropyPack")
class EntropyPack(Layer):
    blob_names = ("start",)

    def parse(self, lp):
        need_blobs(lp, "EntropyPack", (1, 2), 2, "code, importance mask")
        p = lp.entropy_pack_param
        return {"ks": positive_field(p.kernel, "entropy_pack_param.kernel"),
                "depth": positive_field(p.channels, "entropy_pack_param.channels"),
                "samples": positive_field(p.samples, "entropy_pack_param.samples")}

    def infer(self, attrs, in_shapes):
        n, c, h, w = legacy_nchw(in_shapes[0], "EntropyPack")
        if n % attrs["samples"]:
            raise LayerError(f"EntropyPack: the batch {n} must be a multiple of entropy_pack_param.samples "
                             f"{attrs['samples']} (the fork's check)")
        if len(in_shapes) == 2 and legacy_nchw(in_shapes[1], "EntropyPack") != (n, c, h, w):
            raise LayerError(f"EntropyPack's importance mask {list(in_shapes[1])} must be shaped as the code "
                             f"{[n, c, h, w]} (the fork reads both in one layout)")
        attrs["_legacy"] = [n, c, h, w]
        rows = attrs["samples"] * c * h * w
        return [(rows, attrs["depth"], attrs["ks"], attrs["ks"]), (rows, 1, 1, 1)]

    def param_shapes(self, attrs, in_shapes):
        return [(1, 1, 1, 1)]

    def init_params(self, attrs, shapes, rng):
        return [np.zeros((1, 1, 1, 1), np.float32)]

    @staticmethod
    def _start(attrs, value):
        b = int(float(value) + 0.001)
        if not 0 <= b <= attrs["_legacy"][0] - attrs["samples"]:
            raise LayerError(f"EntropyPack's stored start image {b} leaves no {attrs['samples']} images in a batch "
                             f"of {attrs['_legacy'][0]}")
        return b

    def forward(self, attrs, params, x, imp=None):
        start = self._start(attrs, params[0].reshape(-1)[0])
        x = x.reshape(attrs["_legacy"])
        imp = imp.reshape(attrs["_legacy"]) if imp is not None else None
        return entropy_pack(x, imp, start, attrs["samples"], attrs["ks"], attrs["depth"])

    def onnx(self, ctx, node):
        a = node.attrs
        start = self._start(a, np.asarray(node.blobs[0]).reshape(-1)[0])
        n, c, h, w = a["_legacy"]
        s, ks, depth = a["samples"], a["ks"], a["depth"]
        half = ks // 2
        pads = ctx.i64([0, depth - 1, half, half, 0, 0, ks - 1 - half, ks - 1 - half])

        def images(name, hint):
            t = ctx.op("Reshape", [name, ctx.i64(a["_legacy"])], f"{hint}4")
            return ctx.op("Slice", [t, ctx.i64([start]), ctx.i64([start + s]), ctx.i64([0])], hint)

        xs = images(node.inputs[0], "x")
        vp = ctx.op("Pad", [ctx.op("Add", [xs, ctx.f32(1.0)], "plus1"), pads], "vp")
        if len(node.inputs) == 2:
            m = images(node.inputs[1], "m")
            centre = ctx.op("Not", [ctx.op("Less", [m, ctx.f32(0.5)], "low")], "centre")
            mp = ctx.op("Pad", [ctx.op("Cast", [ctx.op("Greater", [m, ctx.f32(0.0)], "pos")], "posf", to=1), pads], "mp")
        zeros = ctx.filled(xs, 0.0, "zeros")
        pieces = []
        for d in range(depth):
            for i in range(ks):
                for j in range(ks):
                    if d == depth - 1 and (i > half or (i == half and j >= half)):
                        piece = zeros
                    else:
                        box = [ctx.i64([d, i, j]), ctx.i64([d + c, i + h, j + w]), ctx.i64([1, 2, 3])]
                        piece = ctx.op("Slice", [vp] + box, f"v{d}_{i}_{j}")
                        if len(node.inputs) == 2:
                            nb = ctx.op("Greater", [ctx.op("Slice", [mp] + box, f"m{d}_{i}_{j}"), ctx.f32(0.0)], "nb")
                            piece = ctx.op("Where", [ctx.op("And", [centre, nb], "ok"), piece, zeros], "kept")
                    pieces.append(ctx.op("Unsqueeze", [piece, ctx.i64([4])], "piece"))
        cubes = ctx.op("Concat", pieces, "cubes", axis=4)
        ctx.add_node("Reshape", [cubes, ctx.i64([s * c * h * w, depth, ks, ks])], [node.outputs[0]])
        label = ctx.op("Add", [xs, m if len(node.inputs) == 2 else ctx.f32(1.0)], "label")
        ctx.add_node("Reshape", [label, ctx.i64([s * c * h * w, 1, 1, 1])], [node.outputs[1]])

    def pytorch_source(self, node, emit):
        a = node.attrs
        start = self._start(a, emit.blob(0).reshape(-1)[0])
        m = emit.module("torch.nn.Parameter(torch.zeros(1, 1, 1, 1), requires_grad=False)")
        emit.param("", 0, attr=m[len("self."):])
        x = f"{emit.inputs[0]}.reshape({a['_legacy']})"
        imp = f"{emit.inputs[1]}.reshape({a['_legacy']})" if len(emit.inputs) == 2 else "None"
        out = emit.tmp("pack")
        emit.stmt(f"{out} = {emit.helper(entropy_pack)}({x}, {imp}, {start}, {a['samples']}, {a['ks']}, {a['depth']})")
        return [f"{out}[0]", f"{out}[1]"]


# ---- MulToBin -------------------------------------------------------------------------------------

def mul_to_bin(x, levels: int, nmod: int, inverse: bool, imp: bool):
    """MulToBin: base-2^nmod digits of (unsigned) (int) x along a new channel axis (see the module docstring)."""
    n, c, h, w = x.shape
    t = torch.nan_to_num(x.to(torch.float64), nan=0.0).clamp(-2147483648.0, 2147483647.0)
    u = torch.trunc(t).to(torch.int64) % 4294967296
    flag = (u > 0).to(torch.int64) if imp else None
    if imp:
        u = u - flag
    digits = []
    for j in range(levels):
        shift = nmod * j
        d = (u // (2 ** shift)) % (2 ** nmod) if shift < 32 else torch.zeros_like(u)
        digits.append(d * flag + flag if imp else d)
    if inverse:
        digits = digits[::-1]
    return torch.stack(digits, dim=2).reshape(n, c * levels, h, w).to(x.dtype)


@register_layer("MulToBin")
class MulToBin(Layer):
    def parse(self, lp):
        need_blobs(lp, "MulToBin", 1, 1)
        p = lp.multobin_param
        if p.mod > 31:
            raise LayerError(f"multobin_param.mod must be at most 31 (the digit base 2^mod is a C int), got {p.mod}")
        return {"levels": positive_field(p.levels, "multobin_param.levels"), "nmod": int(p.mod),
                "inverse": bool(p.inverse), "imp": bool(p.imp)}

    def infer(self, attrs, in_shapes):
        n, c, h, w = legacy_nchw(in_shapes[0], "MulToBin")
        attrs["_legacy"] = [n, c, h, w]
        return [(n, c * attrs["levels"], h, w)]

    def forward(self, attrs, params, x):
        a = attrs
        return mul_to_bin(x.reshape(a["_legacy"]), a["levels"], a["nmod"], a["inverse"], a["imp"])

    def onnx(self, ctx, node):
        a = node.attrs
        n, c, h, w = a["_legacy"]
        x = ctx.op("Cast", [ctx.op("Reshape", [node.inputs[0], ctx.i64(a["_legacy"])], "x4", name=node.name)],
                   "x64", to=11)
        x = ctx.op("Where", [ctx.op("IsNaN", [x], "nan"), ctx.const(np.array(0.0, np.float64)), x], "nonan")
        x = ctx.op("Min", [ctx.op("Max", [x, ctx.const(np.array(-2147483648.0))], "low"),
                           ctx.const(np.array(2147483647.0))], "sat")
        u = ctx.op("Mod", [ctx.op("Cast", [ctx.trunc(x)], "int", to=7), ctx.i64(4294967296)], "u")
        if a["imp"]:
            flag = ctx.op("Cast", [ctx.op("Greater", [u, ctx.i64(0)], "pos")], "flag", to=7)
            u = ctx.op("Sub", [u, flag], "u1")
        digits = []
        for j in range(a["levels"]):
            shift = a["nmod"] * j
            if shift < 32:
                d = ctx.op("Mod", [ctx.op("Div", [u, ctx.i64(2 ** shift)], "shifted"), ctx.i64(2 ** a["nmod"])], "d")
            else:
                d = ctx.op("Mul", [u, ctx.i64(0)], "d0")
            if a["imp"]:
                d = ctx.op("Add", [ctx.op("Mul", [d, flag], "df"), flag], "dimp")
            digits.append(ctx.op("Unsqueeze", [d, ctx.i64([2])], "digit"))
        if a["inverse"]:
            digits = digits[::-1]
        cat = ctx.op("Concat", digits, "digits", axis=2)
        flat = ctx.op("Reshape", [cat, ctx.i64([n, c * a["levels"], h, w])], "flat")
        ctx.add_node("Cast", [flat], [node.outputs[0]], to=1)

    def pytorch_source(self, node, emit):
        a = node.attrs
        return (f"{emit.helper(mul_to_bin)}({emit.inputs[0]}.reshape({a['_legacy']}), {a['levels']}, {a['nmod']}, "
                f"{a['inverse']}, {a['imp']})")


# ---- MTranspose -----------------------------------------------------------------------------------

@register_layer("MTranspose")
class MTranspose(Layer):
    def parse(self, lp):
        need_blobs(lp, "MTranspose", 1, 1)
        p = lp.mtranspose_param
        attrs = {"groups": positive_field(p.groups, "mtranspose_param.groups"), "inverse": bool(p.inverse)}
        if p.inverse:
            attrs["shape"] = [positive_field(v, f"mtranspose_param.{f}") for v, f in
                              ((p.channel, "channel"), (p.height, "height"), (p.width, "width"))]
        return attrs

    def infer(self, attrs, in_shapes):
        g = attrs["groups"]
        if attrs["inverse"]:
            c, h, w = attrs["shape"]
            total = count_of(in_shapes[0])
            if total % (c * h * w):
                raise LayerError(f"MTranspose (inverse): the bottom's {total} values are not a whole number of "
                                 f"{c} x {h} x {w} images")
            n = total // (c * h * w)
        else:
            n, c, h, w = legacy_nchw(in_shapes[0], "MTranspose")
        if c % g:
            raise LayerError(f"MTranspose: channels {c} must be a multiple of mtranspose_param.groups {g}")
        attrs["_view"] = [n, c // g, g, h * w]
        return [(n, c, h, w)] if attrs["inverse"] else [(n * c * h * w // g, g)]

    def forward(self, attrs, params, x):
        n, cg, g, s = attrs["_view"]
        if attrs["inverse"]:
            c, h, w = attrs["shape"]
            return x.reshape(n, cg, s, g).transpose(2, 3).reshape(n, c, h, w)
        return x.reshape(n, cg, g, s).transpose(2, 3).reshape(n * cg * s, g)

    def onnx(self, ctx, node):
        n, cg, g, s = node.attrs["_view"]
        src = [n, cg, s, g] if node.attrs["inverse"] else [n, cg, g, s]
        view = ctx.op("Reshape", [node.inputs[0], ctx.i64(src)], "view", name=node.name)
        moved = ctx.op("Transpose", [view], "moved", perm=[0, 1, 3, 2])
        out = [n] + node.attrs["shape"] if node.attrs["inverse"] else [n * cg * s, g]
        ctx.add_node("Reshape", [moved, ctx.i64(out)], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        n, cg, g, s = node.attrs["_view"]
        if node.attrs["inverse"]:
            c, h, w = node.attrs["shape"]
            return f"{emit.inputs[0]}.reshape({n}, {cg}, {s}, {g}).transpose(2, 3).reshape({n}, {c}, {h}, {w})"
        return f"{emit.inputs[0]}.reshape({n}, {cg}, {g}, {s}).transpose(2, 3).reshape({n * cg * s}, {g})"


def count_of(shape):
    return int(math.prod(int(d) for d in shape))
