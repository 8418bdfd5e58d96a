"""zimenglan-sysu-512/pose_action_caffe's pose layers (caffe/src/caffe/layers/*, commits f40abba and
8f29342, the two the FLIC "ddk" nets were written against; caffe.proto as in proto/README.md).

aux_info is the fork's (N, 5, 1, 1) blob per person: (image index, width, height, im_scale, flippable).

- Resize (resize_layer.cpp, util_img.cpp BiLinearResizeMat_cpu): bilinear, source position
  dst * (src / dst) in float32 (no half-pixel shift); the taps past the last row or column are
  left out (they add nothing, as if the map were followed by zeros).  The size is resize_param's
  height/width, int(H * height_fac)/int(W * width_fac), or a second bottom's H and W (its values
  (width, height, ...) when it holds exactly 4 numbers).  xiaolonw/caffe-3dnormal_joint_pose (11f5adc),
  whose util_img.cpp this resize comes from, writes `is_pyramid_test: true` with out_height_scale/out_width_scale
  for the factors (V1 files: `type: RESIZE`); MaskYolo_Caffe's Resize, which writes them too, is another layer
  (a nearest-neighbour GPU kernel: maskyolo.py's MaskYoloResize).
- SpatialDropout (spatial_dropout_layer.cpp): TEST copies; TRAIN drops whole (n, c) maps with
  probability dropout_ratio and scales the kept ones by 1 / (1 - ratio).
- CoordsFromHeatMaps (coords_from_heat_map_layer.cpp): per map the first maximum's (x, y) = (i % W,
  i // W), each times heat_map_a plus heat_map_b (1 and 0 unless pose_coords_from_heat_maps_param
  or a second bottom's first two values give them) -> (N, 2K, 1, 1); an optional second top holds
  the maxima (N, K, 1, 1).  d397a23's top_k > 0 (704d7de) averages the positions of the top_k
  highest values instead (sum of x, of y, integer-divided by k; the score is their mean; ties go to
  the later index, std::greater on (score, index) pairs).
- RescaledPoseCoords (rescaled_pose_coords_layer.cpp): x / im_scale, mirrored to width - 1 - x when
  flippable, -1 when at or past the image's width (y likewise with the height, never mirrored).
- CoordsToBboxesMasks (coords_to_bboxes_masks_layer.cpp): an (N, 1, H, W) map that is `value` on
  the box spanned by two joints (top_id, bottom_id) or, when the ids are negative or equal, by all
  joints; H and W are the largest height * im_scale and width * im_scale in aux_info, values the
  file cannot tell: `--input-shape TOP=N,1,H,W` gives them (the fork's tools feed the image's own
  size).  When the two id pairs differ it picks one at random per item: read, not run.
- HeatMapsFromCoordsOrigin (training targets from the ground truth), RandomImageData2 (the
  data layer), PoseHeatMapLoss, PosePDJAccuracy (writes logs): read only.  VisualizedHeatMaps,
  VisualizedHeatMaps2, VisualizedPoseCoords write images or files and have no top: sinks.
"""
import numpy as np
import torch
import torch.nn.functional as F

from .common import Sink
from .data import transform_attrs
from .fork_data import ForkDataLayer
from .registry import (
    AT_LEAST,
    Layer,
    LayerError,
    MissingInputShape,
    ReadOnlyLayer,
    count,
    legacy_nchw,
    need_blobs,
    needs_input_shape,
    register_layer,
)


def _check_aux(shape, n, what):
    if tuple(legacy_nchw(shape, what)[1:]) != (5, 1, 1) or shape[0] != n:
        raise LayerError(f"{what}: aux_info must be ({n}, 5, 1, 1) (image index, width, height, "
                         f"im_scale, flippable per item), got {list(shape)}")


# ---- torch functions (model.py copies them) -------------------------------------------------

def pose_resize_taps(src, dst, device):
    """The fork's source rows for dst rows: floor(i * (src / dst)) and the fraction, in float32."""
    scale = torch.tensor(src, dtype=torch.float32) / torch.tensor(dst, dtype=torch.float32)
    pos = torch.arange(dst, dtype=torch.float32, device=device) * scale.to(device)
    first = torch.floor(pos)
    return first.long(), pos - first


def pose_resize(x, out_h, out_w):
    """pose_action_caffe's Resize: bilinear at i * (src / dst); taps past the edge read the zero pad."""
    h, w = x.shape[2], x.shape[3]
    xp = F.pad(x, (0, 1, 0, 1))
    hi, hf = pose_resize_taps(h, out_h, x.device)
    wi, wf = pose_resize_taps(w, out_w, x.device)
    hf, wf = hf.to(x.dtype).view(-1, 1), wf.to(x.dtype)
    rows = xp.index_select(2, hi) * (1 - hf) + xp.index_select(2, hi + 1) * hf
    return rows.index_select(3, wi) * (1 - wf) + rows.index_select(3, wi + 1) * wf


