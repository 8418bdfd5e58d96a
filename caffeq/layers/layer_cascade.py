"""Deep Layer Cascade's layers (Li et al., CVPR 2017, "Not All Pixels Are Equal"), as
lxx1991/caffe_mpi_backup has them: HEAD 90fa387 (src/caffe/layers/mask_layer.cpp/.cu,
spatial_filter_layer.cpp/.cu, seg_data_layer.cpp, include/caffe/neuron_layers.hpp,
src/caffe/proto/caffe.proto), and the Mask of f1c8ae6 / c8107b9 that its older example nets set.
Both layers have only a GPU forward (Forward_cpu is NOT_IMPLEMENTED) and no phase switch: TEST
computes what TRAIN does.

- Mask (bottoms = tops: (prob) -> (mask), or (prob, label) -> (mask, new label)).  Reshape checks
  num() == 1; the mask is (1, 1, H, W) from the prob's legacy height / width, the new label is shaped
  like the label.  Per pixel p of the H x W plane (S = H x W, the prob read as C x S):
    90fa387 (mask_param threshold_easy [1], threshold_hard [1], ignore_label):
      one top   mask = 0 if some prob[c, p] > threshold_easy + 1e-9, else 1 (threshold_hard unused);
      two tops  l = (int) label[p]; dropped if (l < C and prob[l, p] > threshold_easy + 1e-9) or some
                prob[c, p] > threshold_hard + 1e-9; mask = 0 where dropped, else 1; new label =
                ignore_label where dropped, else l.
    f1c8ae6 (mask_param threshold [0], negative_label, ignore_label):
      one top   mask = 0 if prob[negative_label, p] > threshold (negative_label set), else if some
                prob[c, p] > threshold; else 1;
      two tops  dropped if prob[negative_label, p] > threshold and l == negative_label (negative_label
                set), else if l < C and prob[l, p] > threshold; mask and new label as above.
  The first Mask (407e997b to cba00954, the same three fields) differed with two tops only: dropped if
  prob[negative_label, p] > threshold (negative_label set; the label not compared), else if some
  prob[c, p] > threshold; the new label the label copied untruncated.  IRes_VOC_mult_stage_PN_Lconv's net
  was last edited then (cba00954); caffeq reads its fields as f1c8ae6's, the last code that read them.
  The 1e-9 is added in double (a float Dtype plus a double literal): caffeq compares the float prob
  with the float32 just below or at threshold + 1e-9, which decides the same.  A negative l makes the
  kernel read before the prob (undefined): caffeq takes it as not easy.  The label must hold S values
  (the kernel reads S of them; a bigger label keeps stale values past S in the new label).
  caffeq's "Mask" is also WeitaoVan/faceID's (2 bottoms, 1 top, scale; faceid.py), LSTM-CF's (no
  bottom, width / height; lstm_cf.py) and caffe-gan's (imp_map_param): this spec claims the Masks with
  one bottom and one top or two and two, or any of this fork's fields, and refuses a mix of the forks'.
- SpatialFilter (bottoms mask, data; one top shaped like data): Reshape checks num() == 1, the mask's
  channels() == 1 and its height / width are the data's; top[c, p] = 0 where mask[p] < 0.5, else
  data[c, p] (a NaN mask keeps the data).
- SegData (seg_data_param source, root_dir, shuffle, balance; transform_param stride,
  upper_size / upper_height / upper_width): one image and its label map per batch: data
  (1, C, H, W), label (1, 1, H, W), H and W the first image's size rounded down to a multiple of
  stride and capped by the upper size.  The image decides them: `--input-shape data=1,C,H,W` gives
  them, and the label follows.  XiaohangZhan/mix-and-match's later SegData (8d4c9df) adds
  seg_data_param.batch_size: where it is set, crop_size gives H = W (batch_size 1 may leave it out)
  and the data has 3 channels (its images are read in colour).
"""
import numpy as np
import torch

from .data import transform_attrs
from .fork_data import ForkDataLayer
from .registry import (
    Layer,
    LayerError,
    claim_layers,
    legacy_nchw,
    need_blobs,
    needs_input_shape,
    positive_field,
    register_layer,
    torch_sources,
)

_HEAD_FIELDS = ("threshold_easy", "threshold_hard")
_OLD_FIELDS = ("threshold", "negative_label")
_FIELDS = _HEAD_FIELDS + _OLD_FIELDS + ("ignore_label",)
_WHAT = "Mask (lxx1991's layer cascade)"


