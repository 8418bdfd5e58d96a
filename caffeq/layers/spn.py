"""Sifei Liu's spatial propagation networks (Liusifei/caffe-spn a25d2af, caffe-dev/src/caffe/layers, last
changed in 2660415): GateRecurrent2dnoind, Divide and ROI.  They run on the GPU (GateRecurrent2dnoind's
Forward_cpu calls its Forward_gpu), so these follow the CUDA kernels.

- GateRecurrent2dnoind (gaterecurrent2dnoind_param horizontal, reverse): bottoms x and three gates
  g1, g2, g3, all (N, C, H, W); top (N, C, H, W).  A three-way propagation: left to right, column w is
      h[r, w] = (1 - g1 - g2 - g3) x[r, w] + g1 h[r-1, w-1] + g2 h[r, w-1] + g3 h[r+1, w-1]
  with the gates read at (r, w) and counting 0 where their neighbour lies outside the map (so the first
  column is x).  Right to left reads column w + 1; top to bottom row r - 1 (g1, g2, g3 at columns w - 1,
  w, w + 1); bottom to top row r + 1.  Summed as the kernel writes it, ((g1 h1 + g2 h2) + g3 h3) +
  (((1 - g1) - g2) - g3) x; nvcc may fuse some of those products into multiply-adds (the last bit).
  The kernels read no activation: another `active` gets a note.
- Divide: 1 / x, where |x| < 1e-6 is first set to 1e-6 in the bottom blob itself (a later reader of
  that bottom sees it so).  Its CPU forward replaces only exact zeros, by 1e-4: the GPU's is read.
- ROI (roi_layer.cu, roi_layer.cpp, include/caffe/layers/roi_layer.hpp; roi_param pooled_h [128], pooled_w
  [128], caffeq's field 30164, the fork's 164): bottoms x (N, C, H, W) and rois (R, 5) = one-based [batch,
  x1, y1, x2, y2]; top (R, C, pooled_h, pooled_w), a crop: top[n, c, i, j] = x[b, c, y1 + i, x1 + j] with b,
  x1, y1 the roi's values less 1 converted to int (toward zero).  The kernel reads x2 and y2 not at all and
  indexes x flat, ((b C + c) H + y1 + i) W + x1 + j, so a window past the right edge continues on the next
  row; a read outside the blob is refused.  The CPU forward differs (it CHECKs that x2 - x1 + 1 and
  y2 - y1 + 1 are pooled_w and pooled_h, copies rows y1 .. y2 - 1 and columns x1 .. x2 - 1 only, and leaves
  the last row and column at -FLT_MAX): the GPU's is read, as the fork's layer_test/roi_test.py runs it.
"""
import numpy as np
import torch

from ..errors import DataError
from .misc import eager_checks
from .registry import Layer, LayerError, count, four_axes, need_blobs, positive_field, register_layer

DIVIDE_FLOOR = 1e-6   # the kernel's threshold (a double) and replacement


def spn_left_right(x, g1, g2, g3):
    """The left-to-right propagation of (N, C, H, W) maps (spn_propagate orients the others)."""
    height, width = x.shape[2], x.shape[3]
    rows = torch.arange(height, device=x.device)[:, None]
    keep1 = (rows > 0).to(x.dtype)                 # row r - 1 exists
    keep3 = (rows < height - 1).to(x.dtype)        # row r + 1 exists
    zero_row = x.new_zeros([x.shape[0], x.shape[1], 1])
    cols = [x[:, :, :, 0] * 1.0 + 0.0]
    for w in range(1, width):
        prev = cols[-1]
        up = torch.cat([zero_row, prev[:, :, :-1]], 2)          # h[r - 1, w - 1]
        down = torch.cat([prev[:, :, 1:], zero_row], 2)        # h[r + 1, w - 1]
        a, b, c = g1[:, :, :, w] * keep1[:, 0], g2[:, :, :, w], g3[:, :, :, w] * keep3[:, 0]
        cols.append((1 - a - b - c) * x[:, :, :, w] + (a * up + b * prev + c * down))
    return torch.stack(cols, 3)


def spn_orient(t: torch.Tensor, horizontal: bool, reverse: bool):
    """A map turned so that the propagation runs left to right (its own inverse)."""
    t = t if horizontal else t.transpose(2, 3)
    return t.flip(3) if reverse else t


