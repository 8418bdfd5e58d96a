"""NVIDIA's DetectNetTransformation (NVCaffe 0.15-0.17, the layer of DIGITS' DetectNet train_val
nets; NVIDIA/caffe c94daa05: detectnet_transform_layer.cpp / .cu, util/detectnet_coverage_rectangular.cpp).

Bottoms: the images (N, 3, H, W) and DIGITS' bbox label blob (N, 1, max_boxes + 1, 16).  Tops (Reshape):
  transformed_data  (N, 3, image_size_y, image_size_x)
  transformed_label (N, 8 + K, gh, gw), gw = round(image_size_x * float(1 / stride)) (likewise gh; OpenCV's
                    float-to-int Rect conversion rounds), K = 1 + the largest object_class.dst (one class,
                    src 1 -> 0, when none is given).  SidHard/digits-multi-detect (371385e) declares
                    object_class a count n instead (`object_class: 3`): classes 1..n -> maps 0..n-1, K = n
                    (the text reader stores it in object_class_count; its generator is NVCaffe's otherwise).
Parameters: detectnet_groundtruth_param, detectnet_augmentation_param (the fork's numbers 6801, 6802)
and transform_param's mean_value (0, 1 or 3 values) or mean_file; the other transform fields are
not read by the fork.

TEST phase (get_augmentations: no colour change, no flip, no rotation, crop offset 0, scale = the
image size).  caffeq computes what Forward_gpu computes (DIGITS trains and validates DetectNet on the
GPU; NVCaffe 0.17 dropped CPU_ONLY):
  data:  x - mean_value (each of the 3 channels; one value serves all), in float32, then, along each
         axis whose size differs from image_size, the kernel's resize: output i reads source position
         p = i * float((in - 1) / (out - 1)) with 4-point Lagrange cubic weights at d = p - floor(p)
         over floor(p) - 1, floor(p), ceil(p), ceil(p) + 1 (index -1 and `in` read the edge pixel,
         any further one 0).  An unchanged axis is copied.  (Forward_cpu differs there: OpenCV's
         INTER_CUBIC, half-pixel Keys a = -0.75; the two agree where the size is already image_size.)
  label: CoverageGenerator::generate on the boxes, scaled by image_size / (W, H) where the size
         differs: crop to the image when crop_bboxes, keep the mapped classes with area >= FLT_EPSILON;
         per box, in order, a coverage rectangle centred on it (its size * scale_cvg, then at least
         min_cvg_len but at most the box for GRIDBOX_MIN, at most max_cvg_len for GRIDBOX_MAX); every
         grid cell it overlaps by more than FLT_EPSILON of a cell gets: channel 0 = 1, 1-4 = the box's
         corners minus the cell's top-left (x1, y1, x2, y2), 5-6 = 1 / box width, 1 / box height, 7 =
         max(stride^2 / coverage area, 0 if obj_norm else 1), and coverage channel 8 + dst = 1 (the
         other coverage channels 0).  Later boxes overwrite earlier ones.
TRAIN phase: random hue / desaturation / flip / scale / rotation / crop, read and sized only.
ONNX: the data top (mean subtraction and two constant MatMuls); the label maps are built box by box
from values, which ONNX cannot express: the export refuses only where that top is used.
"""
import numpy as np
import torch
from google.protobuf.unknown_fields import UnknownFieldSet
from torch import nn

from ..errors import ExportError
from ..io.schema import caffe_pb2
from .registry import Layer, LayerError, cached_constant, need_blobs, register_layer

BBOX_LEN = 16          # DIGITS' BboxLabel: x, y, w, h, alpha, class, ... (16 floats; the header row too)
LABEL_FIELDS = 8       # foreground, x1, y1, x2, y2, 1/w, 1/h, obj_norm; then one coverage map per class


# ---- the data top ----------------------------------------------------------------------------

