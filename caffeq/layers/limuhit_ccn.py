"""limuhit's learned-quantization image-compression Caffe: limuhit/CCN bf0b27b (caffe/src/caffe/proto/caffe.proto,
caffe/src/caffe/layers/{ml_quant,dynamic_mask_data,split_channel,decoder_quant,decoder_conv3,decoder_input,
decoder_output,decoder_extract}_layer.{cpp,cu}) and limuhit/Nonlocal-CCN 6bc9472 (caffe/nolocal_gemm_v4_pre_layer.*,
caffe/nolocal_gemm_v4_post_layer.*).  Each forward is the TEST one; where the CPU forward is empty, the CUDA kernel's.

- MLQuant (mlquant_param groups L [1], method SINGLE | NEIGHBOR): blob 0 holds per channel (and, for NEIGHBOR, per
  context table) L values r; the levels are t_0 = r_0, t_j = t_(j-1) + exp(r_j), exp(r_j) being float32 expf
  (here the float64 exp rounded to float32: the correctly rounded value; the fork's GPU forward takes CUDA's
  expf, within 2 ulp of it).  Each x of channel c walks them by float32 subtraction: tmp = x - r_0 (< 0: top
  r_0, index 0); else tmp -= exp(r_j) for j = 1.. until tmp < 0 (j = L - 1 when it never is); if 2 tmp + exp(r_j) < 0 it steps back (tmp += exp(r_j), j -= 1); top = x - tmp,
  top 1 (optional) = j.  NEIGHBOR first quantizes with table 0, then picks for each pixel the table
  1 + up (L + 1) + left from the indexes above and to the left in its plane (L where there is none).  Before
  the tables are used, a forward whose blob-1 counter blobs[1][2] is a nonzero multiple of blobs[1][3] first
  rewrites them from the usage counts of blob 2 (ml_quant_check_weight: unused top levels merged, an unused
  level 0 folded into level 1, in float32 as the fork's MSVC build; with groups < 3 that fold writes into the
  next row through the flat pointer, as here, and past the blob for the last row, refused); that rewrite is
  applied here for the one forward caffeq runs (a counter period of 0, where the fork divides by zero, skips
  it).  The counts, the counter and the statistics the fork updates at each forward (training state) are not
  written back.
- DecoderQuant (mlquant_param groups L; GPU kernel): top = entry c L + int(x) (truncated) of the flat table of
  levels t (per channel as above, a float32 running sum of expf), so that an index past L - 1 (or below 0) reads
  the next (previous) channel's levels as the kernel does; only an entry outside the whole table, which the
  kernel reads out of bounds, is clamped to it.
- DynamicMaskData: a mask shaped like the bottom, 1 on the channels below int(blobs[0] + 1e-6) (the stored
  channel count; the fork's setup stores the bottom's channels), else 0.
- SplitChannel (memory_data_param.channels K, as the fork reads it): the first K channels, (N, K, H, W).
- NolocalGemmV4Pre: (N, C, H, W) -> (N, C, HW, HW), top[n, c, a, b] = -(x[n, c, a] - x[n, c, b])^2.
- NolocalGemmV4Post (nonlocal_param groups = C, code [true], mean, margin): bottoms x (N, C, H, W) and d
  (N, C, HW, HW).  w = exp(d) kept where the diagonal index (row + column) of position a is greater than b's
  (code; greater or equal without it), else 0; p = w / sum_b w (w where that sum is 0); top 0 = p x (per
  plane), top 1 = sum_b p d; then each plane's first position gets top 0 = mean, top 1 = -margin^2.
  limuhit/Nonlocal-CCN does not publish its caffe.proto: mean and margin take caffeq's defaults (0).
- DecoderConv3, DecoderInput, DecoderOutput, DecoderExtract: sequential decoders that pycaffe drives one
  diagonal of code positions (h + w + channel group) per call.  Each forward reads a hidden call counter (pidx_,
  DecoderConv3's pindex_; reset only when the shapes change, cycling modulo H + W + nchannels, H + W + channels
  for DecoderExtract, H + W + C / group_in - 2 for DecoderConv3) and writes only that diagonal's part of tops
  that keep the previous calls' values, so one forward has no meaning of its own.  caffeq reads them (shapes as
  their Reshape: DecoderInput (N, nchannels, H, W) from a one-channel bottom, DecoderOutput
  (N H W + 1, 1, 1, C / nchannels + 1), DecoderExtract (N, 1, H, W), DecoderConv3 (N, num_output, H, W) with
  blobs (num_output, C, k, k) and (num_output)) and refuses to run them.  Per image the driver: DecoderInput
  scatters the decoded symbols of the last diagonal into (N, nchannels, H, W) (call 0 clears it), DecoderConv3 convolves the masked causal
  kernel for the positions of the current diagonal only, DecoderOutput turns their softmax into cumulative
  frequency tables for the arithmetic coder, DecoderExtract gathers the current diagonal's labels.
- TPReLU, Merge, EntropyPatch, EntropyDepatch are not registered: limuhit publishes no source for them.
"""
import math

