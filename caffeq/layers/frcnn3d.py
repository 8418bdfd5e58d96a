"""superxuang/caffe_3d_faster_rcnn: a 3-D Faster R-CNN for CT volumes (N, C, L, H, W).

Read from the fork at 9055464 (src/caffe/proto/caffe.proto and the layers, last changed in 7ccd59e):
- Pooling3D with pooling_3d_param (pooling3d_layer.cpp / .cu): BVLC's pooling on three axes.  Kernel,
  stride and pad once (kernel_size, stride, pad) or per axis (_l, _h, _w, all three together);
  global_pooling takes the whole volume.  Outputs ceil((n + 2p - k) / s) + 1, one fewer where padded
  and the last window would start at or past n + p.  MAX: the largest cell inside the input; AVE:
  the sum of the cells inside, over the window clipped to n + p.  The method is read from
  **pooling_param.pool** (default MAX), not pooling_3d_param.pool: both the CPU and the GPU forward
  switch on `layer_param_.pooling_param().pool()`.  The windows are pooling_nd.py's.
- ROIPooling with spatial_scale_xy / spatial_scale_z (roi_pooling_layer.cpp / .cu): Fast R-CNN's
  max pooling on three axes.  rois are (R, 7) = [batch, x1, y1, z1, x2, y2, z2] (x along W, y along
  H, z along L); each corner times its scale in float32, C-rounded; the sides (end - start + 1, at
  least 1) over pooled_w/h/l in float32 give the bins floor(i * bin) .. ceil((i + 1) * bin) from the
  start, clipped to the map; an empty bin gives 0.  Top (R, C, pooled_l, pooled_h, pooled_w).
- MHDRoiData (mhd_roi_data_layer.cpp): MetaImage CT volumes and their organ boxes; tops data,
  im_info and optionally gt_boxes and a label volume.  LayerSetUp sizes them (1, 1, 64, 128, 128),
  (1, 19), (1, 8) and (1, 1, 64, 128, 128); each batch is the volume's own size.
- Proposal with the fork's proposal_param (anchor_size, feat_stride_xy, ...; proposal_layer.cu):
  (batch x proposal_num, 7) rois, the NMS survivors filled up with background boxes picked by
  Caffe's random generator: read and sized, not run.
- BBoxOutput and RPNOutput (write each volume's boxes to text files and have no top): read and
  sized, not run.  The train nets' ProposalTarget (a random sampler) is not declared: its type and
  proposal_target_param are mscnn's and cascade-rcnn's too, with other fields; like theirs it is
  dropped as a layer that only trains.
"""
import math

import torch

from ..errors import ExportError
from .c_numerics import c_round
from .data import DataLayer
from .pooling_nd import POOL_AVE, POOL_MAX, WindowPool3d, first_empty_axis
from .registry import Layer, LayerError, ReadOnlyLayer, claim_layers, need_blobs, register_layer, torch_sources
from .roi_pooling import bin_mask, roi_batch_index, roi_layer_call

# ---- Pooling3D (pooling_3d_param) --------------------------------------------------------------

def _per_axis(p, base, one, default):
    """The fork's `one` (kernel_size, stride, pad) or base_l/_h/_w (all three), as LayerSetUp reads them."""
    named = [p.HasField(f"{base}_{s}") for s in "lhw"]
    if any(named):
        if not all(named) or p.HasField(one):
            raise LayerError(f"pooling_3d_param: {one} OR {base}_l, {base}_h and {base}_w (all three)")
        return [int(getattr(p, f"{base}_{s}")) for s in "lhw"]
    value = int(getattr(p, one)) if p.HasField(one) else default
    return [value] * 3


