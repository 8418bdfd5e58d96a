"""RON's detection Python layer, natively (taokong/RON c62d0ed, lib/ron_layer/det_layer.py DetLayer, with
its generate_anchors.py, lib/fast_rcnn/bbox_transform.py and lib/fast_rcnn/config.py): the head of each
reverse-connection scale of RON's test nets.  caffeq never imports the module; this reproduces it.

param_str "'stride_scale_numcls': S,K,C" (YAML: the value is one string): feature stride S, anchor
scale K and C classes with the background.  The anchors are py-faster-rcnn's generate_anchors with
base_size cfg.MINANCHOR = 32, ratios [0.333, 0.5, 1, 2, 3] and scales [K, K + 1]: A = 10 per cell,
placed on every cell of bottom 0's H x W grid at S pixels apart, rows ordered (h, w, anchor).

Bottoms: the objectness probabilities (N, 2A, H, W), whose channels A.. are the foreground ones; the
class probabilities, whose channels 1.. (background dropped) read as (N, C - 1, A, H, W) (RON feeds
(N, C, A * H, W)); the box deltas (N, 4A, H, W).  Tops, per image (h, w, anchor):
  - the boxes (N, H * W * A, 4): bbox_transform_inv of the anchors (in float32) by the deltas,
    x1 = cx - w / 2 ... x2 = cx + w / 2, not clipped;
  - the scores (N, H * W * A, C): the objectness, then the C - 1 class probabilities.
The layer reshapes by cfg.TEST.BATCH_SIZE (1); caffeq takes N from the bottoms, which is the same for one
image.  RON's test script then thresholds, clips and runs NMS outside the net.
"""
import re

import numpy as np
import torch

from .rcnn import generate_anchors, rpn_decode_centres, shifted_anchors
from .registry import Layer, LayerError, four_axes, need_blobs, register_layer, torch_sources

MIN_ANCHOR = 32                      # cfg.MINANCHOR
RON_RATIOS = (0.333, 0.5, 1, 2, 3)
_PARAM = re.compile(r"""^\s*\{?\s*['"]?stride_scale_numcls['"]?\s*:\s*['"]?\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*['"]?\s*\}?\s*$""")


def ron_detections(objectness, classes, deltas, anchors: list[list[float]], stride: int, num_classes: int):
    """RON's DetLayer forward: (boxes (N, H * W * A, 4), scores (N, H * W * A, num_classes))."""
    n, _, h, w = objectness.shape
    base = torch.tensor(anchors, dtype=torch.float64, device=objectness.device)
    a = base.shape[0]
    fg = objectness[:, a:].permute(0, 2, 3, 1).reshape(-1, 1)
    det = classes[:, 1:].reshape(n, num_classes - 1, a, h, w).permute(0, 3, 4, 2, 1).reshape(-1, num_classes - 1)
    scores = torch.cat([fg, det], 1).reshape(n, -1, num_classes)
    boxes = shifted_anchors(base, h, w, stride).to(deltas.dtype).repeat(n, 1)
    cx, cy, bw, bh = rpn_decode_centres(boxes, deltas.permute(0, 2, 3, 1).reshape(-1, 4))
    corners = torch.stack([cx - 0.5 * bw, cy - 0.5 * bh, cx + 0.5 * bw, cy + 0.5 * bh], 1)
    return corners.reshape(n, -1, 4), scores


TORCH_RON = torch_sources(ron_detections)