import numpy as np
import torch

from .registry import Layer, LayerError, ReadOnlyLayer, legacy_nchw, need_blobs, register_layer, torch_sources

F32 = np.float32


def ml_quant_check(w, cnt, levels: int):
    """ml_quant_check_weight on the flat level blob w (float32 values) with usage counts cnt, row by row.

    Float32 arithmetic as the fork's build does it (MSVC: exp and log of a float are expf, logf, here the
    float64 result rounded to float32; log(levels - j) takes an int, so that difference is float64).  Rows are
    L long, but the level-0 merge touches positions 1 and 2 after the row's start: for groups < 3 that is the
    next row (handled as the fork's flat pointer does), and past the blob's end for its last row (refused)."""
    v = w.reshape(-1).double().tolist()
    c = cnt.reshape(-1).double().tolist()

    def f32(a):
        return float(torch.tensor(a, dtype=torch.float32))

    for b in range(0, len(v) - len(v) % levels, levels):
        j = levels - 1
        while j > 1 and not c[b + j] > 0:
            j -= 1
        t = f32(v[b + j] - math.log(levels - j))
        for k in range(j, levels):
            v[b + k] = t
        if c[b] < 1:
            if b + 2 >= len(v):
                raise ValueError("MLQuant: the fork's table check reads past the level blob (groups < 3, unused "
                                 "level 0 in the last row)")
            v[b] = f32(v[b] + f32(math.exp(v[b + 1])))
            t = f32(math.log(f32(f32(f32(math.exp(v[b + 1])) + f32(math.exp(v[b + 2]))) / 2)))
            v[b + 1] = t
            v[b + 2] = t
    return torch.tensor(v, dtype=torch.float32, device=w.device).reshape(w.shape)


def ml_quant_tables(raw, stats, counts, levels: int):
    """MLQuant's level steps (rows of L: r_0, expf(r_1), ...), after the fork's periodic table check.

    expf is float64 exp rounded to float32 (the correctly rounded expf; the fork's CUDA expf is within 2 ulp)."""
    w = raw.reshape(-1, levels).float()
    it, period = int(stats.reshape(-1)[2]), int(stats.reshape(-1)[3])
    if it != 0 and period != 0 and it % period == 0:
        w = ml_quant_check(w, counts, levels)
    step = torch.exp(w.double()).float()
    step[:, 0] = w[:, 0]
    return step.to(raw.dtype)


def ml_quant_walk(x, steps):
    """Quantize x against per-element level steps (x's shape + (L,)): (top, index) as the fork's kernel."""
    levels = steps.shape[-1]
    tmp = x - steps[..., 0]
    below = tmp < 0
    idx = torch.full_like(x, levels - 1)
    sel = tmp
    found = torch.zeros_like(below)
    t = tmp
    for k in range(1, levels):
        t = t - steps[..., k]
        hit = (~found) & (t < 0)
        idx = torch.where(hit, torch.full_like(x, k), idx)
        sel = torch.where(hit, t, sel)
        found = found | hit
    sel = torch.where(found, sel, t)
    wj = torch.gather(steps, -1, idx.long().clamp(min=0).unsqueeze(-1)).squeeze(-1)
    back = sel + sel + wj < 0
    sel = torch.where(back, sel + wj, sel)
    idx = torch.where(back, idx - 1, idx)
    top = torch.where(below, steps[..., 0], x - sel)
    return top, torch.where(below, torch.zeros_like(idx), idx)


