"""Compact ONNX storage of quantized weights, behind OnnxContext.weight.

Each function returns the name of a float32 tensor equal, bit for bit, to the
dequantized blob that torch runs (node.blobs[i]); the initializers hold the
codes at their precision:

- fp16:   a FLOAT16 initializer and a Cast to float (half the bytes).
- int8:   an INT8 initializer and DequantizeLinear with the per-output-channel
          scale on the channel axis (opset 13+).
- binary: the signs bit-packed into a UINT8 initializer (1/32 of the fp32
          bytes, plus alpha), unpacked by a constant subgraph that works from
          opset 13 up: two BitShifts isolate each bit, Cast to bool, and
          Where(bit, alpha, -alpha) gives alpha * sign exactly.
- Grouped Deconvolution: output channel g * (C_out/group) + j is not one axis
  of the C_in x C_out/group x k... weight, so the decoded codes are reshaped
  to (group, C_in/group, C_out/group, rest), multiplied (or selected) by
  alpha shaped (group, 1, C_out/group, 1), and reshaped back.

The subgraphs are constant: onnxruntime folds them once when the session
starts, so they cost nothing per inference.
"""
import numpy as np

from ..errors import ExportError
from ..quant.binary import pack_signs

_FLOAT, _BOOL = 1, 9


def _blob_name(node, index):
    names = node.spec.blob_names_for(node.attrs)
    return f"{node.name}.{names[index] if index < len(names) else f'blob{index}'}"


def _view(shape, axis, groups):
    """(shape the codes are decoded in, shape of the scale broadcast over it)."""
    shape = tuple(int(d) for d in shape)
    if groups > 1:
        cin, cpg = shape[0], shape[1]
        rest = int(np.prod(shape[2:], dtype=np.int64))
        return (groups, cin // groups, cpg, rest), (groups, 1, cpg, 1)
    b = [1] * len(shape)
    b[axis] = shape[axis]
    return shape, tuple(b)


def emit_quantized_weight(ctx, node, index, transpose=False):
    """Emit node.quant[index] compactly -> name of the float32 weight tensor."""
    qb = node.quant[index]
    shared = node.shared_from.get(index)
    if shared is not None:
        owner = ctx._node(shared[0]) if hasattr(ctx, "_node") else None
        oq = owner.quant.get(shared[1]) if owner is not None else None
        if oq is not None and oq.shape == qb.shape and oq.scheme == qb.scheme:
            return ctx.weight(owner, shared[1], transpose)

    codes, axis, groups, scale = qb.codes, qb.axis, int(qb.groups or 1), qb.scale
    if transpose:
        if codes.ndim != 2 or groups > 1:
            raise ExportError(f"layer '{node.name}': cannot transpose a {codes.ndim}-axis "
                              f"{qb.scheme} blob")
        codes = np.ascontiguousarray(codes.T)
        axis = None if axis is None else 1 - axis
    base = _blob_name(node, index) + ("_T" if transpose else "")
    out = ctx.tmp(base)
    shape = tuple(codes.shape)

    if qb.scheme == "fp16":
        ctx.add_node("Cast", [ctx.const(np.asarray(codes, np.float16), base + "_fp16")], [out], to=_FLOAT)
        return out

    view, sview = _view(shape, axis, groups)
    scale_v = np.asarray(scale, np.float32).reshape(sview)

    if qb.scheme == "int8":
        q = ctx.const(np.asarray(codes, np.int8), base + "_int8")
        if groups == 1:
            s = ctx.const(np.asarray(scale, np.float32), base + "_scale")
            zp = ctx.const(np.zeros(np.size(scale), np.int8), base + "_zero_point")
            dq = ctx.tmp(base + "_dq") if len(shape) == 2 else out
            ctx.add_node("DequantizeLinear", [q, s, zp], [dq], axis=int(axis))
            return _guard(ctx, dq, shape, out)
        f = ctx.tmp(base + "_codes")
        ctx.add_node("Cast", [q], [f], to=_FLOAT)
        return _grouped_scale(ctx, base, f, view, scale_v, shape, out)

    if qb.scheme != "binary":
        raise ExportError(f"layer '{node.name}': unknown quantization scheme {qb.scheme!r}")
    # bit-packed signs: element 8i + k is bit k of byte i, 1 = +1
    packed = pack_signs(codes)
    m = packed.size
    n = int(codes.size)
    col = ctx.const(packed.reshape(m, 1), base + "_signbits")
    up = ctx.tmp(base + "_shl")
    ctx.add_node("BitShift", [col, ctx.const(np.arange(7, -1, -1, dtype=np.uint8).reshape(1, 8))], [up],
                 direction="LEFT")
    bits = ctx.tmp(base + "_bits")
    ctx.add_node("BitShift", [up, ctx.const(np.array([7], np.uint8))], [bits], direction="RIGHT")
    flat = ctx.tmp(base + "_flat")
    ctx.add_node("Reshape", [bits, ctx.const(np.array([m * 8], np.int64))], [flat])
    if m * 8 != n:
        cut = ctx.tmp(base + "_cut")
        ctx.add_node("Slice", [flat, ctx.const(np.array([0], np.int64)), ctx.const(np.array([n], np.int64)),
                               ctx.const(np.array([0], np.int64))], [cut])
        flat = cut
    shaped = ctx.tmp(base + "_bitview")
    ctx.add_node("Reshape", [flat, ctx.const(np.array(view, np.int64))], [shaped])
    cond = ctx.tmp(base + "_positive")
    ctx.add_node("Cast", [shaped], [cond], to=_BOOL)
    alpha = ctx.const(scale_v, base + "_alpha")
    neg = ctx.tmp(base + "_neg_alpha")
    ctx.add_node("Neg", [alpha], [neg])
    if groups == 1:
        ctx.add_node("Where", [cond, alpha, neg], [out])
        return out
    sel = ctx.tmp(base + "_grouped")
    ctx.add_node("Where", [cond, alpha, neg], [sel])
    ctx.add_node("Reshape", [sel, ctx.const(np.array(shape, np.int64))], [out])
    return out


def _guard(ctx, dq, shape, out):
    """A 2-D weight from DequantizeLinear reaches `out` through a same-shape Reshape.

    onnxruntime (1.2x, default session options) fuses DequantizeLinear -> MatMul
    into MatMulNBits with accuracy_level 4, which quantizes the *activations*
    to int8 and departs from the float result by ~1e-2.  A Reshape between the
    two keeps the weight-only semantics this file states.
    """
    if dq != out:
        ctx.add_node("Reshape", [dq, ctx.const(np.array(shape, np.int64))], [out])
    return out


def _grouped_scale(ctx, base, codes_f, view, scale_v, shape, out):
    """codes (float, blob shape) * per-output-channel scale for a grouped Deconvolution weight."""
    v = ctx.tmp(base + "_view")
    ctx.add_node("Reshape", [codes_f, ctx.const(np.array(view, np.int64))], [v])
    scaled = ctx.tmp(base + "_scaled")
    ctx.add_node("Mul", [v, ctx.const(scale_v, base + "_scale")], [scaled])
    ctx.add_node("Reshape", [scaled, ctx.const(np.array(shape, np.int64))], [out])
    return out
