"""zlmzju/caffe 67b1536 (itn branch; LianaWang/itn's caffe submodule): TransformOffset and TransformAnchor,
src/caffe/layers/transform_{offset,anchor}_layer.cpp (Reshape) and .cu (matrix_to_offset, matrix_to_anchor;
GPU only, the CPU forwards are empty stubs).  transform_offset_param = 8888889 { num_output = 1 },
transform_anchor_param = 8888890 { stride = 1 [16] (read, never used), kernel_size = 2 [7] }.

The bottom holds, per location, the first 8 entries of a 3x3 matrix (T0 + 1, T1, T2; T3, T4 + 1, T5;
T6, T7, 1) in its channels 0-7 (more channels are never read; fewer would be read past the sample).
Each output pair maps a point (x, y) through the affine part (the kernels fix z to 1, T6 and T7 unused):
  x' = (T0 + 1) x + T1 y + T2,  y' = T3 x + (T4 + 1) y + T5,
in the kernel's types: T0 + 1.0 is a double, T1 y a float32 product, the sum double, x' stored as float32.
TransformOffset: top (N, num_output, H, W), k = (int) sqrt(num_output / 2); pair c is the tap
(x, y) = (c % k - (k - 1) / 2, (c / k) % k - (k - 1) / 2) and channels 2c, 2c + 1 are y' - y, x' - x (the
deformable convolution's (h, w) offsets).  TransformAnchor: top (N, 8, H, W); pair c is the box corner
(x, y) = s (-1, -1), s (1, -1), s (1, 1), s (-1, 1), s = (kernel_size - 1) / 2, and channels 2c, 2c + 1
are x' - a_x, y' - a_y with a = (0, 0), (1, 0), (1, 1), (0, 1).
The product (T0 + 1) x (and (T4 + 1) y) is exact in double when T0 is 0 or |T0| >= 2^(b - 29), b the
significant bits of x (b = 2 for ITN's taps and corners up to 3), so nvcc's fused multiply-add there gives the
same double as separate operations; below that a fused sum can differ by a double rounding (rarely the float32).
"""
import dataclasses
import math

import numpy as np
import torch

from ..errors import ExportError
from .conv import check_groups
from .deformable_conv import DeformableConvolution, deformable_out_hw
from .deformable_conv_onnx import onnx_deformable_conv
from .param_str import parse_param_str
from .registry import (
    Layer,
    LayerError,
    ReadOnlyLayer,
    claim_layers,
    four_axes,
    need_blobs,
    register_layer,
    torch_sources,
)

F32 = np.float32
MATRIX_CHANNELS = 8
ANCHOR_PAIRS = 4     # the 4 box corners


