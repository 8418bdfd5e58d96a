"""edz504/lstm_dd's Caffe (661546d; Chenyi Chen's DeepDriving layers and the LSTM DeepDriving additions, TORCS):
its activations, its recurrent feedback layers and its data layers.

- NonParaReLUSigmoid (non_para_relu_sigmoid_layer.cpp): y = max(x, 0) + beta_c sigmoid(x), one beta per
  channel (axis 1; a 2-axis bottom's features) or one shared (`channel_shared`); beta starts at 0, so a
  fresh layer is a ReLU.  NonParaReLUSinCos (non_para_relu_sin_cos_layer.cpp): y = max(x, 0) +
  beta_sin_c sin(x) + beta_cos_c cos(x), two such blobs.
- SigmoidHist (sigmoid_hist_layer.cpp): the sigmoid; the fork also copies its output into a process-wide
  vector that DataHist reads at the next forward.
- DataHist (data_hist_layer.cpp): top (num, channels, 14) of its marker bottom; at each forward, where the
  marker is > 0.5, the previous forward's SigmoidHist output, else 0.  Before any forward that vector
  holds zeros: caffeq runs one forward of a fresh net, the fork's first frame, where DataHist gives 0 (its
  later frames feed back the previous output; so does the LSTM's state, which caffeq's LSTM also starts
  from 0).
- Data layers (graph inputs): DataLstmTrainHist (data, label, hist, marker), DataLstmTrain (data, label,
  marker), both B = sequence_size x sequence_num items in time-major order; DataLstmTest (data, marker)
  of sequence_size items.  Data is the TORCS frame the fork's tools write, 3 x 210 x 280 (planar BGR minus
  the mean), labels and hist (B, 1, 1, 14), the marker (B, 1, 1, 1); --input-shape gives other shapes.
"""
import numpy as np
import torch

from .activation import Sigmoid
from .data import DataLayer
from .registry import Layer, LayerError, need_blobs, positive_field, register_layer

TORCS_FRAME = (3, 210, 280)   # the fork's resize_height x resize_width, planar BGR
INDICATORS = 14               # the fork's para_dim: the driving affordances a frame is labelled with


def _channel_blob(w, ndim):
    """A (C,) blob shaped to broadcast along axis 1 of an ndim-axis bottom; a shared 0-axis one as it is."""
    return w.reshape(w.shape + (1,) * (ndim - 2)) if w.dim() else w


class NonParaReLU(Layer):
    """max(x, 0) plus learned per-channel multiples of sigmoid(x) or of sin(x) and cos(x) (module docstring)."""

    def parse(self, lp):
        need_blobs(lp, lp.type, 1, 1)
        field = "nprelu_sigmoid_param" if lp.type == "NonParaReLUSigmoid" else "nprelu_sin_cos_param"
        p = getattr(lp, field)
        # the filler only starts training; without trained weights a constant filler's value (the fork's
        # default, 0: a ReLU) is what the layer holds, and another filler's draw is taken as 0 too
        constant = p.HasField("filler") and p.filler.type == "constant"
        return {"sin_cos": lp.type == "NonParaReLUSinCos", "channel_shared": bool(p.channel_shared),
                "initial": float(np.float32(p.filler.value)) if constant else 0.0}

    def infer(self, attrs, in_shapes):
        if len(in_shapes[0]) < 2:
            raise LayerError(f"bottom must have at least 2 axes, got shape {list(in_shapes[0])}")
        return [tuple(in_shapes[0])]

    def param_shapes(self, attrs, in_shapes):
        shape = () if attrs["channel_shared"] else (in_shapes[0][1],)
        return [shape, shape] if attrs["sin_cos"] else [shape]

    def init_params(self, attrs, shapes, rng):
        return [np.full(s, attrs["initial"], np.float32) for s in shapes]

    def forward(self, attrs, params, x):
        y = x.clamp(min=0)
        if attrs["sin_cos"]:
            y = y + _channel_blob(params[0], x.dim()) * torch.sin(x)
            return y + _channel_blob(params[1], x.dim()) * torch.cos(x)
        return y + _channel_blob(params[0], x.dim()) * torch.sigmoid(x)

    def onnx(self, ctx, node):
        x = node.inputs[0]
        ndim = len(ctx.shape(x))
        zero = ctx.f32(0.0)
        out = ctx.op("Max", [x, zero], "relu")
        terms = (("Sin", 0), ("Cos", 1)) if node.attrs["sin_cos"] else (("Sigmoid", 0),)
        for k, (fn, blob) in enumerate(terms):
            w = ctx.weight(node, blob)
            if not node.attrs["channel_shared"] and ndim > 2:
                w = ctx.op("Reshape", [w, ctx.i64([-1] + [1] * (ndim - 2))], "beta")
            term = ctx.op("Mul", [w, ctx.op(fn, [x], fn.lower())], "term")
            if k == len(terms) - 1:
                ctx.add_node("Add", [out, term], [node.outputs[0]], name=node.name)
            else:
                out = ctx.op("Add", [out, term], "sum")

    def pytorch_source(self, node, emit):
        x = emit.inputs[0]
        ndim = len(emit.in_shape(0))
        terms = (("torch.sin", 0), ("torch.cos", 1)) if node.attrs["sin_cos"] else (("torch.sigmoid", 0),)
        expr = f"{x}.clamp(min=0)"
        for fn, blob in terms:
            attr = emit.extra_attr(self.blob_names[blob]) if blob else None
            m = emit.module(f"nn.Parameter(torch.zeros({tuple(node.blobs[blob].shape)}))", attr=attr)
            emit.param("", blob, attr=attr)
            w = f"{m}.reshape(-1{', 1' * (ndim - 2)})" if not node.attrs["channel_shared"] and ndim > 2 else m
            expr += f" + {w} * {fn}({x})"
        return expr