def ml_quant(x, raw, stats, counts, levels: int, neighbor: bool):
    """MLQuant's TEST forward: (quantized x, level index as float)."""
    n, c, h, w = x.shape
    steps = ml_quant_tables(raw, stats, counts, levels).reshape(-1, c, levels)
    first = steps[0].reshape(1, c, 1, 1, levels).expand(n, c, h, w, levels)
    top, idx = ml_quant_walk(x, first)
    if not neighbor:
        return top, idx
    q = idx.long()
    up = torch.full_like(q, levels)
    up[:, :, 1:, :] = q[:, :, :-1, :]
    left = torch.full_like(q, levels)
    left[:, :, :, 1:] = q[:, :, :, :-1]
    table = 1 + up * (levels + 1) + left
    chan = torch.arange(c, device=x.device).reshape(1, c, 1, 1).expand(n, c, h, w)
    return ml_quant_walk(x, steps[table, chan])


def decoder_quant_table(raw, levels: int):
    """DecoderQuant's levels, flat (C * L): per channel r_0, then a float32 running sum of expf(r_k)."""
    r = raw.reshape(-1, levels).float()
    cols = [r[:, 0]]
    for k in range(1, levels):
        cols.append(cols[-1] + torch.exp(r[:, k].double()).float())
    return torch.stack(cols, 1).reshape(-1)


def decoder_quant(x, raw, levels: int):
    """DecoderQuant: entry c L + int(x) of the flat level table (an index past its channel's L levels reads the
    neighbouring channel's, as the kernel does; one outside the whole table is clamped to it)."""
    table = decoder_quant_table(raw, levels)
    c = x.shape[1]
    base = (torch.arange(c, device=x.device) * levels).reshape(1, c, *([1] * (x.dim() - 2)))
    k = (torch.trunc(x).long() + base).clamp(0, table.numel() - 1)
    return table.to(x.dtype)[k]


def dynamic_mask(x, stored):
    """DynamicMaskData: 1 on the channels below int(stored + 1e-6), else 0, shaped like x."""
    keep = torch.trunc(stored.reshape(-1)[0].double() + 1e-6)
    chan = torch.arange(x.shape[1], device=x.device, dtype=torch.float64)
    mask = (chan < keep).to(x.dtype).reshape(1, -1, *([1] * (x.dim() - 2)))
    return mask.expand_as(x).clone()


def nonlocal_distance(x):
    """NolocalGemmV4Pre: -(x_a - x_b)^2 over each plane's positions a, b."""
    n, c = x.shape[:2]
    v = x.reshape(n, c, -1)
    d = v.unsqueeze(-1) - v.unsqueeze(-2)
    return -(d * d)


def nonlocal_post(x, dist, width: int, code: bool, mean: float, margin: float):
    """NolocalGemmV4Post: causal softmax-like weights over earlier diagonals, their average of x and of dist."""
    n, c, h, w = x.shape
    hw = h * w
    pos = torch.arange(hw, device=x.device)
    diag = pos // width + pos % width
    keep = diag.unsqueeze(1) > diag.unsqueeze(0) if code else diag.unsqueeze(1) >= diag.unsqueeze(0)
    wt = torch.where(keep, torch.exp(dist), torch.zeros_like(dist))
    s = wt.sum(-1, keepdim=True)
    p = torch.where(s > 0, wt / torch.where(s > 0, s, torch.ones_like(s)), wt)
    top0 = torch.matmul(p, x.reshape(n, c, hw, 1)).reshape(n, c, hw)
    top1 = (p * dist).sum(-1)
    top0[:, :, 0] = mean
    top1[:, :, 0] = -(margin * margin)
    return top0.reshape(n, c, h, w), top1.reshape(n, c, h, w)


def _blobs(emit, count):
    """model.py attributes holding the node's first `count` blobs (fixed buffers)."""
    names = []
    for i in range(count):
        attr = emit.extra_attr(f"blob{i}")
        shape = tuple(emit.blob(i).shape)
        m = emit.module(f"torch.nn.Parameter(torch.zeros({shape}), requires_grad=False)", attr=attr)
        emit.param("", i, attr=m[len("self."):])
        names.append(m)
    return names


def _levels(lp, what):
    levels = int(lp.mlquant_param.groups)
    if levels < 1:
        raise LayerError(f"{what}: mlquant_param.groups must be >= 1, got {levels}")
    return levels


