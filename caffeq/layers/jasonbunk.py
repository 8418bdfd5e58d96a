"""jasonbunk/caffe's own layers: BilateralFilter, RBF and TestOpenCVPreview.

Source: jasonbunk/caffe 3b8bb55 (src/caffe/proto/caffe.proto; src/caffe/layers/bilateral_filter_layer.cpp and
.cu, src/caffe/bilateral_filter/modified_permutohedral.cpp and .cu (from mxnet's permutohedral op),
src/caffe/layers/rbf_layer.cpp, src/caffe/layers/testopencvpreview_layer.cpp).  Its MultiStageMeanfield
(do_softmax) is read by crf_rnn.py; DataParameter.duplication_amount and the affine_* transform fields
only change which images a batch holds (the top stays batch_size), so they are read and not applied.

BilateralFilter (bottoms: values V (N, C, *S), features F (N, K, *S), the same N and spatial sizes S;
top V's shape).  The forward here is the fork's GPU one (PermutohedralOp_template_GPU::Forward): per image,
the lattice features are the pixel's position (with create_spatial_dimension_features, default true: its
index unravelled over S, outer axis first, so (row, column) on 4-axis blobs) then F's K channels, each
multiplied by (d + 1) sqrt(2/3 / ((i + 1)(i + 2))) / width (stdv_space for positions, stdv_color for F), as
scale_init_host_to_device; the lattice is the init kernel's (Adams et al.; unlike CRF-RNN's SSE build: one
scale per feature, a tie rounded down, no padding points), so positions on exact lattice boundaries
pick the fork's vertices; V and a channel of ones are splatted, blurred along colours 0..d (me + 0.5 up +
0.5 down, a missing neighbour adding nothing) and sliced, and the top is filter(V) x 1 / filter(1).  The
GPU splat sums with atomicAdd in no fixed order: the last bits may differ.  The fork's CPU Forward
(PermutohedralOp_CPU) is a debugging stub: it ignores the widths and the positions, does not normalize and
shows the blob in an OpenCV window; it is not followed.  The fork's LayerSetUp reads stdv_color only when
stdv_space is set (else both stay -1 and the GPU op reads past an empty width list): such a file is
refused.  No ONNX export (its lattice would need its own graph; not written).

RBF (one 4-axis bottom X (N, K, H, W); top (N, num_output, H, W)): blobs scalars s (I, J), widths b
(I, J), centres c (J, K) with share_centroids (default) or (I, J, K); top[n, i] =
sum_j s[i, j] exp(-(sum_k (X[n, k] - c[j, k])^2) b[i, j] b[i, j]) (rbf_msi_compute_forward).

TestOpenCVPreview (one bottom, one top, not in place): copies its bottom to its top and shows the bottom
in an OpenCV window, waiting for a key; caffeq never displays: an identity.
"""
import math

import torch

from .permutohedral import as_short, lattice_lookup, lattice_vertex_ids, lattice_vertices
from .registry import Layer, LayerError, need_blobs, positive_field, register_layer

# ---- BilateralFilter --------------------------------------------------------------------------------

