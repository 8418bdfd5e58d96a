"""Structural layers: Input, Split, Silence, Dropout, Noise, SeLuDropout."""
import math

import numpy as np
import torch
import torch.nn.functional as F

from ..io.schema import caffe_pb2
from .registry import Layer, LayerError, ReadOnlyLayer, claim_layers, need_blobs, needs_input_shape, register_layer


def input_param_shapes(lp):
    """input_param's shape of every top (one shape given for all tops serves each)."""
    shapes = [tuple(int(d) for d in s.dim) for s in lp.input_param.shape]
    if not shapes:
        raise LayerError("input_param needs a shape")
    if len(shapes) not in (1, len(lp.top)):
        raise LayerError(f"input_param has {len(shapes)} shapes for {len(lp.top)} tops")
    if len(shapes) == 1:
        shapes = shapes * len(lp.top)
    for s in shapes:
        if any(d < -1 for d in s):
            raise LayerError(f"input_param.shape has a negative dimension {list(s)}")
    return shapes


def given_or_fixed(attrs, shapes, given):
    """Each top's shape: --input-shape's, else the file's; a -1 (any size, as ONNX-to-Caffe converters write
    a dynamic axis; Caffe itself refuses it) leaves the shape to --input-shape."""
    out = []
    for i, s in enumerate(shapes):
        if given.get(i) is not None:
            out.append(tuple(given[i]))
        elif -1 in s:
            raise needs_input_shape(attrs, attrs["tops"][i], f"the file gives it a dynamic shape {list(s)} (-1: any "
                                    f"size)", "from the net alone")
        else:
            out.append(s)
    return out


@register_layer("Input")
class Input(Layer):
    is_data = True

    def parse(self, lp):
        if not len(lp.input_param.shape) and lp.top:
            # a shapeless input (an `input:` header without dims, as OpenCV's GOTURN file has, or an Input
            # layer without input_param, which Caffe's InputLayer accepts): the user gives its shape
            return {"shapes": None, "tops": list(lp.top)}
        shapes = input_param_shapes(lp)
        attrs = {"shapes": [(1,) + s[1:] if s and s[0] == -1 else s for s in shapes], "tops": list(lp.top)}
        dynamic = [t for t, s in zip(lp.top, shapes) if s and s[0] == -1]
        if dynamic:   # an ONNX converter's dynamic batch: one item, unless --batch says otherwise
            attrs["reading_notes"] = [f"input {', '.join(repr(t) for t in dynamic)} declares a dynamic batch (-1): "
                                      f"read as 1 (--batch or --input-shape sets it)"]
        return attrs

    def top_shapes(self, attrs, given):
        if attrs["shapes"] is not None:
            return given_or_fixed(attrs, attrs["shapes"], given)
        missing = next(t for i, t in enumerate(attrs["tops"]) if i not in given)
        raise needs_input_shape(attrs, missing, "the file gives the input no shape", "from the net alone")

    def infer(self, attrs, in_shapes):
        return self.top_shapes(attrs, {})


@register_layer("Split")
class Split(Layer):
    def infer(self, attrs, in_shapes):
        return [tuple(in_shapes[0])] * attrs["tops"]

    def parse(self, lp):
        return {"tops": len(lp.top)}

    def forward(self, attrs, params, x):
        return tuple(x for _ in range(attrs["tops"])) if attrs["tops"] != 1 else x

    def onnx(self, ctx, node):
        for out in node.outputs:
            ctx.add_node("Identity", [node.inputs[0]], [out])

    def pytorch_source(self, node, emit):
        return [emit.inputs[0]] * len(node.outputs)  # every top is the bottom itself


class Sink(Layer):
    """A layer without tops (Silence; a fork's writer or visualiser): nothing to compute at inference."""

    def infer(self, attrs, in_shapes):
        return []

    def forward(self, attrs, params, *inputs):
        return ()

    def onnx(self, ctx, node):
        pass

    def pytorch_source(self, node, emit):
        return []


@register_layer("Silence")
class Silence(Sink):
    pass


