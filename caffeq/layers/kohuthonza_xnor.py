"""kohuthonza/caffe's XNOR layers (src/caffe/layers/binary_conv_layer.cpp, signum_layer.cpp).

- BinaryConvolution (the spec is hwgq.py's; this fork's layers carry binary_convolution_param's
  gradient_update / gradient_scale, or their later names update_weight_diff / scale_weight_diff, which
  only shape the backward).  Each output filter's weights become sign(w) times alpha = the float32 sum of
  |w| over the filter divided by its length, at every forward; the input is not binarized.  The fields'
  names tell the fork's commit:
  - 99ce5b63 (gradient_*): sign is copysign(1, w), so +0 gives +1 and -0 gives -1; the bias is added
    unscaled.  (That commit binarizes on the CPU only: its GPU forward still uses the float weights.)
  - 4f68844b, the fork's head (update_weight_diff / scale_weight_diff): sign is w > 0 ? 1 : -1 (0 and NaN
    give -1) and the top is alpha * (conv(x, sign w) + bias): the bias is scaled by alpha too.
- Signum (a NeuronLayer, no parameters): copysign(1, x), +0 giving +1 and -0 giving -1, as every commit that
  has a Signum net computes it (99ce5b63 to bc8fa895; the fork's test nets were deleted before its head
  changed the forward to x > 0 ? 1 : -1).  caffeq reads the sign bit as x < 0, or x == 0 with 1 / x < 0, in
  every backend: a NaN gives +1.
"""
import torch

from .registry import Layer, LayerError, register_layer

#: binary_convolution_param field -> the fork's commit whose forward it marks
COMMIT_OF_FIELD = {"gradient_update": "99ce5b63", "gradient_scale": "99ce5b63",
                   "update_weight_diff": "4f68844b", "scale_weight_diff": "4f68844b"}


def is_kohuthonza(lp, field):
    return (field == "binary_convolution_param" and lp.HasField(field)
            and any(getattr(lp, field).HasField(f) for f in COMMIT_OF_FIELD))


def read_kohuthonza(lp, attrs):
    """attrs for this fork's BinaryConvolution: the commit its field names mark."""
    p = lp.binary_convolution_param
    commits = {COMMIT_OF_FIELD[f] for f in COMMIT_OF_FIELD if p.HasField(f)}
    if len(commits) > 1:
        raise LayerError("binary_convolution_param mixes kohuthonza/caffe's gradient_* fields with their later "
                         "names (update_weight_diff, scale_weight_diff); no commit of the fork reads both")
    if p.HasField("use_alpha") or p.HasField("use_binarization"):
        raise LayerError("binary_convolution_param mixes kohuthonza/caffe's fields with zhaoweicai/hwgq's "
                         "use_alpha / use_binarization")
    attrs["kohuthonza"] = commits.pop()
    attrs["binarize"] = attrs["use_alpha"] = True
    return attrs


# ---- torch (copied into model.py) -------------------------------------------------------------

def kohuthonza_alpha(w):
    """Each output filter's mean |w|, (O, 1): the float32 sum divided by the filter's length."""
    rows = w.reshape(w.shape[0], -1)
    return rows.abs().sum(1, keepdim=True) / rows.shape[1]


def kohuthonza_binarize(w, copysign: bool):
    """sign(w) times its filter's alpha; sign as copysign(1, w) (99ce5b63) or w > 0 ? 1 : -1 (the head)."""
    rows = w.reshape(w.shape[0], -1)
    one = rows.new_ones(())
    negative = torch.signbit(rows) if copysign else ~(rows > 0)
    return (torch.where(negative, -one, one) * kohuthonza_alpha(w)).reshape(w.shape)


def kohuthonza_signum(x):
    """copysign(1, x): -1 where x < 0 or x is -0, else +1 (NaN included)."""
    one = x.new_ones(())
    negative = (x < 0) | ((x == 0) & (one / x < 0))
    return torch.where(negative, -one, one)


def onnx_signum(ctx, x, out, name=None):
    """kohuthonza_signum in ONNX, written to the tensor `out`."""
    zero = ctx.f32(0.0)
    below = ctx.op("Less", [x, zero], "below")
    minus_zero = ctx.op("And", [ctx.op("Equal", [x, zero], "zero"),
                                ctx.op("Less", [ctx.op("Div", [ctx.f32(1.0), x], "inverse"), zero], "inverse_below")],
                        "minus_zero")
    negative = ctx.op("Or", [below, minus_zero], "negative")
    ctx.add_node("Where", [negative, ctx.f32(-1.0), ctx.f32(1.0)], out, name=name)


@register_layer("Signum")
class Signum(Layer):
    bottoms = tops = 1

    def parse(self, lp):
        super().parse(lp)
        return {}

    def forward(self, attrs, params, x):
        return kohuthonza_signum(x)

    def onnx(self, ctx, node):
        onnx_signum(ctx, node.inputs[0], node.outputs[0], node.name)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(kohuthonza_signum)}({emit.inputs[0]})"


__all__ = ["Signum", "is_kohuthonza", "kohuthonza_binarize", "kohuthonza_signum", "onnx_signum", "read_kohuthonza"]
