"""synopsys-caffe's ICNetSubgraph (foss-for-synopsys-dwc-arc-processors/synopsys-caffe 977ba36a,
src/caffe/layers/icnet_subgraph_layer.cpp, include/caffe/layers/icnet_subgraph_layer.hpp; no .cu, so the GPU runs
Forward_cpu; the resize is src/caffe/util/interp.cpp's caffe_cpu_interp2, unpacked).

ICNet's pyramid pooling (conv5_3 -> conv5_3_sum of icnet_cityscapes.prototxt) merged into one layer without
parameters, its geometry fixed in LayerSetUp: four AVE poolings, kernels 33x65, 17x33, 13x25, 8x15 and strides
33x65, 16x32, 10x20, 5x10 (height x width), no pad.  Pooled size per axis: ceil((size - kernel) / stride) + 1
(float there, exact here), not clipped (every stride is at most its kernel, so each window starts inside the
map).  A window's sum over its part inside the map is divided by that part's rows x columns.  Each pooled map is
resized back to the bottom's H x W by interp2 (align-corners bilinear, float32 coordinates) and added to the
top, which starts as a copy of the bottom: ((((x + b0) + b1) + b2) + b3).  In place (top == bottom), each branch
pools the sum so far, as the fork's pointers read it.

The top is shaped as the bottom, which must have 4 axes (the fork's CHECK).  A bottom under 4 x 6 gives a branch
an empty pooled axis, which interp2's CHECK refuses in the fork's forward: read and sized, refused to run.  The
fork's Reshape appends the pooled sizes at every call and keeps reading the first ones; caffeq sizes them from
the shapes it sees, which is the same for a net run at the shape it was set up with.

Each branch is linear per axis: torch, ONNX and model.py apply 0/1 window matrices, divide by the window areas,
then the interpolation matrices (columns first, then rows, as interp2 groups its taps).
"""
import torch
from torch import nn

from ..errors import ExportError
from .registry import Layer, LayerError, cached_constant, four_axes, need_blobs, register_layer, torch_sources

# the fork's branch order; 5 matrices per branch (icnet_branch_matrices)
ICNET_BRANCHES = 4
ICNET_MATRICES = 5


def icnet_geometry(branch: int):
    """The fork's LayerSetUp: (kernel_h, kernel_w, stride_h, stride_w) of a branch."""
    kernels = ((33, 65), (17, 33), (13, 25), (8, 15))
    strides = ((33, 65), (16, 32), (10, 20), (5, 10))
    return kernels[branch][0], kernels[branch][1], strides[branch][0], strides[branch][1]


