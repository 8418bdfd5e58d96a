"""leon-liangwu/MaskYolo_Caffe's RoiGen and its Resize (caffe-maskyolo, 423094e:
src/caffe/layers/roi_gen_layer.cpp, include/caffe/util/box.hpp and src/caffe/util/box.cpp,
src/caffe/layers/resize_layer.cpp / .cu, src/caffe/proto/caffe.proto).

RoiGen (roi_gen_param num_class [20], num_object [2] = A, num_coord [4], prop_num [64], anchor_x,
anchor_y (A each), thresh [0.6], net_w, net_h [224]; softmax is read and unused) turns a YOLO v2
map (N, A * (num_class + num_coord + 1), H, W) into rois (prop_num, 5) and roi_labels (prop_num,).
Its forward has no phase branch (CPU only; the GPU calls it).  Per image b, for anchor k and cell
(row, col), index k * H * W + row * W + col, the fork's get_region_boxes reads channel 5 * k + e
(box.hpp's entry_index with 4 coords and 0 classes, whatever num_class and num_coord say):
objectness sigmoid(e = 4) (expf, the division in double, rounded to float), kept when > thresh; box x = (col +
sigmoid(e0)) / W, y = (row + sigmoid(e1)) / H, w = exp(e2) * anchor_x[k] / W, h = exp(e3) * anchor_y[k] / H,
all float32 (exp: glibc's expf, float64 exp rounded once). do_nms_obj(..., num_class, 0.4) then sorts by
probs[i][num_class]: with num_class 0 that is the objectness, sorted best first (qsort; equal values keep
index order, as glibc's merge sort does), and each kept box zeroes the later boxes whose darknet IoU
(centre/size overlap(), float32, intersection 0 when either side is negative) is > 0.4f; with num_class > 0
that entry is always 0, so nothing is suppressed.  The surviving boxes, in index order (the fork's sort by
score is commented out), image after image, give rows [b, max(0, x - w/2) * net_w, max(0, y - h/2) * net_h,
min(1, x + w/2) * net_w, min(1, y + h/2) * net_h] and label 1; the first prop_num are kept, the remaining rows
and labels stay 0.  ONNX refused (the greedy NMS is not written as a Scan); torch and model.py run it.

Resize: the fork's Forward_cpu is empty and its GPU kernel (the forward the fork runs) weights the
four bilinear taps but reads every one of them at the same source pixel src[floor(i * sh),
floor(j * sw)] (sh = src_h / dst_h in float32): a floor nearest-neighbour resize whose value is
((w_h0 w_w0) v + (w_h0 w_w1) v) + (w_h1 w_w0) v + (w_h1 w_w1) v, w_0 = |1 - f|, w_1 = |f|, f the
fraction of i * sh (1 up to rounding).  Computed without fused multiply-adds: nvcc may contract the kernel's
i * sh - floor and its `res += w v` into fmaf, which would move the value by an ulp or so (not checked on a
GPU; the source index is the same either way).  Sizes: height/width, or with is_pyramid_test
int(H * out_height_scale) x int(W * out_width_scale).  Resize is shared with other forks (pose_action's
bilinear spec); a net holding the fork's RoiGen or DecodeRois has its Resize layers read as
MaskYoloResize (a net_rewrite, with a note).

ROIAlignment is Thanh-Toan Do's layer, the same code as affordance-net's (caffeq/layers/affordance.py);
DepthwiseConvolution is yonghenglh6's BaseConvolutionLayer form (conv.py).
"""
import numpy as np
import torch

from .registry import Layer, LayerError, need_blobs, net_rewrite, positive_field, register_layer, torch_sources

NMS_IOU = 0.4   # do_nms_obj's threshold in get_predict_boxes (box.hpp)


# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------

def maskyolo_expf(t):
    """The float exp (glibc's expf) of float32 values: exp in float64 rounded once to float32 (torch's own
    float32 exp is up to an ulp away from it)."""
    return torch.exp(t.double()).float()


def maskyolo_sigmoid(t):
    """box.hpp's logistic_activate on float: expf, then 1 / (1 + e) in double, rounded to float."""
    return (1.0 / (1.0 + maskyolo_expf(-t).double())).float()