@register_layer("NonParaReLUSigmoid")
class NonParaReLUSigmoid(NonParaReLU):
    blob_names = ("beta",)


@register_layer("NonParaReLUSinCos")
class NonParaReLUSinCos(NonParaReLU):
    blob_names = ("beta_sin", "beta_cos")


@register_layer("SigmoidHist")
class SigmoidHist(Sigmoid):
    """The sigmoid (the fork also keeps its output for DataHist's next forward)."""


@register_layer("DataHist")
class DataHist(Layer):
    """The previous forward's SigmoidHist output where the marker is set: zeros at a fresh net's forward."""

    def parse(self, lp):
        need_blobs(lp, "DataHist", 1, 1)
        return {}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) > 4 or not s:
            raise LayerError(f"DataHist reads num and channels of a blob of 1 to 4 axes, got {list(s)}")
        return [(s[0], s[1] if len(s) > 1 else 1, INDICATORS)]

    def forward(self, attrs, params, marker):
        n = marker.shape[0]
        c = marker.shape[1] if marker.dim() > 1 else 1
        return marker.new_zeros((n, c, INDICATORS))

    def onnx(self, ctx, node):
        ctx.add_node("Identity", [ctx.const(np.zeros(ctx.shape(node.outputs[0]), np.float32))], [node.outputs[0]],
                     name=node.name)

    def pytorch_source(self, node, emit):
        return f"{emit.inputs[0]}.new_zeros({tuple(emit.out_shape(0))})"


class DrivingData(DataLayer):
    """The fork's TORCS data layers: graph inputs of the shapes its readers give (module docstring)."""

    #: (field, tops): the parameter message and the tops the layer makes, in order
    layout = None

    def parse(self, lp):
        field, tops = self.layout
        need_blobs(lp, lp.type, 0, len(tops))
        p = getattr(lp, field)
        items = positive_field(p.sequence_size, f"{field}.sequence_size")
        if field != "data_lstm_test_param":
            items *= positive_field(p.sequence_num, f"{field}.sequence_num")
        return {"type": lp.type, "tops": list(lp.top), "num_tops": len(lp.top), "items": items,
                "source": getattr(p, "source", ""), "mean_file": p.mean_file}

    def top_shapes(self, attrs, given):
        b = attrs["items"]
        shapes = {"data": (b,) + TORCS_FRAME, "label": (b, 1, 1, INDICATORS), "hist": (b, 1, 1, INDICATORS),
                  "marker": (b, 1, 1, 1)}
        return [tuple(given.get(i) or shapes[role]) for i, role in enumerate(self.layout[1])]

    def guessed_label_tops(self, attrs, given):
        return ()

    def preprocessing(self, attrs):
        return [f"TORCS frames of {attrs['source'] or 'the fork driver'!r}: planar BGR 210 x 280 bytes minus the "
                f"per-pixel mean of {attrs['mean_file']!r}, no scaling; {attrs['items']} items in time-major order"]


@register_layer("DataLstmTrainHist")
class DataLstmTrainHist(DrivingData):
    layout = ("data_lstm_train_hist_param", ("data", "label", "hist", "marker"))


@register_layer("DataLstmTrain")
class DataLstmTrain(DrivingData):
    layout = ("data_lstm_train_param", ("data", "label", "marker"))


@register_layer("DataLstmTest")
class DataLstmTest(DrivingData):
    layout = ("data_lstm_test_param", ("data", "marker"))
