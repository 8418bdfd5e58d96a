"""synopsys-caffe's TensorFlow-converted layers (foss-for-synopsys-dwc-arc-processors/synopsys-caffe
977ba36a, src/caffe/layers/<name>_layer.cpp; caffe.proto e73a136).

- Squeeze: drops the size-1 axes that squeeze_param.axis lists (negative counts from the end; an
  axis past the last, or of size > 1, is the fork's CHECK failure), or every size-1 axis when it
  lists none.  The data is shared, unchanged.
- HardSwish: x * min(max(x + 3, 0), 6) / 6.
- Pad: tf.pad, constant: paddings holds (before, after) for every axis, the rest is constant_values.
- MirrorPad: the same pads, then mode REFLECT (x[1], x[0] | x[0] ...: the edge not repeated),
  SYMMETRIC (edge repeated) or EDGE (the edge value), innermost axis first, each over the axes
  already padded; CONSTANT (the default) leaves constant_values.  A pad wider than the axis reads
  into the other pad: what the fork's copies, in their order, leave there (constant_values or
  copies already made); pads so wide that the fork would read outside the axis (REFLECT:
  before >= size + after or after >= size + before, SYMMETRIC: > for >=) are refused.
- ResizeNearestNeighbor: TensorFlow's nearest resize of a 4-D NHWC (data_format "NHWC", the
  default) or NCHW blob (any other data_format, as the fork's else branch).  Output size per axis:
  output_height / output_width when set, else floor(input * scale_height / scale_width) in float32.
  Source index of output i, from the float32 scale in / out ((in - 1) / (out - 1) with
  align_corners and out > 1): round-half-away(i * scale) with align_corners, floor(i * scale)
  otherwise, both at most in - 1; floor((i + 0.5) * scale) with half_pixel_centers and
  floor((i + 0.5) * scale - 0.5) with half_pixel_onnx, both clamped to [0, in - 1].
- DepthToSpace: tf.depth_to_space.  NHWC (default): output (h, w, d) reads input channel
  ((h % b) * b + w % b) * D + d at (h / b, w / b); NCHW or DCR: the same channel on an NCHW blob
  (ONNX DCR); CRD: channel (d * b + h % b) * b + w % b (ONNX CRD).
- SpaceToBatchND / BatchToSpaceND: tf.space_to_batch_nd / tf.batch_to_space_nd over axes
  1 .. len(block_shape) of the blob as it is (the zoo's converted nets use block_shape 1, 2, 2 on
  N, C, H, W): zero pads (before, after) per block axis, each axis split into (axis / b, b), the
  block factors moved in front of the batch, the batch axis first in the output; BatchToSpaceND the
  inverse, then crops (before, after) per block axis.

ONNX: Squeeze, Add/Clip/Mul/Div, Pad, Pad + Gather (mirror modes), Gather (nearest), DepthToSpace,
Pad/Reshape/Transpose/Reshape (space to batch), Reshape/Transpose/Reshape/Slice (batch to space).
The fork's DetectionOutput variant with per-level bottoms (no_permute, nbottom, ratio_permute) is
not read.
"""
import math

import numpy as np
import torch
import torch.nn.functional as F

from .registry import FunctionLayer, Layer, LayerError, canonical_axis, need_blobs, register_layer, torch_sources
from .vision_forks import TORCH_RESIZE_BILINEAR, resize_bilinear_size, synopsys_resize_fields, synopsys_resize_hw


def _i64(values):
    return np.asarray(list(values), np.int64)


# ---- Squeeze -------------------------------------------------------------------------------

def synopsys_squeeze_shape(shape: list, axes: list):
    """The fork's top shape: `shape` less its size-1 axes that `axes` lists (canonical), or less
    every size-1 axis when `axes` is empty."""
    return [d for i, d in enumerate(shape) if not (d == 1 and (not axes or i in axes))]


def synopsys_squeeze(x, axes: list):
    return x.reshape(synopsys_squeeze_shape(list(x.shape), axes))