def spn_propagate(x, g1, g2, g3, horizontal: bool, reverse: bool):
    """GateRecurrent2dnoind: any direction as left to right on transposed or flipped maps."""
    out = spn_left_right(spn_orient(x, horizontal, reverse), spn_orient(g1, horizontal, reverse),
                         spn_orient(g2, horizontal, reverse), spn_orient(g3, horizontal, reverse))
    out = out.flip(3) if reverse else out
    return out if horizontal else out.transpose(2, 3)


@register_layer("GateRecurrent2dnoind")
class GateRecurrent2dnoind(Layer):
    def parse(self, lp):
        need_blobs(lp, "GateRecurrent2dnoind", 4, 1, "x, g1, g2, g3")
        p = lp.gaterecurrent2dnoind_param
        notes = [] if p.active == p.LINEAR else [
            f"gaterecurrent2dnoind_param.active {p.Active.Name(p.active)} is not read: the fork's kernels apply "
            f"no activation"]
        return {"horizontal": bool(p.horizontal), "reverse": bool(p.reverse), "reading_notes": notes}

    def infer(self, attrs, in_shapes):
        shape = four_axes(in_shapes[0], "GateRecurrent2dnoind", "x (bottom 0)")
        for i, s in enumerate(in_shapes[1:], 1):
            if tuple(s) != shape:    # Reshape's CHECKs
                raise LayerError(f"GateRecurrent2dnoind's gate {i} must be shaped as x {list(shape)}, got {list(s)}")
        return [shape]

    def macs(self, attrs, in_shapes, out_shapes):
        n, c, h, w = in_shapes[0]
        return 4 * n * c * h * w

    def forward(self, attrs, params, x, g1, g2, g3):
        return spn_propagate(x, g1, g2, g3, attrs["horizontal"], attrs["reverse"])

    def onnx(self, ctx, node):
        a, name = node.attrs, node.name
        n, c, h, w = ctx.shape(node.inputs[0])
        if not a["horizontal"]:
            h, w = w, h
        rows = torch.arange(h)[:, None]
        first_col = (torch.arange(w) > 0)[None, :]
        # the gates' zeros: at the first column and where row r -+ 1 lies outside the map
        masks = [((rows > 0) & first_col), first_col.expand(h, w), ((rows < h - 1) & first_col)]

        def orient(t, hint):
            if not a["horizontal"]:
                t = ctx.op("Transpose", [t], f"{hint}_t", perm=[0, 1, 3, 2])
            if a["reverse"]:
                t = ctx.op("Slice", [t, ctx.i64([-1]), ctx.i64([-(2 ** 62)]), ctx.i64([3]), ctx.i64([-1])],
                           f"{hint}_flipped")
            return t

        x = orient(node.inputs[0], "x")
        gates = [ctx.op("Mul", [orient(g, f"g{i + 1}"), ctx.const(m.to(torch.float32).numpy())], f"g{i + 1}_kept")
                 for i, (g, m) in enumerate(zip(node.inputs[1:], masks))]
        zeros = ctx.op("ConstantOfShape", [ctx.op("Shape", [ctx.op("Gather", [x, ctx.i64(0)], "col0", axis=3)],
                                                  "col_shape")], "start", value=torch.zeros(1).numpy())
        cols = ctx.tmp(name + "_cols")
        ctx.add_node("Scan", [zeros, x] + gates, [ctx.tmp(name + "_last"), cols], name=name + "_scan",
                     body=_column_body(ctx, name, h), num_scan_inputs=4, scan_input_axes=[3] * 4,
                     scan_output_axes=[3])
        out = cols
        if a["reverse"]:
            out = ctx.op("Slice", [out, ctx.i64([-1]), ctx.i64([-(2 ** 62)]), ctx.i64([3]), ctx.i64([-1])], "unflipped")
        if a["horizontal"]:
            ctx.add_node("Identity", [out], [node.outputs[0]])
        else:
            ctx.add_node("Transpose", [out], [node.outputs[0]], perm=[0, 1, 3, 2])

    def pytorch_source(self, node, emit):
        emit.helper(spn_left_right)
        emit.helper(spn_orient)
        a = node.attrs
        return f"{emit.helper(spn_propagate)}({', '.join(emit.inputs)}, {a['horizontal']}, {a['reverse']})"


