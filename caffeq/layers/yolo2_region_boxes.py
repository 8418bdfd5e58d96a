"""The two-top Region of zhang-xin/caffe's YOLO v2 port (0bfd32d region_layer.cpp and
include/caffe/util/region_util.hpp; another copy of the same layer carries the same region_util):
a Region that reads `region_loss_param` and writes darknet's get_region_boxes.

Bottom (N, num (coords + 1 + classes), H, W) with H W = side^2 (the fork checks only the count);
darknet's layout, anchor n's entry e at channel n (coords + 1 + classes) + e.  On a copy of the
bottom: entries 0, 1 (x, y) and `coords` (objectness) go through the logistic and, with softmax,
the classes through a softmax (max subtracted); the other entries stay raw.  Then, for image 0
only (the fork indexes batch 0 whatever N is):
  box top (num, side, side, coords): ((col + x) / side, (row + y) / side, exp(w) bias[2n] / side,
    exp(h) bias[2n + 1] / side), entries past the fourth left 0;
  prob top (num, side, side, classes + 1): p_j = objectness * class_j kept where p_j > threshold,
    else 0, and last the largest p_j (from 0) under the same rule.
`batch` only says how many images get the activations; it changes nothing the tops hold.
"""
import numpy as np
import torch

from .registry import Layer, LayerError, claim_layers, four_axes, need_blobs, positive_field, torch_sources


def region_boxes(x, num: int, side: int, coords: int, classes: int, softmax: bool, threshold: float,
                 biases: list[float]):
    """zhang-xin's Region: (box, prob) tops from image 0 of x (see the module docstring)."""
    size = coords + 1 + classes
    t = x[0].reshape(num, size, side, side)
    cls = t[:, coords + 1:]
    if softmax:
        cls = torch.softmax(cls, dim=1)
    objectness = torch.sigmoid(t[:, coords])
    step = torch.arange(side, dtype=x.dtype, device=x.device)
    anchors = torch.tensor(biases[:2 * num], dtype=x.dtype, device=x.device).reshape(num, 1, 1, 2)
    box = torch.stack([(step.reshape(1, 1, side) + torch.sigmoid(t[:, 0])) / side,
                       (step.reshape(1, side, 1) + torch.sigmoid(t[:, 1])) / side,
                       torch.exp(t[:, 2]) * anchors[..., 0] / side,
                       torch.exp(t[:, 3]) * anchors[..., 1] / side], dim=-1)
    if coords > 4:
        box = torch.cat([box, box.new_zeros((num, side, side, coords - 4))], dim=-1)
    prob = (objectness.unsqueeze(1) * cls).permute(0, 2, 3, 1)
    best = prob.amax(dim=-1, keepdim=True).clamp(min=0)
    zero = torch.zeros_like(prob)
    kept = torch.where(prob > threshold, prob, zero)
    best = torch.where(best > threshold, best, torch.zeros_like(best))
    return box, torch.cat([kept, best], dim=-1)


def _is_zhang_xin_region(lp):
    return lp.HasField("region_loss_param") and not lp.HasField("region_param")


