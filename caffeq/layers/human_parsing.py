"""Engineering-Course/caffe_ssl's MaskCreate (b62e3de, src/caffe/layers/mask_create_layer.cpp, last changed in
af29973; the Caffe of Engineering-Course/LIP_SSL's human parsing nets; CPU only, so its GPU forward runs this
one): x (N, num_cls, H, W) -> (N, 1, H, W), each pixel's best class as a float, ties going to the highest
index (a partial_sort of (value, class) pairs with std::greater).  With NaN in a pixel the fork's
order is undefined, and torch and onnxruntime pick differently.

The same fork's pose layers (LIP_SSL's self-supervised structure-sensitive training, pose_evaluate_layer.cpp,
pose_create_layer.cpp, heatmap_error_layer.cpp; CPU only):
- PoseEvaluate: a class map (N, 1, H, W) -> joint centres (N, 1, 1, 2J) [x0, y0, x1, y1, ...]: each pixel's
  class (the value truncated) belongs to at most one joint (num_joint 9, 3 or 2 pick the fork's tables), a
  joint's centre is the mean column and row of its pixels, truncated; (0, 0) without pixels.  The fork never
  clears its pixel lists between images, so image i's centres average the pixels of images 0..i (LIP_SSL
  trains one image per batch); so does caffeq.
- PoseCreate: centres (N, 1, 1, 2J) and a map giving the size -> heatmaps (N, J, H, W), 4 / sqrt(2 pi) *
  exp(-d^2 / 2) around each centre (sigma 1 pixel, in double, then float), all zero for a centre (0, 0).
- HeatmapError: two heatmaps -> (N, 1, 1, 1), scale * sum((a - b)^2) / 2 per image.
"""
import math

import numpy as np
import torch

from .registry import AT_LEAST, Layer, LayerError, four_axes, need_blobs, register_layer


def best_class_last_tie(x):
    """(N, 1, H, W): the channel of each pixel's maximum, the highest channel among equal maxima."""
    last = x.shape[1] - 1
    return (last - x.flip(1).argmax(1, keepdim=True)).to(x.dtype)


@register_layer("MaskCreate")
class MaskCreate(Layer):
    def parse(self, lp):
        need_blobs(lp, "MaskCreate", 1, 1)
        classes = int(lp.mask_create_param.num_cls)
        if classes < 1:
            raise LayerError(f"mask_create_param.num_cls must be >= 1, got {classes}")
        return {"classes": classes}

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "MaskCreate")
        if c != attrs["classes"]:   # Reshape's CHECK
            raise LayerError(f"MaskCreate's bottom has {c} channels, mask_create_param.num_cls {attrs['classes']}")
        return [(n, 1, h, w)]

    def forward(self, attrs, params, x):
        return best_class_last_tie(x)

    def onnx(self, ctx, node):
        best = ctx.add_node("ArgMax", [node.inputs[0]], ctx.tmp(node.name + "_best"), name=node.name, axis=1,
                            keepdims=1, select_last_index=1)
        ctx.add_node("Cast", [best], [node.outputs[0]], to=1)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(best_class_last_tie)}({emit.inputs[0]})"


# class ids of each joint, by num_joint (selectJointFun's three tables)
JOINT_CLASSES = {
    9: [[1, 2, 4, 13], [5, 7, 11], [9, 12], [14], [15], [16], [17], [18], [19]],
    3: [[4], [3], [2]],
    2: [[1], [2]],
}


def joint_centres(x, joint_classes: list):
    """PoseEvaluate (see the module docstring): (N, 1, H, W) class map -> (N, 1, 1, 2J) centres."""
    n, _, h, w = x.shape
    cls = torch.trunc(x.reshape(n, h * w))
    member = torch.stack([sum((cls == k).double() for k in ks) for ks in joint_classes], dim=1)   # (N, J, HW)
    cols = torch.arange(w, dtype=torch.float64, device=x.device).repeat(h)
    rows = torch.arange(h, dtype=torch.float64, device=x.device).repeat_interleave(w)
    count = member.sum(dim=2).cumsum(dim=0)       # the fork's lists keep the earlier images' pixels
    sum_x, sum_y = (member * cols).sum(dim=2).cumsum(dim=0), (member * rows).sum(dim=2).cumsum(dim=0)
    safe = torch.where(count > 0, count, torch.ones_like(count))
    cx = torch.where(count > 0, torch.trunc(sum_x / safe), torch.zeros_like(sum_x))
    cy = torch.where(count > 0, torch.trunc(sum_y / safe), torch.zeros_like(sum_y))
    return torch.stack([cx, cy], dim=2).reshape(n, 1, 1, -1).to(x.dtype)


