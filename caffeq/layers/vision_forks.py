"""Vision layers from Caffe forks: Upsample, ShuffleChannel, ResizeBilinear (Interp: interp.py; ROI pooling:
roi_pooling.py).

- Upsample (SegNet): max-unpooling.  With two bottoms the second is the mask of
  argmax positions (index h*W + w within each output plane, as SegNet's
  Pooling writes in its second top); a position written twice keeps the last
  value in row-major order (Caffe's CPU loop).  With one
  bottom, the layer is the darknet2caffe forks' nearest-neighbour upsampling by
  `scale` (those forks' UpsampleParameter also has `scale` = 1).
- UpsampleDarknet (synopsys-caffe): the same nearest upsampling by
  `upsample_darknet_param.stride`.
- ShuffleChannel (ShuffleNet): channels viewed as (group, C/group), transposed.
- ResizeBilinear (synopsys-caffe e73a136 caffe.proto, resize_bilinear_layer.cpp 90349ee):
  TensorFlow's bilinear resize of a 4-D NHWC (the fork's default) or NCHW blob.  Output size per
  axis: output_height / output_width when set, else floor(input * scale_height / scale_width) in
  float32.  Source coordinate of output index i, in float32: i * (in - 1) / (out - 1) with
  align_corners (i * in / out when out is 1), (i + 0.5) * in / out - 0.5 with half_pixel_centers or
  pytorch_half_pixel (the latter -0.5 when out is 1), else i * in / out; taps
  max(floor(src), 0) and min(ceil(src), in - 1), weight src - floor(src), each row
  top + (bottom - top) * wy from top = a + (b - a) * wx.  A non-default output_scale or
  output_zero_point rounds the result (half away from zero), saturate then clamps it.  The 3-D
  NCHWD form (any other data_format) is refused.

ONNX: Upsample -> ScatterElements (mask) or Resize (nearest), ShuffleChannel -> Reshape/Transpose/Reshape,
ResizeBilinear -> Resize (linear, with the matching coordinate_transformation_mode; Transpose around it for
NHWC).  _sizes_const and _resize also serve interp.py's Interp.
"""

import numpy as np
import torch

from .dsod_upsample import dsod_axis, dsod_upsample, onnx_dsod_upsample
from .registry import Layer, LayerError, need_blobs, positive_field, register_layer, torch_sources


def _sizes_const(ctx, x, hw, hint):
    """[N, C, h, w] for Resize/ConstantOfShape without baking N: Shape(x)[0:2] ++ hw."""
    shp = ctx.add_node("Shape", [x], [ctx.tmp(hint + "_shape")])[0]
    nc = ctx.add_node("Slice", [shp, ctx.const(np.array([0], np.int64)), ctx.const(np.array([2], np.int64))],
                      [ctx.tmp(hint + "_nc")])[0]
    return ctx.add_node("Concat", [nc, ctx.const(np.array(hw, np.int64))], [ctx.tmp(hint + "_sizes")], axis=0)[0]


def _resize(ctx, x, out, sizes, name, **attrs):
    if ctx.opset >= 13:
        ctx.add_node("Resize", [x, "", "", sizes], [out], name=name, **attrs)
    else:
        empty = ctx.const(np.zeros(0, np.float32))
        ctx.add_node("Resize", [x, empty, empty, sizes], [out], name=name, **attrs)


# ---- Upsample ----------------------------------------------------------------------

def segnet_unpool(x, mask, out_h: int, out_w: int):
    """SegNet's Upsample with a mask bottom (upsample_layer.cpp): value i of each (n, c) plane goes to
    output position int(mask[i]) = h * out_w + w, zeros elsewhere. Where several values share a
    position the last in row-major order wins, as Caffe's CPU loop writes them in that order."""
    n, c = x.shape[0], x.shape[1]
    index = mask.reshape(n, c, -1).to(torch.int64)   # static_cast<int>: truncation toward zero
    order = torch.arange(index.shape[2], device=x.device).expand(n, c, -1)
    last = torch.full((n, c, out_h * out_w), -1, dtype=torch.int64, device=x.device)
    last = last.scatter_reduce(2, index, order, reduce="amax")
    values = x.reshape(n, c, -1).gather(2, last.clamp_min(0))
    return torch.where(last >= 0, values, torch.zeros_like(values)).reshape(n, c, out_h, out_w)