@register_layer("Python:ron_layer.det_layer.DetLayer")
class RONDetLayer(Layer):
    def parse(self, lp):
        need_blobs(lp, "RON's DetLayer", 3, 2, "objectness, class probabilities, box deltas")
        m = _PARAM.match(lp.python_param.param_str)
        if m is None:
            raise LayerError(f"python_param.param_str must be \"'stride_scale_numcls': STRIDE,SCALE,CLASSES\", got "
                             f"{lp.python_param.param_str!r}")
        stride, scale, classes = (int(v) for v in m.groups())
        if stride < 1 or scale < 1 or classes < 2:
            raise LayerError(f"python_param.param_str: stride and scale must be >= 1 and the classes (with the "
                             f"background) >= 2, got {stride}, {scale}, {classes}")
        anchors = generate_anchors(MIN_ANCHOR, RON_RATIOS, (scale, scale + 1))
        return {"stride": stride, "num_classes": classes, "anchors": anchors.tolist()}

    def infer(self, attrs, in_shapes):
        (n, c0, h, w), cls, box = (four_axes(s, "RON's DetLayer") for s in in_shapes)
        a, k = len(attrs["anchors"]), attrs["num_classes"]
        if c0 != 2 * a or box != (n, 4 * a, h, w):
            raise LayerError(f"RON's DetLayer: the objectness {[n, c0, h, w]} must be (N, 2 x {a}, H, W) and the "
                             f"deltas {list(box)} (N, 4 x {a}, H, W), for its {a} anchors")
        if cls[0] != n or cls[1] < 2 or (cls[1] - 1) * cls[2] * cls[3] != (k - 1) * a * h * w:
            raise LayerError(f"RON's DetLayer: the class probabilities {list(cls)} past channel 0 must hold "
                             f"(N, {k} - 1, {a}, {h}, {w}) values")
        return [(n, h * w * a, 4), (n, h * w * a, k)]

    def forward(self, attrs, params, objectness, classes, deltas):
        return ron_detections(objectness, classes, deltas, attrs["anchors"], attrs["stride"], attrs["num_classes"])

    def pytorch_source(self, node, emit):
        a = node.attrs
        fn = emit.helper(TORCH_RON)
        emit.helper(shifted_anchors)
        emit.helper(rpn_decode_centres)
        return [f"{fn}({', '.join(emit.inputs)}, {a['anchors']!r}, {a['stride']}, {a['num_classes']})[{i}]"
                for i in range(2)]

    def onnx(self, ctx, node):
        a = node.attrs
        objectness, classes, deltas = node.inputs
        n_anchor, k = len(a["anchors"]), a["num_classes"]
        _, _, h, w = ctx.shape(objectness)
        op, i64 = ctx.op, ctx.i64
        fg = op("Slice", [objectness, i64([n_anchor]), i64([2 * n_anchor]), i64([1])], "fg")
        fg = op("Reshape", [op("Transpose", [fg], "fg_t", perm=[0, 2, 3, 1]), i64([0, -1, 1])], "fg_rows")
        det = op("Slice", [classes, i64([1]), i64([2 ** 62]), i64([1])], "det")
        det = op("Reshape", [det, i64([0, k - 1, n_anchor, h, w])], "det5")
        det = op("Reshape", [op("Transpose", [det], "det_t", perm=[0, 3, 4, 2, 1]), i64([0, -1, k - 1])], "det_rows")
        ctx.add_node("Concat", [fg, det], [node.outputs[1]], name=node.name, axis=2)
        boxes = shifted_anchors(torch.tensor(a["anchors"], dtype=torch.float64), h, w, a["stride"]).numpy()
        boxes = boxes.astype(np.float32)
        # rpn_decode_centres's anchor terms, in float32 as there: constants of the export
        widths = boxes[:, 2] - boxes[:, 0] + np.float32(1.0)
        heights = boxes[:, 3] - boxes[:, 1] + np.float32(1.0)
        ctr_x, ctr_y = boxes[:, 0] + np.float32(0.5) * widths, boxes[:, 1] + np.float32(0.5) * heights
        d = op("Reshape", [op("Transpose", [deltas], "d_t", perm=[0, 2, 3, 1]), i64([0, -1, 4])], "d_rows")
        part = [op("Slice", [d, i64([j]), i64([j + 1]), i64([2])], f"d{j}") for j in range(4)]

        def const(v, hint):
            return ctx.const(v.reshape(1, -1, 1).astype(np.float32), f"{node.name}_{hint}")

        cx = op("Add", [op("Mul", [part[0], const(widths, "w")], "mx"), const(ctr_x, "cx")], "cx")
        cy = op("Add", [op("Mul", [part[1], const(heights, "h")], "my"), const(ctr_y, "cy")], "cy")
        half = ctx.f32(0.5)
        hw = op("Mul", [half, op("Mul", [op("Exp", [part[2]], "ew"), const(widths, "w2")], "bw")], "hw")
        hh = op("Mul", [half, op("Mul", [op("Exp", [part[3]], "eh"), const(heights, "h2")], "bh")], "hh")
        ctx.add_node("Concat", [op("Sub", [cx, hw], "x1"), op("Sub", [cy, hh], "y1"), op("Add", [cx, hw], "x2"),
                                op("Add", [cy, hh], "y2")], [node.outputs[0]], axis=2)
