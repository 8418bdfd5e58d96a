"""ONNX emission of caffe_rtpose's ImResize, Nms and Maximum (semantics in rtpose.py).

Each mirrors its torch function op by op; the batch stays dynamic: ImResize builds its per-image
interpolation matrices in the graph from the run's batch size, Nms slices the first N * num_parts
maps of the run's blob.
"""
import numpy as np

from .norm import onnx_reduce
from .ssd.common import scalar_tensor

_F32, _F64, _I64 = 1, 11, 7     # onnx.TensorProto.FLOAT, DOUBLE, INT64


class _Emit:
    """Small constants and one-output nodes of one layer, named after it."""

    def __init__(self, ctx, node):
        self.ctx, self.name = ctx, node.name
        self.f, self.i = ctx.f32, ctx.i64       # float32 and int64 constants

    def d(self, value):
        return self.ctx.const(np.array(value, np.float64))

    def op(self, op_type, inputs, hint="t", out=None, **attrs):
        return self.ctx.add_node(op_type, list(inputs), out or self.ctx.tmp(f"{self.name}_{hint}"), **attrs)

    def unsqueeze(self, x, axes):
        return self.op("Unsqueeze", [x, self.i(axes)], "unsq")

    def batch(self, x):
        """The run's batch size, an int64 scalar."""
        return self.op("Gather", [self.op("Shape", [x], "shape"), self.i(0)], "batch", axis=0)


# ---- ImResize ------------------------------------------------------------------------------