@register_layer("MLQuant")
class MLQuant(Layer):
    blob_names = ("levels", "stats", "counts")
    onnx_refusal = "MLQuant's level walk and its table check from the stored counter are not emitted as ONNX"

    def parse(self, lp):
        need_blobs(lp, "MLQuant", 1, (1, 2))
        return {"levels": _levels(lp, "MLQuant"), "neighbor": lp.mlquant_param.method == 1, "tops": len(lp.top)}

    def infer(self, attrs, in_shapes):
        attrs["_legacy"] = list(legacy_nchw(in_shapes[0], "MLQuant"))
        return [tuple(in_shapes[0])] * attrs["tops"]

    def param_shapes(self, attrs, in_shapes):
        c, L = attrs["_legacy"][1], attrs["levels"]
        tables = (L + 1) * (L + 1) + 1 if attrs["neighbor"] else 1
        return [(tables, c, 1, L), (5, 1, 1, 1), (tables, c, 1, L)]

    def init_params(self, attrs, shapes, rng):
        L = attrs["levels"]
        val = F32(1.0 / L)
        raw = np.full(shapes[0], np.log(val), F32)
        raw[..., 0] = val / F32(2)
        return [raw, np.array([1, 0.999, 0, 200, 0], F32).reshape(5, 1, 1, 1), np.zeros(shapes[2], F32)]

    def forward(self, attrs, params, x):
        top, idx = ml_quant(x.reshape(attrs["_legacy"]), params[0], params[1], params[2], attrs["levels"],
                            attrs["neighbor"])
        outs = (top.reshape(x.shape), idx.reshape(x.shape))
        return outs[:attrs["tops"]] if attrs["tops"] > 1 else outs[0]

    def pytorch_source(self, node, emit):
        a = node.attrs
        fn = emit.helper(torch_sources(ml_quant_check, ml_quant_tables, ml_quant_walk, ml_quant))
        ps = _blobs(emit, 3)
        call = (f"{fn}({emit.inputs[0]}.reshape({a['_legacy']}), {ps[0]}, {ps[1]}, {ps[2]}, {a['levels']}, "
                f"{a['neighbor']})")
        t = emit.tmp("mlq")
        emit.stmt(f"{t} = {call}")
        outs = [f"{t}[0].reshape({emit.inputs[0]}.shape)", f"{t}[1].reshape({emit.inputs[0]}.shape)"]
        return outs[:a["tops"]] if a["tops"] > 1 else outs[0]


