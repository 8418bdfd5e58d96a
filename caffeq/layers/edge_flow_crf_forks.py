"""Single-fork layers of edge detection, skeletons, optical flow and CRF-RNN nets.

- AutoCrop (yun-liu/RCF auto_crop_layer.cpp): no parameters; crops bottom 0 to bottom 1's H and W
  at offsets the fork derives from the coordinate maps of the whole net.  caffeq/io/coord_maps.py
  computes them when the net is read and rewrites each AutoCrop into a BVLC Crop (axis 2, those
  offsets), so the spec below is reached only by a net that skipped that step.
- Insanity (happynear/caffe-windows 967eedf, insanity_layer.cpp/.cu; insanity_param lb [5], ub [10]):
  the randomised leaky ReLU.  At TEST (CPU and GPU alike) y = max(x, 0) + min(x, 0) / mean_slope with
  mean_slope = (ub - lb) / (ln|ub| - ln|lb|): the same layer as ducha-aiki's RReLU (act_forks.py),
  under its first name and parameter field.
- Quantize (zeakey/DeepSkeleton quantize_layer.cpp, CPU only): maps a skeleton scale to its class:
  [1, 12) -> 1, [12, 36) -> 2, [36, 80) -> 3, [80, 200) -> 4, anything else -> 0.  The fork stops
  (LOG(FATAL)) on NaN; here NaN gives 0.
- Rescale (zeakey/DeepSkeleton rescale_layer.cpp; rescale_param rf [1]): top0 = 2 x / rf - 1, and
  an optional top1 = 1, where x < rf and |x| > 0.0001; both 0 elsewhere.  (The fork calls an
  unqualified `abs` on a float; this reads it as the float absolute value.)
- FlowWarp (lmb-freiburg/flownet2 flow_warp_layer.cpp/.cu; flow_warp_param fill_value ZERO | NOT_A_NUMBER):
  bottoms (image, flow), flow (N, 2, H, W) in pixels, x then y.  top[n, c, y, x] samples the image at
  (x2, y2) = (x + fx, y + fy) bilinearly from the pixels (floor(x2), floor(y2)) and the next ones,
  clamped to the last row / column; where x2 or y2 leaves [0, W) x [0, H) the top is the fill
  value (0 or NaN).  optical_flow.flow_warp computes it, PWC-Net's Warp being the same sampling
  with other bounds and neighbours.
- MultiStageMeanfield (CRF-RNN) lives in crf_rnn.py.
- DenseCRF (DeepLab v2's fully connected CRF, and CCNN's) lives in dense_crf.py.
"""
import numpy as np
import torch

from .act_forks import RReLU
from .optical_flow import flow_warp, pixels_at
from .registry import FunctionLayer, Layer, LayerError, need_blobs, positive_field, register_layer
from .warp_onnx import OnnxImageSampler

# ---- torch functions (model.py gets the same code) ---------------------------------------


def skeleton_scale_class(x):
    """DeepSkeleton's Quantize: the class of a skeleton scale (0 outside [1, 200))."""
    cls = 1 + (x >= 12).to(x.dtype) + (x >= 36).to(x.dtype) + (x >= 80).to(x.dtype)
    return torch.where((x >= 1) & (x < 200), cls, torch.zeros_like(x))


def skeleton_rescale(x, rf: float, eps: float):
    """DeepSkeleton's Rescale: (2 x / rf - 1, 1) inside the receptive field, (0, 0) elsewhere."""
    outside = (x >= rf) | (x.abs() <= eps)
    zero = torch.zeros_like(x)
    return torch.where(outside, zero, 2 * x / rf - 1), torch.where(outside, zero, torch.ones_like(x))


# ---- AutoCrop ------------------------------------------------------------------------------

@register_layer("AutoCrop")
class AutoCrop(Layer):
    def parse(self, lp):
        raise LayerError("RCF's AutoCrop takes its offsets from the coordinate maps of the net; caffeq "
                         "computes them when it reads a net file (caffeq.io.upgrade), which this net "
                         "did not go through")


# ---- Insanity ------------------------------------------------------------------------------

@register_layer("Insanity")
class Insanity(RReLU):
    param_field = "insanity_param"


# ---- Quantize and Rescale ------------------------------------------------------------------