def maskyolo_overlap(c1, s1, c2, s2):
    """box.cpp's overlap(): the length two centre/size segments share (negative when apart)."""
    l1, l2 = c1 - s1 / 2, c2 - s2 / 2
    r1, r2 = c1 + s1 / 2, c2 + s2 / 2
    return torch.where(r1 < r2, r1, r2) - torch.where(l1 > l2, l1, l2)


def maskyolo_iou(bx, by, bw, bh):
    """box_iou of every pair of the (K,) boxes -> (K, K), float32."""
    ow = maskyolo_overlap(bx[:, None], bw[:, None], bx[None, :], bw[None, :])
    oh = maskyolo_overlap(by[:, None], bh[:, None], by[None, :], bh[None, :])
    inter = torch.where((ow < 0) | (oh < 0), torch.zeros_like(ow), ow * oh)
    area = bw * bh
    return inter / (area[:, None] + area[None, :] - inter)


def maskyolo_decode(x, anchors_w, anchors_h, thresh: float):
    """get_region_boxes on (N, C, H, W) -> x, y, w, h, prob, each (N, A * H * W) in index order."""
    n, _c, h, w = x.shape
    a = len(anchors_w)
    v = x.reshape(n, -1, h * w)
    ch = torch.arange(a, device=x.device) * 5
    obj = maskyolo_sigmoid(v[:, ch + 4])
    loc = torch.arange(h * w, device=x.device)
    col = (loc % w).to(torch.float32)
    row = torch.div(loc, w, rounding_mode="floor").to(torch.float32)
    aw = torch.tensor(anchors_w, dtype=torch.float32, device=x.device).view(1, a, 1)
    ah = torch.tensor(anchors_h, dtype=torch.float32, device=x.device).view(1, a, 1)
    bx = (col + maskyolo_sigmoid(v[:, ch])) / w
    by = (row + maskyolo_sigmoid(v[:, ch + 1])) / h
    bw = maskyolo_expf(v[:, ch + 2]) * aw / w
    bh = maskyolo_expf(v[:, ch + 3]) * ah / h
    prob = torch.where(obj > torch.tensor(thresh, dtype=torch.float32), obj, torch.zeros_like(obj))
    return [t.reshape(n, -1) for t in (bx, by, bw, bh, prob)]


def maskyolo_roi_gen(x, anchors_w, anchors_h, num_class: int, prop_num: int, thresh: float,
                     net_w: int, net_h: int):
    """MaskYolo_Caffe's RoiGen -> rois (prop_num, 5), roi_labels (prop_num,)."""
    bx, by, bw, bh, prob = maskyolo_decode(x.float(), anchors_w, anchors_h, thresh)
    limit = torch.tensor(0.4, dtype=torch.float32)
    rows = []
    for b in range(x.shape[0]):
        cand = torch.nonzero(prob[b] > 0).flatten()
        if num_class == 0 and cand.numel() > 1:
            order = cand[torch.sort(prob[b][cand], descending=True, stable=True).indices]
            hit = maskyolo_iou(bx[b][order], by[b][order], bw[b][order], bh[b][order]) > limit
            alive = [True] * order.numel()
            for i in range(order.numel()):
                if alive[i]:
                    for j in torch.nonzero(hit[i, i + 1:]).flatten().tolist():
                        alive[i + 1 + j] = False
            cand = torch.sort(order[torch.tensor(alive, device=order.device)]).values
        cx, cy, cw, chh = bx[b][cand], by[b][cand], bw[b][cand], bh[b][cand]
        zero, one = torch.zeros_like(cx), torch.ones_like(cx)
        x1, y1 = cx - cw / 2, cy - chh / 2
        x2, y2 = cx + cw / 2, cy + chh / 2
        rows.append(torch.stack([torch.full_like(cx, float(b)),
                                 torch.where(zero < x1, x1, zero) * float(net_w),
                                 torch.where(zero < y1, y1, zero) * float(net_h),
                                 torch.where(x2 < one, x2, one) * float(net_w),
                                 torch.where(y2 < one, y2, one) * float(net_h)], dim=1))
    found = torch.cat(rows)[:prop_num]
    rois = torch.zeros(prop_num, 5, dtype=torch.float32, device=x.device)
    labels = torch.zeros(prop_num, dtype=torch.float32, device=x.device)
    rois[:found.shape[0]] = found
    labels[:found.shape[0]] = 1.0
    return rois.to(x.dtype), labels.to(x.dtype)


