"""ONNX emission of Caffe's Pooling and SPP, exact at every opset from 13.

ONNX's `ceil_mode` and AveragePool's divisor differ from Caffe's rules (and
changed across opsets), so nothing here relies on them.  The output size comes
from Caffe's formula (static: only the batch is dynamic); the pool op gets
explicit, possibly asymmetric pads so that plain floor rounding covers exactly
Caffe's windows (a Slice trims any extra row):
- MAX: MaxPool with those pads (ONNX never picks a pad cell, as Caffe).  A
  window of -inf cells gives -inf, where Caffe keeps -FLT_MAX; no Max floors it,
  to keep exported graphs (and int8 chains) bare for inputs nets do not make.
- AVE: AveragePool with count_include_pad=1 divides every window by kh*kw;
  a constant map (kh*kw) / (Caffe's window area clipped at H + pad), which
  depends only on H and W, corrects the windows Caffe divides differently.
- STOCHASTIC at TEST: sum(x^2) / (sum(x) + FLT_MIN) over windows that start at
  0 (Caffe ignores pad there) and are clipped at the edge.
- global pooling: GlobalAveragePool / GlobalMaxPool.
- Windows holding no cell at all (ceil rounding with stride > kernel and no
  pad) are left out of the pooling, since ONNX wants pads < kernel, and filled
  with what Caffe's loops leave there: 0 / (area <= 0) for AVE (NaN or 0),
  0 for STOCHASTIC, and -FLT_MAX for MAX (Caffe's initial value, as the torch module).
"""
import numpy as np

from ..errors import ExportError
from ..layers.pooling import (
    AVE,
    FLT_MAX,
    FLT_MIN,
    MAX,
    STOCHASTIC,
    _ave_divisors,
    is_synopsys,
    synopsys_args,
    window,
)
from ..layers.pooling_edges import synopsys_pool_divisors, synopsys_pool_geometry