@register_layer("HDF5Output")
class HDF5Output(Sink):
    """BVLC's HDF5Output (hdf5_output_layer.cpp): each forward writes its two bottoms (data, label) to
    hdf5_output_param.file_name; no tops.  caffeq writes no file a model names: its bottoms are what a user
    exports instead (they become the outputs where nothing else is, or --outputs names them)."""
    bottoms, tops = 2, 0
    bottom_roles = "data, label"


@register_layer("Dropout")
class Dropout(Layer):
    """Identity at TEST (Caffe scales at train time, so inference is a plain copy).

    Faster R-CNN's caffe (`scale_train: false`) keeps the kept units unscaled in training
    and multiplies by (1 - ratio) at TEST instead, rounded as its float32 1 / scale_; NR-IQA-CNN's
    fork says the same with `scale_test: true`.
    """

    def parse(self, lp):
        p = lp.dropout_param
        ratio = p.dropout_ratio
        # Caffe's own check is a DCHECK (debug builds only): release builds load 1.0, which drops
        # every unit in training and copies at TEST
        if not 0 <= ratio <= 1:
            raise LayerError(f"dropout_param.dropout_ratio must be in [0, 1], got {ratio}")
        notes = ["dropout_ratio 1 drops every unit in training (release Caffe loads it; TEST copies the "
                 "input)"] if ratio == 1 else []
        test_scale = 1.0
        if p.scale_test and p.HasField("scale_train") and p.scale_train:
            raise LayerError("dropout_param: scale_test: true (NR-IQA-CNN's fork) is scale_train: false, and "
                             "scale_train: true is given too")
        if not p.scale_train or p.scale_test:
            if ratio == 1:
                test_scale = 0.0   # the fork multiplies by 1 / scale_ = 1 / inf
            else:
                scale = np.float32(1.0 / (1.0 - float(np.float32(ratio))))
                test_scale = float(np.float32(1.0 / float(scale)))
        if lp.HasField("phase") and lp.phase == caffe_pb2.TRAIN and ratio > 0:
            # Caffe's Net::Init keeps a layer's own phase: this one drops units at random in any net
            notes.append("phase: TRAIN on the layer: Caffe drops units at random here even in a TEST net; caffeq "
                         "runs it as at TEST (no random drops)")
        if p.sample_weights_test and ratio > 0:
            # caffe-segnet's dropout_layer.cpp: Bayesian SegNet's Monte Carlo samples, averaged by its script
            notes.append("sample_weights_test: SegNet's Caffe drops units at random at TEST too (Bayesian SegNet "
                         "averages many such samples); caffeq runs the layer as their expectation, a copy")
        return {"ratio": ratio, "test_scale": test_scale, "reading_notes": notes}

    uses_training_flag = True

    def forward(self, attrs, params, x, training=False):
        # Caffe scales by 1/(1-ratio) while training, exactly as torch's dropout does; with
        # scale_train false, (1 - ratio) times that is the unscaled mask at TRAIN and the
        # fork's scaling at TEST
        y = F.dropout(x, attrs["ratio"], training=training) if training else x
        return y * attrs["test_scale"] if attrs["test_scale"] != 1.0 else y

    def onnx(self, ctx, node):
        scale = node.attrs["test_scale"]
        if scale == 1.0:
            ctx.add_node("Identity", [node.inputs[0]], [node.outputs[0]])
        else:
            ctx.add_node("Mul", [node.inputs[0], ctx.const(np.array(scale, np.float32))], [node.outputs[0]],
                         name=node.name)

    def pytorch_source(self, node, emit):
        # nn.Dropout is F.dropout: identity in eval mode, Caffe's 1/(1-ratio) scaling in train mode
        m = emit.module(f"nn.Dropout(p={emit.lit(node.attrs['ratio'])})")
        scale = node.attrs["test_scale"]
        return f"{m}({emit.inputs[0]})" + (f" * {emit.lit(scale)}" if scale != 1.0 else "")


# Guanghan/GNet-caffe's Injection is a data layer without bottoms (read as a fork's data layer)
@claim_layers("Injection", lambda lp: len(lp.bottom) == 1)
class FaultInjection(ReadOnlyLayer):
    """cypox/reliable-net's Injection (fault-injection experiments; its Caffe is not published): its top is
    its input with random faults, in the TEST net too (the README: a bit of the input flipped with
    probability 10%; the repository's test outputs show some values changed in several bits)."""
    types = ("Injection",)

    def parse(self, lp):
        need_blobs(lp, "Injection", 1, 1)
        return {"name": lp.name}

    def why_not_run(self, attrs):
        return ("cypox/reliable-net's fault injection flips random bits of its input, at inference too, by a rule "
                "its unpublished Caffe keeps; caffeq sizes it (its top is shaped as its input) but does not run it")


