"""SpatialTransformer: Jaderberg et al.'s spatial transformer as daerduoCarey/SpatialTransformerLayer
(cf2a461; src/caffe/layers/st_layer.cpp and st_layer.cu as of 4791d99, `st_param`) writes it for Caffe, a layer
copied unchanged into many forks (rremani/py-faster-rcnn-st, the nets of alenaliu/PPR-FCN), and the
same fork's PowerFile (at the end of this module).

Bottom 0 is the image U (N, C, H, W), bottom 1 the localisation net's theta: per item its values
fill, in order, the entries of the 2 x 3 matrix [[t11, t12, t13], [t21, t22, t23]] that st_param
does not fix (theta_1_1 ... theta_2_3), so bottom 1 holds 6 minus that many values per item.
The top is (N, C, output_H, output_W), output_H and output_W defaulting to the image's H and W.

Output pixel (s, t) has the target coordinates (gs, gt) = (s / output_H * 2 - 1, t / output_W * 2 - 1)
(computed in double, stored as float: the grid covers [-1, 1) without reaching 1) and reads the
image at
    x = (t11 gs + t12 gt + t13 + 1) / 2 * H      (a row),
    y = (t21 gs + t22 gt + t23 + 1) / 2 * W      (a column),
from the taps (floor x, floor y), (floor x + 1, floor y), (floor x, floor y + 1), (floor x + 1,
floor y + 1), in that order, with weights (1 - |x - m|)(1 - |y - n|) written as the kernel writes
them; a tap outside the image adds nothing (zero padding).  These are the GPU kernel's semantics
(SpatialTransformerForwardGPU): the fork's Forward_cpu stops on a CHECK, and would ignore the
fixed entries.  With to_compute_dU: false the fork's backward writes no gradient for the image, only
for theta: caffeq detaches the image.  ONNX gathers the four taps (GatherElements), at any opset.
"""
import re

import numpy as np
import torch

from .optical_flow import bilinear_taps, pixels_at
from .registry import Layer, LayerError, count, four_axes, need_blobs, positive_field, register_layer, torch_sources
from .warp_onnx import OnnxImageSampler

#: st_param's fixed-entry fields, in the order theta's values fill the matrix
THETA_FIELDS = ("theta_1_1", "theta_1_2", "theta_1_3", "theta_2_1", "theta_2_2", "theta_2_3")


def target_grid(size: int, device: torch.device):
    """The fork's output grid along one axis: float(i * 1.0 / size * 2 - 1), computed in double."""
    return (torch.arange(size, dtype=torch.float64, device=device) / size * 2 - 1).to(torch.float32)


def st_full_theta(theta, fixed):
    """(N, 6) matrices: the fixed entries (floats, None where bottom 1 gives it), the rest from theta's
    values in order (full_theta in Forward_gpu)."""
    n = theta.shape[0]
    given = theta.flatten(1)
    cols, k = [], 0
    for value in fixed:
        if value is None:
            cols.append(given[:, k:k + 1])
            k += 1
        else:
            cols.append(torch.full((n, 1), value, dtype=given.dtype, device=given.device))
    return torch.cat(cols, 1)


def spatial_transformer(image, theta, out_h: int, out_w: int, fixed, image_grad: bool):
    """daerduoCarey's SpatialTransformer forward (its GPU kernel): affine grid, bilinear taps."""
    if not image_grad:
        image = image.detach()
    n, h, w = image.shape[0], image.shape[2], image.shape[3]
    a = st_full_theta(theta, fixed).to(image.dtype).reshape(n, 6, 1, 1, 1)
    gs = target_grid(out_h, image.device).to(image.dtype).reshape(1, 1, out_h, 1)
    gt = target_grid(out_w, image.device).to(image.dtype).reshape(1, 1, 1, out_w)
    x = (a[:, 0] * gs + a[:, 1] * gt + a[:, 2] + 1) / 2 * h      # (N, 1, out_h, out_w): rows
    y = (a[:, 3] * gs + a[:, 4] * gt + a[:, 5] + 1) / 2 * w      # columns
    return bilinear_taps(image, x, y, False)


TORCH_ST = torch_sources(target_grid, st_full_theta, spatial_transformer)


def _fixed_count(attrs):
    return sum(v is not None for v in attrs["fixed"])


