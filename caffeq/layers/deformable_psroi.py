"""DeformablePSROIPooling: makefile/frcnn 8d9b9eb (src/caffe/DeformConv/deformable_psroi_pooling_layer.cpp,
.cu, .hpp; src/caffe/proto/caffe.proto: deformable_psroi_pooling_param = 228), Bharat Singh's Caffe port
of Deformable R-FCN's pooling with learned offsets.  fireae/caffe_latte a285594
(src/caffe/fast_rcnn/deformable_psroi_pooling_layer.cu) computes the same, with the message at 173.

Bottoms data (N, output_dim * group_size^2, H, W), rois (R, 5) = [batch, x1, y1, x2, y2] and, unless
no_trans, trans; top (R, output_dim, group_size, group_size).  The fork pools group_size x group_size
bins: pooled_size is never read, and part_size is used as given (its default 0 too, not pooled_size as
MXNet's operator would).  Per roi, in float32 as the kernel's Dtype (the CPU and CUDA forwards agree):

- start = round(x1, y1) * spatial_scale - 0.5, end = (round(x2, y2) + 1) * spatial_scale - 0.5 (C's
  round, half away from 0); size = max(end - start, 0.1); bin = size / group_size; sub = bin / sample_per_part.
- bin (ph, pw) of output channel ctop: part = floor(float(p) / group_size * part_size) on each axis,
  class = ctop / (output_dim / num_classes) with num_classes = trans channels / 2; the offsets are read
  from trans as a flat buffer at (((roi * num_classes + class) * 2 + {0: x, 1: y}) * part_size + part_h)
  * part_size + part_w (whatever trans's spatial shape), times trans_std.  With no_trans they are 0.
- wstart = pw * bin_w + start_w, then + trans_x * size_w (h likewise); the samples sit at wstart + iw * sub_w,
  hstart + ih * sub_h for ih, iw < sample_per_part (rows outer).
- a sample with w < -0.5, w > W - 0.5, h < -0.5 or h > H - 0.5 is skipped; the others are clamped to
  [0, W - 1] x [0, H - 1] and read bilinearly between floor and ceil from input channel
  (ctop * group_size + ph) * group_size + pw of the roi's image:
  (1-dx)(1-dy) v[y1,x1] + (1-dx) dy v[y2,x1] + dx (1-dy) v[y1,x2] + dx dy v[y2,x2], in that order.
- the top is the float32 sum of the taken samples (in sample order) / their count, 0 when none is taken.

A file that leaves output_dim out (required in the fork, whose Caffe then refuses the prototxt: makefile/frcnn's
own fpn-res50 dcn nets do) is read with output_dim = input channels / group_size^2, the only value the
fork's Reshape check admits, and a note.  Trans reads the fork would make past trans's end are refused.

The CPU forward is followed to the bit (nvcc may contract the kernel's a * b + c into FMAs: the last bit).
The torch function below serves `forward` and is copied into model.py; the ONNX export writes the same
float32 steps as elementwise ops and Gathers from the flattened data and trans (to the bit).
"""
import math

import numpy as np
import torch

from ..errors import ExportError
from .c_numerics import c_round, onnx_c_round
from .registry import LayerError, need_blobs, register_layer, torch_sources
from .roi_pooling import ROIS_WANTED, RoiLayerSpec, roi_batch_index, roi_rows

# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------