def detectnet_resize_axis(out_size: int, in_size: int):
    """The (out_size, in_size) matrix of Forward_gpu's resize along one axis: source position
    p = i * float32((in - 1) / (out - 1)), Lagrange cubic weights over floor(p) - 1 .. ceil(p) + 1,
    index -1 and in_size reading the edge, indexes past those 0."""
    m = torch.zeros(out_size, in_size, dtype=torch.float64)
    if out_size == in_size:
        return torch.eye(in_size, dtype=torch.float32)
    ratio = torch.tensor(float(in_size - 1), dtype=torch.float32) / torch.tensor(float(out_size - 1),
                                                                                dtype=torch.float32)
    pos = torch.arange(out_size, dtype=torch.float32) * ratio
    lo, hi = torch.floor(pos), torch.ceil(pos)
    d = (pos - lo).double()
    weights = ((-2 * d + 3 * d * d - d ** 3) / 6, 1 + (-3 * d - 6 * d * d + 3 * d ** 3) / 6,
               (6 * d + 3 * d * d - 3 * d ** 3) / 6, (-d + d ** 3) / 6)
    rows = torch.arange(out_size)
    for index, w in zip((lo - 1, lo, hi, hi + 1), weights):
        index = index.long()
        index = torch.where(index == -1, 0, torch.where(index == in_size, in_size - 1, index))
        inside = (index >= 0) & (index < in_size)
        m.index_put_((rows, index.clamp(0, in_size - 1)), torch.where(inside, w, 0.0), accumulate=True)
    return m.float()


def detectnet_data(x, mean, mh, mw):
    """The TEST-phase data top: x - mean (None: none), then mh @ . @ mw^T along the axes that change
    (None: kept)."""
    if mean is not None:
        x = x - mean
    if mh is not None:
        x = torch.matmul(mh, x)
    if mw is not None:
        x = torch.matmul(x, mw.t())
    return x


# ---- the label top ---------------------------------------------------------------------------

def _f32(v):
    return torch.tensor(v, dtype=torch.float32)


def _rect_and(ax, ay, aw, ah, bx, by, bw, bh):
    """cv::Rect_<float> intersection, (0, 0, 0, 0) when empty (element-wise on tensors)."""
    x1 = torch.maximum(ax, bx)
    y1 = torch.maximum(ay, by)
    w = torch.minimum(ax + aw, bx + bw) - x1
    h = torch.minimum(ay + ah, by + bh) - y1
    empty = (w <= 0) | (h <= 0)
    zero = torch.zeros_like(w)
    return (torch.where(empty, zero, x1), torch.where(empty, zero, y1),
            torch.where(empty, zero, w), torch.where(empty, zero, h))


def detectnet_boxes(label, height: int, width: int, image_x: int, image_y: int):
    """Per image, the (count, 16) float32 boxes of DIGITS' label blob (header: count, 16), scaled to
    image_size where (width, height) differs from it, as transform_label_cpu does at TEST."""
    out = []
    rows = label.shape[2] if label.dim() > 2 else 1
    for flat in label.detach().to("cpu", torch.float32).reshape(label.shape[0], -1):
        count, length = int(flat[0].item()), int(flat[1].item())
        if length != 16:
            raise ValueError(f"DetectNetTransformation: a label record's header gives bbox length {length}, "
                             f"the fork reads 16 values per box")
        if count < 0 or count > rows or 16 * (count + 1) > flat.numel():
            raise ValueError(f"DetectNetTransformation: a label record's header gives {count} boxes, more "
                             f"than the label blob's {rows} rows hold")
        boxes = flat[16:16 * (count + 1)].reshape(count, 16).clone()
        if (width, height) != (image_x, image_y):
            sx = _f32(float(image_x)) / _f32(float(width))
            sy = _f32(float(image_y)) / _f32(float(height))
            boxes[:, 0] *= sx
            boxes[:, 1] *= sy
            boxes[:, 2] *= sx
            boxes[:, 3] *= sy
        out.append(boxes)
    return out