@claim_layers("Pooling3D", lambda lp: lp.HasField("pooling_3d_param"))
class FRCNN3DPooling(WindowPool3d):
    """Pooling3D with pooling_3d_param (see the module doc)."""

    def parse(self, lp):
        need_blobs(lp, "Pooling3D", 1, 1)
        p = lp.pooling_3d_param
        method = int(lp.pooling_param.pool)   # the fork switches on pooling_param, not pooling_3d_param
        if method not in (POOL_MAX, POOL_AVE):
            raise LayerError("pooling_param.pool: the fork's Pooling3D runs MAX and AVE only (its STOCHASTIC "
                             "forward reads an unset random index)")
        notes = []
        if p.HasField("pool") and int(p.pool) != method:
            notes.append(f"Pooling3D '{lp.name}': pooling_3d_param.pool is not read by the fork (it pools by "
                         f"pooling_param.pool, {'MAX' if method == POOL_MAX else 'AVE'})")
        glob = bool(p.global_pooling)
        if glob:
            if p.HasField("kernel_size") or any(p.HasField(f"kernel_{s}") for s in "lhw"):
                raise LayerError("pooling_3d_param: with global_pooling the kernel size cannot be given")
            kernel = None
        else:
            kernel = _per_axis(p, "kernel", "kernel_size", 0)
            if min(kernel) < 1:
                raise LayerError(f"pooling_3d_param: kernel_size or kernel_l, kernel_h and kernel_w must be > 0, "
                                 f"got {kernel}")
        pad = _per_axis(p, "pad", "pad", 0)
        stride = _per_axis(p, "stride", "stride", 1)
        if min(stride) < 1:
            raise LayerError(f"pooling_3d_param: stride must be > 0, got {stride}")
        if glob and (any(pad) or any(s != 1 for s in stride)):
            raise LayerError("pooling_3d_param: with global_pooling only pad 0 and stride 1")
        if kernel and any(pd >= k for pd, k in zip(pad, kernel)):
            raise LayerError(f"pooling_3d_param: pad {pad} must be below the kernel {kernel} (CHECK_LT)")
        return {"method": method, "kernel": kernel, "stride": stride, "pad": pad, "reading_notes": notes}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) != 5:
            raise LayerError(f"Pooling3D needs a 5-axis input (N, C, L, H, W), got {list(s)}")
        sizes = [int(n) for n in s[2:]]
        kernel = sizes if attrs["kernel"] is None else list(attrs["kernel"])
        stride, pad = attrs["stride"], attrs["pad"]
        if any(n + 2 * p < k for n, k, p in zip(sizes, kernel, pad)):
            raise LayerError(f"output would be empty: input {list(s)}, kernel {kernel}, pad {pad}")
        out = []
        for n, k, st, p in zip(sizes, kernel, stride, pad):
            o = math.ceil((n + 2 * p - k) / st) + 1
            if p and (o - 1) * st >= n + p:
                o -= 1
            out.append(o)
        axis = first_empty_axis(sizes, stride, pad, out)
        if axis is not None:
            raise LayerError(f"the last window of axis {axis + 2} starts past the input (stride {stride[axis]} > "
                             f"kernel {kernel[axis]}, no pad): the fork's result there is not reproduced")
        attrs["_kernel"], attrs["_out"] = kernel, out
        return [s[:2] + tuple(out)]

def roi3d_axis_bins(start, end, pooled: int, size: int):
    """One axis of one roi (C-rounded int corners): the [start, end) of each of `pooled` bins, float32
    bin sizes as the fork, clipped to [0, size]."""
    f32 = torch.float32
    side = max(int(end) - int(start) + 1, 1)
    bin_size = torch.tensor(float(side), dtype=f32) / torch.tensor(float(pooled), dtype=f32)
    lo = torch.floor(torch.arange(pooled, dtype=f32) * bin_size).long() + int(start)
    hi = torch.ceil(torch.arange(1, pooled + 1, dtype=f32) * bin_size).long() + int(start)
    return lo.clamp(0, size), hi.clamp(0, size)


