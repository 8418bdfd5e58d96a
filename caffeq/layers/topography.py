"""pulkitag/caffe's Topography (6466324c src/caffe/layers/topography_layer.cpp, util/imchannel2col.cpp; the
V1 TOPOGRAPHY of its 2014 CIFAR nets).

Each group's C / group channels are a S x S grid (channel r S + q; C / group must be a perfect square), and
at every pixel the top is the grid's circular cross-correlation with one k x k kernel (blob 0, (1, 1, k, k),
shared by every group, pixel and bottom; no bias):
    top[n, g S^2 + h S + w, i, j] = sum over a, b of W[a, b] * bottom[n, g S^2 + ((h - p + a) mod S) S
                                                                        + ((w - p + b) mod S), i, j],
p = (k - 1) / 2, the modulus non-negative (nothing is zero-padded; it wraps even when k > S).  The fork
computes it as one GEMM of the kernel (1 x k^2, row a k + b) with the gathered columns, as here.  kernel_size
is required and odd; pad, stride, kernel_h/w and engine are read by nothing.  Each bottom makes its own top.
Without a stored blob the kernel starts as the fork's normalized Gaussian (is_gaussian_topo, the default, with
gaussian_sd); without is_gaussian_topo caffeq's random weights draw it from N(0, 0.01^2), not the fork's
filler.  smooth_output: false (its later commits) copies the bottom.
"""
import math

import numpy as np
import torch

from .registry import AT_LEAST, Layer, LayerError, four_axes, need_blobs, register_layer


def topography_gather_index(channels: int, group: int, k: int):
    """(k^2 * C,) channel indices: for kernel entry (a, b), the source channel of each top channel."""
    side = math.isqrt(channels // group)
    pad = (k - 1) // 2
    index = []
    for a in range(k):
        for b in range(k):
            for g in range(group):
                for h in range(side):
                    for w in range(side):
                        index.append(g * side * side + (h - pad + a) % side * side + (w - pad + b) % side)
    return index


# ---- torch (copied into model.py) ------------------------------------------------------------------

def topography(x, kernel, index):
    """Sum over the k^2 kernel entries of W[a, b] times the channel-shifted bottom, as one matrix product."""
    n, c = x.shape[:2]
    taps = kernel.numel()
    shifted = x.index_select(1, index).reshape(n, taps, -1)                  # (N, k^2, C H W)
    return torch.matmul(kernel.reshape(1, taps), shifted).reshape(x.shape)


def gaussian_kernel(k: int, sd: float):
    """caffe_gaussian_kernel: exp(-((c - k/2)^2 + (r - k/2)^2) / (2 sd^2)), normalized to sum 1."""
    centre = k // 2
    grid = np.arange(k, dtype=np.float64) - centre
    w = np.exp(-(grid[None, :] ** 2 + grid[:, None] ** 2) / (2.0 * sd * sd))
    return (w / w.sum()).astype(np.float32).reshape(1, 1, k, k)


@register_layer("Topography")
class Topography(Layer):
    blob_names = ("kernel",)

    def parse(self, lp):
        need_blobs(lp, "Topography", range(1, AT_LEAST), len(lp.bottom) or None)
        p = lp.topography_param
        if not p.HasField("kernel_size"):
            raise LayerError("topography_param.kernel_size is required")
        k, group = int(p.kernel_size), int(p.group)
        if k <= 0 or k % 2 == 0:
            raise LayerError(f"topography_param.kernel_size must be odd and > 0, got {k}")
        if group <= 0:
            raise LayerError(f"topography_param.group must be > 0, got {group}")
        if p.is_gaussian_topo and (p.gaussian_sd == 0 or math.isnan(p.gaussian_sd)):
            raise LayerError("topography_param.gaussian_sd must be set (not 0) with is_gaussian_topo (the fork's "
                             "kernel sum is then not > 0 and it aborts)")
        return {"kernel_size": k, "group": group, "smooth": bool(p.smooth_output),
                "gaussian_sd": float(p.gaussian_sd) if p.is_gaussian_topo else None}

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "Topography")
        if any(tuple(s) != tuple(in_shapes[0]) for s in in_shapes[1:]):
            raise LayerError(f"Topography's bottoms must share one shape, got {[list(s) for s in in_shapes]}")
        if c % attrs["group"]:
            raise LayerError(f"Topography: {c} channels do not divide into {attrs['group']} groups")
        side = math.isqrt(c // attrs["group"])
        if side * side != c // attrs["group"] or side == 0:
            raise LayerError(f"Topography needs a perfect square of channels per group, got {c // attrs['group']}")
        attrs["_index"] = topography_gather_index(c, attrs["group"], attrs["kernel_size"])
        return [tuple(s) for s in in_shapes]

    def param_shapes(self, attrs, in_shapes):
        k = attrs["kernel_size"]
        return [(1, 1, k, k)]

    def init_params(self, attrs, shapes, rng):
        if attrs["gaussian_sd"] is not None:
            return [gaussian_kernel(attrs["kernel_size"], attrs["gaussian_sd"])]
        return [rng.standard_normal(shapes[0]).astype(np.float32) * np.float32(0.01)]

    def forward(self, attrs, params, *xs):
        if not attrs["smooth"]:
            return tuple(x.clone() for x in xs) if len(xs) > 1 else xs[0].clone()
        index = torch.tensor(attrs["_index"], device=xs[0].device)
        tops = tuple(topography(x, params[0], index) for x in xs)
        return tops if len(tops) > 1 else tops[0]

    def onnx(self, ctx, node):
        a = node.attrs
        for i, (x, out) in enumerate(zip(node.inputs, node.outputs)):
            if not a["smooth"]:
                ctx.add_node("Identity", [x], [out])
                continue
            n, c, h, w = ctx.shape(x)
            taps = a["kernel_size"] ** 2
            index = ctx.i64(a["_index"])
            shifted = ctx.op("Gather", [x, index], f"shifted{i}", axis=1)
            columns = ctx.op("Reshape", [shifted, ctx.i64([n, taps, c * h * w])], f"columns{i}")
            row = ctx.op("Reshape", [ctx.weight(node, 0), ctx.i64([1, taps])], f"kernel_row{i}")
            product = ctx.op("MatMul", [row, columns], f"product{i}")
            ctx.add_node("Reshape", [product, ctx.i64([n, c, h, w])], [out], name=node.name)

    def pytorch_source(self, node, emit):
        a = node.attrs
        if not a["smooth"]:
            tops = [f"{x}.clone()" for x in emit.inputs]
            return tops if len(tops) > 1 else tops[0]
        kernel = emit.module(f"nn.Parameter(torch.zeros({(1, 1, a['kernel_size'], a['kernel_size'])}))")
        emit.param("", 0)
        index = emit.module(f"torch.tensor({a['_index']})", attr=f"{emit.attr}_index")
        fn = emit.helper(topography)
        tops = [f"{fn}({x}, {kernel}, {index}.to({x}.device))" for x in emit.inputs]
        return tops if len(tops) > 1 else tops[0]


__all__ = ["Topography", "gaussian_kernel", "topography", "topography_gather_index"]