@register_layer("Squeeze")
class Squeeze(Layer):
    def parse(self, lp):
        need_blobs(lp, "Squeeze", 1, 1, in_place=False)
        return {"axis": [int(a) for a in lp.squeeze_param.axis]}

    @staticmethod
    def axes(attrs, shape):
        n = len(shape)
        out = []
        for a in attrs["axis"]:
            if a > n:  # the fork's CHECK_LE before CanonicalAxisIndex
                raise LayerError(f"squeeze_param.axis {a} is past the last axis of a {n}-axis bottom")
            c = canonical_axis(a, n, "squeeze_param.axis")
            if shape[c] != 1:
                raise LayerError(f"squeeze_param.axis {a} has size {shape[c]}, not 1 (bottom {list(shape)})")
            out.append(c)
        return out

    def infer(self, attrs, in_shapes):
        s = list(in_shapes[0])
        return [tuple(synopsys_squeeze_shape(s, self.axes(attrs, s)))]

    def forward(self, attrs, params, x):
        return synopsys_squeeze(x, self.axes(attrs, x.shape))

    def onnx(self, ctx, node):
        s = ctx.shape(node.inputs[0])
        axes = self.axes(node.attrs, s)
        gone = [i for i, d in enumerate(s) if d == 1 and (not axes or i in axes)]
        if not gone:
            ctx.add_node("Identity", [node.inputs[0]], [node.outputs[0]], name=node.name)
            return
        ctx.add_node("Squeeze", [node.inputs[0], ctx.const(_i64(gone))], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        fn = emit.helper(torch_sources(synopsys_squeeze_shape, synopsys_squeeze))
        return f"{fn}({emit.inputs[0]}, {emit.lit(self.axes(node.attrs, emit.in_shape()))})"


# ---- HardSwish -----------------------------------------------------------------------------

def synopsys_hard_swish(x):
    return x * torch.clamp(x + 3.0, 0.0, 6.0) / 6.0


@register_layer("HardSwish")
class HardSwish(FunctionLayer):
    fn = staticmethod(synopsys_hard_swish)

    def onnx(self, ctx, node):
        x, name = node.inputs[0], node.name
        f32 = np.float32
        t = ctx.add_node("Add", [x, ctx.const(np.array(3.0, f32))], [ctx.tmp(name + "_plus3")])[0]
        t = ctx.add_node("Clip", [t, ctx.const(np.array(0.0, f32)), ctx.const(np.array(6.0, f32))],
                         [ctx.tmp(name + "_clip")])[0]
        t = ctx.add_node("Mul", [x, t], [ctx.tmp(name + "_mul")])[0]
        ctx.add_node("Div", [t, ctx.const(np.array(6.0, f32))], [node.outputs[0]], name=name)


# ---- Pad, MirrorPad --------------------------------------------------------------------------

MIRROR_MODES = ("CONSTANT", "REFLECT", "SYMMETRIC", "EDGE")


def mirror_pad_sources(n_in: int, before: int, after: int, mode: str):
    """MirrorPad along one axis of the padded top: for each top index the index whose value the
    fork's copies leave there (its own index where they write nothing), replaying them in order."""
    n_out = n_in + before + after
    src = list(range(n_out))
    last = n_in + before - 1  # the last index holding the input
    for j in range(before):
        if mode == "REFLECT":
            src[before - j - 1] = src[before + j + 1]
        elif mode == "SYMMETRIC":
            src[before - j - 1] = src[before + j]
        elif mode == "EDGE":
            src[before - j - 1] = src[before]
    for j in range(after):
        if mode == "REFLECT":
            src[last + j + 1] = src[last - j - 1]
        elif mode == "SYMMETRIC":
            src[last + j + 1] = src[last - j]
        elif mode == "EDGE":
            src[last + j + 1] = src[last]
    return src


def torch_pad_list(paddings: list):
    """F.pad's list (last axis first) from (before, after) pairs of consecutive axes."""
    out = []
    for i in range(len(paddings) // 2 - 1, -1, -1):
        out += [paddings[2 * i], paddings[2 * i + 1]]
    return out


def synopsys_mirror_pad(x, paddings: list, value: float, mode: str):
    """synopsys-caffe's Pad (mode "CONSTANT") and MirrorPad: paddings = (before, after) per axis."""
    y = F.pad(x, torch_pad_list(paddings), value=value)
    if mode != "CONSTANT":
        for i in range(x.dim() - 1, -1, -1):
            if paddings[2 * i] or paddings[2 * i + 1]:
                src = mirror_pad_sources(x.shape[i], paddings[2 * i], paddings[2 * i + 1], mode)
                y = y.index_select(i, torch.tensor(src, dtype=torch.long, device=y.device))
    return y


@register_layer("Pad")
class Pad(Layer):
    field = "pad_param"

    def parse(self, lp):
        what = self.types[0]
        need_blobs(lp, what, 1, 1, in_place=False)
        p = getattr(lp, self.field)
        pads = [int(v) for v in p.paddings]
        if len(pads) % 2:
            raise LayerError(f"{self.field}.paddings holds {len(pads)} values: it needs (before, after) per axis")
        return {"paddings": pads, "value": float(p.constant_values), "mode": self.mode(p)}

    def mode(self, p):
        return "CONSTANT"

    def infer(self, attrs, in_shapes):
        s, pads = tuple(in_shapes[0]), attrs["paddings"]
        if len(pads) != 2 * len(s):
            fpga = (" (fpga_caffe's Pad, which pads one axis, is read when its pad_param sets pad, pad_val, pad_to "
                    "or axis)") if not pads and self.field == "pad_param" else ""
            raise LayerError(f"{self.field}.paddings holds {len(pads)} values; a {len(s)}-axis bottom "
                             f"needs {2 * len(s)} (before, after per axis){fpga}")
        mode = attrs["mode"]
        for i, d in enumerate(s):
            b, a = pads[2 * i], pads[2 * i + 1]
            # the fork's copies read up to 2b (REFLECT) or 2b - 1 (SYMMETRIC) into the padded axis
            reach = 1 if mode == "REFLECT" else 0
            if mode in ("REFLECT", "SYMMETRIC") and (b + reach > d + a or a + reach > d + b):
                raise LayerError(f"{self.field}: {mode} pads ({b}, {a}) of axis {i} (size {d}) make the fork "
                                 f"read outside the axis")
        return [tuple(d + pads[2 * i] + pads[2 * i + 1] for i, d in enumerate(s))]

    def forward(self, attrs, params, x):
        self.infer(attrs, [x.shape])
        return synopsys_mirror_pad(x, attrs["paddings"], attrs["value"], attrs["mode"])

    def onnx(self, ctx, node):
        a, name = node.attrs, node.name
        x, out = node.inputs[0], node.outputs[0]
        s, pads = ctx.shape(x), a["paddings"]
        mirror = a["mode"] != "CONSTANT" and any(pads)
        y = ctx.tmp(name + "_const") if mirror else out
        onnx_pads = _i64(pads[0::2] + pads[1::2])
        ctx.add_node("Pad", [x, ctx.const(onnx_pads), ctx.const(np.array(a["value"], np.float32))], [y],
                     name=name, mode="constant")
        if not mirror:
            return
        axes = [i for i in range(len(s) - 1, -1, -1) if pads[2 * i] or pads[2 * i + 1]]
        for k, i in enumerate(axes):
            src = mirror_pad_sources(s[i], pads[2 * i], pads[2 * i + 1], a["mode"])
            dst = out if k == len(axes) - 1 else ctx.tmp(f"{name}_axis{i}")
            y = ctx.add_node("Gather", [y, ctx.const(_i64(src))], [dst], axis=i)[0]

    def pytorch_source(self, node, emit):
        a = node.attrs
        emit.helper(mirror_pad_sources)
        emit.helper(torch_pad_list)
        fn = emit.helper(synopsys_mirror_pad)
        return f"{fn}({emit.inputs[0]}, {emit.lit(a['paddings'])}, {emit.lit(a['value'])}, {emit.lit(a['mode'])})"


@register_layer("MirrorPad")
class MirrorPad(Pad):
    field = "mirror_pad_param"

    def mode(self, p):
        m = str(p.mode)
        if m not in MIRROR_MODES:
            raise LayerError(f"mirror_pad_param.mode '{m}' is not one of {', '.join(MIRROR_MODES)} "
                             f"(the fork would leave constant_values there)")
        return m


# ---- ResizeNearestNeighbor ------------------------------------------------------------------

def nearest_sources(n_in: int, n_out: int, mode: str):
    """synopsys-caffe's ResizeNearestNeighbor input index for each output index on one axis, from
    float32 arithmetic as its C++."""
    f32 = torch.float32
    if mode == "align_corners" and n_out > 1:
        scale = torch.tensor(float(n_in - 1), dtype=f32) / torch.tensor(float(n_out - 1), dtype=f32)
    else:
        scale = torch.tensor(float(n_in), dtype=f32) / torch.tensor(float(n_out), dtype=f32)
    i = torch.arange(n_out, dtype=f32)
    if mode == "half_pixel_onnx":
        return torch.floor((i + 0.5) * scale - 0.5).clamp(0, n_in - 1).long()
    if mode == "half_pixel":
        return torch.floor((i + 0.5) * scale).clamp(0, n_in - 1).long()
    src = i * scale
    low = torch.floor(src)
    if mode == "align_corners":  # roundf: halves away from zero (src >= 0)
        low = low + (src - low >= 0.5).to(f32)
    return low.clamp_max(n_in - 1).long()


def synopsys_resize_nearest(x, out_h: int, out_w: int, scale_h: float, scale_w: float, mode: str, nhwc: bool):
    """synopsys-caffe's ResizeNearestNeighbor of a 4-D x (N, H, W, C when nhwc, else N, C, H, W);
    out_h / out_w: the output size (0: floor(input * scale_h / scale_w))."""
    ha, wa = (1, 2) if nhwc else (2, 3)
    h, w = x.shape[ha], x.shape[wa]
    rows = nearest_sources(h, resize_bilinear_size(h, out_h, scale_h), mode).to(x.device)
    cols = nearest_sources(w, resize_bilinear_size(w, out_w, scale_w), mode).to(x.device)
    return x.index_select(ha, rows).index_select(wa, cols)


@register_layer("ResizeNearestNeighbor")
class ResizeNearestNeighbor(Layer):
    def parse(self, lp):
        need_blobs(lp, "ResizeNearestNeighbor", 1, 1, in_place=False)
        p = lp.resize_nearest_neighbor_param
        flags = [f for f in ("align_corners", "half_pixel_centers", "half_pixel_onnx") if getattr(p, f)]
        if len(flags) > 1:
            raise LayerError(f"resize_nearest_neighbor_param: {' and '.join(flags)} exclude each other "
                             f"(the fork checks it)")
        mode = {"align_corners": "align_corners", "half_pixel_centers": "half_pixel",
                "half_pixel_onnx": "half_pixel_onnx"}[flags[0]] if flags else "asymmetric"
        fmt = str(p.data_format)
        a = {"nhwc": fmt == "NHWC", "mode": mode, **synopsys_resize_fields(p, "resize_nearest_neighbor_param")}
        if fmt not in ("NHWC", "NCHW"):
            a["reading_notes"] = [f"ResizeNearestNeighbor data_format '{fmt}' is read as NCHW, as the fork "
                                  f"reads every format but NHWC"]
        return a

    @staticmethod
    def out_hw(a, shape):
        return synopsys_resize_hw(a, shape, "ResizeNearestNeighbor")

    def infer(self, attrs, in_shapes):
        s = in_shapes[0]
        _, _, ho, wo = self.out_hw(attrs, s)
        return [(s[0], ho, wo, s[3]) if attrs["nhwc"] else (s[0], s[1], ho, wo)]

    @staticmethod
    def _call_args(a):
        return a["output_height"], a["output_width"], a["scale_height"], a["scale_width"], a["mode"], a["nhwc"]

    def forward(self, attrs, params, x):
        self.out_hw(attrs, x.shape)
        return synopsys_resize_nearest(x, *self._call_args(attrs))

    def onnx(self, ctx, node):
        a, name = node.attrs, node.name
        h, w, ho, wo = self.out_hw(a, ctx.shape(node.inputs[0]))
        ha = 1 if a["nhwc"] else 2
        rows = nearest_sources(h, ho, a["mode"]).numpy()
        cols = nearest_sources(w, wo, a["mode"]).numpy()
        t = ctx.add_node("Gather", [node.inputs[0], ctx.const(rows)], [ctx.tmp(name + "_rows")], axis=ha)[0]
        ctx.add_node("Gather", [t, ctx.const(cols)], [node.outputs[0]], name=name, axis=ha + 1)

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_RESIZE_BILINEAR)  # resize_bilinear_size
        fn = emit.helper(torch_sources(nearest_sources, synopsys_resize_nearest))
        args = ", ".join(emit.lit(v) for v in self._call_args(node.attrs))
        return f"{fn}({emit.inputs[0]}, {args})"


# ---- DepthToSpace ----------------------------------------------------------------------------

D2S_FORMATS = ("NHWC", "NCHW", "DCR", "CRD")


def synopsys_depth_to_space(x, b: int, fmt: str):
    """tf.depth_to_space as synopsys-caffe: NHWC, NCHW / DCR (block offsets outside the depth) or
    CRD (the depth outside the block offsets)."""
    n = x.shape[0]
    if fmt == "NHWC":
        h, w, c = x.shape[1], x.shape[2], x.shape[3]
        y = x.reshape(n, h, w, b, b, c // (b * b)).permute(0, 1, 3, 2, 4, 5)
        return y.reshape(n, h * b, w * b, c // (b * b))
    c, h, w = x.shape[1], x.shape[2], x.shape[3]
    if fmt == "CRD":
        y = x.reshape(n, c // (b * b), b, b, h, w).permute(0, 1, 4, 2, 5, 3)
    else:
        y = x.reshape(n, b, b, c // (b * b), h, w).permute(0, 3, 4, 1, 5, 2)
    return y.reshape(n, c // (b * b), h * b, w * b)


@register_layer("DepthToSpace")
class DepthToSpace(Layer):
    def parse(self, lp):
        need_blobs(lp, "DepthToSpace", 1, 1, in_place=False)
        p = lp.depth_to_space_param
        if not p.HasField("block_size"):
            raise LayerError("depth_to_space_param.block_size is required")
        b, fmt = int(p.block_size), str(p.data_format)
        if b < 1:
            raise LayerError(f"depth_to_space_param.block_size must be >= 1, got {b}")
        if fmt not in D2S_FORMATS:
            raise LayerError(f"depth_to_space_param.data_format '{fmt}' is not one of {', '.join(D2S_FORMATS)}")
        return {"block_size": b, "format": fmt}

    def infer(self, attrs, in_shapes):
        s, b = tuple(in_shapes[0]), attrs["block_size"]
        if len(s) != 4:
            raise LayerError(f"DepthToSpace needs a 4-axis bottom, got {list(s)}")
        nhwc = attrs["format"] == "NHWC"
        c = s[3] if nhwc else s[1]
        if c % (b * b):
            raise LayerError(f"DepthToSpace: {c} channels are not divisible by block_size² = {b * b}")
        if nhwc:
            return [(s[0], s[1] * b, s[2] * b, c // (b * b))]
        return [(s[0], c // (b * b), s[2] * b, s[3] * b)]

    def forward(self, attrs, params, x):
        self.infer(attrs, [x.shape])
        return synopsys_depth_to_space(x, attrs["block_size"], attrs["format"])

    def onnx(self, ctx, node):
        a, name = node.attrs, node.name
        x, out = node.inputs[0], node.outputs[0]
        mode = "CRD" if a["format"] == "CRD" else "DCR"
        if a["format"] != "NHWC":
            ctx.add_node("DepthToSpace", [x], [out], name=name, blocksize=a["block_size"], mode=mode)
            return
        t = ctx.add_node("Transpose", [x], [ctx.tmp(name + "_nchw")], perm=[0, 3, 1, 2])[0]
        t = ctx.add_node("DepthToSpace", [t], [ctx.tmp(name + "_d2s")], name=name, blocksize=a["block_size"],
                         mode=mode)[0]
        ctx.add_node("Transpose", [t], [out], perm=[0, 2, 3, 1])

    def pytorch_source(self, node, emit):
        a = node.attrs
        fn = emit.helper(synopsys_depth_to_space)
        return f"{fn}({emit.inputs[0]}, {a['block_size']}, {emit.lit(a['format'])})"


# ---- SpaceToBatchND, BatchToSpaceND --------------------------------------------------------

def space_to_batch_perm(m: int, ndim: int):
    """(N, A1 / b1, b1, ..., Am / bm, bm, rest...) -> (b1, ..., bm, N, A1 / b1, ..., Am / bm, rest...)."""
    return [2 * i + 2 for i in range(m)] + [0] + [2 * i + 1 for i in range(m)] + list(range(2 * m + 1, ndim))


def batch_to_space_perm(m: int, ndim: int):
    """(b1, ..., bm, N, A1, ..., Am, rest...) -> (N, A1, b1, ..., Am, bm, rest...)."""
    perm = [m]
    for i in range(m):
        perm += [m + 1 + i, i]
    return perm + list(range(2 * m + 1, ndim))


def space_to_batch_nd(x, block: list, pads: list):
    """tf.space_to_batch_nd over axes 1 .. len(block) of x; pads: (before, after) per block axis."""
    m, rest = len(block), list(x.shape[len(block) + 1:])
    y = F.pad(x, [0, 0] * len(rest) + torch_pad_list(pads))
    split = [y.shape[0]]
    for i in range(m):
        split += [y.shape[i + 1] // block[i], block[i]]
    y = y.reshape(split + rest).permute(space_to_batch_perm(m, len(split) + len(rest)))
    return y.reshape([-1] + [split[2 * i + 1] for i in range(m)] + rest)


def batch_to_space_nd(x, block: list, crops: list):
    """tf.batch_to_space_nd over axes 1 .. len(block) of x; crops: (before, after) per block axis."""
    m, rest = len(block), list(x.shape[len(block) + 1:])
    spatial = [x.shape[i + 1] for i in range(m)]
    y = x.reshape(block + [-1] + spatial + rest).permute(batch_to_space_perm(m, 2 * m + 1 + len(rest)))
    y = y.reshape([-1] + [spatial[i] * block[i] for i in range(m)] + rest)
    for i in range(m):
        y = y.narrow(i + 1, crops[2 * i], spatial[i] * block[i] - crops[2 * i] - crops[2 * i + 1])
    return y


class _BlockLayer(Layer):
    """SpaceToBatchND and BatchToSpaceND: block_shape and (before, after) pairs per block axis."""
    field = pads_field = ""

    def parse(self, lp):
        what = self.types[0]
        need_blobs(lp, what, 1, 1, in_place=False)
        p = getattr(lp, self.field)
        block, pads = [int(v) for v in p.block_shape], [int(v) for v in getattr(p, self.pads_field)]
        if any(b < 1 for b in block):
            raise LayerError(f"{self.field}.block_shape must be >= 1, got {block}")
        if len(pads) != 2 * len(block):
            raise LayerError(f"{self.field}.{self.pads_field} holds {len(pads)} values; {len(block)} block axes "
                             f"need {2 * len(block)} (before, after per axis)")
        return {"block": block, "pads": pads}

    def infer(self, attrs, in_shapes):
        s, block = tuple(in_shapes[0]), attrs["block"]
        if len(block) >= len(s):
            raise LayerError(f"{self.field}.block_shape has {len(block)} axes; a {len(s)}-axis bottom "
                             f"has {len(s) - 1} after the batch")
        return [tuple(self.leading_dims(s, block, attrs["pads"])) + s[len(block) + 1:]]

    def forward(self, attrs, params, x):
        self.infer(attrs, [x.shape])
        return self.fn(x, attrs["block"], attrs["pads"])

    def pytorch_source(self, node, emit):
        for helper in (torch_pad_list, space_to_batch_perm, batch_to_space_perm):
            emit.helper(helper)
        fn = emit.helper(self.fn)
        return f"{fn}({emit.inputs[0]}, {emit.lit(node.attrs['block'])}, {emit.lit(node.attrs['pads'])})"


@register_layer("SpaceToBatchND")
class SpaceToBatchND(_BlockLayer):
    field, pads_field = "space_to_batch_nd_param", "paddings"
    fn = staticmethod(space_to_batch_nd)

    def leading_dims(self, s, block, pads):
        out = [s[0] * math.prod(block)]
        for i, b in enumerate(block):
            d = s[i + 1] + pads[2 * i] + pads[2 * i + 1]
            if d % b:
                raise LayerError(f"{self.field}: block_shape[{i}] = {b} does not divide axis {i + 1} "
                                 f"({s[i + 1]} + paddings {pads[2 * i]} + {pads[2 * i + 1]})")
            out.append(d // b)
        return out

    def onnx(self, ctx, node):
        a, name = node.attrs, node.name
        s, block, pads = ctx.shape(node.inputs[0]), a["block"], a["pads"]
        m, rest = len(block), list(s[len(block) + 1:])
        padded = [s[i + 1] + pads[2 * i] + pads[2 * i + 1] for i in range(m)]
        onnx_pads = [0] + pads[0::2] + [0] * len(rest) + [0] + pads[1::2] + [0] * len(rest)
        y = ctx.add_node("Pad", [node.inputs[0], ctx.const(_i64(onnx_pads))], [ctx.tmp(name + "_pad")],
                         name=name, mode="constant")[0]
        split = [0]   # Reshape's 0: the batch as it is
        for i in range(m):
            split += [padded[i] // block[i], block[i]]
        y = ctx.add_node("Reshape", [y, ctx.const(_i64(split + rest))], [ctx.tmp(name + "_split")])[0]
        y = ctx.add_node("Transpose", [y], [ctx.tmp(name + "_moved")],
                         perm=space_to_batch_perm(m, len(split) + len(rest)))[0]
        out = [-1] + [padded[i] // block[i] for i in range(m)] + rest
        ctx.add_node("Reshape", [y, ctx.const(_i64(out))], [node.outputs[0]])


@register_layer("BatchToSpaceND")
class BatchToSpaceND(_BlockLayer):
    field, pads_field = "batch_to_space_nd_param", "crops"
    fn = staticmethod(batch_to_space_nd)

    def leading_dims(self, s, block, crops):
        total = math.prod(block)
        if s[0] % total:
            raise LayerError(f"{self.field}: the batch {s[0]} is not divisible by the block size {total}")
        out = [s[0] // total]
        for i, b in enumerate(block):
            d = s[i + 1] * b - crops[2 * i] - crops[2 * i + 1]
            if d <= 0:
                raise LayerError(f"{self.field}: crops {crops[2 * i]} + {crops[2 * i + 1]} leave nothing of axis "
                                 f"{i + 1} ({s[i + 1]} x {b})")
            out.append(d)
        return out

    def onnx(self, ctx, node):
        a, name = node.attrs, node.name
        s, block, crops = ctx.shape(node.inputs[0]), a["block"], a["pads"]
        m, rest = len(block), list(s[len(block) + 1:])
        spatial = list(s[1:m + 1])
        y = ctx.add_node("Reshape", [node.inputs[0], ctx.const(_i64(block + [-1] + spatial + rest))],
                         [ctx.tmp(name + "_split")], name=name)[0]
        y = ctx.add_node("Transpose", [y], [ctx.tmp(name + "_moved")],
                         perm=batch_to_space_perm(m, 2 * m + 1 + len(rest)))[0]
        full = [spatial[i] * block[i] for i in range(m)]
        y = ctx.add_node("Reshape", [y, ctx.const(_i64([-1] + full + rest))], [ctx.tmp(name + "_joined")])[0]
        starts = [crops[2 * i] for i in range(m)]
        ends = [full[i] - crops[2 * i + 1] for i in range(m)]
        ctx.add_node("Slice", [y, ctx.const(_i64(starts)), ctx.const(_i64(ends)), ctx.const(_i64(range(1, m + 1)))],
                     [node.outputs[0]])