def pose_coords_from_heat_maps(maps, a, b):
    """(x, y) of each map's first maximum, times a plus b -> (N, 2K, 1, 1); the maxima (N, K, 1, 1)."""
    n, k, w = maps.shape[0], maps.shape[1], maps.shape[3]
    flat = maps.reshape(n, k, -1)
    idx = flat.argmax(dim=2)
    best = flat.gather(2, idx.unsqueeze(2)).reshape(n, k, 1, 1)
    xy = torch.stack([idx % w, torch.div(idx, w, rounding_mode="floor")], dim=2) * a + b
    return xy.reshape(n, 2 * k, 1, 1).to(maps.dtype), best


def pose_coords_top_k(maps, top_k, a, b):
    """top_k > 0: the mean position (integer division) and mean score of each map's top_k highest
    values; among equal values the fork's partial_sort over (score, index) pairs prefers the later."""
    n, k, w = maps.shape[0], maps.shape[1], maps.shape[3]
    flat = maps.reshape(n, k, -1)
    hw = flat.shape[2]
    kk = min(top_k, hw)
    vals, rev = torch.sort(flat.flip(2), dim=2, descending=True, stable=True)
    idx = hw - 1 - rev[:, :, :kk]
    x = torch.div((idx % w).sum(2), kk, rounding_mode="floor")
    y = torch.div(torch.div(idx, w, rounding_mode="floor").sum(2), kk, rounding_mode="floor")
    xy = torch.stack([x, y], dim=2) * a + b
    return xy.reshape(n, 2 * k, 1, 1).to(maps.dtype), (vals[:, :, :kk].sum(2) / kk).reshape(n, k, 1, 1)


def pose_coords_scale_from_blob(maps, ab):
    """heat_map_a, heat_map_b as the fork reads them from a second bottom: its first two values as int."""
    v = ab.reshape(-1)
    return pose_coords_from_heat_maps(maps, v[0].trunc().long(), v[1].trunc().long())


def pose_rescaled_coords(coords, aux):
    """x / im_scale (mirrored when flippable), y / im_scale; -1 at or past the image's width/height."""
    n = coords.shape[0]
    a = aux.reshape(n, 5, 1).to(coords.dtype)
    width, height, scale, flip = a[:, 1], a[:, 2], a[:, 3], a[:, 4]
    p = coords.reshape(n, -1, 2)
    x, y = p[:, :, 0] / scale, p[:, :, 1] / scale
    gone = torch.full_like(x, -1.0)
    x = torch.where(x >= width, gone, torch.where(flip != 0, width - 1 - x, x))
    y = torch.where(y >= height, gone, y)
    return torch.stack([x, y], dim=2).reshape(coords.shape)


def pose_bbox_masks(coords, aux, joints, value):
    """CoordsToBboxesMasks: `value` on each item's box (joints = (top_id, bottom_id), or None: all
    joints) in an (N, 1, H, W) map, H and W the largest height * im_scale, width * im_scale."""
    n = coords.shape[0]
    p = coords.reshape(n, -1)
    a = aux.reshape(n, -1)
    width = int(max(-1.0, float((a[:, 1] * a[:, 3]).max())))
    height = int(max(-1.0, float((a[:, 2] * a[:, 3]).max())))
    if width <= 0 or height <= 0:
        raise ValueError("CoordsToBboxesMasks: aux_info gives no image size (width or height * im_scale "
                         "<= 0); the fork then sizes the mask from its tools' --gwidth/--gheight")
    if joints is None:
        xs, ys = p[:, 0::2], p[:, 1::2]
        x1, x2, y1, y2 = xs.min(1).values, xs.max(1).values, ys.min(1).values, ys.max(1).values
    else:
        t, b = 2 * joints[0], 2 * joints[1]
        x1, y1, x2, y2 = p[:, t], p[:, t + 1], p[:, b], p[:, b + 1]
    skip = ((x1 <= 0) & (y1 <= 0) & (x2 <= 0) & (y2 <= 0)) | \
        ((x1 >= width) & (y1 >= height) & (x2 >= width) & (y2 >= height))
    lx, hx = torch.minimum(x1, x2), torch.maximum(x1, x2)
    ly, hy = torch.minimum(y1, y2), torch.maximum(y1, y2)
    inside = (lx >= 0) & (hx < width) & (ly >= 0) & (hy < height)
    keep = (inside & ~skip).view(n, 1, 1, 1)
    rows = torch.arange(height, device=p.device, dtype=p.dtype).view(1, 1, -1, 1)
    cols = torch.arange(width, device=p.device, dtype=p.dtype).view(1, 1, 1, -1)
    box = (rows >= torch.floor(ly).view(n, 1, 1, 1)) & (rows <= hy.view(n, 1, 1, 1)) & \
        (cols >= torch.floor(lx).view(n, 1, 1, 1)) & (cols <= hx.view(n, 1, 1, 1))
    return torch.where(box & keep, torch.full_like(box, value, dtype=p.dtype),
                       torch.zeros_like(box, dtype=p.dtype))