TORCH_SEGNET_UNPOOL = torch_sources(segnet_unpool)


def onnx_unpool(ctx, name, x, mask, out, ho, wo):
    """segnet_unpool in ONNX: ScatterElements of each plane's values into zeros at int(mask).
    onnxruntime applies the updates in order, so a position written twice keeps the last."""
    flat_shape = ctx.const(np.array([0, 0, -1], np.int64))
    xf = ctx.add_node("Reshape", [x, flat_shape], [ctx.tmp(name + "_x")])[0]
    mf = ctx.add_node("Reshape", [mask, flat_shape], [ctx.tmp(name + "_m")])[0]
    mi = ctx.add_node("Cast", [mf], [ctx.tmp(name + "_idx")], to=7)[0]   # INT64, truncating as static_cast
    zshape = _sizes_const(ctx, x, [ho * wo], name + "_zeros")
    zeros = ctx.add_node("ConstantOfShape", [zshape], [ctx.tmp(name + "_z")], value=_onnx_scalar(0.0))[0]
    sc = ctx.add_node("ScatterElements", [zeros, mi, xf], [ctx.tmp(name + "_sc")], name=name, axis=2)[0]
    ctx.add_node("Reshape", [sc, ctx.const(np.array([0, 0, ho, wo], np.int64))], [out])


TORCH_DSOD_UPSAMPLE = torch_sources(dsod_axis, dsod_upsample)