def maskyolo_resize_taps(src: int, dst: int):
    """The kernel's source index floor(i * (src / dst)) and its two weights |1 - f|, |f| (float32)."""
    scale = torch.tensor(src, dtype=torch.float32) / torch.tensor(dst, dtype=torch.float32)
    pos = torch.arange(dst, dtype=torch.float32) * scale
    first = torch.floor(pos)
    frac = pos - first
    return first.long(), torch.abs(1.0 - frac), torch.abs(frac)


def maskyolo_resize(x, out_h: int, out_w: int):
    """MaskYolo_Caffe's Resize (its GPU kernel): every tap reads the floor pixel, weighted as bilinear."""
    rows, h0, h1 = maskyolo_resize_taps(x.shape[2], out_h)
    cols, w0, w1 = maskyolo_resize_taps(x.shape[3], out_w)
    v = x.index_select(2, rows.to(x.device)).index_select(3, cols.to(x.device))
    h0, h1 = h0.view(-1, 1), h1.view(-1, 1)
    weights = [(p * q).to(x.device, x.dtype) for p, q in ((h0, w0), (h0, w1), (h1, w0), (h1, w1))]
    return weights[0] * v + weights[1] * v + weights[2] * v + weights[3] * v


TORCH_ROI_GEN = torch_sources(maskyolo_expf, maskyolo_sigmoid, maskyolo_overlap, maskyolo_iou, maskyolo_decode,
                              maskyolo_roi_gen)
TORCH_RESIZE = torch_sources(maskyolo_resize_taps, maskyolo_resize)


# ---- RoiGen -------------------------------------------------------------------------------

@register_layer("RoiGen")
class RoiGen(Layer):
    onnx_refusal = ("RoiGen's greedy NMS walks a data-dependent number of boxes in score order; it is not "
                    "written as an ONNX Scan here (torch and model.py run it)")

    def parse(self, lp):
        need_blobs(lp, "RoiGen", 1, 2, roles="region map")
        p = lp.roi_gen_param
        a = positive_field(p.num_object, "roi_gen_param.num_object")
        if len(p.anchor_x) != a or len(p.anchor_y) != a:
            raise LayerError(f"roi_gen_param needs num_object ({a}) anchor_x and anchor_y values each, got "
                             f"{len(p.anchor_x)} and {len(p.anchor_y)}")
        classes, coords = int(p.num_class), int(p.num_coord)
        if classes + coords < 4:
            raise LayerError(f"roi_gen_param.num_class + num_coord must be >= 4 (the fork reads 5 channels per "
                             f"anchor), got {classes} + {coords}")
        return {"anchors_w": [float(np.float32(v)) for v in p.anchor_x],
                "anchors_h": [float(np.float32(v)) for v in p.anchor_y],
                "num_class": classes, "per_anchor": classes + coords + 1,
                "prop_num": positive_field(p.prop_num, "roi_gen_param.prop_num"),
                "thresh": float(np.float32(p.thresh)),
                "net_w": int(p.net_w), "net_h": int(p.net_h)}

    def infer(self, attrs, in_shapes):
        s = in_shapes[0]
        if len(s) != 4:
            raise LayerError(f"RoiGen needs an (N, C, H, W) bottom, got {list(s)}")
        want = len(attrs["anchors_w"]) * attrs["per_anchor"]
        if s[1] != want:
            raise LayerError(f"RoiGen's bottom has {s[1]} channels; num_object x (num_class + num_coord + 1) "
                             f"is {want}")
        return [(attrs["prop_num"], 5), (attrs["prop_num"],)]

    def _args(self, a):
        return (a["anchors_w"], a["anchors_h"], a["num_class"], a["prop_num"], a["thresh"], a["net_w"],
                a["net_h"])

    def forward(self, attrs, params, x):
        return maskyolo_roi_gen(x, *self._args(attrs))

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_ROI_GEN)
        emit.note(f"{node.name} (RoiGen): its NMS runs eagerly over the boxes above thresh; it does not trace.")
        args = ", ".join(emit.lit(v, exact=isinstance(v, float)) for v in self._args(node.attrs))
        t = emit.tmp("roi_gen")
        emit.stmt(f"{t} = maskyolo_roi_gen({emit.inputs[0]}, {args})")
        return [f"{t}[0]", f"{t}[1]"]