def deformable_ps_roi_pool(x, rois, trans, output_dim: int, group_size: int, part_size: int,
                           sample_per_part: int, trans_std: float, spatial_scale: float):
    """makefile/frcnn's DeformablePSROIPooling -> (R, output_dim, group_size, group_size); trans is None for
    no_trans."""
    f32 = torch.float32
    r = roi_rows(rois, "DeformablePSROIPooling")
    n, c, h, w = x.shape
    g, dim, s = group_size, output_dim, sample_per_part
    num = r.shape[0]
    if num == 0:
        return x.new_zeros((0, dim, g, g))
    dev = x.device
    batch = torch.tensor([roi_batch_index(roi, n, "DeformablePSROIPooling") for roi in r], device=dev)
    r = r.to(dev)
    scale = torch.tensor(spatial_scale, dtype=f32, device=dev)
    half = torch.tensor(0.5, dtype=f32, device=dev)
    start = c_round(r[:, 1:3]) * scale - half                   # (R, 2): x, y
    end = (c_round(r[:, 3:5]) + 1.0) * scale - half
    size = torch.maximum(end - start, torch.tensor(0.1, dtype=f32, device=dev))
    bin_size = size / torch.tensor(float(g), dtype=f32, device=dev)
    sub = bin_size / torch.tensor(float(s), dtype=f32, device=dev)
    p = torch.arange(g, dtype=f32, device=dev)
    ctop = torch.arange(dim, device=dev)
    if trans is None:
        shift = torch.zeros((num, dim, g, g, 2), dtype=f32, device=dev)
    else:
        classes = trans.shape[1] // 2
        part = torch.floor(p / torch.tensor(float(g), dtype=f32, device=dev) * float(part_size)).long()
        cls = ctop // (dim // classes)
        roi = torch.arange(num, device=dev)
        base = (roi[:, None] * classes + cls[None, :]) * 2                                # (R, dim)
        flat = trans.reshape(-1).to(f32)
        reads = []
        for k in range(2):   # x then y
            at = (((base + k) * part_size)[:, :, None, None] + part[None, None, :, None]) * part_size \
                + part[None, None, None, :]
            if int(at.max()) >= flat.numel():
                raise ValueError(f"DeformablePSROIPooling: trans holds {flat.numel()} values, the layer reads "
                                 f"offset {int(at.max())}")
            reads.append(flat[at] * torch.tensor(trans_std, dtype=f32, device=dev))
        shift = torch.stack(reads, dim=-1)                                               # (R, dim, g, g, 2)
    # bin starts: (R, 1, g, 1) rows and (R, 1, 1, g) columns, then the offsets times the roi's size
    wstart = (p[None, :] * bin_size[:, 0:1] + start[:, 0:1])[:, None, None, :]
    hstart = (p[None, :] * bin_size[:, 1:2] + start[:, 1:2])[:, None, :, None]
    wstart = wstart + shift[..., 0] * size[:, 0, None, None, None]
    hstart = hstart + shift[..., 1] * size[:, 1, None, None, None]
    chan = (ctop[:, None, None] * g + torch.arange(g, device=dev)[None, :, None]) * g \
        + torch.arange(g, device=dev)[None, None, :]                                      # (dim, g, g)
    plane = ((batch[:, None, None, None] * c + chan[None]) * h) * w                       # (R, dim, g, g)
    data = x.reshape(-1)
    total = torch.zeros((num, dim, g, g), dtype=x.dtype, device=dev)
    count = torch.zeros((num, dim, g, g), dtype=f32, device=dev)
    zero = torch.zeros((), dtype=x.dtype, device=dev)
    for ih in range(s):
        for iw in range(s):
            xs = wstart + float(iw) * sub[:, 0, None, None, None]
            ys = hstart + float(ih) * sub[:, 1, None, None, None]
            taken = (xs >= -0.5) & (xs <= w - 0.5) & (ys >= -0.5) & (ys <= h - 0.5)
            xs = xs.clamp(0.0, float(w - 1))
            ys = ys.clamp(0.0, float(h - 1))
            x1, x2 = torch.floor(xs), torch.ceil(xs)
            y1, y2 = torch.floor(ys), torch.ceil(ys)
            dx, dy = xs - x1, ys - y1
            x1, x2, y1, y2 = x1.long(), x2.long(), y1.long(), y2.long()
            v11 = data[plane + y1 * w + x1]
            v12 = data[plane + y2 * w + x1]
            v21 = data[plane + y1 * w + x2]
            v22 = data[plane + y2 * w + x2]
            val = (1 - dx) * (1 - dy) * v11 + (1 - dx) * dy * v12 + dx * (1 - dy) * v21 + dx * dy * v22
            total = total + torch.where(taken, val, zero)
            count = count + taken.to(f32)
    return torch.where(count > 0, total / count.clamp(min=1.0), zero)


TORCH_DEFORMABLE_PSROI = torch_sources(deformable_ps_roi_pool)


# ---- ONNX ----------------------------------------------------------------------------------

