"""Two forks' "sparse" layers: a soft threshold (Sparsify) and a convolution over packed nonzero taps.

Sparsify: Lanselott/FM_caffe `f87df8c` and Lanselott/caffe-1 `6723dcb`, byte-identical in both
(include/caffe/layers/sparsify_layer.hpp, src/caffe/layers/sparsify_layer.cpp/.cu; src/caffe/proto/caffe.proto
`SparsifyParameter { thre = 1 [0]; coef = 2 [0] }` at LayerParameter 147, `LayerParameter.display = 12`).  A
NeuronLayer: with thre = 0 the top is a copy of the bottom; otherwise, per element (CPU and GPU alike),
    y = 0 if |x| <= thre,  x - thre if x > thre,  x + thre otherwise (NaN stays NaN).
LayerSetUp checks thre >= 0 and coef >= 0; coef is the backward's L1 decay of the outputs and display only
logs the top's sparsity: read and ignored here.

SparseConvolution: vadim-v-lebedev/caffe `509afff` (include/caffe/layers/sparse_conv_layer.hpp,
src/caffe/layers/sparse_conv_layer.cpp; no proto fields of its own: convolution_param).  Blobs as
Convolution's, weight (O, C / group, kh, kw) and bias (O).  There is no Forward_gpu (the GPU runs Forward_cpu).
At its first forward compressKernel packs the weight: the taps of filter 0 (the first C·kh·kw values) that are
nonzero (`!= 0`: NaN counts, -0 does not) give the pattern, in (c, h, w) order, nnz of them; every nonzero value
of the whole blob, in memory order, is written one after another into a zero-initialized buffer; the gemm reads
that buffer as an (O, nnz) matrix against an im2col of the pattern's taps only.  When every filter has exactly
filter 0's zero pattern (how the fork's demo sparsifies: one mask for all filters and channels) this is the
plain convolution with the stored, masked weight; otherwise filter o takes the o-th run of nnz packed values.
caffeq runs Convolution with that effective dense weight, built from the stored one at each forward (ONNX: a
Gather of the stored weight, only where it differs).  Further readings of the source:
- a 1x1 kernel with pad 0 (is_1x1_) skips the im2col: the gemm then reads input channels 0..nnz-1, not the
  pattern's channels;
- compute_output_shape ignores stride and dilation (H + 2·pad - kh + 1) and the im2col ignores dilation:
  dilation is read and ignored (noted); a stride other than 1 makes the top's size disagree with the im2col's
  rows, and group > 1 offsets the packed weight by the dense sizes: both refused, as are axis != 1 and N-D;
- more nonzero values than the packed buffer's O·(C / group)·nnz overrun it: refused when the weights load.
"""
import torch

from ..errors import ExportError
from .conv import Convolution, _conv_nd, _resolve_spatial, parse_conv
from .registry import FunctionLayer, LayerError, register_layer, torch_sources

# ---- Sparsify -------------------------------------------------------------------------------------


def soft_threshold(x, thre: float):
    """Lanselott's Sparsify with thre > 0: 0 where |x| <= thre, else x moved thre towards 0."""
    return torch.where(x.abs() <= thre, torch.zeros_like(x), torch.where(x > thre, x - thre, x + thre))


@register_layer("Sparsify")
class Sparsify(FunctionLayer):
    def parse(self, lp):
        super().parse(lp)
        p = lp.sparsify_param
        thre, coef = float(p.thre), float(p.coef)
        if not thre >= 0:   # sparsify_layer.cpp: CHECK_GE(thre, 0)
            raise LayerError(f"sparsify_param.thre must be >= 0, got {thre}")
        if not coef >= 0:   # CHECK_GE(coef_, 0)
            raise LayerError(f"sparsify_param.coef must be >= 0, got {coef}")
        return {"thre": thre}

    def forward(self, attrs, params, x):
        return x if attrs["thre"] == 0 else soft_threshold(x, attrs["thre"])

    def onnx(self, ctx, node):
        x, y, t = node.inputs[0], node.outputs[0], node.attrs["thre"]
        if t == 0:
            ctx.add_node("Identity", [x], [y], name=node.name)
            return
        thre = ctx.const(torch.tensor(t, dtype=torch.float32).numpy())
        zero = ctx.const(torch.tensor(0, dtype=torch.float32).numpy())
        inside = ctx.op("LessOrEqual", [ctx.op("Abs", [x], "abs"), thre], "inside")
        above = ctx.op("Greater", [x, thre], "above")
        moved = ctx.op("Where", [above, ctx.op("Sub", [x, thre], "down"), ctx.op("Add", [x, thre], "up")], "moved")
        ctx.add_node("Where", [inside, zero, moved], [y], name=node.name)

    def pytorch_source(self, node, emit):
        t = node.attrs["thre"]
        if t == 0:
            return emit.inputs[0]
        return f"{emit.helper(soft_threshold)}({emit.inputs[0]}, {emit.lit(t)})"