# ---- Resize ---------------------------------------------------------------------------------

@register_layer("Resize")
class PoseResize(Layer):
    def parse(self, lp):
        need_blobs(lp, "Resize", (1, 2), 1, roles="data[, size blob]")
        has_param, two = lp.HasField("resize_param"), len(lp.bottom) == 2
        if has_param == two:
            raise LayerError("Resize takes either resize_param (one bottom) or a second bottom whose "
                             "size it copies, exactly one of them")
        if two:
            return {"mode": "bottom"}
        p = lp.resize_param
        if p.HasField("type") and p.type == p.NEAREST:
            raise LayerError("resize_param.type NEAREST (zhjwustc/cvpr18_rnn_deblur_matcaffe's Resize) is not "
                             "supported: the fork's nearest loop steps by resize_ratio, not by the output size, and "
                             "reads past the last row; BILINEAR is this resize")
        if p.is_pyramid_test:
            # xiaolonw's form (resize_layer.cpp): the size is the input's times these scales
            if not (p.HasField("out_height_scale") and p.HasField("out_width_scale")):
                raise LayerError("resize_param.is_pyramid_test needs out_height_scale and out_width_scale")
            return {"mode": "fac", "fac": (float(p.out_height_scale), float(p.out_width_scale))}
        wh = p.HasField("height") and p.HasField("width")
        fac = p.HasField("height_fac") and p.HasField("width_fac")
        if not wh and not fac and p.HasField("resize_ratio"):   # the deblur fork's one ratio for both sides
            return {"mode": "fac", "fac": (float(p.resize_ratio), float(p.resize_ratio))}
        if wh == fac:
            raise LayerError("resize_param needs height and width, or height_fac and width_fac, "
                             "exactly one of the two pairs")
        if wh:
            return {"mode": "size", "size": (int(p.height), int(p.width))}
        return {"mode": "fac", "fac": (float(p.height_fac), float(p.width_fac))}

    def infer(self, attrs, in_shapes):
        s = in_shapes[0]
        if len(s) != 4:
            raise LayerError(f"Resize needs an (N, C, H, W) bottom, got {list(s)}")
        mode = attrs["mode"]
        if mode == "size":
            h, w = attrs["size"]
        elif mode == "fac":
            h = int(np.float32(s[2]) * np.float32(attrs["fac"][0]))
            w = int(np.float32(s[3]) * np.float32(attrs["fac"][1]))
        elif count(in_shapes[1]) == 4:
            raise MissingInputShape("the size comes from the values (width, height, ...) of its 4-value "
                                    "second bottom, which the file does not tell")
        else:
            h, w = legacy_nchw(in_shapes[1], "Resize's second bottom")[2:]
        if h <= 0 or w <= 0:
            raise LayerError(f"Resize's output size must be positive, got {h}x{w}")
        attrs["_out"] = (h, w)
        return [(s[0], s[1], h, w)]

    def forward(self, attrs, params, x, size=None):
        return pose_resize(x, *attrs["_out"])

    def onnx(self, ctx, node):
        x, out = node.inputs[0], node.outputs[0]
        h, w = ctx.shape(x)[2:]
        oh, ow = node.attrs["_out"]
        padded = ctx.add_node("Pad", [x, ctx.const(np.array([0, 0, 0, 0, 0, 0, 1, 1], np.int64))], ctx.tmp("pad"))
        scales = np.array([1, 1, oh / h, ow / w], np.float32)
        big = ctx.add_node("Resize", [padded, "", ctx.const(scales)],
                           ctx.tmp("resized"), mode="linear", coordinate_transformation_mode="asymmetric")
        ctx.add_node("Slice", [big, ctx.const(np.array([0, 0], np.int64)), ctx.const(np.array([oh, ow], np.int64)),
                               ctx.const(np.array([2, 3], np.int64))], [out], name=node.name)

    def pytorch_source(self, node, emit):
        emit.helper(pose_resize_taps)
        oh, ow = node.attrs["_out"]
        return f"{emit.helper(pose_resize)}({emit.inputs[0]}, {oh}, {ow})"


# ---- SpatialDropout -------------------------------------------------------------------------