def onnx_deformable_psroi(ctx, node, a, in_shapes):
    """deformable_ps_roi_pool's float32 steps as ONNX nodes (elementwise ops and Gathers, so 0 rois pass too)."""
    f32, i64 = 1, 7
    (n, c, h, w), g, dim, s = in_shapes[0], a["group"], a["dim"], a["samples"]
    data = ctx.op("Reshape", [node.inputs[0], ctx.i64([-1])], "data")
    rows = ctx.op("Reshape", [node.inputs[1], ctx.i64([-1, 5])], "rows")
    batch = ctx.op("Cast", [ctx.op("Gather", [rows, ctx.i64([0])], "b", axis=1)], "batch", to=i64)  # (R, 1)
    batch = ctx.op("Min", [ctx.op("Max", [batch, ctx.i64(0)], "b_lo"), ctx.i64(n - 1)], "batch_in")

    def cols(lo, hi):
        return ctx.op("Slice", [rows, ctx.i64([lo]), ctx.i64([hi]), ctx.i64([1])], f"c{lo}")

    scale, half = ctx.f32(float(np.float32(a["scale"]))), ctx.f32(0.5)
    start = ctx.op("Sub", [ctx.op("Mul", [onnx_c_round(ctx, cols(1, 3)), scale], "s"), half], "start")
    end = ctx.op("Sub", [ctx.op("Mul", [ctx.op("Add", [onnx_c_round(ctx, cols(3, 5)), ctx.f32(1.0)], "e"),
                                        scale], "e"), half], "end")
    size = ctx.op("Max", [ctx.op("Sub", [end, start], "size"), ctx.f32(float(np.float32(0.1)))], "size")
    bin_size = ctx.op("Div", [size, ctx.f32(float(g))], "bin")
    sub = ctx.op("Div", [bin_size, ctx.f32(float(s))], "sub")

    def axis(t, k, shape):   # column k of an (R, 2) tensor as (R, 1, 1, 1), or shaped
        return ctx.op("Reshape", [ctx.op("Slice", [t, ctx.i64([k]), ctx.i64([k + 1]), ctx.i64([1])], "k"),
                                  ctx.i64(shape)], "ax")

    p = np.arange(g, dtype=np.float32)
    starts = []
    for k, shape in ((0, [1, 1, 1, g]), (1, [1, 1, g, 1])):
        grid = ctx.op("Add", [ctx.op("Mul", [ctx.const(p.reshape(shape)), axis(bin_size, k, [-1, 1, 1, 1])], "pb"),
                              axis(start, k, [-1, 1, 1, 1])], "grid")
        starts.append(grid)
    if not a["no_trans"]:
        classes = in_shapes[2][1] // 2
        part = np.floor(p / np.float32(g) * np.float32(a["part"])).astype(np.int64)
        cls = np.arange(dim) // (dim // classes)
        per_roi = classes * 2 * a["part"] * a["part"]
        flat = ctx.op("Reshape", [ctx.op("Cast", [node.inputs[2]], "t", to=f32), ctx.i64([-1])], "trans")
        roi = ctx.op("Reshape", [ctx.op("Sub", [ctx.op("CumSum", [ctx.op("Add", [ctx.op("Mul", [batch, ctx.i64(0)],
                                                                                          "z"), ctx.i64(1)], "ones"),
                                                                  ctx.i64(0)], "cum"), ctx.i64(1)], "roi"),
                                 ctx.i64([-1, 1, 1, 1])], "roi")
        for k in range(2):
            local = ((((cls * 2 + k) * a["part"])[:, None, None] + part[None, :, None]) * a["part"]
                     + part[None, None, :])                                                     # (dim, g, g)
            at = ctx.op("Add", [ctx.op("Mul", [roi, ctx.i64(per_roi)], "rb"), ctx.const(local[None])], "at")
            shift = ctx.op("Mul", [ctx.op("Gather", [flat, at], "t", axis=0), ctx.f32(float(np.float32(a["std"])))],
                           "shift")
            starts[k] = ctx.op("Add", [starts[k], ctx.op("Mul", [shift, axis(size, k, [-1, 1, 1, 1])], "ts")],
                               "moved")
    wstart, hstart = starts
    chan = (np.arange(dim)[:, None, None] * g + np.arange(g)[None, :, None]) * g + np.arange(g)[None, None, :]
    plane = ctx.op("Mul", [ctx.op("Add", [ctx.op("Mul", [ctx.op("Reshape", [batch, ctx.i64([-1, 1, 1, 1])], "b4"),
                                                         ctx.i64(c)], "bc"), ctx.const(chan[None])], "bch"),
                           ctx.i64(h * w)], "plane")
    total = count = None
    for ih in range(s):
        for iw in range(s):
            xs = ctx.op("Add", [wstart, ctx.op("Mul", [axis(sub, 0, [-1, 1, 1, 1]), ctx.f32(float(iw))], "sw")], "xs")
            ys = ctx.op("Add", [hstart, ctx.op("Mul", [axis(sub, 1, [-1, 1, 1, 1]), ctx.f32(float(ih))], "sh")], "ys")
            taken = None
            for v, extent in ((xs, w), (ys, h)):
                inside = ctx.op("And", [ctx.op("GreaterOrEqual", [v, ctx.f32(-0.5)], "ge"),
                                        ctx.op("LessOrEqual", [v, ctx.f32(extent - 0.5)], "le")], "in")
                taken = inside if taken is None else ctx.op("And", [taken, inside], "taken")
            xs = ctx.op("Clip", [xs, ctx.f32(0.0), ctx.f32(float(w - 1))], "xc")
            ys = ctx.op("Clip", [ys, ctx.f32(0.0), ctx.f32(float(h - 1))], "yc")
            x1, x2 = ctx.op("Floor", [xs], "x1"), ctx.op("Ceil", [xs], "x2")
            y1, y2 = ctx.op("Floor", [ys], "y1"), ctx.op("Ceil", [ys], "y2")
            dx, dy = ctx.op("Sub", [xs, x1], "dx"), ctx.op("Sub", [ys, y1], "dy")
            hx, hy = ctx.op("Sub", [ctx.f32(1.0), dx], "hx"), ctx.op("Sub", [ctx.f32(1.0), dy], "hy")
            ix1, ix2 = (ctx.op("Cast", [v], "ix", to=i64) for v in (x1, x2))
            row1, row2 = (ctx.op("Add", [plane, ctx.op("Mul", [ctx.op("Cast", [v], "iy", to=i64), ctx.i64(w)], "yw")],
                                 "row") for v in (y1, y2))
            val = None
            corners = ((hx, hy, row1, ix1), (hx, dy, row2, ix1), (dx, hy, row1, ix2), (dx, dy, row2, ix2))
            for wx, wy, row, col in corners:     # (1-dx)(1-dy) v11, (1-dx) dy v12, dx (1-dy) v21, dx dy v22
                term = ctx.op("Mul", [ctx.op("Mul", [wx, wy], "wt"),
                                      ctx.op("Gather", [data, ctx.op("Add", [row, col], "idx")], "v", axis=0)], "term")
                val = term if val is None else ctx.op("Add", [val, term], "val")
            val = ctx.op("Where", [taken, val, ctx.f32(0.0)], "val_t")
            one = ctx.op("Cast", [taken], "one", to=f32)
            total = val if total is None else ctx.op("Add", [total, val], "total")
            count = one if count is None else ctx.op("Add", [count, one], "count")
    mean = ctx.op("Div", [total, ctx.op("Max", [count, ctx.f32(1.0)], "cnt")], "mean")
    ctx.add_node("Where", [ctx.op("Greater", [count, ctx.f32(0.0)], "any"), mean, ctx.f32(0.0)],
                 [node.outputs[0]], name=node.name)


