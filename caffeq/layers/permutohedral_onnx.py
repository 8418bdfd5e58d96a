"""permutohedral.py's lattice in ONNX (opset 16 and later): built in the graph from per-pixel features, with
Unique for the vertex keys and ScatterElements(reduction add) for the barycentric weights and the
splat.  (Not ScatterND: onnxruntime 1.32 adds ScatterND's duplicate rows in parallel threads and loses
some of the sums once the update is large; its ScatterElements adds them one by one.)  The float32 steps are the torch functions' (the same operations in the same order), so
both build the same lattice.  Neighbours are found by numbering the vertex keys and the neighbour keys
together (Unique), where torch binary-searches the vertex keys: the same rows either way.
"""
import math

import numpy as np

from ..errors import ExportError
from .c_numerics import onnx_c_round
from .ssd.common import scalar_tensor

#: the first opset with ScatterElements reduction="add"
LATTICE_OPSET = 16


class OnnxLattice:
    """Emits one lattice (build) and filters through it (filter), node names prefixed with `hint`."""

    #: slice every channel count as (weight x value) x alpha (caffe-hybridnet's sequential lattice)
    sequential_slice = False

    def __init__(self, ctx, hint):
        self.ctx = ctx
        self.hint = hint
        if ctx.opset < LATTICE_OPSET:
            raise ExportError(f"{ctx._where()}: the permutohedral lattice needs ScatterElements with "
                              f"reduction='add' (ONNX opset {LATTICE_OPSET}); export with --opset "
                              f"{LATTICE_OPSET} or later (the default is)")

    def op(self, kind, inputs, hint, **attrs):
        return self.ctx.op(kind, inputs, f"{self.hint}_{hint}", **attrs)

    def ops(self, kind, inputs, count, hint, **attrs):
        outs = [self.ctx.tmp(f"{self.ctx.layer.name}_{self.hint}_{hint}{i}") for i in range(count)]
        return self.ctx.add_node(kind, inputs, outs, **attrs)

    def cols(self, x, start, end, axis=1):
        c = self.ctx
        return self.op("Slice", [x, c.i64([start]), c.i64([end]), c.i64([axis])], "cols")

    def first_rows(self, x, count):
        return self.op("Slice", [x, self.ctx.i64([0]), count, self.ctx.i64([0])], "rows")

    def column(self, x, i):
        return self.op("Gather", [x, self.ctx.i64(i)], "col", axis=1)

    def short(self, keys):
        c = self.ctx
        return self.op("Sub", [self.op("Mod", [self.op("Add", [keys, c.i64(32768)], "k"), c.i64(65536)], "mod"),
                               c.i64(32768)], "short")

    def dense_ids(self, rows, width):
        """Equal rows of an int64 (R, width) tensor get equal ids: (ids, first row of each id, id count)."""
        c = self.ctx
        ids = None
        for i in range(width):
            column = self.column(rows, i)
            column = self.op("Sub", [column, self.op("ReduceMin", [column], "min", keepdims=0)], "c")
            if ids is not None:
                span = self.op("Add", [self.op("ReduceMax", [column], "max", keepdims=0), c.i64(1)], "span")
                column = self.op("Add", [self.op("Mul", [ids, span], "code"), column], "code")
            codes, first, ids, _ = self.ops("Unique", [column], 4, "unique", sorted=1)
        return ids, first, self.op("Shape", [codes], "count")

    def padded(self, features, points, d):
        """features (P, d) with the SSE build's origin rows up to a multiple of 4; points: P as a (1,) int64
        tensor (known only at run time where a size bottom decides it)."""
        c = self.ctx
        pad = self.op("Mod", [self.op("Sub", [c.i64([4]), self.op("Mod", [points, c.i64([4])], "m4")], "p4"),
                              c.i64([4])], "pad")
        zeros = self.op("ConstantOfShape", [self.op("Concat", [pad, c.i64([d])], "zs", axis=0)], "zeros",
                        value=scalar_tensor(0.0))
        return self.op("Concat", [features, zeros], "padded", axis=0)

    def simplex(self, features, points, d, half_away=False, double_first=False, ties_down=False):
        """lattice_simplex in ONNX: the weights (P, d + 1) float32 of the first `points` rows and the keys
        (rows x (d + 1), d) int64 of every row's vertices."""
        c, f32 = self.ctx, np.float32
        inv_std_dev = float(f32(math.sqrt(2.0 / 3.0) * (d + 1)))
        split = self.ops("Split", [features, c.i64([1] * d)], d, "f", axis=1)
        elevated = [None] * (d + 1)
        running = c.f32(0.0)
        for j in range(d, 0, -1):
            cj = self.op("Mul", [split[j - 1], c.f32(f32(1.0 / math.sqrt((j + 1) * j) * inv_std_dev))], "cf")
            elevated[j] = self.op("Sub", [running, self.op("Mul", [c.f32(float(j)), cj], "jc")], "el")
            running = self.op("Add", [running, cj], "sum")
        elevated[0] = running
        e = self.op("Concat", elevated, "elevated", axis=1)
        down, d_plus_1 = c.f32(f32(1.0) / f32(d + 1)), c.f32(float(d + 1))
        scaled = self.op("Mul", [e, down], "v")
        if ties_down:   # caffe-hybridnet: the nearer multiple of d + 1, compared in float32, ties down
            up, low = self.op("Ceil", [scaled], "up"), self.op("Floor", [scaled], "low")
            nearer_up = self.op("Less", [self.op("Sub", [self.op("Mul", [up, d_plus_1], "upm"), e], "to_up"),
                                         self.op("Sub", [e, self.op("Mul", [low, d_plus_1], "lowm")], "to_low")],
                                "nearer")
            rounded = self.op("Where", [nearer_up, up, low], "round")
        else:
            rounded = onnx_c_round(self.ctx, scaled) if half_away else self.op("Round", [scaled], "round")
        rem0 = self.op("Mul", [rounded, d_plus_1], "rem0")
        rest = self.op("Sub", [e, rem0], "rest")
        less = self.op("Less", [self.op("Unsqueeze", [rest, c.i64([2])], "ri"), self.op("Unsqueeze", [rest, c.i64([1])],
                                                                                        "rj")], "less")
        later = np.triu(np.ones((d + 1, d + 1), bool), 1)
        above = self.op("Cast", [self.op("And", [less, c.const(later)], "above")], "a", to=7)
        not_below = self.op("Not", [self.op("Transpose", [less], "lt", perm=[0, 2, 1])], "nb")
        below = self.op("Cast", [self.op("And", [not_below, c.const(later.T.copy())], "below")], "b", to=7)
        rank = self.op("ReduceSum", [self.op("Add", [above, below], "ab"), c.i64([2])], "rank", keepdims=0)
        total = self.op("Cast", [self.op("ReduceSum", [rounded, c.i64([1])], "total", keepdims=1)], "t", to=7)
        rank = self.op("Add", [rank, total], "rank")
        step = c.i64(d + 1)
        shift = self.op("Sub", [
            self.op("Mul", [self.op("Cast", [self.op("Less", [rank, c.i64(0)], "neg")], "n", to=7), step], "add"),
            self.op("Mul", [self.op("Cast", [self.op("Greater", [rank, c.i64(d)], "big")], "g", to=7), step], "sub")],
            "shift")
        rank = self.op("Min", [self.op("Max", [self.op("Add", [rank, shift], "r"), c.i64(0)], "lo"), c.i64(d)], "rank")
        rem0 = self.op("Add", [rem0, self.op("Cast", [shift], "sf", to=1)], "rem0")
        v = self.op("Mul", [self.op("Sub", [e, rem0], "rest"), down], "bv")
        slot = self.op("Sub", [c.i64(d), rank], "slot")
        rows = self.op("Shape", [features], "rows", start=0, end=1)   # the points and the SSE build's padding
        zeros = self.op("ConstantOfShape", [self.op("Concat", [rows, c.i64([d + 2])], "zs", axis=0)], "zeros",
                        value=scalar_tensor(0.0))
        bary = self.op("ScatterElements", [zeros, slot, v], "bary", axis=1, reduction="add")
        bary = self.op("ScatterElements", [bary, self.op("Add", [slot, c.i64(1)], "next"),
                                           self.op("Neg", [v], "nv")], "bary", axis=1, reduction="add")
        if double_first:   # bilateralNN adds 1.0 + the wrapped weight in double
            wrap = self.op("Add", [self.op("Cast", [self.cols(bary, 0, 1)], "b0", to=11),
                                   self.op("Add", [c.const(np.array(1.0)), self.op("Cast", [self.cols(bary, d + 1, d + 2)],
                                                                                   "bd", to=11)], "wrap")], "w0")
            first = self.op("Cast", [wrap], "w0", to=1)
        else:
            first = self.op("Add", [self.cols(bary, 0, 1), self.op("Add", [c.f32(1.0), self.cols(bary, d + 1, d + 2)],
                                                                  "wrap")], "w0")
        weights = self.first_rows(self.op("Concat", [first, self.cols(bary, 1, d + 1)], "w", axis=1), points)
        r = np.arange(d + 1)
        canonical = np.where(r[None, :] <= d - r[:, None], r[:, None], r[:, None] - (d + 1)).astype(np.int64)
        canon = self.op("Transpose", [self.op("Gather", [c.const(canonical), self.cols(rank, 0, d)], "canon",
                                              axis=1)], "canon", perm=[1, 0, 2])
        base = self.op("Unsqueeze", [self.op("Cast", [self.cols(rem0, 0, d)], "ri", to=7), c.i64([1])], "base")
        keys = self.op("Reshape", [self.short(self.op("Add", [base, canon], "keys")), c.i64([-1, d])], "keys")
        return weights, keys

    def vertices(self, keys, points, d):
        """The vertex ids: (slots (P, d + 1) in 1..M of the first `points` rows, the vertices' keys (M, d))."""
        c = self.ctx
        ids, first_rows, _ = self.dense_ids(keys, d)
        vertex_keys = self.op("Gather", [keys, first_rows], "vk", axis=0)
        slots = self.op("Add", [self.first_rows(self.op("Reshape", [ids, c.i64([-1, d + 1])], "slots"), points),
                                c.i64(1)], "slots")
        return slots, vertex_keys

    def find_rows(self, vertex_keys, queries, d):
        """The rows (1..M, 0: none) of the vertices equal to each of the query key tensors (Q, d), stacked (n, Q),
        by numbering the vertex keys and the queries together (Unique)."""
        c = self.ctx
        every, _, count = self.dense_ids(self.op("Concat", [vertex_keys] + queries, "all", axis=0), d)
        m = self.op("Shape", [vertex_keys], "m", start=0, end=1)
        row_of = self.op("ScatterElements", [
            self.op("ConstantOfShape", [count], "table", value=_int64_zero()),
            self.op("Slice", [every, c.i64([0]), m, c.i64([0])], "vid"),
            self.op("Range", [c.i64(1), self.op("Add", [self.op("Squeeze", [m, c.i64([0])], "ms"), c.i64(1)], "m1"),
                              c.i64(1)], "rows")], "row_of", axis=0)
        found = self.op("Gather", [row_of, self.op("Slice", [every, m, c.i64([2 ** 62]), c.i64([0])], "nid")], "nb")
        return self.op("Reshape", [found, c.i64([len(queries), -1])], "nb")

    def build(self, features, points, d):
        """The lattice of `features` ((P + pad, d) float32, the pad rows at the origin; points: P, an int or a
        (1,) int64 tensor): slots (P, d + 1) int64, weights (P, d + 1) float32 and the neighbour lists
        (2 (d + 1), M), as permutohedral_lattice."""
        c = self.ctx
        if isinstance(points, int):
            points = c.i64([points])
        weights, keys = self.simplex(features, points, d)
        slots, vertex_keys = self.vertices(keys, points, d)
        lower, upper = [], []
        for j in range(d + 1):
            axis = np.zeros(d, np.int64)
            if j < d:
                axis[j] = d + 1
            lower.append(self.short(self.op("Add", [vertex_keys, c.const(axis - 1)], "lower")))
            upper.append(self.short(self.op("Add", [vertex_keys, c.const(1 - axis)], "upper")))
        return slots, weights, self.find_rows(vertex_keys, lower + upper, d)

    def constant(self, slots, weights, neighbours):
        """A lattice known at export (the spatial one): permutohedral_lattice's tensors as initializers."""
        c = self.ctx
        n = neighbours.numpy()
        return (c.const(slots.numpy()), c.const(weights.numpy()),
                c.const(np.concatenate([n[:, 0], n[:, 1]]).astype(np.int64)))

    def splat(self, slots, weights, values, channels, by_vertex):
        """values (P, C) weighted onto the vertices: (M + 1, C), row 0 (no vertex) zero; by_vertex: a tensor
        whose axis 1 has the M vertices."""
        c = self.ctx
        splat = self.op("Reshape", [self.op("Mul", [self.op("Unsqueeze", [weights, c.i64([2])], "w3"),
                                                    self.op("Unsqueeze", [values, c.i64([1])], "v3")], "splat"),
                                    c.i64([-1, channels])], "splat")
        m1 = self.op("Add", [self.op("Shape", [by_vertex], "m", start=1, end=2), c.i64([1])], "m1")
        grid = self.op("ConstantOfShape", [self.op("Concat", [m1, c.i64([channels])], "gs", axis=0)], "grid",
                       value=scalar_tensor(0.0))
        at = self.op("Expand", [self.op("Reshape", [slots, c.i64([-1, 1])], "at"), c.i64([1, channels])], "at")
        return self.op("ScatterElements", [grid, at, splat], "grid", axis=0, reduction="add")

    def filter(self, lattice, values, channels, d, sse_only=False):
        """values (P, C) float32 through the lattice -> (P, C), as permutohedral_filter (transposed)."""
        c = self.ctx
        slots, weights, neighbours = lattice
        grid = self.splat(slots, weights, values, channels, neighbours)
        for j in range(d + 1):
            left = self.op("Gather", [grid, self.op("Gather", [neighbours, c.i64(j)], "n1", axis=0)], "l", axis=0)
            right = self.op("Gather", [grid, self.op("Gather", [neighbours, c.i64(d + 1 + j)], "n2", axis=0)], "r",
                            axis=0)
            blurred = self.op("Add", [self.op("Slice", [grid, c.i64([1]), c.i64([2 ** 62]), c.i64([0])], "old"),
                                      self.op("Mul", [self.op("Add", [left, right], "lr"), c.f32(0.5)], "half")],
                              "blur")
            grid = self.op("Concat", [self.cols(grid, 0, 1, axis=0), blurred], "grid", axis=0)
        one = np.float32(1.0)
        alpha = c.f32(one / (one + np.float32(2.0 ** -d)))
        out = None
        for j in range(d + 1):
            w = self.cols(weights, j, j + 1)
            picked = self.op("Gather", [grid, self.column(slots, j)], "pick", axis=0)
            sequential = (channels <= 2 or self.sequential_slice) and not sse_only
            term = (self.op("Mul", [self.op("Mul", [w, picked], "wv"), alpha], "term") if sequential else
                    self.op("Mul", [self.op("Mul", [w, alpha], "wa"), picked], "term"))
            out = term if out is None else self.op("Add", [out, term], "slice")
        return out


def _int64_zero():
    """ConstantOfShape's int64 0 (scalar_tensor's are float32)."""
    from onnx import numpy_helper
    return numpy_helper.from_array(np.zeros(1, np.int64))