@register_layer("SpatialDropout")
class SpatialDropout(Layer):
    """TEST copies; TRAIN drops whole maps and scales the kept ones by 1 / (1 - ratio), torch's dropout2d
    (ENet's Python SpatialDropoutLayer in python_layers.py has its own TEST-phase scaling)."""

    uses_training_flag = True
    ratio_field = "spatial_dropout_param"   # the message holding dropout_ratio
    zero_ratio_ok = False                   # whether a ratio of 0 (a copy) loads

    def parse(self, lp):
        need_blobs(lp, lp.type, 1, 1)
        ratio = float(getattr(lp, self.ratio_field).dropout_ratio)
        if not (0 <= ratio < 1 if self.zero_ratio_ok else 0 < ratio < 1):
            low = "[0" if self.zero_ratio_ok else "(0"
            raise LayerError(f"{self.ratio_field}.dropout_ratio must be in {low}, 1), got {ratio}")
        return {"ratio": ratio}

    def infer(self, attrs, in_shapes):
        legacy_nchw(in_shapes[0], self.types[0])
        return [tuple(in_shapes[0])]

    def forward(self, attrs, params, x, training=False):
        return F.dropout2d(x, attrs["ratio"], training=True) if training else x

    def onnx(self, ctx, node):
        ctx.add_node("Identity", [node.inputs[0]], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        dropout = emit.module(f"nn.Dropout2d(p={emit.lit(node.attrs['ratio'])})")
        return f"{dropout}({emit.inputs[0]})"


@register_layer("ChannelDropout")
class ChannelDropout(SpatialDropout):
    """artiit/caffe-pose's ChannelDropout (0adabbc, channel_dropout_layer.cpp): the same whole-map dropout
    (a mask per item and channel, kept maps scaled by 1 / (1 - ratio), TEST copies), read from
    dropout_param.dropout_ratio (its DCHECKs, which release builds skip, want it in (0, 1): 0 copies; 1 would
    scale by infinity, refused)."""

    ratio_field = "dropout_param"
    zero_ratio_ok = True


# ---- CoordsFromHeatMaps ---------------------------------------------------------------------

@register_layer("CoordsFromHeatMaps")
class CoordsFromHeatMaps(Layer):
    def parse(self, lp):
        need_blobs(lp, "CoordsFromHeatMaps", (1, 2), (1, 2), roles="heat maps[, (a, b) blob]")
        has_param = lp.HasField("pose_coords_from_heat_maps_param")
        if has_param and len(lp.bottom) == 2:
            raise LayerError("CoordsFromHeatMaps takes pose_coords_from_heat_maps_param or a second bottom "
                             "holding (heat_map_a, heat_map_b), not both")
        a, b = 1, 0
        if has_param:
            p = lp.pose_coords_from_heat_maps_param
            if not (p.HasField("heat_map_a") and p.HasField("heat_map_b")):
                raise LayerError("pose_coords_from_heat_maps_param needs both heat_map_a and heat_map_b")
            a, b = int(p.heat_map_a), int(p.heat_map_b)
            if p.top_k < 0:
                raise LayerError(f"pose_coords_from_heat_maps_param.top_k must be >= 0, got {p.top_k}")
        top_k = int(lp.pose_coords_from_heat_maps_param.top_k) if has_param else 0
        return {"a": a, "b": b, "from_blob": len(lp.bottom) == 2, "tops": len(lp.top), "top_k": top_k}

    def infer(self, attrs, in_shapes):
        s = in_shapes[0]
        if len(s) != 4:
            raise LayerError(f"CoordsFromHeatMaps needs (N, K, H, W) heat maps, got {list(s)}")
        if attrs["from_blob"] and count(in_shapes[1]) < 2:
            raise LayerError(f"the second bottom must hold (heat_map_a, heat_map_b), got {list(in_shapes[1])}")
        shapes = [(s[0], 2 * s[1], 1, 1)]
        return shapes + [(s[0], s[1], 1, 1)] * (attrs["tops"] - 1)

    def forward(self, attrs, params, maps, ab=None):
        if attrs.get("top_k"):
            out = pose_coords_top_k(maps, attrs["top_k"], attrs["a"], attrs["b"])
        elif attrs["from_blob"]:
            out = pose_coords_scale_from_blob(maps, ab)
        else:
            out = pose_coords_from_heat_maps(maps, attrs["a"], attrs["b"])
        return out if attrs["tops"] == 2 else out[0]

    def _onnx_top_k(self, ctx, node, i64):
        n, k, h, w = ctx.shape(node.inputs[0])
        kk = min(node.attrs["top_k"], h * w)
        flat = ctx.add_node("Reshape", [node.inputs[0], i64(n, k, h * w)], ctx.tmp("flat"))
        rev = ctx.add_node("Slice", [flat, i64(-1), i64(-(h * w) - 1), i64(2), i64(-1)], ctx.tmp("rev"))
        vals, at = ctx.add_node("TopK", [rev, i64(kk)], [ctx.tmp("vals"), ctx.tmp("at")], axis=2)
        idx = ctx.add_node("Sub", [i64(h * w - 1), at], ctx.tmp("idx"))
        parts = []
        for op in ("Mod", "Div"):
            q = ctx.add_node(op, [idx, i64(w)], ctx.tmp(op))
            q = ctx.add_node("ReduceSum", [q, i64(2)], ctx.tmp("sum"), keepdims=1)
            q = ctx.add_node("Div", [q, i64(kk)], ctx.tmp("mean"))
            parts.append(ctx.add_node("Add", [ctx.add_node("Mul", [q, i64(node.attrs["a"])], ctx.tmp("ma")),
                                              i64(node.attrs["b"])], ctx.tmp("mb")))
        xy = ctx.add_node("Cast", [ctx.add_node("Concat", parts, ctx.tmp("xy"), axis=2)], ctx.tmp("xyf"), to=1)
        ctx.add_node("Reshape", [xy, i64(n, 2 * k, 1, 1)], [node.outputs[0]], name=node.name)
        if node.attrs["tops"] == 2:
            mean = ctx.add_node("Div", [ctx.add_node("ReduceSum", [vals, i64(2)], ctx.tmp("s"), keepdims=1),
                                        ctx.const(np.array(kk, np.float32))], ctx.tmp("best"))
            ctx.add_node("Reshape", [mean, i64(n, k, 1, 1)], [node.outputs[1]])

    def onnx(self, ctx, node):
        n, k, h, w = ctx.shape(node.inputs[0])
        i64 = lambda *v: ctx.const(np.array(v, np.int64))   # noqa: E731
        if node.attrs.get("top_k"):
            return self._onnx_top_k(ctx, node, i64)
        flat = ctx.add_node("Reshape", [node.inputs[0], i64(n, k, h * w)], ctx.tmp("flat"))
        idx = ctx.add_node("ArgMax", [flat], ctx.tmp("idx"), axis=2, keepdims=0)
        if node.attrs["from_blob"]:
            v = ctx.add_node("Reshape", [node.inputs[1], i64(-1)], ctx.tmp("ab"))
            a = ctx.add_node("Cast", [ctx.add_node("Slice", [v, i64(0), i64(1)], ctx.tmp("a"))], ctx.tmp("a"), to=7)
            b = ctx.add_node("Cast", [ctx.add_node("Slice", [v, i64(1), i64(2)], ctx.tmp("b"))], ctx.tmp("b"), to=7)
        else:
            a, b = i64(node.attrs["a"]), i64(node.attrs["b"])
        parts = []
        for op in ("Mod", "Div"):
            q = ctx.add_node(op, [idx, i64(w)], ctx.tmp(op))
            q = ctx.add_node("Add", [ctx.add_node("Mul", [q, a], ctx.tmp("ma")), b], ctx.tmp("mb"))
            parts.append(ctx.add_node("Unsqueeze", [q, i64(2)], ctx.tmp("u")))
        xy = ctx.add_node("Concat", parts, ctx.tmp("xy"), axis=2)
        xy = ctx.add_node("Cast", [xy], ctx.tmp("xyf"), to=1)
        ctx.add_node("Reshape", [xy, i64(n, 2 * k, 1, 1)], [node.outputs[0]], name=node.name)
        if node.attrs["tops"] == 2:
            at = ctx.add_node("Unsqueeze", [idx, i64(2)], ctx.tmp("at"))
            best = ctx.add_node("GatherElements", [flat, at], ctx.tmp("best"), axis=2)
            ctx.add_node("Reshape", [best, i64(n, k, 1, 1)], [node.outputs[1]])

    def pytorch_source(self, node, emit):
        fn = emit.helper(pose_coords_from_heat_maps)
        if node.attrs.get("top_k"):
            call = (f"{emit.helper(pose_coords_top_k)}({emit.inputs[0]}, {node.attrs['top_k']}, "
                    f"{node.attrs['a']}, {node.attrs['b']})")
        elif node.attrs["from_blob"]:
            call = f"{emit.helper(pose_coords_scale_from_blob)}({emit.inputs[0]}, {emit.inputs[1]})"
        else:
            call = f"{fn}({emit.inputs[0]}, {node.attrs['a']}, {node.attrs['b']})"
        return [f"{call}[0]", f"{call}[1]"] if node.attrs["tops"] == 2 else f"{call}[0]"


# ---- RescaledPoseCoords ---------------------------------------------------------------------

@register_layer("RescaledPoseCoords")
class RescaledPoseCoords(Layer):
    bottoms, tops, bottom_roles = 2, 1, "coords, aux_info"

    def infer(self, attrs, in_shapes):
        s = in_shapes[0]
        c = legacy_nchw(s, "RescaledPoseCoords")[1]
        if not s or count(s) != s[0] * c or c % 2:
            raise LayerError(f"RescaledPoseCoords needs (N, 2K, 1, 1) coordinates, got {list(s)}")
        _check_aux(in_shapes[1], s[0], "RescaledPoseCoords")
        return [tuple(s)]

    def forward(self, attrs, params, coords, aux):
        return pose_rescaled_coords(coords, aux)

    def onnx(self, ctx, node):
        coords, aux = node.inputs
        shape = ctx.shape(coords)
        n = shape[0]
        i64 = lambda *v: ctx.const(np.array(v, np.int64))   # noqa: E731
        a = ctx.add_node("Reshape", [aux, i64(n, 5)], ctx.tmp("aux"))
        col = {j: ctx.add_node("Slice", [a, i64(j), i64(j + 1), i64(1)], ctx.tmp("col")) for j in (1, 2, 3, 4)}
        p = ctx.add_node("Reshape", [coords, i64(n, -1, 2)], ctx.tmp("p"))
        x = ctx.add_node("Div", [ctx.add_node("Slice", [p, i64(0), i64(1), i64(2)], ctx.tmp("x")),
                                 ctx.add_node("Unsqueeze", [col[3], i64(2)], ctx.tmp("s"))], ctx.tmp("xs"))
        y = ctx.add_node("Div", [ctx.add_node("Slice", [p, i64(1), i64(2), i64(2)], ctx.tmp("y")),
                                 ctx.add_node("Unsqueeze", [col[3], i64(2)], ctx.tmp("s"))], ctx.tmp("ys"))
        w = ctx.add_node("Unsqueeze", [col[1], i64(2)], ctx.tmp("w"))
        h = ctx.add_node("Unsqueeze", [col[2], i64(2)], ctx.tmp("h"))
        flip = ctx.add_node("Not", [ctx.add_node("Equal", [ctx.add_node("Unsqueeze", [col[4], i64(2)], ctx.tmp("f")),
                                                           ctx.f32(0)], ctx.tmp("eq"))], ctx.tmp("flip"))
        mirrored = ctx.add_node("Sub", [ctx.add_node("Sub", [w, ctx.f32(1)], ctx.tmp("w1")), x], ctx.tmp("mx"))
        past = ctx.add_node("GreaterOrEqual", [x, w], ctx.tmp("gx"))   # tested before mirroring
        x = ctx.add_node("Where", [past, ctx.f32(-1), ctx.add_node("Where", [flip, mirrored, x], ctx.tmp("xf"))],
                         ctx.tmp("xo"))
        y = ctx.add_node("Where",
                         [ctx.add_node("GreaterOrEqual", [y, h], ctx.tmp("gy")), ctx.f32(-1), y], ctx.tmp("yo"))
        xy = ctx.add_node("Concat", [x, y], ctx.tmp("xy"), axis=2)
        ctx.add_node("Reshape", [xy, i64(*shape)], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(pose_rescaled_coords)}({emit.inputs[0]}, {emit.inputs[1]})"


# ---- CoordsToBboxesMasks --------------------------------------------------------------------

@register_layer("CoordsToBboxesMasks")
class CoordsToBboxesMasks(Layer):
    data_dependent_shape = True   # H and W are values of aux_info
    shape_from_user = True
    onnx_refusal = ("its height and width are the largest width * im_scale and height * im_scale among "
                    "aux_info's values, a size ONNX export cannot fix in advance")

    def parse(self, lp):
        need_blobs(lp, "CoordsToBboxesMasks", 2, 1, roles="coords, aux_info")
        if not lp.HasField("coord_to_bbox_masks_param"):
            raise LayerError("CoordsToBboxesMasks needs coord_to_bbox_masks_param")
        p = lp.coord_to_bbox_masks_param
        missing = [f for f in ("top_id", "bottom_id", "top_id2", "bottom_id2", "value") if not p.HasField(f)]
        if missing:
            raise LayerError(f"coord_to_bbox_masks_param needs {', '.join(missing)} (the fork checks each)")
        t, b, t2, b2 = int(p.top_id), int(p.bottom_id), int(p.top_id2), int(p.bottom_id2)
        whole = min(t, b, t2, b2) < 0 or t == b or t2 == b2
        pairs = None if whole else ((t, b), (t2, b2))
        return {"name": lp.name, "pairs": pairs, "value": float(p.value), "top": lp.top[0]}

    def infer(self, attrs, in_shapes):
        s = in_shapes[0]
        c = legacy_nchw(s, "CoordsToBboxesMasks")[1]
        if not s or count(s) != s[0] * c:
            raise LayerError(f"CoordsToBboxesMasks needs (N, C, 1, 1) coordinates, got {list(s)}")
        ids = [i for pair in attrs["pairs"] or () for i in pair]
        if ids and max(ids) >= c:
            raise LayerError(f"coord_to_bbox_masks_param ids must be < the coordinates' {c} channels")
        if not ids and c % 2:
            raise LayerError(f"the whole-body box needs (x, y) pairs: {c} channels")
        if s[0] != in_shapes[1][0]:
            raise LayerError(f"coords have {s[0]} items but aux_info {in_shapes[1][0]}")
        raise MissingInputShape(f"the mask's height and width are the largest height * im_scale and "
                                f"width * im_scale in aux_info's values; give them with --input-shape "
                                f"{attrs['top']}={s[0]},1,H,W (the fork feeds the image's own H and W)")

    def top_shapes(self, attrs, given):
        return None   # a full --input-shape is used as it is; nothing else to add

    def _joints(self, attrs):
        pairs = attrs["pairs"]
        if pairs is not None and pairs[0] != pairs[1]:
            raise LayerError(f"layer '{attrs['name']}' (CoordsToBboxesMasks): with two different joint pairs "
                             f"{pairs[0]} and {pairs[1]} the fork picks one at random per item; caffeq does "
                             f"not reproduce that draw")
        return None if pairs is None else pairs[0]

    def forward(self, attrs, params, coords, aux):
        return pose_bbox_masks(coords, aux, self._joints(attrs), attrs["value"])

    def pytorch_source(self, node, emit):
        from ..errors import ExportError
        try:
            joints = self._joints(node.attrs)
        except LayerError as e:
            raise ExportError(str(e)) from None
        return (f"{emit.helper(pose_bbox_masks)}({emit.inputs[0]}, {emit.inputs[1]}, "
                f"{joints!r}, {emit.lit(node.attrs['value'])})")


# ---- read only: targets, data, loss, accuracy --------------------------------------------------

@register_layer("HeatMapsFromCoordsOrigin")
class HeatMapsFromCoordsOrigin(ReadOnlyLayer):
    shape_from_user = True

    def parse(self, lp):
        need_blobs(lp, "HeatMapsFromCoordsOrigin", 2, (2, 3), roles="coords, aux_info")
        p = lp.heat_maps_from_coords_origin_param
        radius = []
        if p.radius_str:
            try:
                radius = [int(r) for r in p.radius_str.split(",")]
            except ValueError:
                raise LayerError(f"heat_maps_from_coords_origin_param.radius_str must be comma-separated "
                                 f"integers, got {p.radius_str!r}") from None
        return {"name": lp.name, "radius": radius, "tops": list(lp.top)}

    def why_not_run(self, attrs):
        return "draws training heat maps from ground-truth coordinates; caffeq does not reproduce it"

    def top_shapes(self, attrs, given):
        attrs["_given"] = sorted(given)   # infer runs next; what the user gave replaces its tops
        return None

    def infer(self, attrs, in_shapes):
        s = in_shapes[0]
        c = legacy_nchw(s, "HeatMapsFromCoordsOrigin")[1]
        if not s or count(s) != s[0] * c or c % 2:
            raise LayerError(f"HeatMapsFromCoordsOrigin needs (N, 2K, 1, 1) coordinates, got {list(s)}")
        if attrs["radius"] and len(attrs["radius"]) != c // 2:
            raise LayerError(f"heat_maps_from_coords_origin_param.radius_str has {len(attrs['radius'])} "
                             f"radii for {c // 2} joints")
        _check_aux(in_shapes[1], s[0], "HeatMapsFromCoordsOrigin")
        top = attrs["tops"][0]
        if 0 in attrs.get("_given", ()):
            return [None, (s[0], c // 2, 1, 1), (4, 1, 1, 1)][:len(attrs["tops"])]
        raise MissingInputShape(f"the heat maps' height and width are the largest height * im_scale and "
                                f"width * im_scale in aux_info's values; give them with --input-shape "
                                f"{top}={s[0]},{c // 2},H,W")


@register_layer("RandomImageData2")
class RandomImageData2(ForkDataLayer):
    """Tops: images (N, C, H, W), H and W from the scaled images (only --input-shape tells them),
    the joints' coordinates (N, label_num, 1, 1) and aux_info (N, 5, 1, 1)."""

    def parse(self, lp):
        need_blobs(lp, "RandomImageData2", 0, (1, 3))
        p = lp.random_image_data2_param
        if not p.HasField("batch_size") or p.batch_size < 1:
            raise LayerError("random_image_data2_param.batch_size must be set and >= 1")
        if not p.HasField("label_num") or p.label_num < 2 or p.label_num % 2:
            raise LayerError(f"random_image_data2_param.label_num must be a positive even number "
                             f"(x, y per joint), got {p.label_num}")
        t = transform_attrs(lp)
        return {"type": lp.type, "tops": list(lp.top), "num_tops": len(lp.top), "transform": t,
                "source": ", ".join(p.source), "batch_size": int(p.batch_size),
                "channels": 3 if p.is_color else 1, "hw": None, "label_num": int(p.label_num)}

    def data_shape(self, attrs):
        raise needs_input_shape(attrs, attrs["tops"][0], "RandomImageData2 scales each image by max_size "
                                "and min_size and pads the batch to the largest")

    def top_shapes(self, attrs, given):
        data = tuple(given.get(0) or self.data_shape(attrs))
        shapes = [data]
        if attrs["num_tops"] == 3:
            shapes.append(tuple(given.get(1) or (data[0], attrs["label_num"], 1, 1)))
            shapes.append(tuple(given.get(2) or (data[0], 5, 1, 1)))
        return shapes


@register_layer("PoseHeatMapLoss")
class PoseHeatMapLoss(ReadOnlyLayer):
    is_training_only = True

    def parse(self, lp):
        need_blobs(lp, "PoseHeatMapLoss", (2, 3), (0, 1), roles="predicted maps, target maps[, masks]")
        return {"name": lp.name, "tops": len(lp.top)}

    def why_not_run(self, attrs):
        return "a training loss (sampled background pixels); caffeq does not reproduce it"

    def infer(self, attrs, in_shapes):
        p, t = in_shapes[0], in_shapes[1]
        if tuple(p) != tuple(t):
            raise LayerError(f"predicted {list(p)} and target {list(t)} maps must have the same shape")
        if len(in_shapes) == 3:
            m = legacy_nchw(in_shapes[2], "PoseHeatMapLoss")
            if m[0] != p[0] or m[1] != legacy_nchw(p, "PoseHeatMapLoss")[1] or count(m) != m[0] * m[1]:
                raise LayerError(f"the masks must be (N, K, 1, 1) as the maps' N and K, got {list(in_shapes[2])}")
        return [()] * attrs["tops"]


@register_layer("PosePDJAccuracy")
class PosePDJAccuracy(ReadOnlyLayer):
    is_training_only = True

    def parse(self, lp):
        need_blobs(lp, "PosePDJAccuracy", 2, 1, roles="predicted coords, true coords")
        p = lp.pose_pdj_accuracy_param
        return {"name": lp.name, "shoulder": int(p.shoulder_id), "hip": int(p.hip_id)}

    def why_not_run(self, attrs):
        return "an accuracy over the whole test set that writes its logs under acc_path; caffeq does not reproduce it"

    def infer(self, attrs, in_shapes):
        a, b = in_shapes
        if tuple(a) != tuple(b):
            raise LayerError(f"predicted {list(a)} and true {list(b)} coordinates must have the same shape")
        c = legacy_nchw(a, "PosePDJAccuracy")[1]
        if count(a) != a[0] * c or c % 2:
            raise LayerError(f"PosePDJAccuracy needs (N, 2K, 1, 1) coordinates, got {list(a)}")
        for f in ("shoulder", "hip"):
            if not 0 <= attrs[f] < c // 2:
                raise LayerError(f"pose_pdj_accuracy_param.{f}_id must be in [0, {c // 2}), got {attrs[f]}")
        return [(1, 1, 1, 1)]


# ---- sinks: visualisation ---------------------------------------------------------------------

class _VisualSink(Sink):
    """Writes images or text files and has no top: for inference a sink, like Silence."""

    aux_last = True

    def parse(self, lp):
        need_blobs(lp, lp.type, range(2 if self.aux_last else 1, AT_LEAST), 0)
        return {}

    def infer(self, attrs, in_shapes):
        if self.aux_last:
            _check_aux(in_shapes[-1], in_shapes[0][0], self.types[0])
        return []


@register_layer("VisualizedHeatMaps")
class VisualizedHeatMaps(_VisualSink):
    aux_last = False

    def infer(self, attrs, in_shapes):
        if any(tuple(s) != tuple(in_shapes[0]) for s in in_shapes):
            raise LayerError(f"VisualizedHeatMaps' bottoms must share one shape, got {[list(s) for s in in_shapes]}")
        return []


@register_layer("VisualizedHeatMaps2")
class VisualizedHeatMaps2(_VisualSink):
    pass


@register_layer("VisualizedPoseCoords")
class VisualizedPoseCoords(_VisualSink):
    pass