def joint_heatmaps(centres, height: int, width: int):
    """PoseCreate (see the module docstring): (N, 1, 1, 2J) centres -> (N, J, height, width)."""
    n = centres.shape[0]
    c = torch.trunc(centres.reshape(n, -1, 2).double())
    c = torch.nan_to_num(c, nan=-2.0 ** 31)     # int(NaN) is INT_MIN on the fork's x86: a far centre, all 0
    cx, cy = c[..., 0, None, None], c[..., 1, None, None]
    yy = torch.arange(height, dtype=torch.float64, device=centres.device).reshape(height, 1)
    xx = torch.arange(width, dtype=torch.float64, device=centres.device).reshape(1, width)
    g = (1 / math.sqrt(2 * math.pi)) * torch.exp(-0.5 * ((yy - cy) ** 2 + (xx - cx) ** 2))
    g = g.to(centres.dtype) * 4
    missing = (cx == 0) & (cy == 0)
    return torch.where(missing, torch.zeros_like(g), g)


def heatmap_error(a, b, scale: float):
    """HeatmapError: scale * sum((a - b)^2) / 2 per image, (N, 1, 1, 1)."""
    d = a.reshape(a.shape[0], -1) - b.reshape(b.shape[0], -1)   # flat, as caffe_sub: shapes may differ
    return ((d * d).sum(dim=1) / 2 * scale).reshape(-1, 1, 1, 1)


def _num_joint(p, field, allowed=None):
    j = int(p.num_joint)
    if allowed is not None and j not in allowed:
        raise LayerError(f"{field}.num_joint must be 9, 3 or 2 (the fork's joint tables), got {j}")
    if j < 1:
        raise LayerError(f"{field}.num_joint must be >= 1, got {j}")
    return j


@register_layer("PoseEvaluate")
class PoseEvaluate(Layer):
    def parse(self, lp):
        need_blobs(lp, "PoseEvaluate", 1, 1)
        return {"joints": _num_joint(lp.pose_evaluate_param, "pose_evaluate_param", JOINT_CLASSES)}

    def infer(self, attrs, in_shapes):
        n, c, _, _ = four_axes(in_shapes[0], "PoseEvaluate")
        if c != 1:
            raise LayerError(f"PoseEvaluate reads a one-channel class map, got {list(in_shapes[0])}")
        return [(n, 1, 1, 2 * attrs["joints"])]

    def forward(self, attrs, params, x):
        return joint_centres(x, JOINT_CLASSES[attrs["joints"]])

    def onnx(self, ctx, node):
        x = node.inputs[0]
        n, _, h, w = ctx.shape(x)
        cls = ctx.op("Cast", [ctx.op("Reshape", [x, ctx.i64([n, 1, h * w])], "flat")], "cls", to=7)  # truncates
        member = []
        for ks in JOINT_CLASSES[node.attrs["joints"]]:
            hit = ctx.op("Equal", [cls, ctx.i64([ks[0]])], "is_k")
            for k in ks[1:]:
                hit = ctx.op("Or", [hit, ctx.op("Equal", [cls, ctx.i64([k])], "is_k")], "is_joint")
            member.append(ctx.op("Cast", [hit], "member_j", to=11))
        member = ctx.op("Concat", member, "member", axis=1)                                 # (N, J, HW) double
        cols = ctx.const(np.tile(np.arange(w, dtype=np.float64), h))
        rows = ctx.const(np.repeat(np.arange(h, dtype=np.float64), w))
        zero_axis = ctx.i64(0)

        def total(v, hint):   # per image and joint, accumulated over the earlier images too
            return ctx.op("CumSum", [ctx.op("ReduceSum", [v, ctx.i64([2])], hint + "_sum", keepdims=0), zero_axis],
                          hint)
        count = total(member, "count")
        some = ctx.op("Greater", [count, ctx.const(np.array(0.0))], "some")
        safe = ctx.op("Where", [some, count, ctx.const(np.array(1.0))], "safe")

        def centre(v, hint):
            mean = ctx.op("Div", [total(ctx.op("Mul", [member, v], hint + "_w"), hint + "_total"), safe], hint + "_mean")
            whole = ctx.op("Cast", [ctx.trunc(mean, hint + "_trunc")], hint + "_f", to=1)
            return ctx.op("Unsqueeze", [ctx.op("Where", [some, whole, ctx.f32(0.0)], hint), ctx.i64([2])], hint + "_c")
        xy = ctx.op("Concat", [centre(cols, "cx"), centre(rows, "cy")], "xy", axis=2)
        ctx.add_node("Reshape", [xy, ctx.i64([n, 1, 1, -1])], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(joint_centres)}({emit.inputs[0]}, {JOINT_CLASSES[node.attrs['joints']]!r})"