def gpu_simplex(pos, scale):
    """The mxnet permutohedral op's init kernel on (P, d) float32 features and their (d,) float32 scales
    ((d + 1) sqrt(2/3 / ((i + 1)(i + 2))) / width): (keys (P, d + 1, d) int64, each point's d + 1 vertices as
    shorts; weights (P, d + 1) float32).  The nearest 0-coloured point rounds a tie down; rank ties go to
    the later coordinate; a sum off the plane moves the extreme coordinates by d + 1."""
    p, d = pos.shape
    f32, dev = torch.float32, pos.device
    cf = pos.to(f32) * scale
    elevated = [cf[:, 0]] * (d + 1)
    running = torch.zeros(p, dtype=f32, device=dev)
    for i in range(d, 0, -1):
        elevated[i] = running - torch.tensor(float(i), dtype=f32, device=dev) * cf[:, i - 1]
        running = running + cf[:, i - 1]
    elevated[0] = running
    e = torch.stack(elevated, 1)
    d_plus_1 = torch.tensor(float(d + 1), dtype=f32, device=dev)
    down_factor = torch.tensor(1.0, dtype=f32, device=dev) / d_plus_1
    v = e * down_factor
    up, down = torch.ceil(v) * d_plus_1, torch.floor(v) * d_plus_1
    greedy = torch.where(up - e < e - down, up, down)
    total = torch.div(greedy.sum(1, keepdim=True).to(torch.int64), d + 1, rounding_mode="trunc")
    rest = e - greedy
    later = torch.ones(d + 1, d + 1, dtype=torch.bool, device=dev).tril(-1)   # [i, j]: i > j
    rank = ((rest[:, :, None] < rest[:, None, :]) | ((rest[:, :, None] == rest[:, None, :]) & later)).sum(2)
    shift = (rank < -total).to(torch.int64) * (d + 1) - (rank >= d + 1 - total).to(torch.int64) * (d + 1)
    rank = (rank + total + shift).clamp(0, d)   # NaN features give ranks out of range: clamped, not indexed
    greedy = greedy + shift.to(f32)
    delta = (e - greedy) * down_factor
    bary = torch.zeros(p, d + 2, dtype=f32, device=dev)
    bary.scatter_add_(1, d - rank, delta)
    bary.scatter_add_(1, d + 1 - rank, -delta)
    weights = torch.cat([bary[:, :1] + (1 + bary[:, d + 1:]), bary[:, 1:d + 1]], 1)
    color = torch.arange(d + 1, device=dev)
    wrap = (rank[:, None, :d] > d - color[None, :, None]).to(torch.int64) * (d + 1)
    keys = as_short(greedy[:, None, :d].to(torch.int64) + color[None, :, None] - wrap)
    return keys, weights


def points_lattice(pos, scale):
    """The GPU op's lattice over the image's points: (slots (P, d + 1) int64, vertex rows 1..M; weights
    (P, d + 1) float32; neighbours (d + 1, 2, M) int64: along each colour the key minus 1 but plus d there,
    and the key plus 1 but minus d there; 0, a row of zeros, where there is none)."""
    d = pos.shape[1]
    keys, weights = gpu_simplex(pos, scale)
    ids, columns, vertex_keys = lattice_vertices(keys)
    m = vertex_keys.shape[0]
    queries = []
    for j in range(d + 1):
        axis = torch.zeros(d, dtype=torch.int64, device=pos.device)
        if j < d:
            axis[j] = d + 1
        queries.append(torch.cat([as_short(vertex_keys - 1 + axis), as_short(vertex_keys + 1 - axis)]))
    neighbours = torch.stack([(rows + 1).reshape(2, m) for rows in lattice_lookup(columns, queries)])
    return (ids + 1).reshape(-1, d + 1), weights, neighbours


def normalized_filter(values, slots, weights, neighbours):
    """The GPU op's Filter(normalize=true) of values (C, P): the values and a ones channel splatted, blurred
    along colours 0..d (me + 0.5 up, then + 0.5 down), sliced; the values x 1 / the ones."""
    c, p = values.shape
    d = slots.shape[1] - 1
    vals = torch.cat([values, torch.ones(1, p, dtype=values.dtype, device=values.device)]).t()
    grid = vals.new_zeros(neighbours.shape[2] + 1, c + 1)
    grid.index_add_(0, slots.reshape(-1), (weights[:, :, None] * vals[:, None, :]).reshape(-1, c + 1))
    for j in range(d + 1):
        blurred = (grid[1:] + 0.5 * grid.index_select(0, neighbours[j, 1])) + 0.5 * grid.index_select(0, neighbours[j, 0])
        grid = torch.cat([grid[:1], blurred])
    out = vals.new_zeros(p, c + 1)
    for j in range(d + 1):
        out = out + weights[:, j:j + 1] * grid.index_select(0, slots[:, j])
    return (out[:, :c] * (1 / out[:, c:])).t()


def grid_positions(sizes, device):
    """(P, len(sizes)) float32: each point's index along every spatial axis, outer axis first."""
    p = math.prod(sizes)
    index = torch.arange(p, device=device)
    columns, stride = [], p
    for size in sizes:
        stride //= size
        columns.append(torch.remainder(torch.div(index, stride, rounding_mode="floor"), size))
    return torch.stack(columns, 1).to(torch.float32)