# ---- Resize (MaskYolo's) ------------------------------------------------------------------

@register_layer("MaskYoloResize")
class MaskYoloResize(Layer):
    """MaskYolo_Caffe's Resize (a net with its RoiGen / DecodeRois reads its Resize layers as this)."""

    def parse(self, lp):
        need_blobs(lp, "Resize", 1, 1)
        p = lp.resize_param
        if p.is_pyramid_test:
            if not (p.HasField("out_height_scale") and p.HasField("out_width_scale")):
                raise LayerError("resize_param.is_pyramid_test needs out_height_scale and out_width_scale")
            return {"fac": (float(p.out_height_scale), float(p.out_width_scale))}
        if not (p.HasField("height") and p.HasField("width")):
            raise LayerError("resize_param needs height and width (or is_pyramid_test with the scales)")
        return {"size": (int(p.height), int(p.width))}

    def infer(self, attrs, in_shapes):
        s = in_shapes[0]
        if len(s) != 4:
            raise LayerError(f"Resize needs an (N, C, H, W) bottom, got {list(s)}")
        if "fac" in attrs:
            h = int(np.float32(attrs["fac"][0]) * np.float32(s[2]))
            w = int(np.float32(attrs["fac"][1]) * np.float32(s[3]))
        else:
            h, w = attrs["size"]
        if h <= 0 or w <= 0:
            raise LayerError(f"Resize's output size must be positive, got {h}x{w}")
        attrs["_out"] = (h, w)
        return [(s[0], s[1], h, w)]

    def forward(self, attrs, params, x):
        return maskyolo_resize(x, *attrs["_out"])

    def onnx(self, ctx, node):
        x, out = node.inputs[0], node.outputs[0]
        h, w = ctx.shape(x)[2:]
        oh, ow = node.attrs["_out"]
        rows, h0, h1 = (t.numpy() for t in maskyolo_resize_taps(h, oh))
        cols, w0, w1 = (t.numpy() for t in maskyolo_resize_taps(w, ow))
        v = ctx.op("Gather", [ctx.op("Gather", [x, ctx.i64(rows)], "rows", axis=2), ctx.i64(cols)], "taps", axis=3)
        terms = [ctx.op("Mul", [ctx.const((p[:, None] * q[None, :]).astype(np.float32)), v], f"term{i}")
                 for i, (p, q) in enumerate(((h0, w0), (h0, w1), (h1, w0), (h1, w1)))]
        total = ctx.op("Add", [ctx.op("Add", terms[:2], "sum01"), terms[2]], "sum012")
        ctx.add_node("Add", [total, terms[3]], [out], name=node.name)

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_RESIZE)
        oh, ow = node.attrs["_out"]
        return f"maskyolo_resize({emit.inputs[0]}, {oh}, {ow})"


@net_rewrite
def maskyolo_resize_layers(net, source=""):
    """In a net with MaskYolo_Caffe's RoiGen or DecodeRois, Resize is the fork's (nearest-floor) Resize."""
    if not any(lp.type in ("RoiGen", "DecodeRois") for lp in net.layer):
        return []
    names = [lp.name for lp in net.layer if lp.type == "Resize"]
    for lp in net.layer:
        if lp.type == "Resize":
            lp.type = "MaskYoloResize"
    if not names:
        return []
    return [f"{source + ': ' if source else ''}Resize layer(s) {', '.join(map(repr, names[:3]))}"
            f"{', ...' if len(names) > 3 else ''} read as MaskYolo_Caffe's Resize (MaskYoloResize: the net has its "
            f"RoiGen/DecodeRois; its GPU kernel reads all four bilinear taps at the floor pixel)"]
