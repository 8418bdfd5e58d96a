"""Virtual pooling's Interp (joechen24/virtual-pooling-caffe 86665f4: src/caffe/layers/interp_layer.cpp and
.cu, include/caffe/layers/interp_layer.hpp).  The fork's caffe.proto has no InterpParameter: its Interp takes
one bottom and no parameters.  An Interp with one bottom and an empty (or absent) interp_param, which
DeepLab's and PSPNet's Interp (interp.py) refuse, is read here.

- Interp: bottom (N, C, H, W) -> top (N, C, 2H, 2W), or (N, C, 2H - 1, 2W - 1) when H is 4 (the fork's
  special case for a map of 7 that a stride-2 convolution made 4; only H is tested).  The linear
  interpolation that undoes a stride-2 convolution, on both axes, corners aligned: top[2i, 2j] = x[i, j];
  top[2i + 1, 2j] = (x[i, j] + x[i + 1, j]) * 0.5; top[2i, 2j + 1] = (x[i, j] + x[i, j + 1]) * 0.5;
  top[2i + 1, 2j + 1] = (((x[i, j] + x[i + 1, j]) + x[i + 1, j + 1]) + x[i, j + 1]) * 0.25 (float32 sums;
  the kernel's double 0.5 and 0.25 round as float32 products do).  That fills a (2H - 1, 2W - 1) map; when
  H is not 4 its last row and last column are repeated once more (the fork writes row 2H - 1 and column
  2W - 1 from x's last row and column, which gives the same values).  CPU and CUDA forwards are the same.
  The fork fixes H and W at setup; caffeq reads them from the bottom's shape.
"""
import torch

from .registry import Layer, claim_layers, four_axes, need_blobs


def interleave_next(a, b, axis: int):
    """a (n + 1 along axis) and b (n along it) interleaved: a0 b0 a1 b1 ... an."""
    n = b.shape[axis]
    if n == 0:
        return a
    pairs = torch.stack([a.narrow(axis, 0, n), b], axis + 1).flatten(axis, axis + 1)
    return torch.cat([pairs, a.narrow(axis, n, 1)], axis)


def virtual_pooling_interp(x):
    """The fork's Interp: x (N, C, H, W) -> (N, C, 2H, 2W), or (2H - 1, 2W - 1) when H is 4."""
    h = x.shape[2]
    rows = (x[:, :, :-1] + x[:, :, 1:]) * 0.5
    cols = (x[:, :, :, :-1] + x[:, :, :, 1:]) * 0.5
    centre = (((x[:, :, :-1, :-1] + x[:, :, 1:, :-1]) + x[:, :, 1:, 1:]) + x[:, :, :-1, 1:]) * 0.25
    top = interleave_next(interleave_next(x, cols, 3), interleave_next(rows, centre, 3), 2)
    if h != 4:
        top = torch.cat([top, top[:, :, -1:]], 2)
        top = torch.cat([top, top[:, :, :, -1:]], 3)
    return top


@claim_layers("Interp", lambda lp: len(lp.bottom) == 1 and not lp.interp_param.ListFields())
class VirtualPoolingInterp(Layer):
    reading_note = ("an Interp without interp_param read as joechen24/virtual-pooling-caffe's (its only "
                    "parameterless form): linear 2x upsampling, corners aligned, the last row and column repeated (none "
                    "when H is 4: 2H - 1 x 2W - 1)")

    def parse(self, lp):
        need_blobs(lp, "Interp", 1, 1, "data")
        return {}

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "Interp")
        return [(n, c, 2 * h - 1, 2 * w - 1) if h == 4 else (n, c, 2 * h, 2 * w)]

    def forward(self, attrs, params, x):
        return virtual_pooling_interp(x)

    def onnx(self, ctx, node):
        x = node.inputs[0]
        _, c, h, w = ctx.shape(x)
        i64, f32 = ctx.i64, ctx.f32

        def part(t, axis, start, end, hint, name=None):
            return ctx.op("Slice", [t, i64([start]), i64([end]), i64([axis])], hint, name=name)

        def interleave(a, b, axis, n, shape_a, hint):
            # a holds n + 1 along axis, b n; shape_a: a's static (C, rows, cols)
            if n == 0:
                return a
            head = part(a, axis, 0, n, hint + "_head")
            split = list(shape_a)
            split[axis - 1] = n
            split.insert(axis, 1)                       # (C, n, 1, cols) or (C, rows, n, 1)
            pair = ctx.op("Concat", [ctx.op("Reshape", [head, i64([0] + split)], hint + "_a"),
                                     ctx.op("Reshape", [b, i64([0] + split)], hint + "_b")], hint + "_pairs",
                          axis=axis + 1)
            merged = list(shape_a)
            merged[axis - 1] = 2 * n
            flat = ctx.op("Reshape", [pair, i64([0] + merged)], hint + "_flat")
            return ctx.op("Concat", [flat, part(a, axis, n, n + 1, hint + "_last")], hint, axis=axis)

        def add(u, v, hint):
            return ctx.op("Add", [u, v], hint)

        top = x
        if w > 1:
            cols = ctx.op("Mul", [add(part(x, 3, 0, w - 1, "left", node.name), part(x, 3, 1, w, "right"), "cols_sum"),
                                  f32(0.5)], "cols")
            top = interleave(x, cols, 3, w - 1, (c, h, w), "even")
        if h > 1:
            upper, lower = part(x, 2, 0, h - 1, "upper"), part(x, 2, 1, h, "lower")
            odd = ctx.op("Mul", [add(upper, lower, "rows_sum"), f32(0.5)], "rows")
            if w > 1:
                s = add(add(part(upper, 3, 0, w - 1, "ul"), part(lower, 3, 0, w - 1, "ll"), "s2"),
                        part(lower, 3, 1, w, "lr"), "s3")
                centre = ctx.op("Mul", [add(s, part(upper, 3, 1, w, "ur"), "s4"), f32(0.25)], "centre")
                odd = interleave(odd, centre, 3, w - 1, (c, h - 1, w), "odd")
            top = interleave(top, odd, 2, h - 1, (c, h, 2 * w - 1), "interleaved")
        if h != 4:
            top = ctx.op("Concat", [top, part(top, 2, 2 * h - 2, 2 * h - 1, "last_row")], "rows_out", axis=2)
            top = ctx.op("Concat", [top, part(top, 3, 2 * w - 2, 2 * w - 1, "last_col")], "cols_out", axis=3)
        ctx.add_node("Identity", [top], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        emit.helper(interleave_next)
        return f"{emit.helper(virtual_pooling_interp)}({emit.inputs[0]})"


__all__ = ["VirtualPoolingInterp", "virtual_pooling_interp"]