def _float_cut(threshold, epsilon):
    """The float32 c with (float x > double(threshold) + epsilon) == (x > c) for every float32 x."""
    bound = float(np.float32(threshold)) + epsilon
    c = np.float32(bound)
    if float(c) > bound:
        c = np.nextafter(c, np.float32(-np.inf))
    return float(c)


def _as_int(value):
    """A uint32 field stored in the kernel's int."""
    value = int(value)
    return value - (1 << 32) if value >= 1 << 31 else value


def _is_cascade_mask(lp):
    p = lp.mask_param
    if lp.HasField("imp_map_param") or not len(lp.bottom) or p.HasField("width") or p.HasField("height"):
        return False
    return any(p.HasField(f) for f in _FIELDS) or (len(lp.bottom), len(lp.top)) in ((1, 1), (2, 2))


def cascade_mask(prob, label, c: int, s: int, version: int, cut_easy: float, cut_hard: float,
                 negative_label: int, ignore_label: float):
    """The Mask kernel on a num-1 prob: (mask (1, 1, S) as 0/1, new label (S,) or None).
    version 1 is 90fa387's (cut_easy, cut_hard), 0 f1c8ae6's (cut_easy the threshold)."""
    p = prob.reshape(c, s)
    if label is None:
        if version == 0 and negative_label >= 0:
            drop = p[negative_label] > cut_easy
        else:
            drop = (p > cut_easy).any(dim=0)
        return (~drop).to(prob.dtype).reshape(1, 1, s), None
    lab = torch.trunc(label.reshape(s))
    inside = (lab >= 0) & (lab < c)
    at_label = p.gather(0, lab.clamp(0, c - 1).to(torch.int64).reshape(1, s)).reshape(s)
    if version == 0 and negative_label >= 0:
        drop = (p[negative_label] > cut_easy) & (lab == negative_label)
    elif version == 0:
        drop = inside & (at_label > cut_easy)
    else:
        drop = (inside & (at_label > cut_easy)) | (p > cut_hard).any(dim=0)
    mask = (~drop).to(prob.dtype).reshape(1, 1, s)
    new_label = torch.where(drop, torch.full_like(lab, ignore_label), lab)
    return mask, new_label


def lxx_cascade_mask(prob, label, c: int, h: int, w: int, label_shape: list, version: int, cut_easy: float,
                     cut_hard: float, negative_label: int, ignore_label: float):
    """The Mask's tops: (mask (1, 1, H, W), new label shaped `label_shape`) or the mask alone."""
    mask, new_label = cascade_mask(prob, label, c, h * w, version, cut_easy, cut_hard, negative_label,
                                   ignore_label)
    if label is None:
        return mask.reshape(1, 1, h, w)
    return mask.reshape(1, 1, h, w), new_label.reshape(label_shape).to(prob.dtype)


def spatial_filter(mask, data, s: int):
    """SpatialFilter: the data where the (S-valued) mask is not below 0.5, else 0."""
    x = data.reshape(1, -1, s)
    off = mask.reshape(1, 1, s) < 0.5
    return torch.where(off, torch.zeros_like(x), x).reshape(data.shape)


TORCH_MASK = torch_sources(cascade_mask, lxx_cascade_mask)
TORCH_FILTER = torch_sources(spatial_filter)