def roi_max_pool3d(x, rois, pl: int, ph: int, pw: int, scale_xy: float, scale_z: float):
    """The fork's 3-D ROIPooling: rois (R, 7) = [batch, x1, y1, z1, x2, y2, z2] -> (R, C, pl, ph, pw)."""
    r = rois.flatten(1) if rois.dim() > 1 else rois.reshape(-1, 1)
    if r.shape[1] != 7:
        raise ValueError(f"ROIPooling (3-D): rois must be (R, 7) = [batch, x1, y1, z1, x2, y2, z2], "
                         f"got {list(rois.shape)}")
    r = r.detach().float().cpu()
    n, c, length, h, w = x.shape
    scales = torch.tensor([scale_xy, scale_xy, scale_z, scale_xy, scale_xy, scale_z], dtype=torch.float32)
    neg = torch.tensor(float("-inf"), device=x.device, dtype=x.dtype)
    zero = torch.zeros((), device=x.device, dtype=x.dtype)
    outs = []
    for roi in r:
        b = roi_batch_index(roi, n, "ROIPooling (3-D)")
        corners = c_round((roi[1:7] * scales).double()).long()   # float32 product, C's round
        ws, we = roi3d_axis_bins(corners[0], corners[3], pw, w)
        hs, he = roi3d_axis_bins(corners[1], corners[4], ph, h)
        ls, le = roi3d_axis_bins(corners[2], corners[5], pl, length)
        mw = bin_mask(ws, we, w).to(x.device)   # (pw, W)
        mh = bin_mask(hs, he, h).to(x.device)   # (ph, H)
        ml = bin_mask(ls, le, length).to(x.device)   # (pl, L)
        t = torch.where(mw, x[b][:, :, :, None, :], neg).amax(-1)                     # (C, L, H, pw)
        t = torch.where(mh[:, :, None], t[:, :, None, :, :], neg).amax(3)            # (C, L, ph, pw)
        t = torch.where(ml[:, :, None, None], t[:, None, :, :, :], neg).amax(2)      # (C, pl, ph, pw)
        empty = ((le <= ls)[:, None, None] | (he <= hs)[None, :, None] | (we <= ws)[None, None, :]).to(x.device)
        outs.append(torch.where(empty, zero, t.clamp_min(-3.4028234663852886e38)))   # Caffe starts at -FLT_MAX
    if not outs:
        return x.new_zeros((0, c, pl, ph, pw))
    return torch.stack(outs)


TORCH_ROI_POOL3D = torch_sources(roi3d_axis_bins, roi_max_pool3d)


@claim_layers("ROIPooling", lambda lp: any(lp.roi_pooling_param.HasField(f)
                                           for f in ("spatial_scale_xy", "spatial_scale_z")))