def detectnet_coverage(boxes, classes: dict, stride: int, image_x: int, image_y: int, grid_x: int,
                       grid_y: int, scale_cvg: float, gridbox_min: bool, min_cvg_len: int,
                       max_cvg_len: int, obj_norm: bool, crop_bboxes: bool):
    """CoverageGenerator::generate (rectangular) of one image's (count, 16) boxes -> (8 + K, gy, gx)."""
    depth = 8 + max(classes.values()) + 1
    out = torch.zeros(depth, grid_y, grid_x, dtype=torch.float32)
    f_stride = _f32(float(stride))
    cell_area = _f32(float(stride * stride))
    min_norm = _f32(0.0 if obj_norm else 1.0)
    zero, full_x, full_y = _f32(0.0), _f32(float(image_x)), _f32(float(image_y))
    for box in boxes:
        x, y, w, h = box[0], box[1], box[2], box[3]
        if crop_bboxes:
            x, y, w, h = _rect_and(x, y, w, h, zero, zero, full_x, full_y)
        cls = float(box[5].item())
        if cls < 0 or int(cls) not in classes or float(w * h) < 1.1920928955078125e-07:   # FLT_EPSILON
            continue
        cx = (x + (x + w)) * 0.5
        cy = (y + (y + h)) * 0.5
        sw, sh = w * _f32(scale_cvg), h * _f32(scale_cvg)
        if gridbox_min:
            sw = torch.minimum(w, torch.maximum(_f32(float(min_cvg_len)), sw))
            sh = torch.minimum(h, torch.maximum(_f32(float(min_cvg_len)), sh))
        else:
            sw = torch.minimum(_f32(float(max_cvg_len)), sw)
            sh = torch.minimum(_f32(float(max_cvg_len)), sh)
        ax, bx = cx + sw * 0.5, cx - sw * 0.5
        ay, by = cy + sh * 0.5, cy - sh * 0.5
        cov_x, cov_y = torch.minimum(ax, bx), torch.minimum(ay, by)
        cov_w, cov_h = torch.maximum(ax, bx) - cov_x, torch.maximum(ay, by) - cov_y
        norm = torch.maximum(min_norm, cell_area / (cov_w * cov_h))
        gx0, gy0 = int(torch.floor(cov_x / f_stride)), int(torch.floor(cov_y / f_stride))
        gx1, gy1 = int(torch.ceil((cov_x + cov_w) / f_stride)), int(torch.ceil((cov_y + cov_h) / f_stride))
        gx0, gx1 = max(min(gx0, gx1), 0), min(max(gx0, gx1), grid_x)
        gy0, gy1 = max(min(gy0, gy1), 0), min(max(gy0, gy1), grid_y)
        if gx1 <= gx0 or gy1 <= gy0:
            continue
        cell_x = torch.arange(gx0, gx1, dtype=torch.float32) * f_stride
        cell_y = torch.arange(gy0, gy1, dtype=torch.float32) * f_stride
        gxx, gyy = cell_x[None, :].expand(gy1 - gy0, -1), cell_y[:, None].expand(-1, gx1 - gx0)
        _, _, iw, ih = _rect_and(cov_x, cov_y, cov_w, cov_h, gxx, gyy, f_stride, f_stride)
        hit = (iw * ih) / cell_area > 1.1920928955078125e-07
        region = out[:, gy0:gy1, gx0:gx1]
        values = [1.0, x - gxx, y - gyy, (x + w) - gxx, (y + h) - gyy,
                  (1.0 / w.double()).float(), (1.0 / h.double()).float(), norm]
        for channel, value in enumerate(values):
            region[channel] = torch.where(hit, value, region[channel])
        region[8:] = torch.where(hit, 0.0, region[8:])
        region[8 + classes[int(cls)]] = torch.where(hit, 1.0, region[8 + classes[int(cls)]])
    return out


def detectnet_label(label, height: int, width: int, g: dict):
    """The TEST-phase label top: every image's coverage and bbox maps, (N, 8 + K, gy, gx)."""
    maps = [detectnet_coverage(b, g["classes"], g["stride"], g["image_x"], g["image_y"], g["grid_x"],
                               g["grid_y"], g["scale_cvg"], g["gridbox_min"], g["min_cvg_len"],
                               g["max_cvg_len"], g["obj_norm"], g["crop_bboxes"])
            for b in detectnet_boxes(label, height, width, g["image_x"], g["image_y"])]
    return torch.stack(maps).to(label.device)