def _imresize_axis(e, n, size, target, start, gap):
    """(N, target, size) float32, as rtpose.imresize_axis; n: the float64 image indices (N,)."""
    first = float(np.float32(1) - np.float32(start))
    ratio = e.op("Cast", [e.op("Add", [e.op("Mul", [n, e.d(float(np.float32(gap)))]), e.d(first)])], to=_F32)
    pad = e.op("Floor", [e.op("Mul", [e.f(size // 2), ratio])], "pad")
    crop = e.op("Sub", [e.f(size), e.op("Mul", [e.f(2), pad])], "crop")
    t = e.f(target)
    offset = e.unsqueeze(e.op("Sub", [e.op("Div", [e.op("Div", [t, crop]), e.f(2)]), e.f(0.5)]), [1])
    step = e.unsqueeze(e.op("Div", [crop, t]), [1])
    pos = e.op("Mul", [e.op("Sub", [e.f(np.arange(target, dtype=np.float32)[None]), offset]), step], "pos")
    wide = e.op("Add", [e.op("Cast", [pos], to=_F64), e.d(1e-5)])
    i1 = e.op("Max", [e.op("Cast", [e.op("Floor", [wide])], to=_F32), e.f(0)])
    last = e.unsqueeze(e.op("Sub", [crop, e.f(1)]), [1])
    i0 = e.op("Max", [e.op("Sub", [i1, e.f(1)]), e.f(0)])
    i2 = e.op("Min", [e.op("Add", [i1, e.f(1)]), last])
    i3 = e.op("Min", [e.op("Add", [i2, e.f(1)]), last])
    d = e.op("Cast", [e.op("Sub", [pos, i1])], to=_F64)
    d2 = e.op("Mul", [d, d])
    d3 = e.op("Mul", [d2, d])

    def mul(c, x):
        return e.op("Mul", [e.d(c), x])

    weights = (e.op("Sub", [e.op("Add", [mul(-0.5, d3), d2]), mul(0.5, d)]),
               e.op("Add", [e.op("Sub", [mul(1.5, d3), mul(2.5, d2)]), e.d(1.0)]),
               e.op("Add", [e.op("Add", [mul(-1.5, d3), mul(2.0, d2)]), mul(0.5, d)]),
               e.op("Sub", [mul(0.5, d3), mul(0.5, d2)]))
    cols = e.f(np.arange(size, dtype=np.float32)[None, None])
    pad2 = e.unsqueeze(pad, [1])
    terms = []
    for tap, w in zip((i0, i1, i2, i3), weights):
        hit = e.op("Equal", [e.unsqueeze(e.op("Add", [tap, pad2]), [2]), cols])
        terms.append(e.op("Where", [hit, e.unsqueeze(w, [2]), e.d(0.0)]))
    return e.op("Cast", [e.op("Sum", terms)], "matrix", to=_F32)


def emit_imresize(ctx, node, th, tw):
    """ImResize of node.inputs[0] to th x tw."""
    e = _Emit(ctx, node)
    x = node.inputs[0]
    _, _, h, w = ctx.shape(x)
    a = node.attrs
    n = e.op("Range", [e.d(0.0), e.op("Cast", [e.batch(x)], to=_F64), e.d(1.0)], "n")
    mh = e.unsqueeze(_imresize_axis(e, n, h, th, a["start_scale"], a["scale_gap"]), [1])
    mw = _imresize_axis(e, n, w, tw, a["start_scale"], a["scale_gap"])
    mwt = e.unsqueeze(e.op("Transpose", [mw], perm=[0, 2, 1]), [1])
    rows = ctx.add_node("MatMul", [mh, x], ctx.tmp(f"{node.name}_rows"), name=node.name)
    full = e.op("MatMul", [rows, mwt], "full")
    onnx_reduce(ctx, "ReduceMean", full, [0], 1, out=node.outputs[0])


# ---- Nms ---------------------------------------------------------------------------------------

def emit_nms(ctx, node):
    e = _Emit(ctx, node)
    x = node.inputs[0]
    _, c, h, w = ctx.shape(x)
    parts, peaks = node.attrs["num_parts"], node.attrs["max_peaks"]
    batch = e.unsqueeze(e.batch(x), [0])
    if h < 3 or w < 3:
        size = e.op("Concat", [batch, e.i([parts, peaks + 1, 3])], "size", axis=0)
        ctx.add_node("ConstantOfShape", [size], [node.outputs[0]], name=node.name, value=scalar_tensor(0.0))
        return
    flat = ctx.add_node("Reshape", [x, e.i([-1, h, w])], ctx.tmp(f"{node.name}_maps"), name=node.name)
    maps = e.op("Mul", [batch, e.i([parts])], "count")
    src = e.op("Slice", [flat, e.i([0]), maps, e.i([0])], "src")
    centre = e.op("Slice", [src, e.i([1, 1]), e.i([h - 1, w - 1]), e.i([1, 2])], "centre")
    peak = e.op("Greater", [centre, e.f(node.attrs["threshold"])])
    for dy in range(3):
        for dx in range(3):
            if dy != 1 or dx != 1:
                near = e.op("Slice", [src, e.i([dy, dx]), e.i([dy + h - 2, dx + w - 2]), e.i([1, 2])], "near")
                peak = e.op("And", [peak, e.op("Greater", [centre, near])])
    peak = e.op("Pad", [e.op("Cast", [peak], to=_I64), e.i([0, 1, 1, 0, 1, 1])], "peak")
    count = e.op("Cast", [onnx_reduce(ctx, "ReduceSum", peak, [1, 2], 0)], to=_F32)
    ends = e.op("Concat", [e.op("Add", [maps, e.i([1])]), e.i([2])], "ends", axis=0)
    below = e.op("Slice", [flat, e.i([1, 0]), ends, e.i([0, 1])], "below")
    if parts == c:     # the blob's last map: nothing of the blob follows it
        below = e.op("Concat", [below, e.f(np.zeros((1, 2, w), np.float32))], "below", axis=0)
    ext = e.op("Concat", [src, below], "ext", axis=1)
    r = np.arange(h + 2)
    q = np.arange(w)
    keep = ctx.const(((r > 0) & (r < w))[:, None] & (q > 0)[None, :])
    s = e.op("Where", [e.op("And", [e.op("Greater", [ext, e.f(0)]), keep]), ext, e.f(0)], "s")
    sx = e.op("Mul", [s, e.f(q.astype(np.float32))])
    sy = e.op("Mul", [s, e.f(r.astype(np.float32)[:, None])])
    stack = e.op("Concat", [e.unsqueeze(t, [1]) for t in (s, sx, sy)], "stack", axis=1)
    ones = np.ones((3, 1, 7, 1), np.float32)
    box = e.op("Conv", [stack, e.f(ones)], "box", group=3, pads=[3, 0, 3, 0])
    box = e.op("Conv", [box, e.f(np.ascontiguousarray(ones.transpose(0, 1, 3, 2)))], "box", group=3,
               pads=[0, 3, 0, 3])
    box = e.op("Slice", [box, e.i([0]), e.i([h]), e.i([2])], "box")
    hw = h * w
    sums = [e.op("Slice", [box, e.i([k]), e.i([k + 1]), e.i([1])], "sum") for k in range(3)]
    head = e.op("Mul", [e.unsqueeze(count, [1, 2]), e.f(np.array([[[1, 0, 0]]], np.float32))], "head")
    rows = [head]
    k = min(peaks, hw)
    if k:
        key = e.op("Mul", [e.op("Reshape", [peak, e.i([-1, hw])]), e.i((hw - np.arange(hw))[None])], "key")
        top, idx = ctx.add_node("TopK", [key, e.i([k])], [ctx.tmp(f"{node.name}_top"), ctx.tmp(f"{node.name}_idx")],
                                axis=1, largest=1, sorted=1)
        cols = []
        for value in (e.op("Div", [sums[1], sums[0]]), e.op("Div", [sums[2], sums[0]]), src):
            flat_v = e.op("Reshape", [value, e.i([-1, hw])])
            cols.append(e.unsqueeze(e.op("GatherElements", [flat_v, idx], axis=1), [2]))
        vals = e.op("Concat", cols, "vals", axis=2)
        valid = e.unsqueeze(e.op("Greater", [top, e.i(0)]), [2])
        vals = e.op("Where", [valid, vals, e.f(0)], "vals")
        if k < peaks:
            vals = e.op("Pad", [vals, e.i([0, 0, 0, 0, peaks - k, 0])], "vals")
        rows.append(vals)
    table = e.op("Concat", rows, "table", axis=1) if len(rows) > 1 else head
    ctx.add_node("Reshape", [table, e.i([-1, parts, peaks + 1, 3])], [node.outputs[0]])


# ---- Maximum ----------------------------------------------------------------------------------

def _lane_order(size):
    i = np.arange(size)
    return i[np.argsort((i % 32) * size + i, kind="stable")].astype(np.int64)


def emit_maximum(ctx, node):
    e = _Emit(ctx, node)
    x = node.inputs[0]
    _, c, h, w = ctx.shape(x)
    nan = ctx.add_node("IsNaN", [x], ctx.tmp(f"{node.name}_nan"), name=node.name)
    v = e.op("Max", [e.op("Where", [nan, e.f(-np.inf), x]), e.f(-1e10)], "v")
    cols = e.i(_lane_order(w))
    vp = e.op("Gather", [v, cols], "vp", axis=3)
    j = e.op("ArgMax", [vp], "j", axis=3, keepdims=1, select_last_index=0)
    rv = e.op("GatherElements", [vp, j], "rv", axis=3)
    rx = e.op("Cast", [e.op("Gather", [cols, j], axis=0)], "rx", to=_F32)
    if w < h:      # rows the fork's row kernel never reduces: value 0 at x 0
        total = e.op("Mul", [e.batch(x), e.i(c * h)])
        index = e.op("Reshape", [e.op("Range", [e.i(0), total, e.i(1)]), e.i([-1, c, h, 1])], "row")
        bound = e.op("Mul", [e.batch(x), e.i(c * w)])
        skipped = e.op("GreaterOrEqual", [index, bound])
        rv = e.op("Where", [skipped, e.f(0), rv], "rv")
        rx = e.op("Where", [skipped, e.f(0), rx], "rx")
    rows = e.i(_lane_order(h))
    rp = e.op("Gather", [rv, rows], "rp", axis=2)
    jj = e.op("ArgMax", [rp], "jj", axis=2, keepdims=1, select_last_index=0)
    y = e.op("Cast", [e.op("Gather", [rows, jj], axis=0)], "y", to=_F32)
    xx = e.op("GatherElements", [e.op("Gather", [rx, rows], axis=2), jj], "x", axis=2)
    val = e.op("GatherElements", [rp, jj], "val", axis=2)
    ctx.add_node("Concat", [xx, y, val], [node.outputs[0]], axis=3)
