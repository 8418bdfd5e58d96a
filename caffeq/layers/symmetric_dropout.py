"""abhimanyudubey's SymmetricDropout (abhimanyudubey/caffe, the Caffe of abhimanyudubey/confusion:
include/caffe/layers/symmetric_dropout_layer.hpp, src/caffe/layers/symmetric_dropout_layer.cpp and .cu at 44eaf65;
`symmetric_dropout_param { dropout_ratio }` [0.5], caffe.proto at 0d32811; no blobs).

At TRAIN it draws one keep mask for the first half of the batch and applies it to both halves (the pairs of
images its confusion loss compares), scaled by 1 / (1 - ratio).  At TEST both forwards copy the bottom
(caffe_copy): caffeq's forward is that identity, in every backend.  The fork checks 0 < ratio < 1 and an even
batch only with DCHECK (debug builds); caffeq refuses a ratio outside [0, 1], as for Dropout.
"""
from .registry import IdentityLayer, LayerError, need_blobs, register_layer


@register_layer("SymmetricDropout")
class SymmetricDropout(IdentityLayer):
    def parse(self, lp):
        need_blobs(lp, "SymmetricDropout", 1, 1)
        ratio = float(lp.symmetric_dropout_param.dropout_ratio)
        if not 0 <= ratio <= 1:
            raise LayerError(f"symmetric_dropout_param.dropout_ratio must be in [0, 1], got {ratio}")
        return {"ratio": ratio}
