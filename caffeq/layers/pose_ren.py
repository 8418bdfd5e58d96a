"""Pose-REN's region layers (xinghaochen/Pose-REN 7bb908f): GenerateROI (src/libs/generate_roi_layer.cpp)
and the Python layer python_layers.py_generate_roi_layer.PyGenerateROILayer, which computes the same
boxes (its param_str holds the same six values).  caffeq never imports the Python module.

For each image n, with (u, v) the x, y of joint joint_idx of its pose row (normalized to [-1, 1]; the
row holds 3 values per joint), a box roi_w * spatial_mul wide and roi_h * spatial_mul high centred at
((u + 1) img_w / 2, (v + 1) img_h / 2), shifted back inside [0, img_w - 1] x [0, img_h - 1] (first past
the left or top edge, then past the right or bottom one): top row n = [n, x1, y1, x2, y2], (N, 5), in
float32 as the C++ layer.
"""
import math

import torch

from .param_str import parse_param_str
from .registry import Layer, LayerError, need_blobs, register_layer

_FIELDS = ("joint_idx", "roi_h", "roi_w", "img_h", "img_w", "spatial_mul")


def pose_rois(poses, joint: int, roi_h: int, roi_w: int, img_h: int, img_w: int, spatial_mul: float):
    """GenerateROILayer::Forward_cpu: (N, 5) boxes around one joint of each image's pose."""
    f32 = torch.float32
    flat = poses.reshape(poses.shape[0], -1).to(f32)
    u, v = flat[:, 3 * joint], flat[:, 3 * joint + 1]
    mul = torch.tensor(spatial_mul, dtype=f32)
    half_w, half_h = torch.tensor(roi_w, dtype=f32) * mul / 2, torch.tensor(roi_h, dtype=f32) * mul / 2
    width, height = torch.tensor(roi_w, dtype=f32) * mul, torch.tensor(roi_h, dtype=f32) * mul

    def axis(c, size, half, extent):
        centre = (c + 1) * size / 2
        lo, hi = centre - half, centre + half
        left = lo < 0
        lo, hi = torch.where(left, torch.zeros_like(lo), lo), torch.where(left, extent.expand_as(hi), hi)
        right = hi >= size - 1
        hi = torch.where(right, torch.full_like(hi, size - 1), hi)
        return torch.where(right, hi - extent, lo), hi

    x1, x2 = axis(u, img_w, half_w, width)
    y1, y2 = axis(v, img_h, half_h, height)
    index = torch.arange(flat.shape[0], dtype=f32, device=flat.device)
    return torch.stack([index, x1, y1, x2, y2], dim=1).to(poses.dtype)


@register_layer("GenerateROI")
class GenerateROI(Layer):
    def parse(self, lp):
        need_blobs(lp, lp.type, 1, 1, "poses")
        return self._checked({f: getattr(lp.generate_roi_param, f) for f in _FIELDS})

    @staticmethod
    def _checked(values):
        a = {f: (float(values[f]) if f == "spatial_mul" else int(values[f])) for f in _FIELDS}
        if a["joint_idx"] < 0:
            raise LayerError(f"joint_idx must be >= 0, got {a['joint_idx']}")
        return a

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        joints = math.prod(s[1:]) // 3
        if attrs["joint_idx"] >= joints:
            raise LayerError(f"joint_idx {attrs['joint_idx']} is past the {joints} joints of the pose {list(s)}")
        return [(s[0], 5)]

    def forward(self, attrs, params, poses):
        return pose_rois(poses, *(attrs[f] for f in _FIELDS))

    def onnx(self, ctx, node):
        a, poses = node.attrs, node.inputs[0]
        n = int(ctx.shape(poses)[0])
        flat = ctx.op("Reshape", [poses, ctx.i64([0, -1])], "flat")
        mul = float(a["spatial_mul"])
        columns = [ctx.op("Reshape", [ctx.f32(list(range(n))), ctx.i64([-1, 1])], "index")]
        ends = {}
        for axis, offset, size, roi in (("x", 0, a["img_w"], a["roi_w"]), ("y", 1, a["img_h"], a["roi_h"])):
            extent = ctx.f32(float(torch.tensor(roi, dtype=torch.float32) * torch.tensor(mul, dtype=torch.float32)))
            half = ctx.op("Div", [extent, ctx.f32(2.0)], f"{axis}_half")
            c = ctx.op("Gather", [flat, ctx.i64([3 * a["joint_idx"] + offset])], f"{axis}_joint", axis=1)
            centre = ctx.op("Div", [ctx.op("Mul", [ctx.op("Add", [c, ctx.f32(1.0)], f"{axis}_plus1"),
                                                   ctx.f32(float(size))], f"{axis}_scaled"), ctx.f32(2.0)],
                            f"{axis}_centre")
            lo, hi = ctx.op("Sub", [centre, half], f"{axis}_lo"), ctx.op("Add", [centre, half], f"{axis}_hi")
            left = ctx.op("Less", [lo, ctx.f32(0.0)], f"{axis}_left")
            lo = ctx.op("Where", [left, ctx.f32(0.0), lo], f"{axis}_lo_in")
            hi = ctx.op("Where", [left, extent, hi], f"{axis}_hi_in")
            edge = ctx.f32(float(size - 1))
            right = ctx.op("Not", [ctx.op("Less", [hi, edge], f"{axis}_below")], f"{axis}_right")
            hi = ctx.op("Where", [right, edge, hi], f"{axis}_hi_out")
            lo = ctx.op("Where", [right, ctx.op("Sub", [hi, extent], f"{axis}_back"), lo], f"{axis}_lo_out")
            ends[axis] = (lo, hi)
        columns += [ends["x"][0], ends["y"][0], ends["x"][1], ends["y"][1]]
        ctx.add_node("Concat", columns, [node.outputs[0]], name=node.name, axis=1)

    def pytorch_source(self, node, emit):
        a = node.attrs
        args = ", ".join(emit.lit(a[f]) for f in _FIELDS)
        return f"{emit.helper(pose_rois)}({emit.inputs[0]}, {args})"


@register_layer("Python:python_layers.py_generate_roi_layer.PyGenerateROILayer")
class PyGenerateROI(GenerateROI):
    def parse(self, lp):
        need_blobs(lp, "PyGenerateROILayer", 1, 1, "poses")
        values = parse_param_str(lp.python_param.param_str)
        missing = [f for f in _FIELDS if f not in values]
        if missing:
            raise LayerError(f"python_param.param_str: PyGenerateROILayer needs {', '.join(missing)}")
        return self._checked(values)
