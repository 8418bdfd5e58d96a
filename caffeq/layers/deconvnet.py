"""piergiaj/caffe-deconvnet's PoolingSwitches, SliceHalf and InvPooling (a71d409: caffe/src/caffe/layers/
pooling_switches_layer.cpp, slice_half_layer.cpp, inv_pooling_layer.cpp; caffe/include/caffe/vision_layers.hpp,
common_layers.hpp; layer_factory.cpp; caffe/src/proto/caffe.proto).  The fork's python-demo runs a CaffeNet whose
pools keep their switches (deploy.prototxt) and a deconvnet that unpools through them (invdeploy.prototxt).  None of
the three has a Forward_gpu: the CPU loops are the layers, in both modes.  They read BVLC's pooling_param and
slice_param; the fork adds no field (only V1 enum values, INVPOOLING 133, POOLINGSWITCHES 134, SLICEHALF 135, which
its own V2-format files never use).

- PoolingSwitches (pooling_param; engine DEFAULT or CAFFE, CUDNN aborts): Caffe's Pooling geometry (kernel,
  stride, pad, global_pooling; ceil rounding and the last-window rule when padded: pooling.py's window) on a
  (N, C, H, W) bottom, but ONE top of (2N, C, PH, PW) holding two stacked halves.  MAX: samples 0..N-1 are the
  pooled values, samples N..2N-1 the switches, the index h * W + w of each window's maximum within its input plane,
  as a float.  Both halves start at -FLT_MAX; a cell replaces the running maximum only when strictly greater, so
  the first maximum in row-major scan order keeps it, a NaN never wins, and a window with nothing above -FLT_MAX
  keeps -FLT_MAX as its value AND as its switch.  An optional second top (MaxTopBlobs 2 for MAX) is (2N, C, PH, PW),
  filled with -1 and given the index in both halves.  AVE: the fork's channel loop runs to C / 2 while stepping
  one plane at a time, so only the first N * (C / 2) planes (flattened n * C + c order) get Caffe's average
  (divided by the window clipped to the padded extent), the rest of the first half and the whole second half stay
  0.  STOCHASTIC aborts (NOT_IMPLEMENTED).
- SliceHalf (slice_param): Slice with one slice point, num / 2 of the bottom (axis 0's size, whatever the slice
  axis), set in LayerSetUp; slice_point is not read.  Exactly two tops: [0, num / 2) and [num / 2, size) along
  slice_param.axis (or slice_dim), as BVLC's Slice copies them.  caffeq takes num / 2 of the blob it runs on
  (the same as the fork's at the prototxt's batch; after a Caffe reshape the fork would keep its setup-time point).
- InvPooling (pooling_param, MAX only; AVE and STOCHASTIC abort): its one bottom is (2M, C, H, W), the switches in
  samples 0..M-1 and the values in M..2M-1 (the demo Concats switches and data along axis 0); an odd count's last
  sample is not read.  The top is (M, C, (H - 1) * stride_h + kernel_h - 2 * pad_h, (W - 1) * stride_w + kernel_w -
  2 * pad_w) (with global_pooling the kernel is the bottom's H x W, so 2H - 1).  The top is zeroed, then every
  value is written at int(switch) (truncation) of its own (m, c) plane, in the bottom's row-major order: where
  overlapping windows share a switch the later write wins (an overwrite, no sum).  That is SegNet's mask
  unpooling (vision_forks.segnet_unpool / onnx_unpool).  The fork indexes with int(switch) into the plane
  unchecked: a switch outside [0, top H * W) writes into another plane or outside the blob (its -FLT_MAX switch
  is undefined), which caffeq refuses at run time.  Its second top (MaxTopBlobs 2) is never written: refused.
"""
import torch

from .pooling import (
    AVE,
    CEIL,
    FLT_MAX,
    MAX,
    STOCHASTIC,
    TORCH_POOL_FUNCTIONS,
    caffe_max_pool2d_mask,
    caffe_pool2d,
    parse_pooling,
    pooling_geometry,
    window,
)
from .registry import Layer, LayerError, four_axes, need_blobs, register_layer, torch_sources
from .shape_ops import INT64_MAX, _axis_attrs, _concat_slice_axis, _onnx_slice, onnx_dims
from .unpooling import unpooled_size
from .vision_forks import TORCH_SEGNET_UNPOOL, onnx_unpool, segnet_unpool

