"""crfgd's layers in ONNX: the entropic step and the leaky simplex projection, and CrfEd / CrfGrad with
bilateralNN's lattice built in the graph (permutohedral_onnx.OnnxLattice's simplex with C's rounding, the
taps walked through the vertices found by Unique), their iterations unrolled: the same float32 steps as
crfgd.py's torch functions, in the same order."""
import numpy as np

from .crfgd import bnn_gauss_filter, entropic_step_size
from .norm import onnx_reduce
from .permutohedral_onnx import OnnxLattice
from .ssd.common import scalar_tensor


def onnx_entropic_step(ctx, x, g, step, hint, out=None):
    """entropic_step: x exp(-step g), the exponent less its per-pixel maximum, renormalized over axis 1."""
    e = ctx.op("Mul", [g, ctx.f32(-step)], f"{hint}_e")
    e = ctx.op("Sub", [e, onnx_reduce(ctx, "ReduceMax", e, [1], True)], f"{hint}_shift")
    e = ctx.op("Mul", [ctx.op("Exp", [e], f"{hint}_exp"), x], f"{hint}_ex")
    total = onnx_reduce(ctx, "ReduceSum", e, [1], True)
    if out is not None:
        ctx.add_node("Div", [e, total], [out])
        return out
    return ctx.op("Div", [e, total], f"{hint}_x")


def onnx_leaky_projection(ctx, y, channels, leak, hint, out=None):
    """simplex_leaky_projection of y (N, C, H, W): the running means of the sorted values, the first that reaches
    the next value (else over all C), then y - t, times leak below 0."""
    ranked = ctx.add_node("TopK", [y, ctx.i64([channels])], [ctx.tmp(f"{hint}_ranked"), ctx.tmp(f"{hint}_order")],
                          axis=1, largest=1, sorted=1)[0]
    sums = ctx.op("CumSum", [ranked, ctx.const(np.array(1, np.int64))], f"{hint}_sums")
    count = ctx.const(np.arange(1, channels + 1, dtype=np.float32).reshape(1, channels, 1, 1))
    means = ctx.op("Div", [ctx.op("Sub", [sums, ctx.f32(1.0)], f"{hint}_less1"), count], f"{hint}_means")
    head = ctx.op("Slice", [means, ctx.i64([0]), ctx.i64([channels - 1]), ctx.i64([1])], f"{hint}_head")
    nxt = ctx.op("Slice", [ranked, ctx.i64([1]), ctx.i64([channels]), ctx.i64([1])], f"{hint}_next")
    hit = ctx.op("Cast", [ctx.op("GreaterOrEqual", [head, nxt], f"{hint}_hit")], f"{hint}_hitf", to=1)
    first = ctx.op("ArgMax", [hit], f"{hint}_first", axis=1, keepdims=1, select_last_index=0)
    anyhit = ctx.op("Greater", [onnx_reduce(ctx, "ReduceMax", hit, [1], True), ctx.f32(0.0)], f"{hint}_any")
    pick = ctx.op("Where", [anyhit, first, ctx.const(np.array(channels - 1, np.int64))], f"{hint}_pick")
    t = ctx.op("GatherElements", [means, pick], f"{hint}_t", axis=1)
    shifted = ctx.op("Sub", [y, t], f"{hint}_shifted")
    positive = ctx.op("Greater", [shifted, ctx.f32(0.0)], f"{hint}_pos")
    leaked = ctx.op("Mul", [shifted, ctx.f32(leak)], f"{hint}_leak")
    if out is not None:
        ctx.add_node("Where", [positive, shifted, leaked], [out])
        return out
    return ctx.op("Where", [positive, shifted, leaked], f"{hint}_proj")