class CaffeDetectNetTransform(nn.Module):
    """DetectNetTransformation at TEST: (images, DIGITS bbox labels) -> (data, ground-truth maps)."""

    def __init__(self, mean, in_h: int, in_w: int, ground_truth, classes, with_label: bool = True):
        super().__init__()
        self.with_label = with_label
        ground_truth = dict(ground_truth, classes={int(s): int(d) for s, d in classes})
        self.has_mean = mean is not None
        self.register_buffer("mean", torch.tensor(mean if mean is not None else [0.0] * 3,
                                                  dtype=torch.float32).reshape(1, 3, 1, 1), persistent=False)
        self.in_h, self.in_w, self.g = in_h, in_w, ground_truth
        self.resize_h = in_h != ground_truth["image_y"]
        self.resize_w = in_w != ground_truth["image_x"]
        self.register_buffer("mh", detectnet_resize_axis(ground_truth["image_y"], in_h), persistent=False)
        self.register_buffer("mw", detectnet_resize_axis(ground_truth["image_x"], in_w), persistent=False)

    def forward(self, x, label):
        data = detectnet_data(x, self.mean if self.has_mean else None, self.mh if self.resize_h else None,
                              self.mw if self.resize_w else None)
        return data, (detectnet_label(label, self.in_h, self.in_w, self.g) if self.with_label else None)


# ---- the spec ---------------------------------------------------------------------------------

def _phase(lp):
    """The layer's own phase field (Net::Init gives a layer without one the net's phase: None here,
    which the graph builder fills in with the phase it builds)."""
    return caffe_pb2.Phase.Name(lp.phase) if lp.HasField("phase") else None


#: the most classes a count-form object_class may give (SidHard's fork has no bound below INT_MAX elements)
MAX_CLASS_COUNT = 65536


def _class_count(p):
    """SidHard/digits-multi-detect's `object_class: n` (a uint32 at 13 there, NVCaffe's ClassMapping here):
    from the text reader's object_class_count, or a binary file's varint 13, which protobuf keeps unknown."""
    if p.HasField("object_class_count"):
        return int(p.object_class_count)
    numbers = [f.data for f in UnknownFieldSet(p) if f.field_number == 13 and f.wire_type == 0]
    return int(numbers[-1]) if numbers else None


def _ground_truth(lp):
    p = lp.detectnet_groundtruth_param
    what = "detectnet_groundtruth_param"
    for field in ("stride", "image_size_x", "image_size_y"):
        if getattr(p, field) < 1:
            raise LayerError(f"{what}.{field} must be >= 1, got {getattr(p, field)}")
    classes = {}
    for mapping in p.object_class:
        classes[int(mapping.src)] = int(mapping.dst)    # std::map: a repeated src keeps the last dst
    count = _class_count(p)
    if count is not None:
        if classes:
            raise LayerError(f"{what}.object_class: give src / dst mappings (NVCaffe) or one class count "
                             f"(SidHard/digits-multi-detect), not both")
        if count > MAX_CLASS_COUNT:
            # checked before the map is built: the label blob has 8 + count maps
            raise LayerError(f"{what}.object_class: {count} classes is absurd (the label top would hold "
                             f"8 + {count} maps); caffeq reads at most {MAX_CLASS_COUNT}")
        # the fork's assignLabels: source classes 1..count to coverage maps 0..count-1
        classes = {k + 1: k for k in range(count)}
    if not classes:
        classes = {1: 0}    # the fork's KITTI default: class 1 (car) -> coverage map 0
    stride = int(p.stride)
    inv = np.float32(1.0 / stride)
    grid_x = int(np.rint(np.float32(p.image_size_x) * inv))
    grid_y = int(np.rint(np.float32(p.image_size_y) * inv))
    if grid_x < 1 or grid_y < 1:
        raise LayerError(f"{what}: image_size {p.image_size_x} x {p.image_size_y} over stride {stride} gives "
                         f"a {grid_x} x {grid_y} label grid")
    if not np.isfinite(p.scale_cvg) or p.scale_cvg < 0:
        raise LayerError(f"{what}.scale_cvg must be a number >= 0, got {p.scale_cvg}")
    return {"stride": stride, "image_x": int(p.image_size_x), "image_y": int(p.image_size_y),
            "grid_x": grid_x, "grid_y": grid_y, "scale_cvg": float(p.scale_cvg),
            "gridbox_min": p.gridbox_type == 1, "min_cvg_len": int(p.min_cvg_len),
            "max_cvg_len": int(p.max_cvg_len), "obj_norm": bool(p.obj_norm),
            "crop_bboxes": bool(p.crop_bboxes), "classes": classes}