def itn_points(kernel: int, pairs: int, anchor: bool, device=None):
    """(x, y, subtracted x, subtracted y), each (1, pairs, 1, 1) float32: the points the kernel maps and what
    it takes from each mapped point, as matrix_to_anchor / matrix_to_offset compute them."""
    center = torch.tensor((kernel - 1.0) / 2.0, dtype=torch.float32, device=device)
    if anchor:
        box = torch.tensor([[-1.0, -1.0], [1.0, -1.0], [1.0, 1.0], [-1.0, 1.0]], device=device)
        x, y = box[:, 0] * center, box[:, 1] * center
        corner = torch.tensor([[0.0, 0.0], [1.0, 0.0], [1.0, 1.0], [0.0, 1.0]], device=device)
        sub_x, sub_y = corner[:, 0], corner[:, 1]
    else:
        tap = torch.arange(pairs, device=device)
        x = (tap % kernel).to(torch.float32) - center
        y = ((tap // kernel) % kernel).to(torch.float32) - center
        sub_x, sub_y = x, y
    return tuple(v.reshape(1, pairs, 1, 1) for v in (x, y, sub_x, sub_y))


def itn_transform(matrix, kernel: int, pairs: int, anchor: bool):
    """The fork's forward: (N, >= 8, H, W) matrices -> (N, 2 pairs, H, W), pairs (x' - a_x, y' - a_y) for the
    anchor, (y' - y, x' - x) for the offsets."""
    x, y, sub_x, sub_y = itn_points(kernel, pairs, anchor, matrix.device)
    t = [matrix[:, i:i + 1] for i in range(6)]
    new_x = ((t[0].double() + 1.0) * x.double() + (t[1] * y).double() + t[2].double()).to(matrix.dtype)
    new_y = ((t[3] * x).double() + (t[4].double() + 1.0) * y.double() + t[5].double()).to(matrix.dtype)
    first, second = (new_x - sub_x, new_y - sub_y) if anchor else (new_y - sub_y, new_x - sub_x)
    n, _, h, w = matrix.shape
    return torch.stack([first, second], dim=2).reshape(n, 2 * pairs, h, w)


class _ItnTransform(Layer):
    anchor = False

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], self.type_name, "matrix bottom")
        if c < MATRIX_CHANNELS:
            raise LayerError(f"{self.type_name} reads 8 matrix channels (T0-T7) per location, got a bottom of "
                             f"{c} channels {list(in_shapes[0])} (the fork would read past the sample)")
        return [(n, 2 * attrs["pairs"], h, w)]

    def forward(self, attrs, params, matrix):
        return itn_transform(matrix, attrs["kernel"], attrs["pairs"], self.anchor)

    def onnx(self, ctx, node):
        from onnx import TensorProto
        x, y, sub_x, sub_y = (v.numpy() for v in itn_points(node.attrs["kernel"], node.attrs["pairs"],
                                                               self.anchor))
        t = [ctx.op("Slice", [node.inputs[0], ctx.i64([i]), ctx.i64([i + 1]), ctx.i64([1])], f"t{i}",
                    name=node.name if i == 0 else None) for i in range(6)]

        def double(v, hint):
            return ctx.op("Cast", [v], hint, to=TensorProto.DOUBLE)

        def plus_one_times(ti, point, hint):     # (T + 1.0) * point, in double
            return ctx.op("Mul", [ctx.op("Add", [double(ti, f"{hint}_d"), ctx.const(np.float64(1.0))],
                                         f"{hint}_plus1"), ctx.const(point.astype(np.float64))], f"{hint}_scaled")

        def float_times(ti, point, hint):        # the float32 product, then double
            return double(ctx.op("Mul", [ti, ctx.const(point)], f"{hint}_f"), f"{hint}_prod")

        def mapped(a, b, shift, hint):
            s = ctx.op("Add", [ctx.op("Add", [a, b], f"{hint}_ab"), double(shift, f"{hint}_shift")], f"{hint}_d")
            return ctx.op("Cast", [s], hint, to=TensorProto.FLOAT)

        new_x = mapped(plus_one_times(t[0], x, "x0"), float_times(t[1], y, "x1"), t[2], "new_x")
        new_y = mapped(float_times(t[3], x, "y0"), plus_one_times(t[4], y, "y1"), t[5], "new_y")
        out_x = ctx.op("Sub", [new_x, ctx.const(sub_x)], "out_x")
        out_y = ctx.op("Sub", [new_y, ctx.const(sub_y)], "out_y")
        first, second = (out_x, out_y) if self.anchor else (out_y, out_x)
        pairs = ctx.op("Concat", [ctx.op("Unsqueeze", [first, ctx.i64([2])], "first"),
                                  ctx.op("Unsqueeze", [second, ctx.i64([2])], "second")], "pairs", axis=2)
        h, w = ctx.shape(node.inputs[0])[2:]
        ctx.add_node("Reshape", [pairs, ctx.i64([0, 2 * node.attrs["pairs"], int(h), int(w)])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        a = node.attrs
        return f"{emit.helper(torch_sources(itn_points, itn_transform))}({emit.inputs[0]}, {a['kernel']}, {a['pairs']}, {self.anchor})"


@register_layer("TransformOffset")
class TransformOffset(_ItnTransform):
    type_name = "TransformOffset"

    def parse(self, lp):
        need_blobs(lp, "TransformOffset", 1, 1, "matrix", in_place=False)
        c = int(lp.transform_offset_param.num_output)
        if c < 2 or c % 2:
            raise LayerError(f"transform_offset_param.num_output must be even and >= 2 (an (h, w) offset per "
                             f"kernel tap; the fork writes past its top or divides by a 0 kernel otherwise), "
                             f"got {c}")
        # the fork's (int) sqrt(C / 2); a count that is not a square wraps around the k x k taps
        return {"num_output": c, "pairs": c // 2, "kernel": math.isqrt(c // 2)}


@register_layer("TransformAnchor")
class TransformAnchor(_ItnTransform):
    type_name = "TransformAnchor"
    anchor = True

    def parse(self, lp):
        need_blobs(lp, "TransformAnchor", 1, 1, "matrix", in_place=False)
        p = lp.transform_anchor_param
        kernel = int(np.array(p.kernel_size, np.uint32).astype(np.int32))     # the fork keeps it in an int
        return {"kernel": kernel, "pairs": ANCHOR_PAIRS, "stride": float(F32(p.stride))}


def _zlmzju_deformable(lp):
    """zlmzju's DeformableConvolution: convolution_param only (SAR_plane's and Xdet's read
    deformable_convolution_param)."""
    return lp.HasField("convolution_param") and not lp.HasField("deformable_convolution_param")


@claim_layers("DeformableConvolution", _zlmzju_deformable)
class ZlmzjuDeformableConvolution(DeformableConvolution):
    """zlmzju/caffe's DeformableConvolution (deformable_conv_layer.{cpp,cu}, util/deformable_im2col.cu): MSRA's
    v1 kernel, as deformable_conv.py's spec (whose columns, GEMM, ONNX and model.py run it).  Its differences:
    convolution_param; the deformable group is the offsets' channels / (kh kw) / 2 (C's integer division, set
    in LayerSetUp); the offsets' shape is never checked (image n read from n times their per-image count),
    so caffeq refuses to run only where the kernel would read past an image's offsets."""
    field = "convolution_param"

    def deformable_group_of(self, p, f):
        return None

    def _check(self, attrs, in_shapes):
        what = "DeformableConvolution"
        n, c, h, w = four_axes(in_shapes[0], what, "data bottom")
        if attrs["axis"] not in (1, -3):
            raise LayerError(f"convolution_param.axis must be 1: the fork's kernel reads (N, C, H, W), got "
                             f"{attrs['axis']}")
        check_groups(attrs, c)
        kh, kw = attrs["kernel"]
        off = tuple(in_shapes[1])
        dg = off[1] // (kh * kw) // 2 if len(off) >= 2 else 0
        if dg < 1:
            raise LayerError(f"the offsets (bottom 1) {list(off)} need at least 2 x {kh} x {kw} = {2 * kh * kw} "
                             f"channels: the fork's deformable group, channels / (kernel_h x kernel_w) / 2, would "
                             f"be 0 (a division by zero in its im2col)")
        if c % dg:
            raise LayerError(f"input channels {c} not divisible by the deformable group {dg} (offset channels "
                             f"{off[1]} / ({kh} x {kw}) / 2): the fork's kernel would read the offsets of a group "
                             f"that does not exist")
        attrs["deformable_group"] = dg
        return (n, c, h, w), deformable_out_hw(attrs, in_shapes[0])

    def infer(self, attrs, in_shapes):
        (n, _, _, _), (ho, wo) = self._check(attrs, in_shapes)
        return [(n, attrs["num_output"], ho, wo)]

    def _offsets_read(self, attrs, ho, wo):
        return 2 * math.prod(attrs["kernel"]) * attrs["deformable_group"] * ho * wo

    def cannot_run(self, attrs, in_shapes):
        (n, _, _, _), (ho, wo) = self._check(attrs, in_shapes)
        off = tuple(in_shapes[1])
        need, have = self._offsets_read(attrs, ho, wo), math.prod(off[1:])
        if off[0] != n:
            return f"the offsets {list(off)} need the data's batch {n} (the fork reads one block per image)"
        if have < need:
            kh, kw = attrs["kernel"]
            return (f"the fork's kernel reads 2 x {kh} x {kw} x deformable group {attrs['deformable_group']} x "
                    f"{ho} x {wo} = {need} offsets per image, past the {have} of the offsets {list(off)}")
        return None

    def onnx(self, ctx, node):
        self.refuse_if_cannot_run(node.name, node.attrs, [ctx.shape(t) for t in node.inputs[:2]], ExportError)
        ho, wo = ctx.shape(node.outputs[0])[2:]
        need = self._offsets_read(node.attrs, ho, wo)
        offsets = node.inputs[1]
        if math.prod(ctx.shape(offsets)[1:]) != need:
            # only each image's first 2 kh kw dg Ho Wo values count
            flat = ctx.op("Flatten", [offsets], "offsets_all", name=node.name, axis=1)
            offsets = ctx.op("Slice", [flat, ctx.i64([0]), ctx.i64([need]), ctx.i64([1])], "offsets_used")
        onnx_deformable_conv(ctx, dataclasses.replace(node, inputs=[node.inputs[0], offsets]))


# ---- LianaWang/itn 77507a3 lib/rpn: the test nets' proposal and NMS Python layers ---------------------------

def itn_anchors(height: int, width: int, feat_stride: float, device=None):
    """ProposalLayer's quadrilateral anchors (H W, 8) float32, rows (h, w): corners (0, 0), (s - 1, 0),
    (s - 1, s - 1), (0, s - 1) shifted by (w s, h s), summed in float64 as numpy does, then float32."""
    corner = torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0], dtype=torch.float64, device=device)
    base = corner * (feat_stride - 1.0)
    shift_x = torch.arange(width, dtype=torch.float64, device=device) * feat_stride
    shift_y = torch.arange(height, dtype=torch.float64, device=device) * feat_stride
    sy, sx = torch.meshgrid(shift_y, shift_x, indexing="ij")
    shifts = torch.stack([sx.reshape(-1), sy.reshape(-1)] * 4, dim=1)
    return (base[None, :] + shifts).to(torch.float32)


def itn_delta_scales(anchors):
    """(K, 8) float32: each delta column's side length, in float32 as bbox_transform_inv computes it: a side
    is sqrt((|dx| + 1)^2 + (|dy| + 1)^2) between two corners; w1 = |p1 p2|, w2 = |p3 p4|, h1 = |p1 p4|,
    h2 = |p2 p3|, and the columns x1, y1, ..., x4, y4 take w1, h1, w1, h2, w2, h2, w2, h1."""
    xs, ys = anchors[:, 0::2], anchors[:, 1::2]
    one = torch.ones((), dtype=anchors.dtype, device=anchors.device)
    w1, w2, h1, h2 = (torch.sqrt(((xs[:, a] - xs[:, b]).abs() + one) ** 2 + ((ys[:, a] - ys[:, b]).abs() + one) ** 2)
                      for a, b in ((0, 1), (2, 3), (0, 3), (1, 2)))
    return torch.stack([w1, h1, w1, h2, w2, h2, w2, h1], dim=1)


def itn_proposals(prob, deltas, im_info, feat_stride: float):
    """ITN's ProposalLayer with 4 bottoms: every anchor moved by its 8 deltas (scaled by the anchor's sides),
    clipped to [0, W - 1] x [0, H - 1] of im_info's first row; rois (H W, 9) with batch index 0 and the
    foreground scores (H W (C - 1), 1), no sorting and no NMS (the module leaves both to NMSLayer)."""
    height, width = prob.shape[2], prob.shape[3]
    anchors = itn_anchors(height, width, feat_stride, prob.device)
    moved = deltas.permute(0, 2, 3, 1).reshape(-1, 8) * itn_delta_scales(anchors) + anchors
    size = im_info[0, :2]
    bound = size[[1, 0, 1, 0, 1, 0, 1, 0]] - 1.0     # x columns to W - 1, y columns to H - 1
    boxes = torch.maximum(torch.minimum(moved, bound[None, :]), torch.zeros_like(moved))
    rois = torch.cat([torch.zeros_like(boxes[:, :1]), boxes], dim=1)
    return rois, prob[:, 1:].permute(0, 2, 3, 1).reshape(-1, 1)


def _itn_proposal(lp):
    """ITN's form: 4 bottoms (probabilities, deltas, im_info, data) and 'kernel_size' in param_str."""
    if len(lp.bottom) != 4:
        return False
    try:
        keys = set(parse_param_str(lp.python_param.param_str))
    except LayerError:
        return False
    return "kernel_size" in keys and keys <= {"feat_stride", "kernel_size"}


@claim_layers("Python:rpn.proposal_layer.ProposalLayer", _itn_proposal)
class ItnProposalLayer(Layer):
    """LianaWang/itn lib/rpn/proposal_layer.py with its 4 bottoms: one anchor per location (feat_stride's
    square as 4 corners), bbox_transform_inv's quadrilateral decoding and clip_boxes (fast_rcnn/bbox_transform.py),
    all in float32 on float32 blobs; the data bottom and kernel_size are read only with a fifth bottom (the
    projection), which this form has not."""

    def parse(self, lp):
        need_blobs(lp, "ITN's ProposalLayer", 4, 2, "rpn_cls_prob_reshape, rpnbbox_pred, im_info, data",
                   in_place=False)
        p = parse_param_str(lp.python_param.param_str)
        stride = p.get("feat_stride")
        if not isinstance(stride, (int, float)) or isinstance(stride, bool) or stride <= 0:
            raise LayerError(f"python_param.param_str: 'feat_stride' must be a positive number, got {stride!r}")
        return {"name": lp.name, "feat_stride": float(stride)}

    def infer(self, attrs, in_shapes):
        prob, deltas, info = (tuple(s) for s in in_shapes[:3])
        if len(prob) != 4 or prob[0] != 1 or prob[1] < 2:
            raise LayerError(f"rpn_cls_prob_reshape must be (1, 2 or more, H, W): the module asserts one image "
                             f"and reads the channels after the first as the foreground, got {list(prob)}")
        if deltas != (1, 8, prob[2], prob[3]):
            raise LayerError(f"rpnbbox_pred must be (1, 8, {prob[2]}, {prob[3]}), one quadrilateral per anchor "
                             f"(the module reshapes it to (-1, 8) against the H x W anchors), got {list(deltas)}")
        if len(info) != 2 or info[1] < 2:
            raise LayerError(f"im_info must be (1, 2 or more) [height, width, ...], got {list(info)}")
        k = prob[2] * prob[3]
        return [(k, 9), (k * (prob[1] - 1), 1)]

    def forward(self, attrs, params, prob, deltas, im_info, data):
        return itn_proposals(prob, deltas, im_info, attrs["feat_stride"])

    def onnx(self, ctx, node):
        prob, deltas, info = node.inputs[:3]
        _, _, h, w = ctx.shape(prob)
        anchors = itn_anchors(int(h), int(w), node.attrs["feat_stride"])
        scales = itn_delta_scales(anchors)
        rows = ctx.op("Reshape", [ctx.op("Transpose", [deltas], "deltas_hwc", name=node.name, perm=[0, 2, 3, 1]),
                                  ctx.i64([-1, 8])], "deltas_rows")
        moved = ctx.op("Add", [ctx.op("Mul", [rows, ctx.const(scales.numpy())], "scaled"),
                               ctx.const(anchors.numpy())], "moved")
        size = ctx.op("Slice", [info, ctx.i64([0, 0]), ctx.i64([1, 2]), ctx.i64([0, 1])], "size")
        bound = ctx.op("Sub", [ctx.op("Gather", [size, ctx.i64([1, 0, 1, 0, 1, 0, 1, 0])], "size_xy", axis=1),
                               ctx.f32(1.0)], "bound")
        boxes = ctx.op("Max", [ctx.op("Min", [moved, bound], "below_edge"), ctx.f32(0.0)], "boxes")
        zeros = ctx.const(np.zeros((int(h) * int(w), 1), np.float32))
        ctx.add_node("Concat", [zeros, boxes], [node.outputs[0]], axis=1)
        fg = ctx.op("Slice", [prob, ctx.i64([1]), ctx.i64([2 ** 62]), ctx.i64([1])], "fg")
        ctx.add_node("Reshape", [ctx.op("Transpose", [fg], "fg_hwc", perm=[0, 2, 3, 1]), ctx.i64([-1, 1])],
                     [node.outputs[1]])

    def pytorch_source(self, node, emit):
        fn = emit.helper(torch_sources(itn_anchors, itn_delta_scales, itn_proposals))
        t = emit.tmp("proposals")
        emit.stmt(f"{t} = {fn}({', '.join(emit.inputs[:3])}, {emit.lit(node.attrs['feat_stride'])})")
        return [f"{t}[0]", f"{t}[1]"]


#: fast_rcnn/config.py's TEST.RPN_PRE_NMS_TOP_N, which both experiments' config.yml keep
ITN_TEST_PRE_NMS_TOP_N = 1000


@register_layer("Python:rpn.nms_layer.NMSLayer")
class ItnNMSLayer(ReadOnlyLayer):
    """LianaWang/itn lib/rpn/nms_layer.py: the proposals scoring >= 0.5, the best RPN_PRE_NMS_TOP_N (1000 at
    TEST), then soft-NMS (nms/py_cpu_nms.py py_soft_nms) over quadrilateral overlaps; tops (R, 9) rois and
    (R, 1) scores, R data-dependent: given here as its bound."""

    def parse(self, lp):
        need_blobs(lp, "ITN's NMSLayer", 2, (1, 2), "rois_pre_nms, scores_pre_nms", in_place=False)
        return {"name": lp.name, "tops": len(lp.top)}

    def infer(self, attrs, in_shapes):
        rois, scores = (tuple(s) for s in in_shapes)
        if len(rois) != 2 or rois[1] != 9:
            raise LayerError(f"rois_pre_nms must be (R, 9), a batch index and 8 corner coordinates, got {list(rois)}")
        if not scores or scores[0] != rois[0]:
            raise LayerError(f"scores_pre_nms must have one score per roi ({rois[0]}), got {list(scores)}")
        rows = min(rois[0], ITN_TEST_PRE_NMS_TOP_N)
        return [(rows, 9), (rows, 1)][:attrs["tops"]]

    def why_not_run(self, attrs):
        return ("ITN's soft-NMS weighs scores by quadrilateral overlaps from utils/bbox_overlap.py's "
                "plg_nms_area, a pycuda rasterization of the polygons that caffeq does not reproduce; the number "
                "of boxes it keeps depends on the data (at most 1000)")


__all__ = ["ItnNMSLayer", "ItnProposalLayer", "TransformAnchor", "TransformOffset", "ZlmzjuDeformableConvolution",
           "itn_anchors", "itn_delta_scales", "itn_points", "itn_proposals", "itn_transform"]
