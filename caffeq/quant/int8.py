"""int8 weights: weight-only, symmetric, per output channel, scale = max|W_c| / 127."""
import numpy as np

from .base import QuantizedBlob, Quantizer, broadcast_scale, channel_matrix, register_quantizer


@register_quantizer
class Int8(Quantizer):
    name = "int8"
    bits = 8

    def quantize(self, array, axis=0, groups=1):
        w = np.asarray(array, np.float32)
        if axis is None:
            axis = 0 if w.ndim else None
        mat = channel_matrix(w, axis, groups)
        peak = np.abs(mat).max(axis=1) if mat.shape[1] else np.zeros(mat.shape[0], np.float32)
        scale = (peak.astype(np.float64) / 127.0).astype(np.float32)
        # an all-zero channel has codes 0 whatever the step; 1 keeps ONNX's scale positive
        scale[scale == 0] = 1.0
        b = broadcast_scale(scale, w.shape, axis, groups)
        t = w / b                      # float32, then rounded and clipped in place
        np.rint(t, out=t)
        np.clip(t, -127, 127, out=t)
        codes = t.astype(np.int8)
        return QuantizedBlob("int8", axis, scale, codes, groups)