@register_layer("Upsample")
class Upsample(Layer):
    def parse(self, lp):
        need_blobs(lp, "Upsample", (1, 2), roles="data, max-pooling mask")
        p = lp.upsample_param
        a = {"mask": len(lp.bottom) == 2, "out": None, "pad_out": (0, 0), "value_scale": 1,
             "bare": len(lp.bottom) == 2 and not lp.HasField("upsample_param")}   # Tiny-DSOD's, maybe
        has = p.HasField
        if has("size"):   # before darknet's stride: a size beside a stride is refused, not dropped
            return self._bitmain_size(lp, a)
        if has("stride") or has("stride_h") or has("stride_w"):
            return self._darknet_stride(lp, a)
        if not a["mask"] and p.nearestneighbor_mode and (has("upsample_h") or has("upsample_w")):
            # Cambricon's nearest-neighbour mode: a fixed output size, a whole multiple of the input's
            if not (has("upsample_h") and has("upsample_w")):
                raise LayerError("upsample_param.nearestneighbor_mode with an output size needs both "
                                 "upsample_h and upsample_w")
            a["out"] = (int(p.upsample_h), int(p.upsample_w))
            a["scale"] = (0, 0)
            if min(a["out"]) < 1:
                raise LayerError(f"upsample_param.upsample_h/upsample_w must be >= 1, got {list(a['out'])}")
            return a
        if a["mask"] and has("upsample_h") and has("upsample_w"):
            # SegNet: an explicit output size wins; scale and pad_out are then unused
            a["out"] = (int(p.upsample_h), int(p.upsample_w))
            a["scale"] = (0, 0)
            if min(a["out"]) <= 1:
                raise LayerError(f"upsample_param.upsample_h/upsample_w must be > 1, got {list(a['out'])}")
            return a
        if has("scale_h") or has("scale_w"):
            # SegNet's check: scale_h and scale_w together, and then no scale
            if has("scale") or not (has("scale_h") and has("scale_w")):
                raise LayerError("upsample_param: give scale, or both scale_h and scale_w, not both forms")
            a["scale"] = (int(p.scale_h), int(p.scale_w))
        else:
            a["scale"] = (int(p.scale), int(p.scale))
        if a["mask"]:
            # (upsample_h or upsample_w alone is ignored, as SegNet does)
            a["pad_out"] = (int(bool(p.pad_out_h)), int(bool(p.pad_out_w)))
            if min(a["scale"]) <= 1:
                raise LayerError(f"upsample_param scale must be > 1, got {list(a['scale'])}")
            for pad, sc, f in zip(a["pad_out"], a["scale"], ("h", "w")):
                if pad and sc != 2:
                    raise LayerError(f"upsample_param.pad_out_{f} needs scale_{f} == 2")
        else:
            if has("upsample_h") or has("upsample_w") or p.pad_out_h or p.pad_out_w:
                raise LayerError("one-bottom (nearest) Upsample takes only scale; upsample_h/w and pad_out "
                                 "need the SegNet form with a mask bottom")
            if min(a["scale"]) < 1:
                raise LayerError(f"upsample_param.scale must be >= 1, got {list(a['scale'])}")
        return a

    @staticmethod
    def _darknet_stride(lp, a):
        """Ascend ATC's / darknet's form: nearest upsampling by stride (or stride_h, stride_w), the
        values times scale (darknet's upsample_cpu multiplies by l.scale)."""
        p = lp.upsample_param
        if a["mask"]:
            raise LayerError("upsample_param.stride is the one-bottom (darknet) form; a mask bottom needs "
                             "SegNet's scale")
        if p.HasField("stride"):
            if p.HasField("stride_h") or p.HasField("stride_w"):
                raise LayerError("upsample_param: give stride, or stride_h and stride_w, not both forms")
            a["scale"] = (int(p.stride), int(p.stride))
        else:
            a["scale"] = (int(p.stride_h), int(p.stride_w))
        if min(a["scale"]) < 1:
            raise LayerError(f"upsample_param stride must be >= 1, got {list(a['scale'])}")
        if p.HasField("scale_h") or p.HasField("scale_w") or p.HasField("upsample_h") or p.HasField("upsample_w"):
            raise LayerError("upsample_param: stride (darknet's form) takes only scale, the values' factor")
        a["value_scale"] = int(p.scale) if p.HasField("scale") else 1
        return a

    @staticmethod
    def _bitmain_size(lp, a):
        """Bitmain's BM1880 toolchain (its yolov3 conversion): upsample_param.size, read as darknet's nearest
        upsampling by that factor, which the YOLOv3 route after it needs (the fork's source is not public)."""
        p = lp.upsample_param
        others = [f.name for f, _ in p.ListFields() if f.name != "size"]
        if a["mask"] or others:
            raise LayerError("upsample_param.size (Bitmain's one-bottom nearest upsampling) takes no mask bottom "
                             f"and no other field{': ' + ', '.join(others) if others else ''}")
        if p.size < 1:
            raise LayerError(f"upsample_param.size must be >= 1, got {p.size}")
        a["scale"] = (int(p.size), int(p.size))
        a["reading_notes"] = [f"upsample_param.size {p.size}: read as nearest upsampling by that factor (darknet's, "
                              "as Bitmain's yolov3 conversion needs; its Caffe's source is not public)"]
        return a

    @staticmethod
    def out_hw(a, h, w):
        if a["out"] is not None:
            return a["out"]
        return h * a["scale"][0] - a["pad_out"][0], w * a["scale"][1] - a["pad_out"][1]

    def infer(self, attrs, in_shapes):
        s = in_shapes[0]
        if len(s) != 4:
            raise LayerError(f"Upsample needs a 4-axis input, got {list(s)}")
        if attrs["mask"] and tuple(in_shapes[1]) != tuple(s):
            m = tuple(in_shapes[1])
            if not (attrs.get("bare") and len(m) == 4 and m[0] == s[0] and m[1] >= s[1] and m[2] <= s[2]
                    and m[3] <= s[3] and m[1] * m[2] * m[3] > 0):
                raise LayerError(f"the mask {list(m)} must be shaped like the data {list(s)}")
            # Tiny-DSOD's Upsample (dsod_upsample): bottom 1 resized to bottom 0's size
            attrs["dsod"] = True
            attrs.setdefault("reading_notes", []).append(
                "two bottoms, no upsample_param and a smaller second bottom: read as Tiny-DSOD's Upsample, "
                "the second bottom resized bilinearly to the first's height and width")
            return [tuple(s)]
        ho, wo = self.out_hw(attrs, s[2], s[3])
        if not attrs["mask"] and (ho % s[2] or wo % s[3]):
            raise LayerError(f"nearest-neighbour Upsample to {ho}x{wo} from {s[2]}x{s[3]}: the output must be a "
                             f"whole multiple of the input")
        return [(s[0], s[1], ho, wo)]

    @classmethod
    def nearest_scale(cls, a, h, w):
        """The whole factor of the one-bottom (nearest) form: scale, or output size / input size."""
        ho, wo = cls.out_hw(a, h, w)
        return ho // h, wo // w

    def forward(self, attrs, params, x, mask=None):
        if attrs.get("dsod"):
            return dsod_upsample(mask[:, :x.shape[1]], x.shape[2], x.shape[3])
        ho, wo = self.out_hw(attrs, x.shape[2], x.shape[3])
        if mask is None:
            sh, sw = self.nearest_scale(attrs, x.shape[2], x.shape[3])
            y = x.repeat_interleave(sh, dim=2).repeat_interleave(sw, dim=3)
            return y if attrs.get("value_scale", 1) == 1 else y * attrs["value_scale"]
        idx = mask.to(torch.int64)   # SegNet casts the float mask to int
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= ho * wo):
            raise LayerError(f"Upsample mask index out of range for a {ho}x{wo} output: check that the "
                             f"scale matches the pooling that made the mask")
        return segnet_unpool(x, mask, ho, wo)

    def onnx(self, ctx, node):
        a = node.attrs
        x = node.inputs[0]
        _n, _c, h, w = ctx.shape(x)
        if a.get("dsod"):
            small = node.inputs[1]
            small_hw = [int(d) for d in ctx.shape(small)[2:]]
            if ctx.shape(small)[1] != _c:
                small = ctx.op("Slice", [small, ctx.i64([0]), ctx.i64([int(_c)]), ctx.i64([1])], "channels")
            onnx_dsod_upsample(ctx, node, small, node.outputs[0], small_hw, int(h), int(w))
            return
        ho, wo = self.out_hw(a, h, w)
        if not a["mask"]:
            scales = ctx.const(np.array([1, 1, *self.nearest_scale(a, h, w)], np.float32))
            empty = "" if ctx.opset >= 13 else ctx.const(np.zeros(0, np.float32))
            value_scale = a.get("value_scale", 1)
            out = node.outputs[0] if value_scale == 1 else ctx.tmp(node.name + "_up")
            ctx.add_node("Resize", [x, empty, scales], [out], name=node.name, mode="nearest",
                         coordinate_transformation_mode="asymmetric", nearest_mode="floor")
            if value_scale != 1:
                ctx.add_node("Mul", [out, ctx.const(np.array([value_scale], np.float32))], [node.outputs[0]])
            return
        onnx_unpool(ctx, node.name, x, node.inputs[1], node.outputs[0], ho, wo)

    def pytorch_source(self, node, emit):
        a = node.attrs
        x = emit.inputs[0]
        if a.get("dsod"):
            fn = emit.helper(TORCH_DSOD_UPSAMPLE)
            c, h, w = emit.in_shape(0)[1:]
            return f"{fn}({emit.inputs[1]}[:, :{c}], {h}, {w})"
        if not a["mask"]:
            sh, sw = self.nearest_scale(a, *emit.in_shape(0)[2:])
            up = f"{x}.repeat_interleave({sh}, dim=2).repeat_interleave({sw}, dim=3)"
            return up if a.get("value_scale", 1) == 1 else f"{up} * {float(a['value_scale'])!r}"
        ho, wo = self.out_hw(a, *emit.in_shape(0)[2:])
        fn = emit.helper(TORCH_SEGNET_UNPOOL)
        return f"{fn}({x}, {emit.inputs[1]}, {ho}, {wo})"