@register_layer("Quantize")
class Quantize(FunctionLayer):
    fn = staticmethod(skeleton_scale_class)

    def onnx(self, ctx, node):
        x, name = node.inputs[0], node.name

        def step(edge):
            above = ctx.add_node("GreaterOrEqual", [x, ctx.const(np.array(edge, np.float32))],
                                 ctx.tmp(f"{name}_ge{edge}"))
            return ctx.add_node("Cast", [above], ctx.tmp(f"{name}_step{edge}"), to=1)   # FLOAT

        cls = ctx.const(np.array(1, np.float32))
        for edge in (12, 36, 80):
            cls = ctx.add_node("Add", [cls, step(edge)], ctx.tmp(f"{name}_cls{edge}"))
        low = ctx.add_node("GreaterOrEqual", [x, ctx.const(np.array(1, np.float32))], ctx.tmp(name + "_low"),
                           name=name)
        high = ctx.add_node("Less", [x, ctx.const(np.array(200, np.float32))], ctx.tmp(name + "_high"))
        inside = ctx.add_node("And", [low, high], ctx.tmp(name + "_inside"))
        ctx.add_node("Where", [inside, cls, ctx.const(np.array(0, np.float32))], [node.outputs[0]])


_RESCALE_EPS = float(np.float32(0.0001))   # Dtype(0.0001)


@register_layer("Rescale")
class Rescale(Layer):
    def parse(self, lp):
        need_blobs(lp, "Rescale", 1, (1, 2))
        # rf == 0 divides by zero in the fork; refuse it rather than return infinities
        return {"rf": float(positive_field(lp.rescale_param.rf, "rescale_param.rf")), "tops": len(lp.top)}

    def infer(self, attrs, in_shapes):
        return [tuple(in_shapes[0])] * attrs["tops"]

    def forward(self, attrs, params, x):
        scaled, inside = skeleton_rescale(x, attrs["rf"], _RESCALE_EPS)
        return (scaled, inside) if attrs["tops"] == 2 else scaled

    def onnx(self, ctx, node):
        x, name = node.inputs[0], node.name
        far = ctx.add_node("GreaterOrEqual", [x, ctx.const(np.array(node.attrs["rf"], np.float32))],
                           ctx.tmp(name + "_far"), name=name)
        mag = ctx.add_node("Abs", [x], ctx.tmp(name + "_abs"))
        tiny = ctx.add_node("LessOrEqual", [mag, ctx.const(np.array(_RESCALE_EPS, np.float32))],
                            ctx.tmp(name + "_tiny"))
        outside = ctx.add_node("Or", [far, tiny], ctx.tmp(name + "_outside"))
        zero = ctx.const(np.array(0, np.float32))
        twice = ctx.add_node("Mul", [ctx.const(np.array(2, np.float32)), x], ctx.tmp(name + "_2x"))
        ratio = ctx.add_node("Div", [twice, ctx.const(np.array(node.attrs["rf"], np.float32))],
                             ctx.tmp(name + "_ratio"))
        shifted = ctx.add_node("Sub", [ratio, ctx.const(np.array(1, np.float32))], ctx.tmp(name + "_shifted"))
        ctx.add_node("Where", [outside, zero, shifted], [node.outputs[0]])
        if node.attrs["tops"] == 2:
            ctx.add_node("Where", [outside, zero, ctx.const(np.array(1, np.float32))], [node.outputs[1]])

    def pytorch_source(self, node, emit):
        call = (f"{emit.helper(skeleton_rescale)}({emit.inputs[0]}, {emit.lit(node.attrs['rf'])}, "
                f"{emit.lit(_RESCALE_EPS)})")
        if node.attrs["tops"] == 1:
            return f"{call}[0]"
        pair = emit.tmp("rescaled")
        emit.stmt(f"{pair} = {call}")
        return [f"{pair}[0]", f"{pair}[1]"]


# ---- FlowWarp ------------------------------------------------------------------------------

@register_layer("FlowWarp")
class FlowWarp(Layer):
    def parse(self, lp):
        need_blobs(lp, "FlowWarp", 2, 1, "image, flow")
        fill = lp.flow_warp_param.fill_value
        return {"fill": 0.0 if fill == lp.flow_warp_param.ZERO else float("nan")}

    def infer(self, attrs, in_shapes):
        image, flow = (tuple(s) for s in in_shapes)
        if len(image) != 4 or len(flow) != 4:
            raise LayerError(f"FlowWarp needs 4-axis image and flow, got {list(image)} and {list(flow)}")
        if flow[0] != image[0] or flow[1] != 2 or flow[2:] != image[2:]:
            raise LayerError(f"FlowWarp's flow must be (N, 2, H, W) of the image's N, H and W: image "
                             f"{list(image)}, flow {list(flow)}")
        return [image]

    def forward(self, attrs, params, image, flow):
        return flow_warp(image, flow, attrs["fill"], False)

    def onnx(self, ctx, node):
        image, flow = node.inputs
        s = OnnxImageSampler(ctx, node.name, image)
        s.flow_warp(s.channel(flow, 0, "fx", name=node.name), s.channel(flow, 1, "fy"), node.attrs["fill"], False,
                    node.outputs[0])

    def pytorch_source(self, node, emit):
        emit.helper(pixels_at)
        fn = emit.helper(flow_warp)
        return f"{fn}({emit.inputs[0]}, {emit.inputs[1]}, {emit.lit(node.attrs['fill'])}, False)"