# ---- the spec ------------------------------------------------------------------------------

FIELD = "deformable_psroi_pooling_param"


@register_layer("DeformablePSROIPooling")
class DeformablePSROIPooling(RoiLayerSpec):
    roi_fn, roi_source = staticmethod(deformable_ps_roi_pool), TORCH_DEFORMABLE_PSROI

    def parse(self, lp):
        need_blobs(lp, "DeformablePSROIPooling", (2, 3), 1, roles="data, rois[, trans]")
        p = getattr(lp, FIELD)
        notes = []
        if not p.HasField("spatial_scale") or not p.HasField("group_size"):
            raise LayerError(f"{FIELD}.spatial_scale and group_size are required")
        if not math.isfinite(p.spatial_scale) or not math.isfinite(p.trans_std):
            raise LayerError(f"{FIELD}.spatial_scale and trans_std must be finite numbers, "
                             f"got {p.spatial_scale} and {p.trans_std}")
        if p.group_size <= 0:
            raise LayerError(f"{FIELD}.group_size must be > 0, got {p.group_size}")
        if p.HasField("output_dim") and p.output_dim <= 0:
            raise LayerError(f"{FIELD}.output_dim must be > 0, got {p.output_dim}")
        if p.sample_per_part <= 0:
            raise LayerError(f"{FIELD}.sample_per_part must be > 0, got {p.sample_per_part}")
        if p.part_size < 0:
            raise LayerError(f"{FIELD}.part_size must be >= 0, got {p.part_size}")
        if not p.HasField("output_dim"):
            notes.append(f"{FIELD}.output_dim is missing (required in makefile/frcnn, whose Caffe refuses the "
                         f"file): read as the input's channels / group_size^2, the only value its Reshape admits")
        if p.HasField("pooled_size") and p.pooled_size != p.group_size:
            notes.append(f"{FIELD}.pooled_size {p.pooled_size} is not read: makefile/frcnn pools "
                         f"group_size x group_size = {p.group_size} x {p.group_size} bins")
        bottoms = len(lp.bottom)
        if p.no_trans and bottoms == 3:
            notes.append(f"{FIELD}.no_trans: the third bottom is not read")
        if not p.no_trans and bottoms == 2:
            raise LayerError(f"{FIELD}.no_trans is false: a third bottom (trans) is needed")
        attrs = {"scale": float(p.spatial_scale), "dim": int(p.output_dim) if p.HasField("output_dim") else None,
                 "group": int(p.group_size), "part": int(p.part_size), "samples": int(p.sample_per_part),
                 "std": float(p.trans_std), "no_trans": bool(p.no_trans)}
        if notes:
            attrs["reading_notes"] = notes
        return attrs

    def _dim(self, attrs, channels):
        g2 = attrs["group"] ** 2
        dim = attrs["dim"] if attrs["dim"] is not None else channels // g2
        if dim <= 0 or channels != dim * g2:
            raise LayerError(f"input has {channels} channels; output_dim {attrs['dim'] or 'x'} x group_size^2 "
                             f"{g2} are needed")
        return dim

    def infer(self, attrs, in_shapes):
        s, r = in_shapes[0], in_shapes[1]
        if len(s) != 4:
            raise LayerError(f"DeformablePSROIPooling needs a 4-axis input, got {list(s)}")
        if not r or math.prod(r[1:]) != 5:
            raise LayerError(f"DeformablePSROIPooling: {ROIS_WANTED}, got {list(r)}")
        dim = self._dim(attrs, s[1])
        if not attrs["no_trans"]:
            t = in_shapes[2]
            classes = t[1] // 2 if len(t) > 1 else 0
            if classes == 0 or dim % classes:
                raise LayerError(f"trans has {t[1] if len(t) > 1 else 0} channels: 2 x num_classes with "
                                 f"num_classes dividing output_dim {dim} are needed")
            part, g = attrs["part"], attrs["group"]
            top = int(np.floor(np.float32(g - 1) / np.float32(g) * np.float32(part)))   # the last bin's part
            last = ((r[0] * classes * 2 - 1) * part + top) * part + top
            if r[0] and last >= math.prod(t):
                raise LayerError(f"trans {list(t)} holds {math.prod(t)} values; {r[0]} rois with part_size {part} "
                                 f"read up to offset {last}")
        return [(r[0], dim, attrs["group"], attrs["group"])]

    def _args(self, attrs, channels):
        return (self._dim(attrs, channels), attrs["group"], attrs["part"], attrs["samples"], attrs["std"],
                attrs["scale"])

    def forward(self, attrs, params, x, rois, *more):
        trans = None if attrs["no_trans"] else more[0]
        try:
            return deformable_ps_roi_pool(x, rois, trans, *self._args(attrs, x.shape[1]))
        except ValueError as e:
            raise LayerError(str(e)) from None

    def pytorch_source(self, node, emit):
        from .roi_pooling import TORCH_ROI_COMMON, RoiLayer
        fn = emit.Code(emit.helper(TORCH_DEFORMABLE_PSROI))
        emit.helper(TORCH_ROI_COMMON)
        m = emit.instance(RoiLayer, fn, *self._args(node.attrs, emit.in_shape(0)[1]))
        x, rois = emit.inputs[:2]
        return f"{m}({x}, {rois}, {'None' if node.attrs['no_trans'] else emit.inputs[2]})"

    def onnx(self, ctx, node):
        shapes = [ctx.shape(i) for i in node.inputs]
        if math.prod(shapes[1][1:]) != 5:
            raise ExportError(f"layer '{node.name}' (DeformablePSROIPooling): {ROIS_WANTED}, the net declares "
                              f"{list(shapes[1])}; give their shape with --input-shape")
        a = dict(node.attrs)
        a["dim"] = self._dim(a, shapes[0][1])
        onnx_deformable_psroi(ctx, node, a, shapes)
