"""liuzechun/Bi-Real-net's Caffes (f58aa4d, caffe_implementation/Bi-Real-net-caffe, last changed in 1339343):
caffe-train's BinaryConvolutionTrain and lClip, and the Threshold both Caffes change.

- BinaryConvolutionTrain (caffe-train ex_layers/binary_conv_train_layer.cpp and .cu; caffe-retrainBN-test
  registers the same layer as BinaryConvolution): a Convolution whose forward first binarizes the weights
  per output channel, sign(w) (+1 where w >= 0) times the channel's mean |w|, summed as |w| / n one weight
  after another (here as HWGQ's use_alpha, float32(1 / n) times the sum: the last bit of the scale may
  differ).  The bias stays as it is.  XNOR-Net's binary-weight rule, which `convert --to binary` also uses.
- Threshold: +1 where x > threshold, else -1 (BVLC's gives 0), with the same text; caffeq/io/upgrade.py
  sets threshold_param.below_value -1 in the nets that show these Caffes (caffeq/layers/activation.py).
- lClip (ex_layers/leaky_clip_layer.cpp and .cu): x inside (-1, 1), else +-1 plus relu_param.negative_slope
  times the distance past the bound.
"""
import torch

from .activation import Neuron, f32, scalar
from .conv import Convolution
from .hwgq import BinaryConvolution
from .registry import LayerError, register_layer


@register_layer("BinaryConvolutionTrain")
class BinaryConvolutionTrain(BinaryConvolution):
    """Convolution on weights binarized per output channel, always scaled by the channel's mean |w|."""

    def parse(self, lp):
        attrs = Convolution.parse(self, lp)
        if attrs.get("orn") or attrs.get("first_conv"):
            raise LayerError("BinaryConvolutionTrain reads no other fork's convolution fields")
        attrs["binarize"] = attrs["use_alpha"] = True
        return attrs


def leaky_clip(x, negative_slope: float):
    """lClip: x inside (-1, 1); -1 + s (x + 1) at or below -1; 1 + s (x - 1) at or above 1."""
    low = -1 + negative_slope * (x + 1)
    high = 1 + negative_slope * (x - 1)
    return torch.where(x <= -1, low, torch.where(x < 1, x, high))


@register_layer("lClip")
class LeakyClip(Neuron):
    def parse_param(self, lp):
        return {"negative_slope": f32(lp.relu_param.negative_slope)}

    def forward(self, attrs, params, x):
        return leaky_clip(x, attrs["negative_slope"])

    def onnx(self, ctx, node):
        x = node.inputs[0]
        one, minus_one, slope = scalar(ctx, 1.0), scalar(ctx, -1.0), scalar(ctx, node.attrs["negative_slope"])
        low = ctx.op("Add", [ctx.op("Mul", [slope, ctx.op("Add", [x, one], "x_plus_1", name=node.name)], "low_part"),
                             minus_one], "low")
        high = ctx.op("Add", [ctx.op("Mul", [slope, ctx.op("Sub", [x, one], "x_minus_1")], "high_part"), one], "high")
        # NaN fails both comparisons and takes the upper branch, as in the fork
        upper = ctx.op("Where", [ctx.op("Less", [x, one], "inside"), x, high], "upper")
        ctx.add_node("Where", [ctx.op("LessOrEqual", [x, minus_one], "below"), low, upper], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        return f"{emit.helper(leaky_clip)}({emit.inputs[0]}, {emit.lit(node.attrs['negative_slope'])})"
