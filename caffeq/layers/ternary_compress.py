"""GongCheng1919/Quantitative-and-ternary-caffe-for-network-compression (a529f00): the LayerParameter
fields weights_compress / activations_compress ("Ternary_Quantize", "Quantize") with their
CompressParameter lists, on standard layers (include/caffe/layer.hpp Forward and CompressLayerWeights,
src/caffe/blob.cpp, util/math_functions.cpp).

What the fork computes at TEST cannot be reproduced from what caffeq reads:
- Its weight compression returns at once in TEST.  The layer then runs on the ternary / quantized copies
  of its weights that the fork's caffemodel stores in BlobProto fields 10-17, which caffeq's reader does
  not keep (NVCaffe uses 10-13 for other data).  Where those copies are missing, they are zeros.
- Its activation Quantize rounds with uniform noise in [-0.5, 0.5) on every forward, TEST included.

So such layers read and size as their standard type.  They refuse to run or export, naming
these fields, rather than run as if the fields were not there.  A data layer with activations_compress
is an input here: a reading note says that the fork adds rounding noise to it.
"""
from .registry import LayerError, claim_layers, get_spec

_FORK = "GongCheng1919's ternary/quantization fork"


def _compresses_weights_or_outputs(lp):
    return bool(len(lp.weights_compress) or len(lp.activations_compress))


def _fields(lp_or_attrs):
    return ", ".join(f"{k} {list(v)}" for k, v in lp_or_attrs if v)


def _refusing_variant(type_name):
    """A subclass of `type_name`'s spec that reads and sizes as it does but refuses to run or export."""
    base = type(get_spec(type_name))

    def parse(self, lp):
        attrs = base.parse(self, lp)
        attrs["compress_fields"] = _fields([("weights_compress", lp.weights_compress),
                                            ("activations_compress", lp.activations_compress)])
        attrs["compress_layer"] = lp.name
        return attrs

    def refuse(self, attrs):
        raise LayerError(f"layer '{attrs['compress_layer']}' ({type_name}): {attrs['compress_fields']}: "
                         f"{_FORK} runs it on the ternary/quantized weights its caffemodel stores in fields "
                         f"caffeq does not read, and rounds activations with random noise; caffeq reads and sizes "
                         f"the net but does not run or export it")

    def forward(self, attrs, params, *inputs, **options):
        refuse(self, attrs)

    def onnx(self, ctx, node):
        refuse(self, node.attrs)

    def pytorch_source(self, node, emit):
        refuse(self, node.attrs)

    members = {"parse": parse, "forward": forward, "onnx": onnx, "pytorch_source": pytorch_source,
               "types": (type_name,), "__doc__": f"{type_name} with {_FORK}'s compression fields: not run."}
    if getattr(base, "is_data", False):
        # an input: nothing to refuse, but the fork perturbs it
        members = {"types": (type_name,), "reading_note": (
            f"activations_compress on a data layer: {_FORK} rounds the data with uniform noise in [-0.5, 0.5) "
            f"at every forward; caffeq feeds it unrounded")}
    return type(f"Compressed{type_name}", (base,), members)


# the types the fork's example nets set the fields on
for _type in ("Convolution", "InnerProduct", "Deconvolution", "Data"):
    claim_layers(_type, _compresses_weights_or_outputs)(_refusing_variant(_type))