# ---- SparseConvolution ----------------------------------------------------------------------------


def sparse_conv_index(nonzero, direct: bool):
    """For the bool map `nonzero` (O, C, kh, kw) of a SparseConvolution weight: the flat index into the stored
    weight of each tap of the dense filter bank its forward applies, or the weight's count (a zero) for a tap it
    does not.  direct: the 1x1, pad-0 gemm that reads input channels 0..nnz-1 in the pattern's place."""
    o, c, kh, kw = nonzero.shape
    k = c * kh * kw
    flat = nonzero.reshape(-1)
    dev = flat.device
    taps = torch.nonzero(flat[:k]).reshape(-1)   # filter 0's nonzero taps, (c, h, w) order
    nnz = taps.numel()
    values = torch.nonzero(flat).reshape(-1)     # every nonzero value, packed in memory order
    used = min(values.numel(), o * nnz)
    packed = torch.full((o * nnz,), flat.numel(), dtype=torch.int64, device=dev)
    packed[:used] = values[:used]
    cols = torch.arange(nnz, device=dev) if direct else taps
    index = torch.full((o, k), flat.numel(), dtype=torch.int64, device=dev)
    index[:, cols] = packed.reshape(o, nnz)
    return index.reshape(o, c, kh, kw)


def sparse_conv_weight(weight, direct: bool):
    """The dense weight that vadim-v-lebedev's packed SparseConvolution forward applies."""
    index = sparse_conv_index(weight != 0, direct)
    return torch.cat([weight.reshape(-1), weight.new_zeros(1)])[index]