def icnet_pooled_size(size: int, kernel: int, stride: int):
    """ceil((size - kernel) / stride) + 1, pad 0: 0 or less where the map is too small for the branch."""
    return -((kernel - size) // stride) + 1


def icnet_window_sums(size: int, kernel: int, stride: int):
    """(pooled, size): 1 where a window covers a position of the map."""
    pooled = icnet_pooled_size(size, kernel, stride)
    m = torch.zeros(pooled, size)
    for p in range(pooled):
        m[p, p * stride:min(p * stride + kernel, size)] = 1.0
    return m


def icnet_window_lengths(size: int, kernel: int, stride: int):
    """Each window's length inside the map (the fork's hend - hstart with pad 0)."""
    pooled = icnet_pooled_size(size, kernel, stride)
    return torch.tensor([float(min(p * stride + kernel, size) - p * stride) for p in range(pooled)])


def icnet_interp_axis(out_size: int, in_size: int):
    """(out_size, in_size): interp2's two taps per output, at floor(coordinate) and the next (the same one at
    the last input), weighted 1 - lambda and lambda in float32."""
    ratio = torch.tensor(float(in_size - 1)) / torch.tensor(float(out_size - 1)) if out_size > 1 \
        else torch.tensor(0.0)
    coords = ratio * torch.arange(out_size, dtype=torch.float32)   # float32, as interp2's
    low = coords.long()
    high = torch.where(low < in_size - 1, low + 1, low)
    frac = coords - low.float()
    m = torch.zeros(out_size, in_size)
    rows = torch.arange(out_size)
    m.index_put_((rows, low), 1.0 - frac, accumulate=True)
    m.index_put_((rows, high), frac, accumulate=True)
    return m


def icnet_branch_matrices(height: int, width: int, branch: int):
    """[row sums (ph, H), column sums transposed (W, pw), window areas (ph, pw), column interpolation transposed
    (pw, W), row interpolation (H, ph)] of one branch."""
    kh, kw, sh, sw = icnet_geometry(branch)
    ph, pw = icnet_pooled_size(height, kh, sh), icnet_pooled_size(width, kw, sw)
    areas = icnet_window_lengths(height, kh, sh)[:, None] * icnet_window_lengths(width, kw, sw)[None, :]
    return [icnet_window_sums(height, kh, sh), icnet_window_sums(width, kw, sw).t().contiguous(), areas,
            icnet_interp_axis(width, pw).t().contiguous(), icnet_interp_axis(height, ph)]


def icnet_branch_matrix(height: int, width: int, branch: int, index: int):
    return icnet_branch_matrices(height, width, branch)[index]


def icnet_pyramid_sum(x, mats: list, in_place: bool):
    """The fork's forward: x plus each branch's pooled and resized map, in branch order; `mats` holds the
    branches' icnet_branch_matrices one after the other."""
    out = x
    for b in range(len(mats) // 5):
        rows, cols_t, areas, up_cols_t, up_rows = mats[5 * b:5 * b + 5]
        source = out if in_place else x
        pooled = torch.matmul(torch.matmul(rows, source), cols_t) / areas
        out = out + torch.matmul(up_rows, torch.matmul(pooled, up_cols_t))
    return out


class ICNetSubgraph(nn.Module):
    """synopsys-caffe's ICNetSubgraph for an H x W bottom (the interpolation and window matrices as buffers)."""

    def __init__(self, height: int, width: int, in_place: bool):
        super().__init__()
        self.in_place = in_place
        self.count = 0
        for b in range(4):
            for m in icnet_branch_matrices(height, width, b):
                self.register_buffer(f"m{self.count}", m, persistent=False)
                self.count += 1

    def forward(self, x):
        return icnet_pyramid_sum(x, [getattr(self, f"m{i}") for i in range(self.count)], self.in_place)


TORCH_ICNET = torch_sources(icnet_geometry, icnet_pooled_size, icnet_window_sums, icnet_window_lengths,
                            icnet_interp_axis, icnet_branch_matrices, icnet_pyramid_sum)


@register_layer("ICNetSubgraph")
class ICNetSubgraphLayer(Layer):
    def parse(self, lp):
        need_blobs(lp, "ICNetSubgraph", 1, 1)
        return {"name": lp.name, "in_place": lp.top[0] == lp.bottom[0]}

    def infer(self, attrs, in_shapes):
        return [four_axes(in_shapes[0], "ICNetSubgraph")]

    def cannot_run(self, attrs, in_shapes):
        h, w = in_shapes[0][2:]
        for b in range(ICNET_BRANCHES):
            kh, kw, sh, sw = icnet_geometry(b)
            ph, pw = icnet_pooled_size(h, kh, sh), icnet_pooled_size(w, kw, sw)
            if ph < 1 or pw < 1:
                return (f"its pooling branch {b} (kernel {kh} x {kw}, stride {sh} x {sw}) pools a {h} x {w} bottom "
                        f"to {max(ph, 0)} x {max(pw, 0)}, which the fork's interp2 CHECK refuses (the bottom needs "
                        f"at least 4 x 6)")
        return None

    def forward(self, attrs, params, x):
        self.refuse_if_cannot_run(attrs["name"], attrs, [tuple(x.shape)], LayerError)
        h, w = int(x.shape[2]), int(x.shape[3])
        mats = [cached_constant(icnet_branch_matrix, h, w, b, i, device=x.device, dtype=x.dtype)
                for b in range(ICNET_BRANCHES) for i in range(ICNET_MATRICES)]
        return icnet_pyramid_sum(x, mats, attrs["in_place"])

    def onnx(self, ctx, node):
        shape = ctx.shape(node.inputs[0])
        self.refuse_if_cannot_run(node.name, node.attrs, [shape], ExportError)
        x = out = node.inputs[0]
        for b in range(ICNET_BRANCHES):
            rows, cols_t, areas, up_cols_t, up_rows = (ctx.const(m.numpy(), f"{node.name}_b{b}_{hint}") for m, hint in
                                                       zip(icnet_branch_matrices(shape[2], shape[3], b),
                                                           ("rows", "cols", "areas", "up_cols", "up_rows")))
            source = out if node.attrs["in_place"] else x
            summed = ctx.op("MatMul", [ctx.op("MatMul", [rows, source], f"b{b}_row_sums"), cols_t], f"b{b}_sums")
            pooled = ctx.op("Div", [summed, areas], f"b{b}_pooled")
            up = ctx.op("MatMul", [up_rows, ctx.op("MatMul", [pooled, up_cols_t], f"b{b}_up_cols")], f"b{b}_up")
            if b == ICNET_BRANCHES - 1:
                ctx.add_node("Add", [out, up], [node.outputs[0]], name=f"{node.name}/sum{b}")
            else:
                out = ctx.op("Add", [out, up], f"sum{b}")

    def pytorch_source(self, node, emit):
        shape = emit.in_shape(0)
        self.refuse_if_cannot_run(node.name, node.attrs, [shape], ExportError)
        m = emit.instance(ICNetSubgraph, int(shape[2]), int(shape[3]), bool(node.attrs["in_place"]),
                          needs=[TORCH_ICNET])
        return f"{m}({emit.inputs[0]})"


__all__ = ["ICNetSubgraphLayer", "icnet_pyramid_sum"]