@register_layer("SpatialTransformer")
class SpatialTransformer(Layer):
    def parse(self, lp):
        need_blobs(lp, "SpatialTransformer", 2, 1, "image, theta", in_place=False)
        p = lp.st_param
        # LayerSetUp: "Transformation type only supports affine now!", "Sampler type only supports bilinear now!"
        if p.transform_type != "affine":
            raise LayerError(f'SpatialTransformer supports st_param.transform_type "affine" only, as the fork, '
                             f'got "{p.transform_type}"')
        if p.sampler_type != "bilinear":
            raise LayerError(f'SpatialTransformer supports st_param.sampler_type "bilinear" only, as the fork, '
                             f'got "{p.sampler_type}"')
        size = [positive_field(getattr(p, f), f"st_param.{f}") if p.HasField(f) else None
                for f in ("output_H", "output_W")]
        # the fork keeps the fixed entries as Dtype (float32)
        fixed = tuple(float(np.float32(getattr(p, f))) if p.HasField(f) else None for f in THETA_FIELDS)
        return {"output_h": size[0], "output_w": size[1], "fixed": fixed, "image_grad": bool(p.to_compute_dU)}

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "SpatialTransformer", "image (bottom 0)")
        theta = tuple(in_shapes[1])
        given, fixed = count(theta, 1), _fixed_count(attrs)
        if given + fixed != 6:
            raise LayerError(f"SpatialTransformer's theta (bottom 1, {list(theta)}) gives {given} values per item "
                             f"and st_param fixes {fixed} entries: together they must make the 6 of the 2 x 3 matrix")
        if not theta or theta[0] != n:
            raise LayerError(f"SpatialTransformer's theta (bottom 1, {list(theta)}) must have the image's "
                             f"{n} items on axis 0")
        attrs["_out"] = (attrs["output_h"] or h, attrs["output_w"] or w)
        return [(n, c) + attrs["_out"]]

    def macs(self, attrs, in_shapes, out_shapes):
        return count(out_shapes[0]) * 4

    def forward(self, attrs, params, image, theta):
        return spatial_transformer(image, theta, *attrs["_out"], attrs["fixed"], attrs["image_grad"])

    def onnx(self, ctx, node):
        image, theta = node.inputs
        out_h, out_w = node.attrs["_out"]
        fixed, given = node.attrs["fixed"], 6 - _fixed_count(node.attrs)
        s = OnnxImageSampler(ctx, node.name, image)
        op, f32, i64 = s.op, s.f32, s.i64
        size = out_h * out_w
        if given:
            theta = op("Reshape", [theta, i64([0, given])], "theta")
        coef, k = [], 0
        for i, value in enumerate(fixed):
            if value is None:
                coef.append(op("Slice", [theta, i64([k]), i64([k + 1]), i64([1])], f"a{i}"))
                k += 1
            else:
                coef.append(f32([[value]]))
        grid = target_grid(out_h, "cpu").numpy(), target_grid(out_w, "cpu").numpy()
        gs = ctx.const(np.repeat(grid[0], out_w).reshape(1, size), node.name + "_gs")
        gt = ctx.const(np.tile(grid[1], out_h).reshape(1, size), node.name + "_gt")

        def source(a, b, c, extent, hint):   # ((a gs + b gt + c) + 1) / 2 * extent, as (N, 1, size)
            p = op("Add", [op("Add", [op("Mul", [a, gs], hint + "_gs"), op("Mul", [b, gt], hint + "_gt")],
                              hint + "_ab"), c], hint + "_p")
            v = op("Mul", [op("Div", [op("Add", [p, f32(1)], hint + "_p1"), f32(2)], hint + "_half"),
                           f32(extent)], hint)
            return op("Reshape", [v, i64([0, 1, size])], hint + "_col")

        x, y = source(*coef[:3], s.h, "x"), source(*coef[3:], s.w, "y")
        m0, n0 = op("Floor", [x], "m0"), op("Floor", [y], "n0")
        m1, n1 = op("Add", [m0, f32(1)], "m1"), op("Add", [n0, f32(1)], "n1")

        def weight(a, b, hint):   # 1 - (a - b), as the kernel writes each tap's factor
            return op("Sub", [f32(1), op("Sub", [a, b], "d" + hint)], "w" + hint)

        wm0, wm1, wn0, wn1 = weight(x, m0, "m0"), weight(m1, x, "m1"), weight(y, n0, "n0"), weight(n1, y, "n1")
        # every item's (C, size) indexes: the batch from the image (theta may give none of the entries)
        batch_c = op("Slice", [op("Shape", [s.flat], "shape"), i64([0]), i64([2])], "nc")
        spread = op("Concat", [batch_c, i64([size])], "spread", axis=0)
        total = None
        for t, (m, k, wm, wk) in enumerate(((m0, n0, wm0, wn0), (m1, n0, wm1, wn0), (m0, n1, wm0, wn1),
                                            (m1, n1, wm1, wn1))):
            inside = s.within(k, m, f"in{t}", True)      # 0 <= column < W, 0 <= row < H
            row = op("Where", [inside, m, f32(0)], f"row{t}")
            col = op("Where", [inside, k, f32(0)], f"col{t}")
            index = op("Cast", [op("Add", [op("Mul", [row, f32(s.w)], f"rw{t}"), col], f"i{t}")], f"i64_{t}", to=7)
            got = op("GatherElements", [s.flat, op("Expand", [index, spread], f"all{t}")], f"v{t}", axis=2)
            term = op("Mul", [op("Mul", [wm, wk], f"w{t}"), got], f"t{t}")
            term = op("Where", [inside, term, f32(0)], f"k{t}")
            total = term if total is None else op("Add", [total, term], f"s{t}")
        ctx.add_node("Reshape", [total, i64([0, s.c, out_h, out_w])], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        emit.helper(pixels_at)
        emit.helper(bilinear_taps)
        fn = emit.helper(TORCH_ST)
        out_h, out_w = node.attrs["_out"]
        return (f"{fn}({emit.inputs[0]}, {emit.inputs[1]}, {out_h}, {out_w}, {node.attrs['fixed']!r}, "
                f"{node.attrs['image_grad']})")


# ---- PowerFile --------------------------------------------------------------------------------
# The same fork's PowerFile (power_file_layer.cpp / .cu): top = bottom + shift, one shift value per
# element of an item (count(1) of them), read at setup with `ifstream >> Dtype` from shift_file, a
# path relative to the working directory; values the file lacks, or a file that cannot be opened,
# leave zeros.  Only the GPU forward exists (its Forward_cpu stops on a CHECK).

SHIFT_FILE_LIMIT = 1 << 24       # bytes of a shift file caffeq reads (the spatial transformers' are 6 numbers)
_NUMBER_PREFIX = re.compile(rb"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


def read_shift_file(path):
    """The numbers `ifstream >> float` reads from the file's start (float32), or None when it cannot
    be opened."""
    try:
        with open(path, "rb") as f:
            data = f.read(SHIFT_FILE_LIMIT + 1)
    except OSError:
        return None
    if len(data) > SHIFT_FILE_LIMIT:
        raise LayerError(f"power_file_param.shift_file: {path} is larger than {SHIFT_FILE_LIMIT} bytes")
    values = []
    for token in data.split():
        m = _NUMBER_PREFIX.match(token)
        if m is None:
            break
        values.append(float(m.group()))
        if m.end() < len(token):   # `>>` read the number's prefix; the rest stops the next read
            break
    return np.asarray(values, np.float32)


@register_layer("PowerFile")
class PowerFile(Layer):
    def parse(self, lp):
        need_blobs(lp, "PowerFile", 1, 1)
        p = lp.power_file_param
        attrs = {"values": np.zeros(0, np.float32), "reading_notes": []}
        if p.HasField("shift_file"):
            values = read_shift_file(p.shift_file)
            if values is None:
                attrs["reading_notes"].append(
                    f"power_file_param.shift_file {p.shift_file!r} cannot be opened (relative to the working "
                    f"directory, as the fork opens it): the shift is all zeros, as the fork then leaves it")
            else:
                attrs["values"] = values
        return attrs

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) < 1:
            raise LayerError("PowerFile needs an input with a batch axis")
        n = count(s[1:])
        shift = np.zeros(n, np.float32)
        given = attrs["values"][:n]
        shift[:len(given)] = given
        attrs["_shift"] = shift.reshape((1,) + s[1:])
        return [s]

    def forward(self, attrs, params, x):
        return x + torch.from_numpy(attrs["_shift"]).to(device=x.device, dtype=x.dtype)

    def onnx(self, ctx, node):
        ctx.add_node("Add", [node.inputs[0], ctx.const(node.attrs["_shift"])], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        module = emit.module(f"{emit.helper(ShiftByBuffer)}({list(node.attrs['_shift'].shape)!r})")
        emit.buffer("shift", node.attrs["_shift"])
        return f"{module}({emit.inputs[0]})"


class ShiftByBuffer(torch.nn.Module):
    """x + shift, the shift a buffer of one item's shape (PowerFile's shift file)."""

    def __init__(self, shape: list):
        super().__init__()
        self.register_buffer("shift", torch.zeros(shape))

    def forward(self, x):
        return x + self.shift
