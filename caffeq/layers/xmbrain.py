"""XmBrain/Quantizer (75dd74d; "based on the Ristretto project"): the layer types its generator writes
beside Ristretto's names, with its own quantization_param (bw_params / fl_params, bw_layer_data /
fl_layer_data, is_sign_data; xmbrain_quantization_param here, picked by those field names).

- PoolingRistretto, ReLURistretto (and LRNRistretto, in ristretto.py): the stock layer, then top 0 rounded
  to fixed point (ristretto.TrimsTopZero); ConvolutionRistretto, InnerProductRistretto and
  DeconvolutionRistretto are ristretto.py's layers read with parse_xmbrain.
- DataRistretto: a Data layer whose prefetch rounds the data top after the transform (the label is left as
  it is).  Read as that Data layer and, right after it, an in-place DataRistrettoTrim (caffeq's name for
  that rounding), so the data top stays the graph input and the layers after it read the rounded values.
"""
from ..io.schema import caffe_pb2
from .activation import ReLU
from .pooling import Pooling
from .registry import Layer, need_blobs, net_rewrite, register_layer
from .ristretto import TrimsTopZero, onnx_trim, parse_xmbrain, ristretto_trim, trim_source


@register_layer("PoolingRistretto")
class PoolingRistretto(TrimsTopZero, Pooling):
    """Pooling, then top 0 (not the mask) in fixed point (pooling_ristretto_layer.cpp)."""


@register_layer("ReLURistretto")
class ReLURistretto(TrimsTopZero, ReLU):
    """ReLU (negative_slope read), then its top in fixed point (relu_ristretto_layer.cpp)."""


@register_layer("DataRistrettoTrim")
class DataRistrettoTrim(Layer):
    """The rounding DataRistretto applies to its data top, as its own in-place layer (see the module
    docstring): one bottom, one top."""

    def parse(self, lp):
        need_blobs(lp, "DataRistrettoTrim", 1, 1)
        return {"trim": parse_xmbrain(lp, weights=False)["outputs"]}

    def infer(self, attrs, in_shapes):
        return [tuple(in_shapes[0])]

    def forward(self, attrs, params, x):
        return ristretto_trim(x, attrs["trim"])

    def onnx(self, ctx, node):
        onnx_trim(ctx, node.inputs[0], node.attrs["trim"], node.outputs[0], node.name)

    def pytorch_source(self, node, emit):
        return trim_source(emit, emit.inputs[0], node.attrs["trim"])


@net_rewrite
def split_data_ristretto(net, source=""):
    """Each DataRistretto becomes a Data layer followed by an in-place DataRistrettoTrim of its data top."""
    if not any(lp.type == "DataRistretto" for lp in net.layer):
        return []
    layers, split = [], []
    for lp in net.layer:
        layers.append(lp)
        if lp.type != "DataRistretto" or not len(lp.top):
            continue
        lp.type = "Data"
        trim = caffe_pb2.LayerParameter(name=f"{lp.name}/fixed_point", type="DataRistrettoTrim",
                                        bottom=[lp.top[0]], top=[lp.top[0]])
        trim.include.extend(lp.include)
        trim.exclude.extend(lp.exclude)
        trim.xmbrain_quantization_param.CopyFrom(lp.xmbrain_quantization_param)
        layers.append(trim)
        split.append(lp.name)
    del net.layer[:]
    net.layer.extend(layers)
    return [f"{source + ': ' if source else ''}DataRistretto layer(s) {', '.join(map(repr, split))} (XmBrain/"
            f"Quantizer) read as Data and an in-place DataRistrettoTrim of the data top (the fork rounds the "
            f"data it reads to fixed point; the layer's top stays the graph input)"]