def _augmentation(lp):
    a = lp.detectnet_augmentation_param
    what = "detectnet_augmentation_param"
    fields = ("crop_prob", "scale_prob", "flip_prob", "rotation_prob", "hue_rotation_prob", "desaturation_prob")
    for field in fields:
        if not np.isfinite(getattr(a, field)):
            raise LayerError(f"{what}.{field} must be a number, got {getattr(a, field)}")
    for field in ("scale_min", "scale_max"):
        if not getattr(a, field) > 0:    # the random scale resizes the image to that factor of its size
            raise LayerError(f"{what}.{field} must be > 0, got {getattr(a, field):g}")
    return {f.name: (v if not isinstance(v, float) else float(np.float32(v)))
            for f, v in ((f, getattr(a, f.name)) for f in a.DESCRIPTOR.fields if f.message_type is None)}


@register_layer("DetectNetTransformation")
class DetectNetTransformation(Layer):
    makes_training_targets = True    # the label maps: what DetectNet's losses and scorers read

    def parse(self, lp):
        need_blobs(lp, "DetectNetTransformation", 2, 2, "data, label")
        t = lp.transform_param
        means = [float(v) for v in t.mean_value]
        if len(means) not in (0, 1, 3):
            raise LayerError(f"transform_param.mean_value: give 1 or 3 values, got {len(means)} (the fork "
                             f"reads only those counts)")
        mean = None
        if means and not t.HasField("mean_file"):
            # retrieveMeanChannels: value / 255 in float32, the GPU kernel multiplies back by 255
            mean = [float(np.float32(np.float32(v) / np.float32(255)) * np.float32(255))
                    for v in (means * 3 if len(means) == 1 else means)]
        notes = []
        ignored = [f for f in ("scale", "mirror", "crop_size", "force_color", "force_gray") if t.HasField(f)]
        if ignored:
            notes.append(f"transform_param {', '.join(ignored)}: not read by NVCaffe's DetectNetTransformation "
                         f"(it reads only mean_value / mean_file)")
        attrs = {"name": lp.name, "phase": _phase(lp), "mean": mean,
                 "mean_file": t.mean_file if t.HasField("mean_file") else None,
                 "ground_truth": _ground_truth(lp), "augmentation": _augmentation(lp)}
        if notes:
            attrs["reading_notes"] = notes
        return attrs

    def infer(self, attrs, in_shapes):
        data, label = tuple(in_shapes[0]), tuple(in_shapes[1])
        if len(data) != 4 or data[1] != 3:
            raise LayerError(f"the images (bottom 0) must be N x 3 x H x W (the fork takes 3-channel images "
                             f"only), got {list(data)}")
        if not label or label[0] != data[0]:
            raise LayerError(f"the label blob's num {label[0] if label else '?'} differs from the data's {data[0]}")
        g = attrs["ground_truth"]
        depth = LABEL_FIELDS + max(g["classes"].values()) + 1
        return [(data[0], 3, g["image_y"], g["image_x"]), (label[0], depth, g["grid_y"], g["grid_x"])]

    def cannot_run(self, attrs, in_shapes):
        if attrs["phase"] == "TRAIN":
            return ("TRAIN phase: random hue, desaturation, flip, scale, rotation and crop per image "
                    "(detectnet_augmentation_param) are not reproduced; run the TEST phase")
        if attrs["mean_file"]:
            return (f"transform_param.mean_file {attrs['mean_file']!r}: the fork resizes the mean image with "
                    f"OpenCV's bicubic resize, which caffeq does not reproduce; give mean_value instead")
        g = attrs["ground_truth"]
        if in_shapes:
            _, _, h, w = in_shapes[0]
            for size, image, axis in ((w, g["image_x"], "x"), (h, g["image_y"], "y")):
                if size != image and image == 1:
                    return (f"image_size_{axis} 1 from a {size}-pixel axis: the fork's GPU resize divides "
                            f"by image_size_{axis} - 1 = 0")
            if len(in_shapes) > 1 and len(in_shapes[1]) > 1 and int(np.prod(in_shapes[1][1:])) < BBOX_LEN:
                return (f"the label blob {list(in_shapes[1])} holds fewer than the 16 values of DIGITS' "
                        f"header row")
        return None

    @staticmethod
    def _mats(attrs, h, w, device, dtype):
        g = attrs["ground_truth"]
        mh = cached_constant(detectnet_resize_axis, g["image_y"], h, device=device, dtype=dtype) \
            if h != g["image_y"] else None
        mw = cached_constant(detectnet_resize_axis, g["image_x"], w, device=device, dtype=dtype) \
            if w != g["image_x"] else None
        return mh, mw

    def forward(self, attrs, params, x, label):
        self.refuse_if_cannot_run(attrs["name"], attrs, [tuple(x.shape), tuple(label.shape)], LayerError)
        h, w = x.shape[2], x.shape[3]
        mean = None
        if attrs["mean"] is not None:
            mean = torch.tensor(attrs["mean"], dtype=x.dtype, device=x.device).reshape(1, 3, 1, 1)
        mh, mw = self._mats(attrs, h, w, x.device, x.dtype)
        try:
            maps = detectnet_label(label, h, w, attrs["ground_truth"])
        except ValueError as e:
            raise LayerError(f"layer '{attrs['name']}' (DetectNetTransformation): {e}") from None
        return detectnet_data(x, mean, mh, mw), maps.to(x.dtype)

    def pytorch_source(self, node, emit):
        shapes = [emit.in_shape(i) for i in range(2)]
        self.refuse_if_cannot_run(node.name, node.attrs, shapes, ExportError)
        _, _, h, w = shapes[0]
        with_label = bool(emit.consumers(node.outputs[1]) or emit.is_output(node.outputs[1]))
        g = node.attrs["ground_truth"]
        flat = [[k, v] for k, v in g.items() if k != "classes"]
        m = emit.instance(CaffeDetectNetTransform, node.attrs["mean"], h, w, flat, sorted(g["classes"].items()),
                          with_label,
                          needs=[detectnet_resize_axis, detectnet_data, _f32, _rect_and, detectnet_boxes,
                                 detectnet_coverage, detectnet_label])
        out = emit.tmp("detectnet")
        emit.stmt(f"{out} = {m}({', '.join(emit.inputs)})")
        return [f"{out}[0]", f"{out}[1]"]

    def onnx(self, ctx, node):
        shapes = [ctx.shape(i) for i in node.inputs]
        self.refuse_if_cannot_run(node.name, node.attrs, shapes, ExportError)
        if ctx.needed(node.outputs[1]):
            raise ExportError(f"layer '{node.name}' (DetectNetTransformation): its ground-truth maps "
                              f"'{node.outputs[1]}' are built box by box from the label blob's values, "
                              f"which ONNX cannot express; export the net without them (--outputs)")
        _, _, h, w = shapes[0]
        g = node.attrs["ground_truth"]
        x = node.inputs[0]
        steps = []
        if node.attrs["mean"] is not None:
            steps.append(("Sub", ctx.const(np.array(node.attrs["mean"], np.float32).reshape(1, 3, 1, 1)), False))
        if h != g["image_y"]:
            steps.append(("MatMul", ctx.const(detectnet_resize_axis(g["image_y"], h).numpy()), True))
        if w != g["image_x"]:
            mw = np.ascontiguousarray(detectnet_resize_axis(g["image_x"], w).numpy().T)
            steps.append(("MatMul", ctx.const(mw), False))
        if not steps:
            ctx.add_node("Identity", [x], [node.outputs[0]], name=node.name)
            return
        for i, (op, const, const_first) in enumerate(steps):
            out = node.outputs[0] if i == len(steps) - 1 else ctx.tmp(f"{node.name}_{op.lower()}{i}")
            x = ctx.add_node(op, [const, x] if const_first else [x, const], [out], name=node.name)[0]