class FRCNN3DRoiPooling(Layer):
    """ROIPooling with spatial_scale_xy / spatial_scale_z (see the module doc)."""

    onnx_refusal = ("ONNX has no 3-D ROI pooling (MaxRoiPool pools 2-D maps) and the fork's bins over "
                    "the length axis depend on each roi")

    def parse(self, lp):
        need_blobs(lp, "ROIPooling (3-D)", 2, 1, "data, rois")
        p = lp.roi_pooling_param
        for f in ("spatial_scale", "pad_ratio", "pool", "temporal_scale"):
            if p.HasField(f):
                raise LayerError(f"roi_pooling_param.{f} is another fork's field: the 3-D ROIPooling of "
                                 f"spatial_scale_xy / spatial_scale_z does not read it")
        for f in ("pooled_l", "pooled_h", "pooled_w"):   # LayerSetUp: CHECK_GT(..., 0)
            if getattr(p, f) <= 0:
                raise LayerError(f"roi_pooling_param.{f} must be > 0 (the 3-D ROIPooling), got {getattr(p, f)}")
        for f in ("spatial_scale_xy", "spatial_scale_z"):
            if not math.isfinite(getattr(p, f)):
                raise LayerError(f"roi_pooling_param.{f} must be a finite number, got {getattr(p, f)}")
        return {"pl": int(p.pooled_l), "ph": int(p.pooled_h), "pw": int(p.pooled_w),
                "scale_xy": float(p.spatial_scale_xy), "scale_z": float(p.spatial_scale_z)}

    def infer(self, attrs, in_shapes):
        s, r = in_shapes
        if len(s) != 5:
            raise LayerError(f"ROIPooling with spatial_scale_xy / _z needs a 5-axis input (N, C, L, H, W), "
                             f"got {list(s)}")
        if not r:   # Reshape reads only the rois' count
            raise LayerError(f"ROIPooling (3-D): rois must be (R, 7), got {list(r)}")
        return [(r[0], s[1], attrs["pl"], attrs["ph"], attrs["pw"])]

    def forward(self, attrs, params, x, rois):
        try:
            return roi_max_pool3d(x, rois, attrs["pl"], attrs["ph"], attrs["pw"], attrs["scale_xy"],
                                  attrs["scale_z"])
        except ValueError as e:
            raise LayerError(str(e)) from None

    def onnx(self, ctx, node):
        raise ExportError(f"layer '{node.name}' (ROIPooling): {self.onnx_refusal}")

    def pytorch_source(self, node, emit):
        a = node.attrs
        return roi_layer_call(emit, TORCH_ROI_POOL3D, a["pl"], a["ph"], a["pw"], a["scale_xy"], a["scale_z"])


# ---- the data layer ----------------------------------------------------------------------------

@register_layer("MHDRoiData")
class MHDRoiData(DataLayer):
    """The fork's CT reader: tops data, im_info [, gt_boxes [, label volume]]."""

    def parse(self, lp):
        if not 2 <= len(lp.top) <= 4 or len(lp.bottom):
            raise LayerError(f"MHDRoiData takes no bottom and 2 to 4 tops (data, im_info, gt_boxes, labels), "
                             f"got {len(lp.bottom)} and {len(lp.top)}")
        p = lp.mhd_data_param
        return {"type": lp.type, "tops": list(lp.top), "num_tops": len(lp.top), "source": p.source,
                "root_folder": p.root_folder, "min_intensity": float(p.min_intensity),
                "max_intensity": float(p.max_intensity),
                "spacing": [float(p.resample_spacing_x), float(p.resample_spacing_y), float(p.resample_spacing_z)],
                "reading_notes": [f"MHDRoiData '{lp.name}': each batch is its volume's own size; the net is sized "
                                  f"with the fork's LayerSetUp shapes (data 1 x 1 x 64 x 128 x 128): give "
                                  f"--input-shape to size it otherwise"]}

    def top_shapes(self, attrs, given):
        data = tuple(given.get(0) or (1, 1, 64, 128, 128))
        shapes = [data, tuple(given.get(1) or (data[0], 19))]
        if attrs["num_tops"] > 2:
            shapes.append(tuple(given.get(2) or (data[0], 8)))
        if attrs["num_tops"] > 3:
            shapes.append(tuple(given.get(3) or data))
        return shapes

    def guessed_label_tops(self, attrs, given):
        return ()

    def preprocessing(self, attrs):
        x, y, z = attrs["spacing"]
        return [f"MetaImage (.mhd) CT volumes listed in {attrs['source']!r}, resampled to {x} x {y} x {z} mm",
                f"intensities clipped to [{attrs['min_intensity']}, {attrs['max_intensity']}] and scaled to [0, 1]",
                "im_info: 19 values (sizes, spacings and origins of the volume before and after resampling)"]


# ---- read, sized, not run ----------------------------------------------------------------------

def _fork_proposal(lp):
    p = lp.proposal_param
    return any(p.HasField(f) for f in ("anchor_size", "feat_stride_xy", "feat_stride_z", "proposal_num",
                                       "rpn_pre_nms_top_n", "rpn_post_nms_top_n", "rpn_nms_threshold",
                                       "bg_score_threshold", "rpn_min_size"))