class BnnOnnxLattice(OnnxLattice):
    """bilateralNN's lattice (bnn_lattice) and its filter (bnn_filter) in ONNX."""

    def build_bnn(self, features, points, d):
        """features (P, d) float32 -> (slots (P, d + 1) in 1..M, weights (P, d + 1), taps (T, M) in 0..M)."""
        c = self.ctx
        points = c.i64([points])
        weights, keys = self.simplex(features, points, d, half_away=True, double_first=True)
        slots, vertex_keys = self.vertices(keys, points, d)
        lower = []
        for k in range(d + 1):   # a step along k: every coordinate less 1, coordinate k (k < d) plus d + 1
            axis = np.full(d, -1, np.int64)
            if k < d:
                axis[k] = d
            lower.append(self.short(self.op("Add", [vertex_keys, c.const(axis)], "step")))
        steps = self.find_rows(vertex_keys, lower, d)                      # (d + 1, M), 0: none
        table = self.op("Concat", [c.const(np.zeros((d + 1, 1), np.int64)), steps], "steps", axis=1)   # row 0 stays 0
        m = self.op("Shape", [vertex_keys], "m", start=0, end=1)
        start = self.op("Range", [c.i64(1), self.op("Add", [self.op("Squeeze", [m, c.i64([0])], "ms"), c.i64(1)], "m1"),
                                  c.i64(1)], "vertices")
        taps = []
        for t in range(2 ** (d + 1) - 1):
            walking = start
            for k in range(d + 1):
                if (t >> (d - k)) & 1:
                    walking = self.op("Gather", [self.op("Gather", [table, c.i64(k)], "row", axis=0), walking], "walk")
            taps.append(self.op("Unsqueeze", [walking, c.i64([0])], "tap"))
        return slots, weights, self.op("Concat", taps, "taps", axis=0)

    def filter_bnn(self, lattice, values, channels, filters, taps_count, d):
        """values (P, C) through the lattice with filters (O, C, T) -> (P, O), as bnn_filter (transposed)."""
        c = self.ctx
        slots, weights, taps = lattice
        grid = self.splat(slots, weights, values, channels, taps)
        blurred = None
        for t in range(taps_count):
            picked = self.op("Gather", [grid, self.op("Gather", [taps, c.i64(t)], "tap", axis=0)], "picked", axis=0)
            w_t = self.op("Transpose", [self.op("Gather", [filters, c.i64(t)], "wt", axis=2)], "wtt", perm=[1, 0])
            term = self.op("MatMul", [picked, w_t], "term")
            blurred = term if blurred is None else self.op("Add", [blurred, term], "blurred")
        outs = self.op("Shape", [blurred], "o", start=1, end=2)
        zero_row = self.op("ConstantOfShape", [self.op("Concat", [c.i64([1]), outs], "zr", axis=0)], "zero",
                           value=scalar_tensor(0.0))
        blurred = self.op("Concat", [zero_row, blurred], "blurred", axis=0)
        out = None
        for j in range(d + 1):   # each point's vertices
            w = self.cols(weights, j, j + 1)
            term = self.op("Mul", [w, self.op("Gather", [blurred, self.column(slots, j)], "pick", axis=0)], "term")
            out = term if out is None else self.op("Add", [out, term], "slice")
        return out