def bilateral_filter(values, features, stdv_space: float, stdv_color: float, positions: bool):
    """jasonbunk/caffe's BilateralFilter (its GPU forward): values (N, C, *S) filtered over the lattice of
    (positions, features) scaled by (d + 1) sqrt(2/3 / ((i + 1)(i + 2))) / width (stdv_space for positions,
    stdv_color for features), normalized by the filtered ones."""
    n, c = values.shape[0], values.shape[1]
    sizes = list(features.shape[2:])
    p = math.prod(sizes)
    f32, dev = torch.float32, values.device
    k = features.shape[1]
    space = grid_positions(sizes, dev)
    widths = ([stdv_space] * len(sizes) if positions else []) + [stdv_color] * k
    d = len(widths)
    scale = torch.stack([torch.tensor(float(d + 1), dtype=f32, device=dev)
                         * torch.sqrt(torch.tensor(2.0 / 3.0, dtype=f32, device=dev)
                                      / torch.tensor(float((i + 1) * (i + 2)), dtype=f32, device=dev))
                         / torch.tensor(width, dtype=f32, device=dev) for i, width in enumerate(widths)])
    tops = []
    for b in range(n):
        pos = features[b].reshape(k, p).t().to(f32)
        if positions:
            pos = torch.cat([space, pos], 1)
        filtered = normalized_filter(values[b].reshape(c, p).to(f32), *points_lattice(pos, scale))
        tops.append(filtered.reshape(values.shape[1:]))
    return torch.stack(tops).to(values.dtype)


@register_layer("BilateralFilter")
class BilateralFilter(Layer):
    onnx_refusal = ("BilateralFilter's lattice is the mxnet GPU op's (ties rounded down, one scale per feature): "
                    "its ONNX graph is not written")

    def parse(self, lp):
        need_blobs(lp, "BilateralFilter", 2, 1, "values, features")
        p = lp.bilateral_filter_param
        if not p.HasField("stdv_space"):
            raise LayerError("bilateral_filter_param.stdv_space must be set: the fork reads stdv_color only "
                             "with it, and without both its filter has no widths")
        space, color = float(p.stdv_space), float(p.stdv_color)
        if not (space > 0 and color > 0):
            raise LayerError(f"bilateral_filter_param.stdv_space and stdv_color must both be > 0 (the fork's "
                             f"check), got {space:g} and {color:g}")
        return {"stdv_space": space, "stdv_color": color,
                "positions": bool(p.create_spatial_dimension_features)}

    def infer(self, attrs, in_shapes):
        values, feats = (tuple(s) for s in in_shapes)
        if len(values) != len(feats) or len(values) < 3:
            raise LayerError(f"BilateralFilter needs two bottoms of the same number (3 or more) of axes, got "
                             f"{list(values)} and {list(feats)}")
        if values[0] != feats[0] or values[2:] != feats[2:]:
            raise LayerError(f"BilateralFilter's features must share the values' N and spatial sizes "
                             f"{list(values)}, got {list(feats)}")
        d = feats[1] + (len(feats) - 2 if attrs["positions"] else 0)
        if feats[1] < 1 or not 2 <= d <= 16:
            raise LayerError(f"BilateralFilter's lattice has {d} dimensions (positions and feature channels); "
                             f"the fork's GPU op takes 2 to 16")
        return [values]

    def forward(self, attrs, params, values, features):
        return bilateral_filter(values, features, attrs["stdv_space"], attrs["stdv_color"], attrs["positions"])

    def macs(self, attrs, in_shapes, out_shapes):
        n, c = in_shapes[0][:2]
        d = in_shapes[1][1] + len(in_shapes[1]) - 2
        return n * (c + 1) * math.prod(in_shapes[0][2:]) * (d + 1) * 3

    def pytorch_source(self, node, emit):
        for helper in (as_short, lattice_vertex_ids, lattice_lookup, lattice_vertices, gpu_simplex, points_lattice,
                       normalized_filter, grid_positions):
            emit.helper(helper)
        fn = emit.helper(bilateral_filter)
        a = node.attrs
        return (f"{fn}({emit.inputs[0]}, {emit.inputs[1]}, {emit.lit(a['stdv_space'])}, "
                f"{emit.lit(a['stdv_color'])}, {emit.lit(a['positions'])})")


# ---- RBF --------------------------------------------------------------------------------------------

