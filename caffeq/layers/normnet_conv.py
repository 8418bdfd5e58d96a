"""GuohongWu/caffe-windows's weight-norm projection, branch `experiment` (6206125d; its examples/pycaffe/normnet.py
writes normnet_train_test.prototxt): `normalize_scale` in convolution_param (19 there) and
inner_product_param (7 there), src/caffe/proto/caffe.proto.

What the fork does with it (src/caffe/layers/base_conv_layer.cpp LayerSetUp, inner_product_layer.cpp
LayerSetUp, src/caffe/blob.cpp Blob::Update, include/caffe/blob.hpp set_normalize_scale): a layer whose
message sets the field marks its freshly filled weight blob; Blob::Update, the solver's step, then rescales
each output filter (each row of count(1) weights) to the L2 norm normalize_scale after applying the
gradient.  Forward_cpu / Forward_gpu of Convolution, Deconvolution (the same BaseConvolutionLayer) and
InnerProduct are BVLC's, with the weights as stored.  So the field matters only for training: caffeq reads
it and runs the stored weights as those layers do, with a note.
"""
from .conv import Convolution, Deconvolution, InnerProduct
from .registry import claim_layers


def _note(lp, field):
    return (f"{field}.normalize_scale {getattr(lp, field).normalize_scale:g}: GuohongWu/caffe-windows rescales each "
            f"output filter to this L2 norm at every training update only; the stored weights are used as they are")


class _TrainingOnlyNorm:
    field = None

    def parse(self, lp):
        attrs = super().parse(lp)
        attrs.setdefault("reading_notes", []).append(_note(lp, self.field))
        return attrs


@claim_layers("Convolution", lambda lp: lp.convolution_param.HasField("normalize_scale"))
class NormScaledConvolution(_TrainingOnlyNorm, Convolution):
    field = "convolution_param"


@claim_layers("Deconvolution", lambda lp: lp.convolution_param.HasField("normalize_scale"))
class NormScaledDeconvolution(_TrainingOnlyNorm, Deconvolution):
    field = "convolution_param"


@claim_layers("InnerProduct", lambda lp: lp.inner_product_param.HasField("normalize_scale"))
class NormScaledInnerProduct(_TrainingOnlyNorm, InnerProduct):
    field = "inner_product_param"


__all__ = ["NormScaledConvolution", "NormScaledDeconvolution", "NormScaledInnerProduct"]