def emit_crf_descent(ctx, node):
    """CrfEd / CrfGrad: crf_descent unrolled (a lattice per image, built once)."""
    a = node.attrs
    q, feats = node.inputs
    n, c, h, w = ctx.shape(q)
    d = ctx.shape(feats)[1]
    taps_count = 2 ** (d + 1) - 1
    k = a["kernel_size"]
    weight = ctx.op("Reshape", [ctx.weight(node, 0), ctx.i64([])], "unary_weight")
    unary = ctx.op("Neg", [ctx.op("Mul", [weight, ctx.op("Log", [ctx.op("Add", [q, ctx.f32(a["log_eps"])], "q_eps")],
                                                         "log_q")], "wlog")], "unary")
    filters = ctx.op("Reshape", [ctx.weight(node, 2), ctx.i64([c, c, taps_count])], "lattice_filter")
    gauss = ctx.const(bnn_gauss_filter(d).numpy().reshape(1, 1, taps_count), node.name + "_gauss")
    lattices = []
    if not a["skip_pl"]:
        ones = ctx.const(np.ones((h * w, 1), np.float32))   # filtered by the Gaussian taps: the normalization
        for i in range(n):
            lat = BnnOnnxLattice(ctx, f"lattice{i}")
            image = ctx.op("Gather", [feats, ctx.i64(i)], f"feats{i}", axis=0)
            points = ctx.op("Transpose", [ctx.op("Reshape", [image, ctx.i64([d, h * w])], f"f{i}")], f"pts{i}", perm=[1, 0])
            built = lat.build_bnn(points, h * w, d)
            smooth = ctx.op("Cast", [lat.filter_bnn(built, ones, 1, gauss, taps_count, d)], f"norm_in{i}", to=11)
            norm = ctx.op("Cast", [ctx.op("Reciprocal", [ctx.op("Sqrt", [ctx.op("Add", [smooth, ctx.const(np.array(1e-20))],
                                                                                 f"eps{i}")], f"sqrt{i}")], f"inv{i}")],
                          f"norm{i}", to=1)
            lattices.append((lat, built, norm))
    x = q
    energies = []
    last = a["iterations"] - 1
    for it in range(a["iterations"]):
        conv = None if a["skip_conv"] else ctx.op("Conv", [x, ctx.weight(node, 1)], f"conv{it}", pads=[(k - 1) // 2] * 4,
                                                   kernel_shape=[k, k])
        pl = None
        if lattices:
            images = []
            for i, (lat, built, norm) in enumerate(lattices):
                values = ctx.op("Transpose", [ctx.op("Reshape", [ctx.op("Gather", [x, ctx.i64(i)], f"x{i}", axis=0),
                                                                 ctx.i64([c, h * w])], f"xi{i}")], f"vals{i}", perm=[1, 0])
                filtered = lat.filter_bnn(built, ctx.op("Mul", [values, norm], f"scaled{i}"), c, filters, taps_count, d)
                filtered = ctx.op("Mul", [filtered, norm], f"back{i}")
                images.append(ctx.op("Reshape", [ctx.op("Transpose", [filtered], f"t{i}", perm=[1, 0]),
                                                 ctx.i64([1, c, h, w])], f"pl{i}"))
            pl = images[0] if n == 1 else ctx.op("Concat", images, f"pl{it}", axis=0)
        if a["tops"] == 2:
            terms = ctx.op("Add", [ctx.op("Add", [ctx.op("Mul", [x, conv], f"xc{it}"), ctx.op("Mul", [x, unary], f"xu{it}")],
                                          f"xcu{it}"), ctx.op("Mul", [x, pl], f"xp{it}")], f"en{it}")
            energies.append(onnx_reduce(ctx, "ReduceSum", ctx.op("Cast", [terms], f"end{it}", to=11),
                                        list(range(4)), False))
        pairwise = conv if pl is None else pl if conv is None else ctx.op("Add", [conv, pl], f"pw{it}")
        g = unary if pairwise is None else ctx.op("Add", [pairwise, unary], f"g{it}")
        out = node.outputs[0] if it == last else None
        if a["projected"]:
            y = ctx.op("Add", [x, ctx.op("Mul", [g, ctx.f32(-a["step_size"])], f"gs{it}")], f"y{it}")
            x = onnx_leaky_projection(ctx, y, c, a["leak"], f"proj{it}", out)
        else:
            x = onnx_entropic_step(ctx, x, g, entropic_step_size(a["classes"], it, a["step_size_factor"]),
                                   f"ed{it}", out)
    if a["tops"] == 2:
        sums = ctx.op("Cast", [ctx.op("Concat", [ctx.op("Unsqueeze", [e, ctx.i64([0])], "e1") for e in energies],
                                      "energies", axis=0)], "energies", to=1)
        padded = ctx.op("Pad", [sums, ctx.i64([0, n * a["iterations"] - a["iterations"]])], "energy_pad")
        ctx.add_node("Reshape", [padded, ctx.i64([n, 1, 1, a["iterations"]])], [node.outputs[1]])