def _anchor_count(p, field):
    """GenerateAnchors (fast_rcnn_layers.cpp): one anchor per (length, height, width) combination."""
    a = p.anchor_size
    n = len(a.width) * len(a.height) * len(a.length)
    if not n:
        raise LayerError(f"{field}.anchor_size needs width, height and length values (an anchor for each "
                         f"combination), got {len(a.width)}, {len(a.height)} and {len(a.length)}")
    return n


def _normalization(p, field):
    if p.bbox_normalize and (len(p.bbox_normalize_mean) != 6 or len(p.bbox_normalize_std) != 6):
        raise LayerError(f"{field}: bbox_normalize reads 6 bbox_normalize_mean and 6 bbox_normalize_std values, "
                         f"got {len(p.bbox_normalize_mean)} and {len(p.bbox_normalize_std)}")


@claim_layers("Proposal", _fork_proposal)
class FRCNN3DProposal(ReadOnlyLayer):
    """The fork's 3-D Proposal: (batch x proposal_num, 7) rois."""

    def parse(self, lp):
        need_blobs(lp, "Proposal (3-D)", 3, 1, "rpn_cls_prob_reshape, rpn_bbox_pred, im_info")
        p = lp.proposal_param
        anchors = _anchor_count(p, "proposal_param")
        _normalization(p, "proposal_param")
        if p.proposal_num < 1:
            raise LayerError("proposal_param.proposal_num must be >= 1")
        return {"name": lp.name, "kind": "Proposal (3-D)", "anchors": anchors, "proposal_num": int(p.proposal_num)}

    def infer(self, attrs, in_shapes):
        prob, deltas = in_shapes[0], in_shapes[1]
        a = attrs["anchors"]
        if len(prob) != 5 or len(deltas) != 5:
            raise LayerError(f"Proposal (3-D) reads (N, C, L, H, W) scores and deltas, got {list(prob)} and "
                             f"{list(deltas)}")
        if prob[1] != 2 * a or deltas[1] != 6 * a:
            raise LayerError(f"Proposal (3-D): {a} anchors need 2 x {a} score and 6 x {a} delta channels "
                             f"(CHECK_EQ(class_num, 2)), got {prob[1]} and {deltas[1]}")
        return [(prob[0] * attrs["proposal_num"], 7)]

    def why_not_run(self, attrs):
        return ("the fork fills the NMS survivors up to proposal_num with background boxes drawn by Caffe's "
                "random generator, which caffeq does not reproduce")


class _FileWriter(ReadOnlyLayer):
    """A layer without tops that writes each volume's boxes to text files."""

    bottoms = 0
    what = ""

    def parse(self, lp):
        need_blobs(lp, lp.type, self.bottoms, 0, self.what)
        field = "bbox_output_param" if lp.type == "BBoxOutput" else "rpn_output_param"
        p = getattr(lp, field)
        if field == "rpn_output_param":
            _anchor_count(p, field)
        _normalization(p, field)
        return {"name": lp.name, "output": p.output_root_folder if field == "bbox_output_param" else p.roi_root_folder}

    def infer(self, attrs, in_shapes):
        return []

    def why_not_run(self, attrs):
        return (f"writes each volume's boxes to text files under {attrs['output']!r} (named from the data "
                f"layer's list, in world coordinates from the MetaImage headers): it has no top, and caffeq "
                f"does not write those files")


@register_layer("BBoxOutput")
class BBoxOutput(_FileWriter):
    bottoms, what = 4, "rois, cls_prob, bbox_pred, im_info"


@register_layer("RPNOutput")
class RPNOutput(_FileWriter):
    bottoms, what = 3, "rpn_cls_prob_reshape, rpn_bbox_pred, im_info"