def _column_body(ctx, name, height):
    """Scan's step over columns: state the previous column (N, C, H), scan inputs the column of x and of
    the three masked gates -> ((g1 up + g2 prev) + g3 down) + (((1 - g1) - g2) - g3) x."""
    from onnx import TensorProto, helper

    def t(part):
        return ctx.tmp(f"{name}_{part}")
    prev, x, g1, g2, g3 = (t(p) for p in ("prev", "x_col", "g1_col", "g2_col", "g3_col"))
    nodes = []

    def op(kind, inputs, part, **attrs):
        out = t(part)
        nodes.append(helper.make_node(kind, inputs, [out], **attrs))
        return out

    def const(values, part, dtype):
        out = t(part)
        nodes.append(helper.make_node("Constant", [], [out], value=helper.make_tensor(out + "_v", dtype, [len(values)],
                                                                                      values)))
        return out
    pads_up, pads_down = const([0, 0, 1, 0, 0, 0], "pads_up", TensorProto.INT64), \
        const([0, 0, 0, 0, 0, 1], "pads_down", TensorProto.INT64)
    zero, last, axis = const([0], "zero", TensorProto.INT64), const([height - 1], "last", TensorProto.INT64), \
        const([2], "axis", TensorProto.INT64)
    one_i, end = const([1], "one_i", TensorProto.INT64), const([height], "end", TensorProto.INT64)
    up = op("Pad", [op("Slice", [prev, zero, last, axis], "above"), pads_up], "up")
    down = op("Pad", [op("Slice", [prev, one_i, end, axis], "below"), pads_down], "down")
    one = const([1.0], "one", TensorProto.FLOAT)
    h_sum = op("Add", [op("Add", [op("Mul", [g1, up], "p1"), op("Mul", [g2, prev], "p2")], "p12"),
                       op("Mul", [g3, down], "p3")], "h_hype")
    keep = op("Sub", [op("Sub", [op("Sub", [one, g1], "k1"), g2], "k2"), g3], "keep")
    col = op("Add", [op("Mul", [keep, x], "x_hype"), h_sum], "col")
    out = op("Identity", [col], "col_out")

    def value(n):
        return helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
    return helper.make_graph(nodes, f"{name}_column", [value(v) for v in (prev, x, g1, g2, g3)],
                             [value(col), value(out)])


def spn_divide(x, floor: float = 1e-6):
    """Divide: (1 / x with |x| < floor set to floor, that clamped x); the kernel's floor is 1e-6, compared
    in double: float32 x < 1e-6 is x <= float32(1e-6), so -float32(1e-6) becomes +1e-6 too."""
    small = (x <= floor) & (x >= -floor)
    clamped = torch.where(small, torch.full_like(x, floor), x)
    return 1.0 / clamped, clamped