FORK = "piergiaj/caffe-deconvnet"


# ---- torch: used by forward and copied into model.py ----------------------------------------

def pool_switches(x, ave: bool, kernel: list[int], stride: list[int], pad: list[int], mask_top: bool):
    """PoolingSwitches: [values over switches stacked on axis 0] (and the -1-filled mask top twice, mask_top)
    for MAX; for AVE the fork's half-channel average over zeros."""
    if ave:
        y = caffe_pool2d(x, "ave", kernel, stride, pad, True)
        n, c = y.shape[0], y.shape[1]
        planes = torch.arange(n * c, device=x.device).reshape(n, c, 1, 1)
        y = torch.where(planes < n * (c // 2), y, torch.zeros_like(y))
        return [torch.cat([y, torch.zeros_like(y)], 0)]
    # the fork's strict > never takes a NaN: as -inf it never wins either
    x = torch.where(torch.isnan(x), torch.full_like(x, float("-inf")), x)
    values, mask = caffe_max_pool2d_mask(x, kernel, stride, pad, True)
    floor = -65504.0 if x.dtype == torch.float16 else -3.4028234663852886e38   # as caffe_max_pool2d_mask's
    switches = torch.where(mask < 0, torch.full_like(mask, floor), mask)
    tops = [torch.cat([values, switches], 0)]
    if mask_top:
        tops.append(torch.cat([mask, mask], 0))
    return tops


def inv_pooling(x, out_h: int, out_w: int):
    """InvPooling: the values (second half of axis 0) written at their switches (first half) into zeros."""
    half = x.shape[0] // 2
    return segnet_unpool(x[half:2 * half], x[:half], out_h, out_w)


TORCH_POOL_SWITCHES = torch_sources(pool_switches)
TORCH_INV_POOLING = torch_sources(inv_pooling)


# ---- reading pooling_param as the fork does ----------------------------------------------

def _fork_pooling(lp, what, methods):
    """pooling_param as the fork's LayerSetUp reads it: BVLC's fields only, ceil rounding, engine CAFFE."""
    p = lp.pooling_param
    attrs = parse_pooling(p)
    if attrs.get("negate") or attrs["pool"] not in methods:
        name = {AVE: "AVE", STOCHASTIC: "STOCHASTIC"}.get(attrs["pool"], str(int(p.pool)))
        raise LayerError(f"pooling_param.pool {name}: {FORK}'s {what} implements "
                         f"{' and '.join('MAX' if m == MAX else 'AVE' for m in methods)} only (NOT_IMPLEMENTED)")
    if attrs["round_mode"] != CEIL or attrs.get("edge") is not None or attrs.get("fork") is not None \
            or attrs.get("bins") is not None:
        raise LayerError(f"pooling_param: {what} ({FORK}) reads BVLC's kernel, stride, pad and global_pooling "
                         f"only, always rounding up (no round_mode / ceil_mode, per-side pads, dilation or bins)")
    if p.engine == p.CUDNN:
        raise LayerError(f"pooling_param.engine CUDNN: {FORK}'s {what} has only the CAFFE engine (unknown engine)")
    pooling_geometry(attrs, 2)
    return attrs


# ---- PoolingSwitches -----------------------------------------------------------------------

@register_layer("PoolingSwitches")
class PoolingSwitches(Layer):
    def parse(self, lp):
        p = lp.pooling_param
        most = 2 if p.pool == p.MAX else 1
        need_blobs(lp, "PoolingSwitches", 1, (1, 2) if most == 2 else 1,
                   roles="data")
        attrs = _fork_pooling(lp, "PoolingSwitches", (MAX, AVE))
        attrs["mask"] = len(lp.top) == 2
        return attrs

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "PoolingSwitches")
        _, _, _, out = window(attrs, h, w)
        if min(out) < 1:
            raise LayerError(f"PoolingSwitches output would be empty for input {list(in_shapes[0])}")
        top = (2 * n, c) + tuple(out)
        return [top, top] if attrs["mask"] else [top]

    @staticmethod
    def _args(attrs, h, w):
        k, s, p, _ = window(attrs, h, w)
        return attrs["pool"] == AVE, list(k), list(s), list(p), attrs["mask"]

    def forward(self, attrs, params, x):
        tops = pool_switches(x, *self._args(attrs, x.shape[2], x.shape[3]))
        return tops[0] if len(tops) == 1 else tuple(tops)

    def macs(self, attrs, in_shapes, out_shapes):
        k = window(attrs, in_shapes[0][2], in_shapes[0][3])[0]
        return out_shapes[0][0] // 2 * out_shapes[0][1] * out_shapes[0][2] * out_shapes[0][3] * k[0] * k[1]

    def onnx(self, ctx, node):
        from ..backends.onnx_pooling import emit_max_pool_mask, emit_pooling
        a, x = node.attrs, node.inputs[0]
        if a["pool"] == AVE:
            c = int(ctx.shape(x)[1])
            y = ctx.tmp(f"{node.name}_pooled")
            emit_pooling(ctx, node, a, x, y)
            # planes n * C + c below N * (C / 2) keep their average (the fork's C / 2 channel loop)
            n = onnx_dims(ctx, x, 0, 1)
            planes = ctx.op("Range", [ctx.i64(0), ctx.op("Squeeze", [ctx.op("Mul", [n, ctx.i64([c])], "nc"),
                                                                    ctx.i64([0])], "nc_scalar"), ctx.i64(1)], "planes")
            bound = ctx.op("Squeeze", [ctx.op("Mul", [n, ctx.i64([c // 2])], "kept"), ctx.i64([0])], "kept_scalar")
            kept = ctx.op("Reshape", [ctx.op("Less", [planes, bound], "kept_planes"), ctx.i64([-1, c, 1, 1])],
                          "kept_mask")
            y = ctx.op("Where", [kept, y, ctx.f32(0.0)], "half_channels")
            ctx.add_node("Concat", [y, ctx.filled(y, 0.0, "zeros")], [node.outputs[0]], name=node.name, axis=0)
            return
        x = ctx.op("Where", [ctx.op("IsNaN", [x], "nan"), ctx.f32(float("-inf")), x], "nan_low")
        values, mask = ctx.tmp(f"{node.name}_values"), ctx.tmp(f"{node.name}_mask")
        emit_max_pool_mask(ctx, node, x, [values, mask])
        switches = ctx.op("Where", [ctx.op("Less", [mask, ctx.f32(0.0)], "none"), ctx.f32(-FLT_MAX), mask],
                          "switches")
        ctx.add_node("Concat", [values, switches], [node.outputs[0]], name=node.name, axis=0)
        if a["mask"]:
            ctx.add_node("Concat", [mask, mask], [node.outputs[1]], name=f"{node.name}/mask", axis=0)

    def pytorch_source(self, node, emit):
        a = node.attrs
        if a["global"]:
            emit.note("Global PoolingSwitches uses the prototxt's input size as its window.")
        emit.helper(TORCH_POOL_FUNCTIONS)
        fn = emit.helper(TORCH_POOL_SWITCHES)
        ave, k, s, p, mask = self._args(a, *emit.in_shape(0)[2:])
        call = f"{fn}({emit.inputs[0]}, {ave}, {emit.lit(k)}, {emit.lit(s)}, {emit.lit(p)}, {mask})"
        if not mask:
            return f"{call}[0]"
        tops = emit.tmp(node.name + "_tops")
        emit.stmt(f"{tops} = {call}")
        return [f"{tops}[0]", f"{tops}[1]"]


# ---- SliceHalf -----------------------------------------------------------------------------

@register_layer("SliceHalf")
class SliceHalf(Layer):
    def parse(self, lp):
        need_blobs(lp, "SliceHalf", 1, 2)
        attrs = _axis_attrs(lp.slice_param, "slice_dim", "slice")
        if lp.slice_param.slice_point:
            attrs["reading_notes"] = [f"SliceHalf ({FORK}) does not read slice_param.slice_point: it slices at "
                                      f"num / 2"]
        return attrs

    def infer(self, attrs, in_shapes):
        s = tuple(int(d) for d in in_shapes[0])
        if not s:
            raise LayerError("SliceHalf needs a bottom with axes, got a scalar")
        axis = attrs["_axis"] = _concat_slice_axis(attrs, len(s), "slice")
        point = s[0] // 2
        if point < 1:
            raise LayerError(f"SliceHalf slices at num / 2 = {point}: the bottom {list(s)} needs num >= 2")
        if s[axis] <= point:
            raise LayerError(f"SliceHalf slices axis {axis} at num / 2 = {point}, which leaves nothing of the "
                             f"bottom {list(s)} for its second top")
        return [s[:axis] + (point,) + s[axis + 1:], s[:axis] + (s[axis] - point,) + s[axis + 1:]]

    def forward(self, attrs, params, x):
        point = x.shape[0] // 2
        return tuple(torch.split(x, [point, x.shape[attrs["_axis"]] - point], dim=attrs["_axis"]))

    def onnx(self, ctx, node):
        x, axis = node.inputs[0], node.attrs["_axis"]
        half = ctx.op("Div", [onnx_dims(ctx, x, 0, 1), ctx.i64([2])], "half")
        _onnx_slice(ctx, x, [0], half, [axis], out=node.outputs[0], name=node.name)
        _onnx_slice(ctx, x, half, [INT64_MAX], [axis], out=node.outputs[1], name=f"{node.name}/second")

    def pytorch_source(self, node, emit):
        x, axis = emit.inputs[0], node.attrs["_axis"]
        return f"torch.split({x}, [{x}.shape[0] // 2, {x}.shape[{axis}] - {x}.shape[0] // 2], dim={axis})"


# ---- InvPooling ----------------------------------------------------------------------------

@register_layer("InvPooling")
class InvPooling(Layer):
    def parse(self, lp):
        if len(lp.top) == 2:
            raise LayerError(f"InvPooling's second top: {FORK}'s forward never writes it")
        need_blobs(lp, "InvPooling", 1, 1, roles="switches and values stacked on axis 0")
        return _fork_pooling(lp, "InvPooling", (MAX,))

    @staticmethod
    def _out(attrs, h, w):
        k, s, p = ((h, w), (1, 1), (0, 0)) if attrs["global"] else (attrs["kernel"], attrs["stride"], attrs["pad"])
        return tuple(unpooled_size(int(n), kk, ss, pp) for n, kk, ss, pp in zip((h, w), k, s, p))

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "InvPooling")
        if n < 2:
            raise LayerError(f"InvPooling reads switches and values from the two halves of axis 0; the bottom "
                             f"{list(in_shapes[0])} has num {n}")
        out = self._out(attrs, h, w)
        if min(out) < 1:
            raise LayerError(f"InvPooling output would be {list(out)} for input {list(in_shapes[0])}")
        return [(n // 2, c) + out]

    def forward(self, attrs, params, x):
        oh, ow = self._out(attrs, x.shape[2], x.shape[3])
        half = x.shape[0] // 2
        index = torch.trunc(x[:half])
        bad = ~((index >= 0) & (index < oh * ow))
        if bool(bad.any()):
            v = float(x[:half][bad].reshape(-1)[0])
            raise LayerError(f"InvPooling switch {v} lies outside its {oh}x{ow} top plane ({FORK}'s loop would write "
                             f"into another plane or outside the blob)")
        return inv_pooling(x, oh, ow)

    def onnx(self, ctx, node):
        x = node.inputs[0]
        oh, ow = self._out(node.attrs, *ctx.shape(x)[2:])
        half = ctx.op("Div", [onnx_dims(ctx, x, 0, 1), ctx.i64([2])], "half")
        switches = _onnx_slice(ctx, x, [0], half, [0], out=ctx.tmp(f"{node.name}_switches"))
        values = _onnx_slice(ctx, x, half, ctx.op("Mul", [half, ctx.i64([2])], "both"), [0],
                             out=ctx.tmp(f"{node.name}_values"))
        onnx_unpool(ctx, node.name, values, switches, node.outputs[0], oh, ow)

    def pytorch_source(self, node, emit):
        if node.attrs["global"]:
            emit.note("Global InvPooling uses the prototxt's input size as its window.")
        emit.helper(TORCH_SEGNET_UNPOOL)
        fn = emit.helper(TORCH_INV_POOLING)
        oh, ow = self._out(node.attrs, *emit.in_shape(0)[2:])
        return f"{fn}({emit.inputs[0]}, {oh}, {ow})"


__all__ = ["InvPooling", "PoolingSwitches", "SliceHalf"]