def rbf_forward(x, scalars, widths, centres):
    """jasonbunk/caffe's RBF: x (N, K, H, W) -> (N, I, H, W), top[n, i] = sum_j scalars[i, j]
    exp(-|x[n] - centre[(i,) j]|^2 widths[i, j]^2); centres (J, K) shared or (I, J, K)."""
    n, k, h, w = x.shape
    i_out, j = scalars.shape
    c = centres.reshape(-1, j, k)   # (1 or I, J, K)
    diff = x.reshape(n, 1, 1, k, h * w) - c[None, :, :, :, None]
    distance = (diff * diff).sum(3)   # (N, 1 or I, J, P)
    beta = widths[None, :, :, None]
    terms = torch.exp(-distance * beta * beta) * scalars[None, :, :, None]
    return terms.sum(2).reshape(n, i_out, h, w)


@register_layer("RBF")
class RBF(Layer):
    blob_names = ("scalars", "widths", "centroids")

    def parse(self, lp):
        need_blobs(lp, "RBF", 1, 1)
        p = lp.rbf_param
        return {"num_output": positive_field(p.num_output, "rbf_param.num_output"),
                "centroids": positive_field(p.centroids_per_output, "rbf_param.centroids_per_output"),
                "share": bool(p.share_centroids)}

    def infer(self, attrs, in_shapes):
        x = tuple(in_shapes[0])
        if len(x) != 4 or x[1] < 1:
            raise LayerError(f"RBF needs a 4-axis bottom (N, C, H, W) with channels (the fork's check), got "
                             f"{list(x)}")
        return [(x[0], attrs["num_output"], x[2], x[3])]

    def param_shapes(self, attrs, in_shapes):
        i, j, k = attrs["num_output"], attrs["centroids"], in_shapes[0][1]
        return [(i, j), (i, j), (j, k) if attrs["share"] else (i, j, k)]

    def forward(self, attrs, params, x):
        return rbf_forward(x, *params)

    def macs(self, attrs, in_shapes, out_shapes):
        n, k, h, w = in_shapes[0]
        return n * attrs["num_output"] * attrs["centroids"] * (k + 2) * h * w

    def onnx(self, ctx, node):
        a = node.attrs
        n, k, h, w = ctx.shape(node.inputs[0])
        i, j = a["num_output"], a["centroids"]
        x = ctx.op("Reshape", [node.inputs[0], ctx.i64([n, 1, 1, k, h * w])], "x")
        c = ctx.op("Reshape", [ctx.weight(node, 2), ctx.i64([1, -1, j, k, 1])], "c")
        diff = ctx.op("Sub", [x, c], "diff")
        distance = ctx.op("ReduceSum", [ctx.op("Mul", [diff, diff], "sq"), ctx.i64([3])], "dist", keepdims=0)
        beta = ctx.op("Reshape", [ctx.weight(node, 1), ctx.i64([1, i, j, 1])], "beta")
        scale = ctx.op("Reshape", [ctx.weight(node, 0), ctx.i64([1, i, j, 1])], "s")
        e = ctx.op("Exp", [ctx.op("Mul", [ctx.op("Mul", [ctx.op("Neg", [distance], "neg"), beta], "nb"), beta],
                                      "nbb")], "e")
        total = ctx.op("ReduceSum", [ctx.op("Mul", [e, scale], "t"), ctx.i64([2])], "sum", keepdims=0)
        ctx.add_node("Reshape", [total, ctx.i64([n, i, h, w])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        m = emit.module("torch.nn.ParameterDict()")
        shapes = self.param_shapes(node.attrs, [emit.in_shape(0)])
        for b, (name, shape) in enumerate(zip(self.blob_names, shapes)):
            emit.init(f"{m}['{name}'] = torch.nn.Parameter(torch.zeros({', '.join(map(str, shape))}))")
            emit.param(name, b)
        fn = emit.helper(rbf_forward)
        return f"{fn}({emit.inputs[0]}, " + ", ".join(f"{m}['{name}']" for name in self.blob_names) + ")"


# ---- TestOpenCVPreview ------------------------------------------------------------------------------

@register_layer("TestOpenCVPreview")
class TestOpenCVPreview(Layer):
    reading_note = ("TestOpenCVPreview (jasonbunk/caffe): the fork copies the bottom to the top and shows the "
                    "bottom in an OpenCV window, waiting for a key; read as an identity, nothing is displayed")

    def parse(self, lp):
        need_blobs(lp, "TestOpenCVPreview", 1, 1, in_place=False)
        return {}

    def forward(self, attrs, params, x):
        return x.clone()

    def onnx(self, ctx, node):
        ctx.add_node("Identity", [node.inputs[0]], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        return f"{emit.inputs[0]}.clone()"