class SparseConv2d(torch.nn.Conv2d):
    """nn.Conv2d running vadim-v-lebedev's SparseConvolution: the weight packed as the fork packs it."""

    def __init__(self, *args, direct=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.direct = direct

    def forward(self, x):
        return self._conv_forward(x, sparse_conv_weight(self.weight, self.direct), self.bias)


TORCH_SPARSE_CONV = torch_sources(sparse_conv_index, sparse_conv_weight, SparseConv2d)


def packed_overrun(weight):
    """Why the fork's compressKernel would write past its buffer for this weight (O, C, kh, kw), or None."""
    w = torch.as_tensor(weight)
    if w.dim() != 4:
        return None
    o, c = w.shape[:2]
    nnz = int((w.reshape(-1)[:w[0].numel()] != 0).sum())
    total = int((w != 0).sum())
    if total > o * c * nnz:
        return (f"the weight has {total} nonzero values but its filter 0 only {nnz} nonzero taps: the fork's "
                f"compressKernel packs them into {o * c * nnz} places and writes past its buffer")
    return None


def _direct(attrs):
    return tuple(attrs["kernel"]) == (1, 1) and tuple(attrs["pad"]) == (0, 0)


@register_layer("SparseConvolution")
class SparseConvolution(Convolution):
    def parse(self, lp):
        attrs = parse_conv(lp)
        p = lp.convolution_param
        if attrs.get("orn") or "first_conv" in attrs:
            raise LayerError("SparseConvolution (vadim-v-lebedev/caffe) reads only BVLC's convolution_param fields")
        if attrs["group"] != 1:
            raise LayerError(f"convolution_param.group {attrs['group']}: the fork's SparseConvolution offsets its "
                             f"packed weight by the dense filter sizes; only group 1 computes a convolution")
        if any(d > 1 for d in p.dilation):
            attrs.setdefault("reading_notes", []).append(
                "convolution_param.dilation: vadim-v-lebedev's SparseConvolution ignores it (its output size and "
                "im2col are undilated); read and ignored")
        return attrs

    def _geometry(self, attrs, shape):
        _resolve_spatial(attrs, shape)
        if attrs["_axis"] != 1 or len(attrs["kernel"]) != 2:
            raise LayerError(f"SparseConvolution is 2-D over axis 1 (the fork reads kernel_h / kernel_w from the "
                             f"weight's axes 2 and 3): input {list(shape)}, convolution_param.axis {attrs['axis']}")
        if any(s != 1 for s in attrs["stride"]):
            raise LayerError(f"convolution_param.stride {list(attrs['stride'])}: the fork's SparseConvolution sizes "
                             f"its top as for stride 1 while its im2col strides (sparse_conv_layer.cpp); only stride "
                             f"1 is defined")
        if attrs.get("edge_pads") is not None:
            raise LayerError("pad_type / pad_l/r/t/b are not fields of vadim-v-lebedev's SparseConvolution")
        attrs["dilation"] = (1, 1)

    def infer(self, attrs, in_shapes):
        self._geometry(attrs, in_shapes[0])
        return super().infer(attrs, in_shapes)

    def param_shapes(self, attrs, in_shapes):
        self._geometry(attrs, in_shapes[0])
        return super().param_shapes(attrs, in_shapes)

    def stored_blobs(self, attrs, arrays, notes):
        why = packed_overrun(arrays[0]) if arrays else None
        if why:
            raise LayerError(why)
        return arrays

    def forward(self, attrs, params, *xs):
        why = packed_overrun(params[0].detach().cpu())
        if why:
            raise LayerError(why)
        weight = sparse_conv_weight(params[0], _direct(attrs))
        bias = params[1] if attrs["bias_term"] else None
        ys = [_conv_nd(x, attrs, weight, bias, False) for x in xs]
        return ys[0] if len(ys) == 1 else tuple(ys)

    def onnx(self, ctx, node):
        a = node.attrs
        blob = torch.as_tensor(node.blobs[0])
        why = packed_overrun(blob)
        if why:
            raise ExportError(f"layer '{node.name}' (SparseConvolution): {why}")
        index = sparse_conv_index(blob != 0, _direct(a))
        w = ctx.weight(node, 0)
        if not torch.equal(index.reshape(-1), torch.arange(blob.numel())):
            flat = ctx.op("Reshape", [w, ctx.i64([-1])], "flat_weight")
            padded = ctx.op("Concat", [flat, ctx.const(torch.zeros(1).numpy())], "padded_weight", axis=0)
            w = ctx.op("Gather", [padded, ctx.const(index.numpy())], "packed_weight", axis=0)
        b = [ctx.weight(node, 1)] if a["bias_term"] else []
        for i, (x, y) in enumerate(zip(node.inputs, node.outputs)):
            ctx.add_node("Conv", [x, w] + b, [y], name=node.name if i == 0 else f"{node.name}_{i}",
                         kernel_shape=list(a["kernel"]), strides=[1, 1], pads=list(a["pad"]) * 2,
                         dilations=[1, 1], group=1)

    def pytorch_source(self, node, emit):
        a = node.attrs
        args = [emit.lit(emit.in_shape(0)[1]), emit.lit(a["num_output"]), f"kernel_size={emit.size_arg(a['kernel'])}"]
        if any(a["pad"]):
            args.append(f"padding={emit.size_arg(a['pad'])}")
        if not a["bias_term"]:
            args.append("bias=False")
        if _direct(a):
            args.append("direct=True")
        m = emit.module(f"{emit.helper(TORCH_SPARSE_CONV)}({', '.join(args)})")
        emit.param("weight", 0)
        if a["bias_term"]:
            emit.param("bias", 1)
        calls = [f"{m}({x})" for x in emit.inputs]
        return calls[0] if len(calls) == 1 else calls