@register_layer("Noise")
class AdditiveNoise(Layer):
    """sergeyk's Noise layer (bnkang/caffe-windows-for-fr noise_layer.cpp and other forks): TEST copies
    the input; TRAIN adds gaussian noise of mean bias and std gaussian_std, else uniform noise in
    bias +- uniform_range when that is set, else nothing."""

    uses_training_flag = True
    bottoms = tops = 1

    def parse(self, lp):
        p = lp.noise_param
        for f in ("gaussian_std", "uniform_range"):
            if not math.isfinite(getattr(p, f)) or getattr(p, f) < 0:
                raise LayerError(f"noise_param.{f} must be a finite number >= 0, got {getattr(p, f)}")
        kind = "gaussian" if p.HasField("gaussian_std") else "uniform" if p.HasField("uniform_range") else None
        if p.HasField("filler_param") or p.HasField("std"):
            # sunke123/FW-Net's Noise (its source unpublished): gaussian noise of the filler's mean and `std`,
            # read as the others' training-time noise; its nets are evaluated on noisy images fed as `data`
            if p.filler_param.type not in ("gaussian", "constant") or not math.isfinite(p.std) or p.std < 0:
                raise LayerError(f"noise_param: FW-Net's filler_param must be gaussian and std a finite number >= 0, "
                                 f"got {p.filler_param.type!r} and {p.std}")
            return {"kind": "gaussian", "std": float(p.std), "range": 0.0, "bias": float(p.filler_param.mean),
                    "reading_notes": ["FW-Net's Noise layer (its source is not published) copies its input at "
                                      "inference here, as the other forks' Noise layers do: feed the noisy image"]}
        return {"kind": kind, "std": float(p.gaussian_std), "range": float(p.uniform_range), "bias": float(p.bias)}

    def forward(self, attrs, params, x, training=False):
        if not training or attrs["kind"] is None:
            return x
        if attrs["kind"] == "gaussian":
            return x + torch.randn_like(x) * attrs["std"] + attrs["bias"]
        return x + (torch.rand_like(x) * 2 - 1) * attrs["range"] + attrs["bias"]

    def onnx(self, ctx, node):
        ctx.add_node("Identity", [node.inputs[0]], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        emit.note("Noise copies its input at inference; model.py leaves out its training-time noise")
        return emit.inputs[0]


@register_layer("SeLuDropout")
class SeLuDropout(Layer):
    """jolibrain/caffe's (and synopsys-caffe's SeLU) alpha dropout for SELU nets: TEST copies the input;
    TRAIN keeps each unit with probability q = 1 - dropout_ratio, sets the others to alpha, then
    returns a * y + b with a = (q (1 + alpha^2 (1 - q)))^-1/2 and b = -a (1 - q) alpha."""

    uses_training_flag = True

    def parse(self, lp):
        p = lp.selu_dropout_param
        if not 0 < p.dropout_ratio < 1:
            raise LayerError(f"selu_dropout_param.dropout_ratio must be in (0, 1), got {p.dropout_ratio}")
        q = 1.0 - float(p.dropout_ratio)
        a = (q * (1.0 + float(p.alpha) ** 2 * (1.0 - q))) ** -0.5
        return {"ratio": float(p.dropout_ratio), "alpha": float(p.alpha), "a": a, "b": -a * (1.0 - q) * float(p.alpha)}

    def forward(self, attrs, params, x, training=False):
        if not training:
            return x
        keep = torch.rand_like(x) >= attrs["ratio"]
        return attrs["a"] * torch.where(keep, x, torch.full_like(x, attrs["alpha"])) + attrs["b"]

    def onnx(self, ctx, node):
        ctx.add_node("Identity", [node.inputs[0]], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        emit.note("SeLuDropout copies its input at inference; model.py leaves out its training-time alpha dropout")
        return emit.inputs[0]