@register_layer("UpsampleDarknet")
class UpsampleDarknet(Upsample):
    """synopsys-caffe's UpsampleDarknet (upsample_darknet_layer.cpp): top[n, c, h, w] =
    bottom[n, c, h / stride, w / stride], the one-bottom nearest Upsample with scale = stride."""

    def parse(self, lp):
        need_blobs(lp, "UpsampleDarknet", 1)
        stride = int(lp.upsample_darknet_param.stride)
        if stride < 1:
            raise LayerError(f"upsample_darknet_param.stride must be >= 1, got {stride}")
        return {"mask": False, "out": None, "pad_out": (0, 0), "scale": (stride, stride), "value_scale": 1}


def _onnx_scalar(v):
    from onnx import numpy_helper
    return numpy_helper.from_array(np.array([v], np.float32))


# ---- ShuffleChannel ----------------------------------------------------------------

@register_layer("ShuffleChannel")
class ShuffleChannel(Layer):
    def parse(self, lp):
        need_blobs(lp, "ShuffleChannel", 1)
        g = int(lp.shuffle_channel_param.group)
        positive_field(g, "shuffle_channel_param.group")
        return {"group": g}

    def infer(self, attrs, in_shapes):
        s = in_shapes[0]
        if len(s) < 2:
            raise LayerError(f"ShuffleChannel needs a channel axis, got {list(s)}")
        if s[1] % attrs["group"]:
            raise LayerError(f"{s[1]} channels are not divisible by group {attrs['group']}")
        return [tuple(s)]

    def forward(self, attrs, params, x):
        g = attrs["group"]
        n, c = x.shape[0], x.shape[1]
        return x.reshape((n, g, c // g) + tuple(x.shape[2:])).transpose(1, 2).reshape(x.shape)

    def onnx(self, ctx, node):
        g = node.attrs["group"]
        s = ctx.shape(node.inputs[0])
        c = s[1]
        a = ctx.add_node("Reshape", [node.inputs[0], ctx.const(np.array([0, g, c // g, -1], np.int64))],
                         [ctx.tmp(node.name + "_grp")])[0]
        t = ctx.add_node("Transpose", [a], [ctx.tmp(node.name + "_t")], name=node.name, perm=[0, 2, 1, 3])[0]
        ctx.add_node("Reshape", [t, ctx.const(np.array([0] + list(s[1:]), np.int64))], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        # nn.ChannelShuffle: the (group, C/group) view transposed, as forward
        m = emit.module(f"nn.ChannelShuffle({node.attrs['group']})")
        return f"{m}({emit.inputs[0]})"


# ---- ResizeBilinear (synopsys-caffe) --------------------------------------------------

#: saturate enum value -> (low, high) as the fork's caffe_cpu_saturate clamps (math_functions.cpp)
SATURATE_RANGES = {1: (-2048.0, 2047.0), 2: (0.0, 4095.0), 3: (-128.0, 127.0), 4: (0.0, 255.0)}
RESIZE_MODES = ("asymmetric", "align_corners", "half_pixel", "pytorch_half_pixel")


def resize_bilinear_taps(n_in: int, n_out: int, mode: str, device: torch.device):
    """synopsys-caffe's compute_interpolation_weights for one axis: (lower, upper, lerp) per output
    index, the source coordinate in float32 as the fork computes it."""
    f32 = torch.float32
    i = torch.arange(n_out, dtype=f32)
    if mode == "align_corners" and n_out > 1:
        scale = torch.tensor(float(n_in - 1), dtype=f32) / torch.tensor(float(n_out - 1), dtype=f32)
    else:
        scale = torch.tensor(float(n_in), dtype=f32) / torch.tensor(float(n_out), dtype=f32)
    if mode in ("align_corners", "asymmetric"):
        src = i * scale
    elif mode == "pytorch_half_pixel" and n_out <= 1:
        src = torch.full((n_out,), -0.5, dtype=f32)
    else:
        src = (i + 0.5) * scale - 0.5
    base = torch.floor(src)
    lower = base.clamp_min(0).long().to(device)
    upper = torch.ceil(src).clamp_max(n_in - 1).long().to(device)
    return lower, upper, (src - base).to(device)


def resize_bilinear_size(n_in: int, out: int, scale: float):
    """The fork's output size on one axis: `out` when set (> 0), else floor(n_in * scale) in float32."""
    if out > 0:
        return out
    return int(torch.floor(torch.tensor(float(n_in), dtype=torch.float32)
                           * torch.tensor(scale, dtype=torch.float32)))


def synopsys_resize_bilinear(x, out_h: int, out_w: int, scale_h: float, scale_w: float, mode: str,
                             nhwc: bool, round_out: bool = False, low: float = None, high: float = None):
    """synopsys-caffe's ResizeBilinear of a 4-D x (N, H, W, C when nhwc, else N, C, H, W); out_h /
    out_w: the output size (0: floor(input * scale_h / scale_w)); round_out: round half away from
    zero (the fork's quantized output); low / high: its saturate clamp."""
    if nhwc:
        x = x.permute(0, 3, 1, 2)
    h, w = x.shape[2], x.shape[3]
    ho, wo = resize_bilinear_size(h, out_h, scale_h), resize_bilinear_size(w, out_w, scale_w)
    y0, y1, ly = resize_bilinear_taps(h, ho, mode, x.device)
    x0, x1, lx = resize_bilinear_taps(w, wo, mode, x.device)
    ly, lx = ly.to(x.dtype)[:, None], lx.to(x.dtype)
    rows0, rows1 = x.index_select(2, y0), x.index_select(2, y1)
    tl, tr = rows0.index_select(3, x0), rows0.index_select(3, x1)
    bl, br = rows1.index_select(3, x0), rows1.index_select(3, x1)
    top = tl + (tr - tl) * lx
    bottom = bl + (br - bl) * lx
    out = top + (bottom - top) * ly
    if round_out:
        out = torch.sign(out) * torch.floor(torch.abs(out) + 0.5)
    if low is not None:
        out = out.clamp(low, high)
    return out.permute(0, 2, 3, 1) if nhwc else out


# model.py gets the same code that forward runs
TORCH_RESIZE_BILINEAR = torch_sources(resize_bilinear_taps, resize_bilinear_size,
                                                                      synopsys_resize_bilinear)


def synopsys_resize_fields(p, field):
    """output_height / output_width (0 when unset) and scale_height / scale_width of synopsys-caffe's
    resize messages (ResizeBilinear, ResizeNearestNeighbor), checked."""
    a = {}
    for axis in ("height", "width"):
        out, scale = f"output_{axis}", f"scale_{axis}"
        a[out] = int(getattr(p, out)) if p.HasField(out) else 0
        a[scale] = float(getattr(p, scale))
        if p.HasField(out) and a[out] <= 0:
            raise LayerError(f"{field}.{out} must be positive, got {a[out]}")
        if not p.HasField(out) and not a[scale] > 0:
            raise LayerError(f"{field}.{scale} must be positive, got {a[scale]}")
    return a


def synopsys_resize_hw(a, shape, what):
    """(h, w, output h, output w) of a synopsys-caffe resize of a 4-axis NHWC (a["nhwc"]) or NCHW blob."""
    if len(shape) != 4:
        raise LayerError(f"{what} needs a 4-axis input, got {list(shape)}")
    h, w = (shape[1], shape[2]) if a["nhwc"] else (shape[2], shape[3])
    ho = resize_bilinear_size(h, a["output_height"], a["scale_height"])
    wo = resize_bilinear_size(w, a["output_width"], a["scale_width"])
    if ho <= 0 or wo <= 0:
        raise LayerError(f"output size {ho}x{wo} (from a {h}x{w} input) must be positive")
    return h, w, ho, wo


@register_layer("ResizeBilinear")
class ResizeBilinear(Layer):
    def parse(self, lp):
        need_blobs(lp, "ResizeBilinear", 1, 1, in_place=False)
        p = lp.resize_bilinear_param
        fmt = str(p.data_format)
        if fmt not in ("NHWC", "NCHW"):
            raise LayerError(f"resize_bilinear_param.data_format '{fmt}' is the fork's 3-D (NCHWD) resize, "
                             f"which caffeq does not read; use NHWC or NCHW")
        flags = [f for f in ("align_corners", "half_pixel_centers", "pytorch_half_pixel") if getattr(p, f)]
        if len(flags) > 1:
            raise LayerError(f"resize_bilinear_param: {' and '.join(flags)} exclude each other (the fork checks it)")
        mode = {"align_corners": "align_corners", "half_pixel_centers": "half_pixel",
                "pytorch_half_pixel": "pytorch_half_pixel"}[flags[0]] if flags else "asymmetric"
        a = {"nhwc": fmt == "NHWC", "mode": mode, **synopsys_resize_fields(p, "resize_bilinear_param")}
        # the fork's quantization options: a non-default output scale / zero point rounds the result
        a["round"] = float(p.output_scale) != 1.0 or int(p.output_zero_point) != 0
        a["saturate"] = SATURATE_RANGES.get(int(p.saturate))
        return a

    @staticmethod
    def out_hw(a, shape):
        return synopsys_resize_hw(a, shape, "ResizeBilinear")[2:]

    def infer(self, attrs, in_shapes):
        s = in_shapes[0]
        ho, wo = self.out_hw(attrs, s)
        return [(s[0], ho, wo, s[3]) if attrs["nhwc"] else (s[0], s[1], ho, wo)]

    @staticmethod
    def _call_args(a):
        low, high = a["saturate"] or (None, None)
        return (a["output_height"], a["output_width"], a["scale_height"], a["scale_width"], a["mode"],
                a["nhwc"], a["round"], low, high)

    def forward(self, attrs, params, x):
        self.out_hw(attrs, x.shape)
        return synopsys_resize_bilinear(x, *self._call_args(attrs))

    def onnx(self, ctx, node):
        a, name = node.attrs, node.name
        x, out = node.inputs[0], node.outputs[0]
        ho, wo = self.out_hw(a, ctx.shape(x))
        if a["nhwc"]:
            x = ctx.add_node("Transpose", [x], [ctx.tmp(name + "_nchw")], perm=[0, 3, 1, 2])[0]
        tail = a["nhwc"] or a["round"] or a["saturate"]
        y = ctx.tmp(name + "_resized") if tail else out
        _resize(ctx, x, y, _sizes_const(ctx, x, [ho, wo], name), name, mode="linear",
                coordinate_transformation_mode=a["mode"])
        if a["round"]:  # half away from zero: sign(y) * floor(|y| + 0.5)
            mag = ctx.add_node("Abs", [y], [ctx.tmp(name + "_abs")])[0]
            mag = ctx.add_node("Add", [mag, ctx.const(np.array(0.5, np.float32))], [ctx.tmp(name + "_half")])[0]
            mag = ctx.add_node("Floor", [mag], [ctx.tmp(name + "_floor")])[0]
            sign = ctx.add_node("Sign", [y], [ctx.tmp(name + "_sign")])[0]
            y = ctx.add_node("Mul", [sign, mag], [ctx.tmp(name + "_round")])[0]
        if a["saturate"]:
            low, high = (ctx.const(np.array(v, np.float32)) for v in a["saturate"])
            y = ctx.add_node("Clip", [y, low, high], [ctx.tmp(name + "_sat")])[0]
        if a["nhwc"]:
            ctx.add_node("Transpose", [y], [out], perm=[0, 2, 3, 1])
        elif tail:
            ctx.add_node("Identity", [y], [out])

    def pytorch_source(self, node, emit):
        fn = emit.helper(TORCH_RESIZE_BILINEAR)
        args = ", ".join(emit.lit(v) for v in self._call_args(node.attrs))
        return f"{fn}({emit.inputs[0]}, {args})"