@register_layer("Divide")
class Divide(Layer):
    def parse(self, lp):
        need_blobs(lp, "Divide", 1, 1)
        return {}

    def bottoms_written_back(self, attrs):
        return (0,)

    def forward(self, attrs, params, x):
        inverse, clamped = spn_divide(x, DIVIDE_FLOOR)
        return (inverse, clamped) if attrs.get("written_back") else inverse

    def onnx(self, ctx, node):
        x = node.inputs[0]
        floor = ctx.f32(DIVIDE_FLOOR)
        small = ctx.add_node("And", [ctx.op("LessOrEqual", [x, floor], "below", name=node.name),
                                     ctx.op("GreaterOrEqual", [x, ctx.f32(-DIVIDE_FLOOR)], "above")],
                             ctx.tmp(node.name + "_small"))
        clamped = node.outputs[1] if node.attrs.get("written_back") else ctx.tmp(node.name + "_clamped")
        ctx.add_node("Where", [small, floor, x], [clamped])
        ctx.add_node("Div", [ctx.f32(1.0), clamped], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        out = emit.tmp("divided")
        emit.stmt(f"{out} = {emit.helper(spn_divide)}({emit.inputs[0]}, {emit.lit(DIVIDE_FLOOR)})")
        return [f"{out}[0]", f"{out}[1]"] if node.attrs.get("written_back") else f"{out}[0]"


def spn_roi_index(x, rois, pooled_h: int, pooled_w: int):
    """ROI's flat indexes into x, (R, C, pooled_h, pooled_w), as the fork's kernel computes them."""
    c, h, w = x.shape[1], x.shape[2], x.shape[3]
    r = rois.reshape(rois.shape[0], 5)
    batch, x1, y1 = (r[:, 0] - 1).long(), (r[:, 1] - 1).long(), (r[:, 2] - 1).long()   # C's int(): toward zero
    start = (batch * (c * h * w) + y1 * w + x1).reshape(-1, 1, 1, 1)
    channel = (torch.arange(c, device=x.device) * (h * w)).reshape(1, c, 1, 1)
    row = (torch.arange(pooled_h, device=x.device) * w).reshape(1, 1, pooled_h, 1)
    col = torch.arange(pooled_w, device=x.device).reshape(1, 1, 1, pooled_w)
    return start + channel + row + col


def spn_roi(x, rois, pooled_h: int, pooled_w: int):
    """ROI: each roi's pooled_h x pooled_w window of x, read flat from its one-based corner (x1, y1)."""
    return x.reshape(-1)[spn_roi_index(x, rois, pooled_h, pooled_w)]


@register_layer("ROI")
class ROI(Layer):
    reading_note = ("ROI read as Liusifei/caffe-spn's GPU kernel (its CPU forward leaves the last row and column "
                    "at -FLT_MAX)")

    def parse(self, lp):
        need_blobs(lp, "ROI", 2, 1, "x, rois")
        p = lp.roi_param
        return {"pooled_h": positive_field(p.pooled_h, "roi_param.pooled_h"),
                "pooled_w": positive_field(p.pooled_w, "roi_param.pooled_w")}

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "ROI", "x (bottom 0)")
        rois = tuple(in_shapes[1])
        if not rois or count(rois) != 5 * rois[0]:
            raise LayerError(f"ROI's rois must be (R, 5) = one-based [batch, x1, y1, x2, y2], got {list(rois)}")
        return [(rois[0], c, attrs["pooled_h"], attrs["pooled_w"])]

    def forward(self, attrs, params, x, rois):
        if eager_checks() and rois.shape[0]:
            index = spn_roi_index(x, rois, attrs["pooled_h"], attrs["pooled_w"])
            bad = ((index < 0) | (index >= x.numel())).flatten(1).any(1)
            if bool(bad.any()):
                k = int(bad.nonzero()[0, 0])
                raise DataError(f"ROI: roi {k} {rois.reshape(-1, 5)[k].tolist()} reads outside the bottom "
                                f"{list(x.shape)} (its {attrs['pooled_h']} x {attrs['pooled_w']} window from the "
                                f"one-based corner x1, y1 of batch item b)")
        return spn_roi(x, rois, attrs["pooled_h"], attrs["pooled_w"])

    def onnx(self, ctx, node):
        x, rois = node.inputs
        _, c, h, w = ctx.shape(x)
        ph, pw = node.attrs["pooled_h"], node.attrs["pooled_w"]
        r = ctx.op("Reshape", [rois, ctx.i64([-1, 5])], "rois", name=node.name)

        def value(k, hint):   # column k less 1, toward zero, as int64 (R, 1)
            col = ctx.op("Slice", [r, ctx.i64([k]), ctx.i64([k + 1]), ctx.i64([1])], hint + "_col")
            return ctx.op("Cast", [ctx.trunc(ctx.op("Sub", [col, ctx.f32(1)], hint + "_less"), hint + "_int")],
                          hint, to=7)

        batch, x1, y1 = value(0, "batch"), value(1, "x1"), value(2, "y1")
        start = ctx.op("Add", [ctx.op("Add", [ctx.op("Mul", [batch, ctx.i64(c * h * w)], "item"),
                                              ctx.op("Mul", [y1, ctx.i64(w)], "row")], "item_row"), x1], "start")
        offsets = (np.arange(c).reshape(c, 1, 1) * (h * w) + np.arange(ph).reshape(1, ph, 1) * w
                   + np.arange(pw).reshape(1, 1, pw)).astype(np.int64)[None]
        index = ctx.op("Add", [ctx.op("Reshape", [start, ctx.i64([-1, 1, 1, 1])], "start4"),
                               ctx.const(offsets, node.name + "_offsets")], "index")
        flat = ctx.op("Reshape", [x, ctx.i64([-1])], "flat")
        ctx.add_node("Gather", [flat, index], [node.outputs[0]], axis=0)

    def pytorch_source(self, node, emit):
        emit.helper(spn_roi_index)
        return (f"{emit.helper(spn_roi)}({emit.inputs[0]}, {emit.inputs[1]}, {node.attrs['pooled_h']}, "
                f"{node.attrs['pooled_w']})")
