"""ONNX emission of Caffe's Pooling and SPP, exact at every opset from 13.

ONNX's `ceil_mode` and AveragePool's divisor differ from Caffe's rules (and
changed across opsets), so nothing here relies on them.  The output size comes
from Caffe's formula (static: only the batch is dynamic); the pool op gets
explicit, possibly asymmetric pads so that plain floor rounding gives exactly
that size:
- MAX: MaxPool with those pads (ONNX never picks a pad cell, as Caffe).
- AVE: AveragePool with count_include_pad=1 divides every window by kh*kw;
  a constant map (kh*kw) / (Caffe's clipped window area), which depends only
  on H and W, corrects the windows Caffe divides differently.
- STOCHASTIC at TEST: sum(x^2) / (sum(x) + FLT_MIN) over windows that start at
  0 (Caffe ignores pad there) and are clipped at the edge.
- global pooling: GlobalAveragePool / GlobalMaxPool.
"""
import numpy as np

from ..errors import ExportError
from ..layers.pooling import AVE, FLT_MIN, MAX, STOCHASTIC, _ave_divisors, window


def _pool_extent(size, k, s, p_begin, p_end):
    return (size + p_begin + p_end - k) // s + 1


def _finish(ctx, node, x, out, full, y):
    """Write x (spatially `full`) into y, slicing off the extra rows/cols floor pooling made."""
    if tuple(full) == tuple(out):
        if x != y:
            ctx.add_node("Identity", [x], [y])
        return y
    ctx.add_node("Slice", [x, ctx.const(np.array([0, 0], np.int64)),
                           ctx.const(np.array(list(out), np.int64)),
                           ctx.const(np.array([2, 3], np.int64))], [y])
    return y


def _pads(h, w, k, s, p, out, start_pad=None):
    """Begin pads, end pads and the floor-rounded output size they give."""
    begin = list(p) if start_pad is None else list(start_pad)
    end = []
    for n, kk, ss, pb, o in zip((h, w), k, s, begin, out):
        end.append(max(0, (o - 1) * ss + kk - (n + pb)))
    full = tuple(_pool_extent(n, kk, ss, pb, pe) for n, kk, ss, pb, pe in zip((h, w), k, s, begin, end))
    return begin, end, full


def emit_pooling(ctx, node, attrs, x, y):
    """Caffe's Pooling of x (N x C x H x W, static H and W) into the tensor named y."""
    shape = ctx.shape(x)
    if len(shape) != 4:
        raise ExportError(f"layer '{node.name}': pooling of a {len(shape)}-axis blob")
    h, w = int(shape[2]), int(shape[3])
    pool = attrs["pool"]
    k, s, p, out = window(attrs, h, w)
    if attrs["global"] and pool in (MAX, AVE):
        ctx.add_node("GlobalMaxPool" if pool == MAX else "GlobalAveragePool", [x], [y], name=node.name)
        return y
    if any(o <= 0 for o in out):
        raise ExportError(f"layer '{node.name}': pooling of a {h}x{w} input gives an empty output")

    if pool == MAX:
        begin, end, full = _pads(h, w, k, s, p, out)
        target = y if full == tuple(out) else ctx.tmp(f"{node.name}_pooled")
        ctx.add_node("MaxPool", [x], [target], name=node.name, kernel_shape=list(k), strides=list(s),
                     pads=begin + end)
        return _finish(ctx, node, target, out, full, y)

    if pool == AVE:
        begin, end, full = _pads(h, w, k, s, p, out)
        dh = _ave_divisors(h, k[0], s[0], p[0], out[0]).astype(np.float64)
        dw = _ave_divisors(w, k[1], s[1], p[1], out[1]).astype(np.float64)
        ratio = (k[0] * k[1]) / np.outer(dh, dw)
        exact = bool(np.all(ratio == 1.0))
        target = y if (exact and full == tuple(out)) else ctx.tmp(f"{node.name}_avg")
        ctx.add_node("AveragePool", [x], [target], name=node.name, kernel_shape=list(k), strides=list(s),
                     pads=begin + end, count_include_pad=1)
        if exact:
            return _finish(ctx, node, target, out, full, y)
        if full != tuple(out):
            cropped = ctx.tmp(f"{node.name}_crop")
            target = _finish(ctx, node, target, out, full, cropped)
        ctx.add_node("Mul", [target, ctx.const(ratio.astype(np.float32), f"{node.name}_divisor_fix")], [y])
        return y

    if pool == STOCHASTIC:
        # Caffe's test-time stochastic pooling: windows start at 0 whatever pad says
        begin, end, full = _pads(h, w, k, s, (0, 0), out)
        sq = ctx.tmp(f"{node.name}_sq")
        ctx.add_node("Mul", [x, x], [sq])
        num, den = ctx.tmp(f"{node.name}_num"), ctx.tmp(f"{node.name}_den")
        kw = dict(kernel_shape=list(k), strides=list(s), pads=begin + end, count_include_pad=1)
        ctx.add_node("AveragePool", [sq], [num], name=node.name, **kw)
        ctx.add_node("AveragePool", [x], [den], **kw)
        # both are window sums / (kh*kw), so their ratio is Caffe's; FLT_MIN (not a denormal
        # FLT_MIN / (kh*kw), which runtimes may flush to 0) keeps empty windows at 0
        den_eps = ctx.tmp(f"{node.name}_den_eps")
        ctx.add_node("Add", [den, ctx.const(np.array(FLT_MIN, np.float32))], [den_eps])
        q = y if full == tuple(out) else ctx.tmp(f"{node.name}_ratio")
        ctx.add_node("Div", [num, den_eps], [q])
        return _finish(ctx, node, q, out, full, y)

    raise ExportError(f"layer '{node.name}': unknown pool method {pool}")


def emit_spp(ctx, node, spec):
    """SPP: each pyramid level pooled, flattened from axis 1, and concatenated."""
    a = node.attrs
    x, y = node.inputs[0], node.outputs[0]
    n, c, h, w = ctx.shape(x)
    if a["height"] == 1:
        gattrs = {"pool": a["pool"], "global": True, "round_mode": 0, "kernel": None,
                  "stride": (1, 1), "pad": (0, 0)}
        return emit_pooling(ctx, node, gattrs, x, y)
    parts = []
    for level in range(a["height"]):
        la = spec.level_attrs(a, level, h, w)
        pooled = ctx.tmp(f"{node.name}_level{level}")
        sub = _Named(node, f"{node.name}/level{level}")
        emit_pooling(ctx, sub, la, x, pooled)
        flat = ctx.tmp(f"{node.name}_level{level}_flat")
        ctx.add_node("Flatten", [pooled], [flat], axis=1)
        parts.append(flat)
    ctx.add_node("Concat", parts, [y], name=node.name, axis=1)
    return y


class _Named:
    """A node stand-in with another name, so each pyramid level's ops get their own names."""

    def __init__(self, node, name):
        self._node = node
        self.name = name

    def __getattr__(self, item):
        return getattr(self._node, item)