@claim_layers("Region", _is_zhang_xin_region)
class RegionBoxes(Layer):
    def parse(self, lp):
        need_blobs(lp, "Region (region_loss_param)", 1, 2, in_place=False)
        p = lp.region_loss_param
        a = {"name": lp.name, "side": int(p.side), "num": int(p.num), "coords": int(p.coords),
             "classes": int(p.num_classes if p.HasField("num_classes") else p.num_class),
             "softmax": bool(p.softmax), "threshold": float(np.float32(p.threshold if p.HasField("threshold")
                                                                        else p.thresh)),
             "biases": [float(b) for b in p.biases]}
        for field in ("side", "num", "classes"):
            positive_field(a[field], f"region_loss_param.{'num_classes' if field == 'classes' else field}")
        if a["coords"] < 4:
            raise LayerError(f"region_loss_param.coords must be >= 4 (the layer writes x, y, w, h per box), "
                             f"got {a['coords']}")
        return a

    def infer(self, attrs, in_shapes):
        s = four_axes(in_shapes[0], "Region")
        num, side = attrs["num"], attrs["side"]
        size = attrs["coords"] + 1 + attrs["classes"]
        if s[1] * s[2] * s[3] != side * side * num * size:
            raise LayerError(f"Region: the bottom holds {s[1]}x{s[2]}x{s[3]} values per image, the fork's check "
                             f"needs side^2 x num x (coords + 1 + classes) = {side}^2 x {num} x {size}")
        return [(num, side, side, attrs["coords"]), (num, side, side, attrs["classes"] + 1)]

    def cannot_run(self, attrs, in_shapes):
        if len(attrs["biases"]) < 2 * attrs["num"]:
            return (f"region_loss_param.biases holds {len(attrs['biases'])} values, the layer reads 2 x num = "
                    f"{2 * attrs['num']} (the fork would read past them)")
        return None

    def _args(self, attrs):
        return (attrs["num"], attrs["side"], attrs["coords"], attrs["classes"], attrs["softmax"],
                attrs["threshold"], attrs["biases"])

    def forward(self, attrs, params, x):
        self.refuse_if_cannot_run(attrs["name"], attrs, [x.shape], LayerError)
        return region_boxes(x, *self._args(attrs))

    def onnx(self, ctx, node):
        from ..errors import ExportError
        self.refuse_if_cannot_run(node.name, node.attrs, [ctx.shape(node.inputs[0])], ExportError)
        a, name = node.attrs, node.name
        num, side, coords, classes = a["num"], a["side"], a["coords"], a["classes"]
        size = coords + 1 + classes

        def entries(lo, hi, hint):
            return ctx.op("Slice", [t, ctx.i64([lo]), ctx.i64([hi]), ctx.i64([1])], hint)

        first = ctx.op("Slice", [node.inputs[0], ctx.i64([0]), ctx.i64([1]), ctx.i64([0])], "image0", name=name)
        t = ctx.op("Reshape", [first, ctx.i64([num, size, side, side])], "anchors")
        cls = entries(coords + 1, size, "cls_raw")
        if a["softmax"]:
            cls = ctx.op("Softmax", [cls], "cls", axis=1)
        objectness = ctx.op("Sigmoid", [entries(coords, coords + 1, "obj_raw")], "obj")
        step = np.arange(side, dtype=np.float32)
        cols, rows = ctx.f32(step.reshape(1, 1, 1, side)), ctx.f32(step.reshape(1, 1, side, 1))
        anchors = np.array(a["biases"][:2 * num], np.float32).reshape(num, 1, 1, 2)
        bw, bh = ctx.f32(anchors[..., 0].reshape(num, 1, 1, 1)), ctx.f32(anchors[..., 1].reshape(num, 1, 1, 1))
        per_side = ctx.f32(side)
        parts = [ctx.op("Div", [ctx.op("Add", [cols, ctx.op("Sigmoid", [entries(0, 1, "x_raw")], "x")], "cx"),
                                per_side], "bx"),
                 ctx.op("Div", [ctx.op("Add", [rows, ctx.op("Sigmoid", [entries(1, 2, "y_raw")], "y")], "cy"),
                                per_side], "by"),
                 ctx.op("Div", [ctx.op("Mul", [ctx.op("Exp", [entries(2, 3, "w_raw")], "ew"), bw], "aw"),
                                per_side], "bw"),
                 ctx.op("Div", [ctx.op("Mul", [ctx.op("Exp", [entries(3, 4, "h_raw")], "eh"), bh], "ah"),
                                per_side], "bh")]
        if coords > 4:
            parts.append(ctx.f32(np.zeros((num, coords - 4, side, side), np.float32)))
        box = ctx.op("Concat", parts, "box_nchw", axis=1)
        ctx.add_node("Transpose", [box], [node.outputs[0]], perm=[0, 2, 3, 1])
        prob = ctx.op("Mul", [objectness, cls], "prob")
        best = ctx.op("Max", [ctx.op("ReduceMax", [prob], "best_raw", axes=[1], keepdims=1) if ctx.opset < 18 else
                              ctx.op("ReduceMax", [prob, ctx.i64([1])], "best_raw", keepdims=1), ctx.f32(0.0)], "best")
        both = ctx.op("Concat", [prob, best], "both", axis=1)
        kept = ctx.op("Where", [ctx.op("Greater", [both, ctx.f32(a["threshold"])], "over"), both, ctx.f32(0.0)], "kept")
        ctx.add_node("Transpose", [kept], [node.outputs[1]], perm=[0, 2, 3, 1])

    def pytorch_source(self, node, emit):
        args = ", ".join(emit.lit(v) if isinstance(v, (bool, float)) else repr(v) for v in self._args(node.attrs))
        return f"{emit.helper(torch_sources(region_boxes))}({emit.inputs[0]}, {args})"
