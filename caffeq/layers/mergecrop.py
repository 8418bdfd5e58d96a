"""naibaf7/caffe's MergeCrop (2996015, mergecrop_layer.cpp/.cu), the skip connection of its U-Nets
(the TuragaLab connectomics nets): bottom 1 is centre-cropped to bottom 0's spatial size, at
offset (size_1 - size_0) / 2 per axis (integer division), then
- STACK (default): concatenated after bottom 0 along the channels;
- ADD: added to bottom 0 (equal channels).
mergecrop_param.forward (one flag per bottom, default true) zeroes a bottom's part when false;
`backward` only steers gradients.  Any number of spatial axes; the fork has a GPU forward only.

The fork's STACK kernel finds each top channel's source with index arithmetic that is a plain
concatenation only when both bottoms have the same channels (or, for one item, when bottom 1's
channels divide bottom 0's and are no more).  With other counts (the PyGreentea U-Nets stack 86 and 64
channels) it reads other channels, and the nets were trained that way, so caffeq reads what the
kernel reads: top channel c of item n, with g = n (C_a + C_b) + c, comes from bottom 0 channel
g mod C_a of item n when (c div C_a) is even, else from bottom 1 channel g mod C_b of item n.
"""
import torch

from .registry import Layer, LayerError, count, register_layer, torch_sources
from .ssd.common import scalar_tensor

_ADD = 1


def stack_rows(n: int, ca: int, cb: int):
    """The row each top channel reads in (bottom 0 as N*C_a rows, then bottom 1 as N*C_b rows), in
    the fork's STACK kernel order; the second table is what a concatenation would read."""
    g = torch.arange(n * (ca + cb))
    item, c = g // (ca + cb), g % (ca + cb)
    kernel = torch.where((c // ca) % 2 == 0, item * ca + g % ca, n * ca + item * cb + g % cb)
    concat = torch.where(c < ca, item * ca + c, n * ca + item * cb + (c - ca))
    return kernel, concat


def merge_crop(a, b, stack: bool, use_a: bool, use_b: bool):
    """b centre-cropped to a's spatial size, then stacked after a as the fork's kernel reads it
    (a concatenation where the channel counts allow) or added to it."""
    for axis in range(2, a.dim()):
        b = b.narrow(axis, (b.shape[axis] - a.shape[axis]) // 2, a.shape[axis])
    if not use_a:
        a = torch.zeros_like(a)
    if not use_b:
        b = torch.zeros_like(b)
    if not stack:
        return a + b
    n, ca, cb = a.shape[0], a.shape[1], b.shape[1]
    kernel, concat = stack_rows(n, ca, cb)
    if torch.equal(kernel, concat):
        return torch.cat([a, b], 1)
    rows = torch.cat([a.reshape((n * ca,) + a.shape[2:]), b.reshape((n * cb,) + a.shape[2:])])
    return rows.index_select(0, kernel.to(rows.device)).reshape((n, ca + cb) + a.shape[2:])


TORCH_MERGE_CROP = torch_sources(stack_rows, merge_crop)


@register_layer("MergeCrop")
class MergeCrop(Layer):
    bottoms, tops, bottom_roles = 2, 1, "data, the larger map to crop"

    def parse(self, lp):
        attrs = super().parse(lp)
        p = lp.mergecrop_param
        flags = [True, True]
        for i, flag in enumerate(p.forward[:2]):
            flags[i] = bool(flag)
        return dict(attrs, stack=p.operation != _ADD, forward=flags)

    def infer(self, attrs, in_shapes):
        a, b = (tuple(s) for s in in_shapes)
        if len(a) < 3 or len(a) != len(b):
            raise LayerError(f"MergeCrop needs two (N, C, spatial...) bottoms of one rank, got {list(a)} and {list(b)}")
        if a[0] != b[0]:
            raise LayerError(f"MergeCrop needs the same batch in both bottoms, got {a[0]} and {b[0]}")
        if any(sb < sa for sa, sb in zip(a[2:], b[2:])):
            raise LayerError(f"MergeCrop crops bottom 1 {list(b)} to bottom 0's size {list(a[2:])}: it is smaller")
        ca, cb = a[1], b[1]
        if not attrs["stack"]:
            if ca != cb:
                raise LayerError(f"MergeCrop ADD needs equal channels, got {ca} and {cb}")
            return [a]
        return [(a[0], ca + cb) + a[2:]]

    def macs(self, attrs, in_shapes, out_shapes):
        return 0 if attrs["stack"] else count(out_shapes[0])

    def forward(self, attrs, params, a, b):
        return merge_crop(a, b, attrs["stack"], *attrs["forward"])

    def onnx(self, ctx, node):
        a, b = node.inputs
        sa, sb = ctx.shape(a), ctx.shape(b)
        name = node.name
        axes = list(range(2, len(sa)))
        starts = [(sb[i] - sa[i]) // 2 for i in axes]

        crop = ctx.add_node("Slice", [b, ctx.i64(starts), ctx.i64([s + sa[i] for s, i in zip(starts, axes)]),
                                      ctx.i64(axes)], [ctx.tmp(name + "_crop")], name=name)[0]
        parts = []
        for tensor, used in ((a, node.attrs["forward"][0]), (crop, node.attrs["forward"][1])):
            if not used:
                shape = ctx.add_node("Shape", [tensor], [ctx.tmp(name + "_shape")])[0]
                tensor = ctx.add_node("ConstantOfShape", [shape], [ctx.tmp(name + "_zeros")],
                                      value=scalar_tensor(0.0))[0]
            parts.append(tensor)
        if not node.attrs["stack"]:
            ctx.add_node("Add", parts, [node.outputs[0]])
            return
        n, ca, cb = sa[0], sa[1], sb[1]
        kernel, concat = stack_rows(n, ca, cb)
        if torch.equal(kernel, concat):
            ctx.add_node("Concat", parts, [node.outputs[0]], axis=1)
            return
        # the kernel's reading: both bottoms as rows of channels, one Gather of the rows it reads
        flat = [ctx.op("Reshape", [t, ctx.i64([n * c] + list(sa[2:]))], "rows") for t, c in zip(parts, (ca, cb))]
        rows = ctx.op("Concat", flat, "all_rows", axis=0)
        picked = ctx.op("Gather", [rows, ctx.i64(kernel.tolist())], "picked", axis=0)
        ctx.add_node("Reshape", [picked, ctx.i64([n, ca + cb] + list(sa[2:]))], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        use_a, use_b = node.attrs["forward"]
        emit.helper(TORCH_MERGE_CROP)
        return (f"merge_crop({emit.inputs[0]}, {emit.inputs[1]}, {emit.lit(node.attrs['stack'])}, "
                f"{emit.lit(use_a)}, {emit.lit(use_b)})")