def _plan(size, k, s, begin, out, limit):
    """(windows computed, end pad, rows floor pooling gives) along one axis.

    Window i starts at i*s - begin; the ones starting at or beyond `limit` are empty.
    """
    valid = min(out, -(-(limit + begin) // s))
    end = max(0, (valid - 1) * s + k - (size + begin))
    full = (size + begin + end - k) // s + 1
    return valid, end, full


def _pool(ctx, node, op, x, k, s, begin, plans, **attrs):
    """One pooling op over the non-empty windows, sliced to exactly them."""
    valid = [pl[0] for pl in plans]
    full = [pl[2] for pl in plans]
    y = ctx.tmp(f"{node.name}_{op.lower()}")
    ctx.add_node(op, [x], [y], name=node.name, kernel_shape=list(k), strides=list(s),
                 pads=list(begin) + [pl[1] for pl in plans], **attrs)
    return _keep_rows(ctx, node, y, full, valid)


def _keep_rows(ctx, node, y, full, wanted):
    """y's first `wanted` rows and columns, when the pool op made `full` of them."""
    if list(full) == list(wanted):
        return y
    cut = ctx.tmp(f"{node.name}_cut")
    ctx.add_node("Slice", [y, ctx.const(np.array([0, 0], np.int64)), ctx.const(np.array(wanted, np.int64)),
                           ctx.const(np.array([2, 3], np.int64))], [cut])
    return cut


def _fill(ctx, node, x, valid, out, value):
    """Pad the bottom/right rows of empty windows with `value`."""
    if list(valid) == list(out):
        return x
    y = ctx.tmp(f"{node.name}_filled")
    pads = np.array([0, 0, 0, 0, 0, 0, out[0] - valid[0], out[1] - valid[1]], np.int64)
    ctx.add_node("Pad", [x, ctx.const(pads), ctx.const(np.array(value, np.float32))], [y], mode="constant")
    return y


def _write_to(ctx, x, y):
    """Make the tensor the emission ended with be called y (renaming its producer's output)."""
    if x == y:
        return y
    for n in reversed(ctx.nodes):
        if x in n.output:
            outs = list(n.output)
            outs[outs.index(x)] = y
            del n.output[:]
            n.output.extend(outs)
            return y
    ctx.add_node("Identity", [x], [y])
    return y


def emit_max_pool_mask(ctx, node, x, outs):
    """MAX pooling of x (shaped as the node's bottom) with its mask top into outs (values, mask): one MaxPool
    with the Indices output. ONNX indices count over the whole N x C x H x W tensor (padding excluded), so
    Mod(H * W) gives Caffe's h * W + w; empty windows, and windows with nothing above -FLT_MAX, get -1
    (value -FLT_MAX) as in Caffe."""
    h, w = (int(d) for d in ctx.shape(node.inputs[0])[2:])
    k, s, p, out = window(node.attrs, h, w)
    plans = [_plan(n, kk, ss, pp, o, n) for n, kk, ss, pp, o in zip((h, w), k, s, p, out)]
    valid = [pl[0] for pl in plans]
    full = [pl[2] for pl in plans]
    values, cells = ctx.tmp(node.name + "_max"), ctx.tmp(node.name + "_cells")
    ctx.add_node("MaxPool", [x], [values, cells], name=node.name, kernel_shape=list(k), strides=list(s),
                 pads=list(p) + [pl[1] for pl in plans])
    if full != valid:
        start, end, axes = (ctx.const(np.array(v, np.int64)) for v in ([0, 0], valid, [2, 3]))
        values = ctx.add_node("Slice", [values, start, end, axes], [ctx.tmp(node.name + "_max_cut")])[0]
        cells = ctx.add_node("Slice", [cells, start, end, axes], [ctx.tmp(node.name + "_cells_cut")])[0]
    plane = ctx.add_node("Mod", [cells, ctx.const(np.array(h * w, np.int64))], [ctx.tmp(node.name + "_plane")])[0]
    index = ctx.add_node("Cast", [plane], [ctx.tmp(node.name + "_index")], to=1)[0]  # FLOAT
    found = ctx.add_node("Greater", [values, ctx.const(np.array(-FLT_MAX, np.float32))],
                         [ctx.tmp(node.name + "_found")])[0]
    mask = ctx.add_node("Where", [found, index, ctx.const(np.array(-1, np.float32))],
                        [ctx.tmp(node.name + "_mask")])[0]
    values = ctx.add_node("Max", [values, ctx.const(np.array(-FLT_MAX, np.float32))],
                          [ctx.tmp(node.name + "_clamped")])[0]
    _write_to(ctx, _fill(ctx, node, values, valid, out, -FLT_MAX), outs[0])
    _write_to(ctx, _fill(ctx, node, mask, valid, out, -1.0), outs[1])


def emit_pooling(ctx, node, attrs, x, y, shape=None):
    """Caffe's Pooling of x (N x C x H x W, static H and W; `shape` where x is not an IR tensor) into the
    tensor named y."""
    shape = shape or ctx.shape(x)
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
    sizes = (h, w)
    if is_synopsys(attrs):
        return _write_to(ctx, _emit_synopsys(ctx, node, attrs, x, h, w), y)

    if pool == MAX:
        plans = [_plan(n, kk, ss, pp, o, n) for n, kk, ss, pp, o in zip(sizes, k, s, p, out)]
        valid = [pl[0] for pl in plans]
        r = _pool(ctx, node, "MaxPool", x, k, s, p, plans)
        r = _fill(ctx, node, r, valid, out, -FLT_MAX)
    elif pool == AVE:
        # a window reaches at most H + pad; one starting there has nothing to average
        plans = [_plan(n, kk, ss, pp, o, n + pp) for n, kk, ss, pp, o in zip(sizes, k, s, p, out)]
        valid = [pl[0] for pl in plans]
        r = _pool(ctx, node, "AveragePool", x, k, s, p, plans, count_include_pad=1)
        r = _fill(ctx, node, r, valid, out, 0.0)
        # Caffe divides each window's sum by its area clipped at H + pad; the empty windows
        # (sum 0) divide by an area <= 0: NaN for 0, a zero otherwise
        dh = np.asarray(_ave_divisors(h, k[0], s[0], p[0], out[0]), np.float64)
        dw = np.asarray(_ave_divisors(w, k[1], s[1], p[1], out[1]), np.float64)
        area = np.outer(dh, dw)
        ratio = np.ones_like(area)
        ratio[:valid[0], :valid[1]] = (k[0] * k[1]) / area[:valid[0], :valid[1]]
        ratio[area == 0] = np.nan
        if not np.all(ratio == 1.0):
            fixed = ctx.tmp(f"{node.name}_divided")
            ctx.add_node("Mul", [r, ctx.const(ratio.astype(np.float32), f"{node.name}_divisor_fix")], [fixed])
            r = fixed
    elif pool == STOCHASTIC:
        plans = [_plan(n, kk, ss, 0, o, n) for n, kk, ss, o in zip(sizes, k, s, out)]
        valid = [pl[0] for pl in plans]
        sq = ctx.tmp(f"{node.name}_sq")
        ctx.add_node("Mul", [x, x], [sq])
        num = _pool(ctx, node, "AveragePool", sq, k, s, (0, 0), plans, count_include_pad=1)
        den = _pool(ctx, node, "AveragePool", x, k, s, (0, 0), plans, count_include_pad=1)
        # both are window sums / (kh*kw), so their ratio is Caffe's; FLT_MIN (rather than the
        # denormal FLT_MIN / (kh*kw), which runtimes may flush to 0) keeps empty windows at 0
        den_eps = ctx.tmp(f"{node.name}_den_eps")
        ctx.add_node("Add", [den, ctx.const(np.array(FLT_MIN, np.float32))], [den_eps])
        q = ctx.tmp(f"{node.name}_ratio")
        ctx.add_node("Div", [num, den_eps], [q])
        r = _fill(ctx, node, q, valid, out, 0.0)
    else:
        raise ExportError(f"layer '{node.name}': unknown pool method {pool}")
    return _write_to(ctx, r, y)


def _cut_to(ctx, node, y, sizes, before, after, k, s, out):
    """Slice the pool op's rows past the last kept window off (the end pad is never negative)."""
    full = [(n + b + a - kk) // ss + 1 for n, b, a, kk, ss in zip(sizes, before, after, k, s)]
    return _keep_rows(ctx, node, y, full, out)


def _emit_synopsys(ctx, node, attrs, x, h, w):
    """synopsys-caffe's per-side / SAME padded pooling and AVE_EXC_PAD (pooling_edges.py): the pool op
    with the fork's pads before and just enough after; AVE's divisors corrected by a constant map."""
    mode, k, s, edges, same, ceil = synopsys_args(attrs)
    out, pads = synopsys_pool_geometry([h, w], k, s, edges, same, ceil)
    before = [pads[0], pads[2]]
    if any(b >= kk for b, kk in zip(before, k)):
        raise ExportError(f"layer '{node.name}': a pad before ({before}) as large as the kernel {k} "
                          f"has no ONNX pooling form")
    # every kept window starts inside the image (the fork's Reshape rule), so none is empty
    after = [max(0, (o - 1) * ss + kk - n - b) for o, ss, kk, n, b in zip(out, s, k, (h, w), before)]
    if mode == "max":
        y = ctx.tmp(f"{node.name}_maxpool")
        ctx.add_node("MaxPool", [x], [y], name=node.name, kernel_shape=k, strides=s, pads=before + after)
        y = _cut_to(ctx, node, y, (h, w), before, after, k, s, out)
    else:
        y = ctx.tmp(f"{node.name}_avgpool")
        ctx.add_node("AveragePool", [x], [y], name=node.name, kernel_shape=k, strides=s,
                     pads=before + after, count_include_pad=1)
        y = _cut_to(ctx, node, y, (h, w), before, after, k, s, out)
        exclude = mode == "ave_exc_pad"
        dh = synopsys_pool_divisors(h, k[0], s[0], pads[0], pads[1], out[0], exclude)
        dw = synopsys_pool_divisors(w, k[1], s[1], pads[2], pads[3], out[1], exclude)
        ratio = (k[0] * k[1]) / np.outer(np.asarray(dh, np.float64), np.asarray(dw, np.float64))
        if not np.all(ratio == 1.0):
            fixed = ctx.tmp(f"{node.name}_divided")
            ctx.add_node("Mul", [y, ctx.const(ratio.astype(np.float32), f"{node.name}_divisor_fix")], [fixed])
            y = fixed
    return y


def emit_spp(ctx, node, spec):
    """SPP: each pyramid level pooled, flattened from axis 1, and concatenated."""
    a = node.attrs
    x, y = node.inputs[0], node.outputs[0]
    h, w = ctx.shape(x)[2:]
    if a["height"] == 1 and a.get("pyramid") is None:
        gattrs = {"pool": a["pool"], "global": True, "round_mode": 0, "kernel": None,
                  "stride": (1, 1), "pad": (0, 0)}
        return emit_pooling(ctx, node, gattrs, x, y)
    if a["height"] == 1:   # kyu-sz's single level keeps its pooled map
        return emit_pooling(ctx, node, spec.level_attrs(a, 0, h, w), x, y)
    parts = []
    for level in range(a["height"]):
        la = spec.level_attrs(a, level, h, w)
        pooled = ctx.tmp(f"{node.name}_level{level}")
        emit_pooling(ctx, _Named(node, f"{node.name}/level{level}"), la, x, pooled)
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
