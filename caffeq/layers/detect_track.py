"""feichtenhofer/Detect-Track's BoxTransform (its Caffe feichtenhofer/caffe-rfcn 9089816,
box_transform_layer.cpp; CPU only, the GPU runs the same code).

Bottoms: box deltas (N, D, ...) and rois (>= N, 5) [batch, x1, y1, x2, y2].  For each of the N rows (the
fork takes the count from the deltas for both bottoms), the deltas of class 1, columns 4 to 7, with
box_reg_param's bbox_std and bbox_mean (4 each) as delta x std + mean, move the roi as Faster R-CNN's
decoding does, with the fork's own centre: roi_w = x2 - x1 + 1, centre x1 + 0.5 roi_w - 1 (in double,
stored as float), new centre dx roi_w + centre, new width roi_w exp(dw); the box is centre -+ 0.5 (w - 1).
The top is (N, 5, 1, 1) rows [0, x1, y1, x2, y2] (batch index 0).  With box_reg_param.batch_ind only the
rows whose roi batch index is listed are kept, in order: their count depends on the rois, so the top is
sized N (at most) and ONNX export is refused.
"""
import numpy as np
import torch

from ..errors import ExportError
from .registry import Layer, LayerError, need_blobs, register_layer


def box_transform(deltas, rois, means: list[float], stds: list[float], batch_inds: list[float]):
    """BoxTransform's forward: (R, 5, 1, 1) boxes, R the kept rows."""
    n = deltas.shape[0]
    d = deltas.reshape(n, -1)[:, 4:8]
    if stds:
        d = d * torch.tensor(stds, dtype=d.dtype, device=d.device) + torch.tensor(means, dtype=d.dtype, device=d.device)
    r = rois.reshape(rois.shape[0], -1)[:n]
    x1, y1 = r[:, 1], r[:, 2]
    w, h = r[:, 3] - x1 + 1, r[:, 4] - y1 + 1
    cx = (x1.double() + 0.5 * w.double() - 1).to(d.dtype)
    cy = (y1.double() + 0.5 * h.double() - 1).to(d.dtype)
    px, py = d[:, 0] * w + cx, d[:, 1] * h + cy
    pw = (w.double() * torch.exp(d[:, 2].double())).to(d.dtype)
    ph = (h.double() * torch.exp(d[:, 3].double())).to(d.dtype)
    half_w, half_h = (pw - 1) * 0.5, (ph - 1) * 0.5
    out = torch.stack([torch.zeros_like(px), px - half_w, py - half_h, px + half_w, py + half_h], dim=1)
    if batch_inds:
        keep = (r[:, 0:1] == torch.tensor(batch_inds, dtype=r.dtype, device=r.device)[None]).any(dim=1)
        out = out[keep]
    return out.reshape(-1, 5, 1, 1)


@register_layer("BoxTransform")
class BoxTransform(Layer):
    def parse(self, lp):
        need_blobs(lp, "BoxTransform", 2, 1, roles="box deltas, rois")
        p = lp.box_reg_param
        means, stds = [float(v) for v in p.bbox_mean], [float(v) for v in p.bbox_std]
        if (means or stds) and not (len(means) == 4 and len(stds) == 4):
            raise LayerError(f"box_reg_param needs 4 bbox_mean and 4 bbox_std (the fork's check), got {len(means)} and "
                             f"{len(stds)}")
        if bool(means) != bool(stds):
            raise LayerError("box_reg_param: give bbox_mean and bbox_std together (the fork uses them only so)")
        return {"means": means, "stds": stds, "batch_inds": [float(v) for v in p.batch_ind]}

    def infer(self, attrs, in_shapes):
        deltas, rois = (tuple(s) for s in in_shapes)
        n = deltas[0]
        if len(deltas) < 2 or int(np.prod(deltas[1:])) < 8:
            raise LayerError(f"BoxTransform reads class 1's deltas (columns 4 to 7) of each row, got {list(deltas)}")
        if len(rois) < 2 or int(np.prod(rois[1:])) != 5 or rois[0] < n:
            raise LayerError(f"BoxTransform needs rois (>= {n}, 5) [batch, x1, y1, x2, y2], got {list(rois)}")
        return [(n, 5, 1, 1)]

    def forward(self, attrs, params, deltas, rois):
        return box_transform(deltas, rois, attrs["means"], attrs["stds"], attrs["batch_inds"])

    def onnx(self, ctx, node):
        a = node.attrs
        if a["batch_inds"]:
            raise ExportError(f"layer '{node.name}' (BoxTransform): box_reg_param.batch_ind keeps a number of rows "
                              f"that the rois decide; ONNX export needs the count fixed")
        deltas, rois = node.inputs
        n = ctx.shape(deltas)[0]
        d = ctx.op("Slice", [ctx.op("Reshape", [deltas, ctx.i64([n, -1])], "d2", name=node.name), ctx.i64([4]),
                             ctx.i64([8]), ctx.i64([1])], "cls1")
        if a["stds"]:
            d = ctx.op("Add", [ctx.op("Mul", [d, ctx.const(np.array(a["stds"], np.float32))], "scaled"),
                               ctx.const(np.array(a["means"], np.float32))], "denorm")
        r = ctx.op("Slice", [ctx.op("Reshape", [rois, ctx.i64([-1, 5])], "r2"), ctx.i64([0]), ctx.i64([n]),
                             ctx.i64([0])], "rows")

        def col(t, k, hint):
            return ctx.op("Slice", [t, ctx.i64([k]), ctx.i64([k + 1]), ctx.i64([1])], hint)
        one = ctx.f32(1.0)
        outs = []
        for k, (lo, hi) in enumerate(((1, 3), (2, 4))):
            start = col(r, lo, f"s{k}")
            size = ctx.op("Add", [ctx.op("Sub", [col(r, hi, f"e{k}"), start], f"span{k}"), one], f"size{k}")
            wide = [ctx.op("Cast", [t], f"{hint}{k}", to=11) for t, hint in ((start, "sd"), (size, "zd"))]
            centre = ctx.op("Cast", [ctx.op("Sub", [ctx.op("Add", [wide[0], ctx.op(
                "Mul", [wide[1], ctx.const(np.array(0.5))], f"hz{k}")], f"c{k}"), ctx.const(np.array(1.0))], f"cm{k}")],
                f"centre{k}", to=1)
            moved = ctx.op("Add", [ctx.op("Mul", [col(d, k, f"dc{k}"), size], f"shift{k}"), centre], f"moved{k}")
            grown = ctx.op("Cast", [ctx.op("Mul", [wide[1], ctx.op("Exp", [ctx.op(
                "Cast", [col(d, k + 2, f"dz{k}")], f"dzd{k}", to=11)], f"ez{k}")], f"gd{k}")], f"grown{k}", to=1)
            half = ctx.op("Mul", [ctx.op("Sub", [grown, one], f"gm{k}"), ctx.f32(0.5)], f"half{k}")
            outs.append((ctx.op("Sub", [moved, half], f"lo{k}"), ctx.op("Add", [moved, half], f"hi{k}")))
        zero = ctx.op("Mul", [col(r, 0, "b"), ctx.f32(0.0)], "zero")
        boxes = ctx.op("Concat", [zero, outs[0][0], outs[1][0], outs[0][1], outs[1][1]], "boxes", axis=1)
        ctx.add_node("Reshape", [boxes, ctx.i64([n, 5, 1, 1])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        a = node.attrs
        return f"{emit.helper(box_transform)}({', '.join(emit.inputs)}, {a['means']}, {a['stds']}, {a['batch_inds']})"