@register_layer("DecoderQuant")
class DecoderQuant(Layer):
    blob_names = ("levels", "stats", "counts")

    def parse(self, lp):
        need_blobs(lp, "DecoderQuant", 1, 1)
        return {"levels": _levels(lp, "DecoderQuant")}

    def param_shapes(self, attrs, in_shapes):
        c = legacy_nchw(in_shapes[0], "DecoderQuant")[1]
        return [(1, c, 1, attrs["levels"]), (5, 1, 1, 1), (1, c, 1, attrs["levels"])]

    def forward(self, attrs, params, x):
        return decoder_quant(x, params[0], attrs["levels"])

    def onnx(self, ctx, node):
        L = node.attrs["levels"]
        flat = decoder_quant_table(torch.tensor(np.asarray(node.blobs[0], F32)), L).numpy()
        c = flat.size // L
        k = ctx.op("Cast", [node.inputs[0]], "k", name=node.name, to=7)
        off = ctx.const((np.arange(c, dtype=np.int64) * L).reshape(1, c, 1, 1), "chan_offset")
        k = ctx.op("Add", [k, off], "flat_k")
        k = ctx.op("Clip", [k, ctx.const(np.array(0, np.int64)), ctx.const(np.array(flat.size - 1, np.int64))], "kc")
        ctx.add_node("Gather", [ctx.const(flat, "table"), k], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        p = _blobs(emit, 1)[0]
        fn = emit.helper(torch_sources(decoder_quant_table, decoder_quant))
        return f"{fn}({emit.inputs[0]}, {p}, {node.attrs['levels']})"


@register_layer("DynamicMaskData")
class DynamicMaskData(Layer):
    blob_names = ("channels",)

    def parse(self, lp):
        need_blobs(lp, "DynamicMaskData", 1, 1)
        return {}

    def infer(self, attrs, in_shapes):
        attrs["_legacy"] = list(legacy_nchw(in_shapes[0], "DynamicMaskData"))
        return [tuple(in_shapes[0])]

    def param_shapes(self, attrs, in_shapes):
        return [(1, 1, 1, 1)]

    def init_params(self, attrs, shapes, rng):
        return [np.full((1, 1, 1, 1), attrs["_legacy"][1], F32)]

    def forward(self, attrs, params, x):
        return dynamic_mask(x, params[0])

    def onnx(self, ctx, node):
        stored = float(np.asarray(node.blobs[0], F32).reshape(-1)[0])
        mask = dynamic_mask(torch.zeros(node.attrs["_legacy"]), torch.tensor([stored])).numpy().astype(F32)
        ctx.add_node("Identity", [ctx.const(mask, "mask")], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        p = _blobs(emit, 1)[0]
        return f"{emit.helper(dynamic_mask)}({emit.inputs[0]}, {p})"


@register_layer("SplitChannel")
class SplitChannel(Layer):
    def parse(self, lp):
        need_blobs(lp, "SplitChannel", 1, 1)
        k = int(lp.memory_data_param.channels)
        if k < 1:
            raise LayerError(f"SplitChannel: memory_data_param.channels (the channels kept) must be >= 1, got {k}")
        return {"channels": k}

    def infer(self, attrs, in_shapes):
        n, c, h, w = legacy_nchw(in_shapes[0], "SplitChannel")
        if attrs["channels"] > c:
            raise LayerError(f"SplitChannel: memory_data_param.channels {attrs['channels']} exceeds the bottom's "
                             f"{c} channels")
        attrs["_flat"] = [int(in_shapes[0][0]), c, -1]
        attrs["_out"] = [n, attrs["channels"], h, w]
        return [(n, attrs["channels"], h, w)]

    def forward(self, attrs, params, x):
        return x.reshape(attrs["_flat"])[:, :attrs["channels"]].reshape(attrs["_out"])

    def onnx(self, ctx, node):
        a = node.attrs
        flat = ctx.op("Reshape", [node.inputs[0], ctx.i64(a["_flat"])], "flat", name=node.name)
        part = ctx.op("Slice", [flat, ctx.i64([0]), ctx.i64([a["channels"]]), ctx.i64([1])], "part")
        ctx.add_node("Reshape", [part, ctx.i64(a["_out"])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        a = node.attrs
        return f"{emit.inputs[0]}.reshape({a['_flat']})[:, :{a['channels']}].reshape({a['_out']})"


@register_layer("NolocalGemmV4Pre")
class NolocalGemmV4Pre(Layer):
    def parse(self, lp):
        need_blobs(lp, "NolocalGemmV4Pre", 1, 1)
        return {}

    def infer(self, attrs, in_shapes):
        n, c, h, w = legacy_nchw(in_shapes[0], "NolocalGemmV4Pre")
        attrs["_legacy"] = [n, c, h, w]
        return [(n, c, h * w, h * w)]

    def forward(self, attrs, params, x):
        return nonlocal_distance(x.reshape(attrs["_legacy"]))

    def onnx(self, ctx, node):
        n, c, h, w = node.attrs["_legacy"]
        a = ctx.op("Reshape", [node.inputs[0], ctx.i64([n, c, h * w, 1])], "a", name=node.name)
        b = ctx.op("Reshape", [node.inputs[0], ctx.i64([n, c, 1, h * w])], "b")
        d = ctx.op("Sub", [a, b], "d")
        ctx.add_node("Neg", [ctx.op("Mul", [d, d], "sq")], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        return f"{emit.helper(nonlocal_distance)}({emit.inputs[0]}.reshape({node.attrs['_legacy']}))"


@register_layer("NolocalGemmV4Post")
class NolocalGemmV4Post(Layer):
    onnx_refusal = "NolocalGemmV4Post's masked normalisation and first-position overwrite are not emitted as ONNX"
    reading_note = ("NolocalGemmV4Post: limuhit/Nonlocal-CCN publishes no caffe.proto; nonlocal_param.mean and "
                    "margin take caffeq's defaults (0) where the file leaves them out")

    def parse(self, lp):
        need_blobs(lp, "NolocalGemmV4Post", 2, 2, "data, distance")
        p = lp.nonlocal_param
        return {"groups": int(p.groups), "code": bool(p.code), "mean": float(F32(p.mean)),
                "margin": float(F32(p.margin))}

    def infer(self, attrs, in_shapes):
        n, c, h, w = legacy_nchw(in_shapes[0], "NolocalGemmV4Post")
        if tuple(in_shapes[1]) != (n, c, h * w, h * w):
            raise LayerError(f"NolocalGemmV4Post: bottom 1 must be (N, C, HW, HW) = {[n, c, h * w, h * w]}, "
                             f"got {list(in_shapes[1])}")
        if attrs["groups"] != c:
            raise LayerError(f"NolocalGemmV4Post: nonlocal_param.groups must equal the data's {c} channels (the "
                             f"kernel multiplies N x groups planes), got {attrs['groups']}")
        attrs["_legacy"] = [n, c, h, w]
        return [(n, c, h, w), (n, c, h, w)]

    def forward(self, attrs, params, x, dist):
        a = attrs
        return nonlocal_post(x.reshape(a["_legacy"]), dist, a["_legacy"][3], a["code"], a["mean"], a["margin"])

    def pytorch_source(self, node, emit):
        a = node.attrs
        t = emit.tmp("nlc")
        emit.stmt(f"{t} = {emit.helper(nonlocal_post)}({emit.inputs[0]}.reshape({a['_legacy']}), {emit.inputs[1]}, "
                  f"{a['_legacy'][3]}, {a['code']}, {emit.lit(a['mean'])}, {emit.lit(a['margin'])})")
        return [f"{t}[0]", f"{t}[1]"]


_SEQUENTIAL = ("a sequential decoder step: its forward depends on a hidden call counter and keeps the tops "
               "of earlier calls, so one forward has no meaning of its own (pycaffe drives it)")


class _DecoderStep(ReadOnlyLayer):
    def why_not_run(self, attrs):
        return _SEQUENTIAL


@register_layer("DecoderInput")
class DecoderInput(_DecoderStep):
    def parse(self, lp):
        need_blobs(lp, "DecoderInput", 1, 1)
        return {"name": lp.name, "nchannels": int(lp.decoder_param.nchannels)}

    def infer(self, attrs, in_shapes):
        n, c, h, w = legacy_nchw(in_shapes[0], "DecoderInput")
        if c != 1:
            raise LayerError(f"DecoderInput takes one channel (the fork's check), got {c}")
        return [(n, attrs["nchannels"], h, w)]


@register_layer("DecoderOutput")
class DecoderOutput(_DecoderStep):
    def parse(self, lp):
        need_blobs(lp, "DecoderOutput", 1, 1)
        k = int(lp.decoder_param.nchannels)
        if k < 1:
            raise LayerError(f"DecoderOutput: decoder_param.nchannels must be >= 1, got {k}")
        return {"name": lp.name, "nchannels": k}

    def infer(self, attrs, in_shapes):
        n, c, h, w = legacy_nchw(in_shapes[0], "DecoderOutput")
        return [(n * h * w + 1, 1, 1, c // attrs["nchannels"] + 1)]


@register_layer("DecoderExtract")
class DecoderExtract(_DecoderStep):
    def parse(self, lp):
        need_blobs(lp, "DecoderExtract", 1, 1)
        return {"name": lp.name}

    def infer(self, attrs, in_shapes):
        n, c, h, w = legacy_nchw(in_shapes[0], "DecoderExtract")
        return [(n, 1, h, w)]


@register_layer("DecoderConv3")
class DecoderConv3(_DecoderStep):
    blob_names = ("weight", "bias")

    def parse(self, lp):
        need_blobs(lp, "DecoderConv3", 1, 1)
        p = lp.convolution_param
        if not p.kernel_size:
            raise LayerError("DecoderConv3: convolution_param.kernel_size is required")
        if p.num_output < 1:
            raise LayerError(f"DecoderConv3: convolution_param.num_output must be >= 1, got {p.num_output}")
        return {"name": lp.name, "nout": int(p.num_output), "k": int(p.kernel_size[0])}

    def infer(self, attrs, in_shapes):
        n, c, h, w = legacy_nchw(in_shapes[0], "DecoderConv3")
        attrs["_c"] = c
        return [(n, attrs["nout"], h, w)]

    def param_shapes(self, attrs, in_shapes):
        return [(attrs["nout"], attrs["_c"], attrs["k"], attrs["k"]), (attrs["nout"],)]