@claim_layers("Mask", _is_cascade_mask)
class CascadeMask(Layer):
    def parse(self, lp):
        p = lp.mask_param
        counts = (len(lp.bottom), len(lp.top))
        if counts not in ((1, 1), (2, 2)):
            raise LayerError(f"a Mask that sets mask_param {'/'.join(f for f in _FIELDS if p.HasField(f))} is "
                             f"lxx1991's (1 bottom and 1 top, or 2 and 2), got {counts[0]} and {counts[1]} "
                             f"(faceID's Mask takes 2 bottoms, 1 top and only scale)")
        if p.HasField("scale") or len(p.background):
            other = "scale" if p.HasField("scale") else "background"
            raise LayerError(f"ambiguous Mask: mask_param.{other} is another fork's, lxx1991's Mask (1 bottom and "
                             f"1 top, or 2 and 2) reads threshold_easy / threshold_hard / ignore_label or "
                             f"threshold / negative_label")
        old = [f for f in _OLD_FIELDS if p.HasField(f)]
        head = [f for f in _HEAD_FIELDS if p.HasField(f)]
        if old and head:
            raise LayerError(f"mask_param sets {'/'.join(old)} (lxx1991's Mask before 90fa387) and "
                             f"{'/'.join(head)} (its 90fa387 Mask): one version's fields only")
        version = 0 if old else 1
        attrs = {"version": version, "two": counts == (2, 2), "ignore_label": float(np.float32(_as_int(p.ignore_label)))}
        if version:
            attrs.update(cut_easy=_float_cut(p.threshold_easy, 1e-9), cut_hard=_float_cut(p.threshold_hard, 1e-9),
                         negative_label=-1)
        else:
            attrs.update(cut_easy=_float_cut(p.threshold, 0.0), cut_hard=0.0,
                         negative_label=_as_int(p.negative_label) if p.HasField("negative_label") else -1)
            if p.HasField("negative_label") and attrs["negative_label"] < 0:
                raise LayerError(f"mask_param.negative_label {p.negative_label} indexes no channel")
        return attrs

    def infer(self, attrs, in_shapes):
        n, c, h, w = legacy_nchw(in_shapes[0], _WHAT)
        if n != 1:
            raise LayerError(f"{_WHAT} takes a num-1 prob (its Reshape's CHECK_EQ(num, 1)), got {list(in_shapes[0])}")
        if attrs["negative_label"] >= c:
            raise LayerError(f"mask_param.negative_label {attrs['negative_label']} is past the prob's {c} channels")
        attrs["_dims"] = [c, h, w]
        if not attrs["two"]:
            return [(1, 1, h, w)]
        label = tuple(in_shapes[1])
        if int(np.prod(label)) != h * w:
            raise LayerError(f"{_WHAT} reads {h * w} label values (the prob's height x width), the label "
                             f"{list(label)} holds {int(np.prod(label))}")
        attrs["_label"] = list(label)
        return [(1, 1, h, w), label]

    def _args(self, attrs):
        a = attrs
        return (*a["_dims"], a.get("_label", []), a["version"], a["cut_easy"], a["cut_hard"], a["negative_label"],
                a["ignore_label"])

    def forward(self, attrs, params, prob, label=None):
        return lxx_cascade_mask(prob, label, *self._args(attrs))

    def onnx(self, ctx, node):
        a = node.attrs
        c, h, w = a["_dims"]
        s = h * w
        p = ctx.op("Reshape", [node.inputs[0], ctx.i64([c, s])], "prob", name=node.name)

        def above(x, cut, hint):
            return ctx.op("Greater", [x, ctx.f32(cut)], hint)

        def any_above(cut, hint):
            hit = ctx.op("Cast", [above(p, cut, hint + "_hit")], hint + "_f", to=1)
            top = ctx.op("ReduceMax", [hit], hint + "_max", axes=[0], keepdims=0) if ctx.opset < 18 else \
                ctx.op("ReduceMax", [hit, ctx.i64([0])], hint + "_max", keepdims=0)
            return ctx.op("Cast", [top], hint, to=9)

        neg = a["negative_label"]
        if a["version"] == 0 and neg >= 0:
            row = ctx.op("Gather", [p, ctx.i64(neg)], "negative_row", axis=0)
        if not a["two"]:
            drop = above(row, a["cut_easy"], "drop") if a["version"] == 0 and neg >= 0 else \
                any_above(a["cut_easy"], "drop")
        else:
            raw = ctx.op("Reshape", [node.inputs[1], ctx.i64([s])], "label")
            lab = ctx.op("Where", [ctx.op("Less", [raw, ctx.f32(0.0)], "negative"),
                                   ctx.op("Ceil", [raw], "up"), ctx.op("Floor", [raw], "down")], "trunc")
            if a["version"] == 0 and neg >= 0:
                drop = ctx.op("And", [above(row, a["cut_easy"], "neg_above"),
                                      ctx.op("Equal", [lab, ctx.f32(float(neg))], "is_negative")], "drop")
            else:
                inside = ctx.op("And", [ctx.op("Not", [ctx.op("Less", [lab, ctx.f32(0.0)], "below")], "from_0"),
                                        ctx.op("Less", [lab, ctx.f32(float(c))], "under_c")], "inside")
                idx = ctx.op("Cast", [ctx.op("Clip", [lab, ctx.f32(0.0), ctx.f32(float(c - 1))], "clamped")],
                             "index", to=7)
                at = ctx.op("GatherElements", [p, ctx.op("Reshape", [idx, ctx.i64([1, s])], "index_row")],
                            "at_label", axis=0)
                easy = ctx.op("And", [inside, above(ctx.op("Reshape", [at, ctx.i64([s])], "at_flat"),
                                                    a["cut_easy"], "easy_hit")], "easy")
                drop = easy if a["version"] == 0 else ctx.op("Or", [easy, any_above(a["cut_hard"], "hard")], "drop")
            new = ctx.op("Where", [drop, ctx.f32(a["ignore_label"]), lab], "new_label")
            ctx.add_node("Reshape", [new, ctx.i64(a["_label"])], [node.outputs[1]])
        keep = ctx.op("Cast", [ctx.op("Not", [drop], "keep_b")], "keep", to=1)
        ctx.add_node("Reshape", [keep, ctx.i64([1, 1, h, w])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_MASK)
        label = emit.inputs[1] if node.attrs["two"] else "None"
        args = ", ".join(repr(v) for v in self._args(node.attrs))
        return f"lxx_cascade_mask({emit.inputs[0]}, {label}, {args})"


@register_layer("SpatialFilter")
class SpatialFilter(Layer):
    def parse(self, lp):
        need_blobs(lp, "SpatialFilter", 2, 1, "mask, data")
        return {}

    def infer(self, attrs, in_shapes):
        mn, mc, mh, mw = legacy_nchw(in_shapes[0], "SpatialFilter's mask")
        dn, dc, dh, dw = legacy_nchw(in_shapes[1], "SpatialFilter's data")
        if mn != 1 or mc != 1:
            raise LayerError(f"SpatialFilter takes a num-1, one-channel mask (its Reshape's checks), "
                             f"got {list(in_shapes[0])}")
        if (dn, dh, dw) != (mn, mh, mw):
            raise LayerError(f"SpatialFilter's data {list(in_shapes[1])} must have the mask's num, height and "
                             f"width {[mn, mh, mw]}")
        attrs["_s"], attrs["_shape"] = mh * mw, [int(d) for d in in_shapes[1]]
        return [tuple(in_shapes[1])]

    def forward(self, attrs, params, mask, data):
        return spatial_filter(mask, data, attrs["_s"])

    def onnx(self, ctx, node):
        s = node.attrs["_s"]
        mask, data = node.inputs
        x = ctx.op("Reshape", [data, ctx.i64([1, -1, s])], "data", name=node.name)
        off = ctx.op("Less", [ctx.op("Reshape", [mask, ctx.i64([1, 1, s])], "mask"), ctx.f32(0.5)], "off")
        out = ctx.op("Where", [off, ctx.f32(0.0), x], "kept")
        ctx.add_node("Reshape", [out, ctx.i64(node.attrs["_shape"])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_FILTER)
        return f"spatial_filter({emit.inputs[0]}, {emit.inputs[1]}, {node.attrs['_s']})"


@register_layer("SegData")
class SegData(ForkDataLayer):
    def parse(self, lp):
        need_blobs(lp, "SegData", 0, 2)
        p = lp.seg_data_param
        t = transform_attrs(lp)
        attrs = {"type": lp.type, "tops": list(lp.top), "num_tops": 2, "transform": t, "source": p.source,
                 "batch_size": 1, "hw": None, "channels": 3}
        if p.HasField("batch_size"):
            # XiaohangZhan/mix-and-match's later SegData (8d4c9df seg_data_layer.cpp): batch_size images a
            # batch, and a crop_size fixes H = W (its images are read in colour: 3 channels)
            attrs["batch_size"] = positive_field(p.batch_size, "seg_data_param.batch_size")
            if t["crop_size"]:
                attrs["hw"] = (t["crop_size"], t["crop_size"])
            elif attrs["batch_size"] != 1:
                raise LayerError(f"SegData: seg_data_param.batch_size {attrs['batch_size']} needs "
                                 f"transform_param.crop_size (the fork CHECKs it: images differ in size)")
        return attrs

    def data_shape(self, attrs):
        if attrs["hw"]:
            return (attrs["batch_size"], attrs["channels"]) + tuple(attrs["hw"])
        raise needs_input_shape(attrs, attrs["tops"][0], f"SegData sizes it by the first image of "
                                f"'{attrs['source'] or '?'}', not read here")

    def top_shapes(self, attrs, given):
        shapes = super().top_shapes(attrs, given)
        if shapes[0][0] != attrs["batch_size"]:
            raise LayerError(f"SegData gives a batch of {attrs['batch_size']} (seg_data_param.batch_size), "
                             f"got --input-shape {list(shapes[0])}")
        return shapes

    def label_shape(self, attrs, data):
        return (data[0], 1) + tuple(data[2:])

    def guessed_label_tops(self, attrs, given):
        return ()


__all__ = ["CascadeMask", "SegData", "SpatialFilter", "cascade_mask", "lxx_cascade_mask", "spatial_filter"]