@register_layer("PoseCreate")
class PoseCreate(Layer):
    def parse(self, lp):
        need_blobs(lp, "PoseCreate", 2, 1, "joint centres, a map giving the size")
        return {"joints": _num_joint(lp.pose_create_param, "pose_create_param")}

    def infer(self, attrs, in_shapes):
        centres, like = tuple(in_shapes[0]), four_axes(in_shapes[1], "PoseCreate", "second bottom")
        j = attrs["joints"]
        if len(centres) != 4 or centres[1:] != (1, 1, 2 * j):
            raise LayerError(f"PoseCreate's centres must be (N, 1, 1, 2 x num_joint = {2 * j}), got {list(centres)}")
        if centres[0] != like[0]:
            raise LayerError(f"PoseCreate's bottoms disagree on N: {centres[0]} vs {like[0]} (the fork reads "
                             f"one set of centres per image of the second)")
        return [(like[0], j, like[2], like[3])]

    def forward(self, attrs, params, centres, like):
        return joint_heatmaps(centres, like.shape[2], like.shape[3])

    def onnx(self, ctx, node):
        centres, like = node.inputs
        n, j, h, w = ctx.shape(node.outputs[0])
        c = ctx.op("Cast", [ctx.op("Cast", [ctx.op("Reshape", [centres, ctx.i64([n, j, 2, 1, 1])], "c")], "c_int", to=7)],
                   "c_d", to=11)
        cx = ctx.op("Gather", [c, ctx.i64(0)], "cx", axis=2)
        cy = ctx.op("Gather", [c, ctx.i64(1)], "cy", axis=2)                                  # (N, J, 1, 1)
        yy = ctx.const(np.arange(h, dtype=np.float64).reshape(h, 1))
        xx = ctx.const(np.arange(w, dtype=np.float64).reshape(1, w))
        dy, dx = ctx.op("Sub", [yy, cy], "dy"), ctx.op("Sub", [xx, cx], "dx")
        d2 = ctx.op("Add", [ctx.op("Mul", [dy, dy], "dy2"), ctx.op("Mul", [dx, dx], "dx2")], "d2")
        e = ctx.op("Exp", [ctx.op("Mul", [d2, ctx.const(np.array(-0.5))], "half")], "e")
        g = ctx.op("Cast", [ctx.op("Mul", [e, ctx.const(np.array(1 / math.sqrt(2 * math.pi)))], "g_d")], "g_f", to=1)
        g4 = ctx.op("Mul", [g, ctx.f32(4.0)], "g4")
        zero = ctx.const(np.array(0.0))
        missing = ctx.op("And", [ctx.op("Equal", [cx, zero], "x0"), ctx.op("Equal", [cy, zero], "y0")], "missing")
        ctx.add_node("Where", [missing, ctx.f32(0.0), g4], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(joint_heatmaps)}({emit.inputs[0]}, {emit.inputs[1]}.shape[2], {emit.inputs[1]}.shape[3])"


@register_layer("HeatmapError")
class HeatmapError(Layer):
    def parse(self, lp):
        need_blobs(lp, "HeatmapError", range(2, AT_LEAST), 1, "prediction, label")
        scale = float(lp.heatmap_error_param.scale)
        if not scale > 0:
            raise LayerError(f"heatmap_error_param.scale must be > 0, got {scale}")
        return {"scale": scale}

    def infer(self, attrs, in_shapes):
        a, b = tuple(in_shapes[0]), tuple(in_shapes[1])
        if not a or math.prod(a[1:]) != math.prod(b[1:]) or a[0] != b[0]:
            raise LayerError(f"HeatmapError's bottoms must hold as many values per image: {list(a)} vs {list(b)}")
        return [(a[0], 1, 1, 1)]

    def forward(self, attrs, params, a, b, *unread):
        return heatmap_error(a, b, attrs["scale"])

    def onnx(self, ctx, node):
        a, b = node.inputs[:2]
        n = ctx.shape(a)[0]
        flat = [ctx.op("Reshape", [v, ctx.i64([n, -1])], "flat") for v in (a, b)]
        d = ctx.op("Sub", flat, "d")
        total = ctx.op("ReduceSum", [ctx.op("Mul", [d, d], "d2"), ctx.i64([1])], "total", keepdims=0)
        half = ctx.op("Div", [total, ctx.f32(2.0)], "half")
        ctx.add_node("Reshape", [ctx.op("Mul", [half, ctx.f32(node.attrs["scale"])], "scaled"),
                                 ctx.i64([n, 1, 1, 1])], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(heatmap_error)}({emit.inputs[0]}, {emit.inputs[1]}, {emit.lit(node.attrs['scale'])})"
