"""Binary weights (binary-weight networks, as in XNOR-Net).

For each output channel c: alpha_c = mean(|W_c|) and W_c := alpha_c * sign(W_c),
with sign(0) = +1 (torch.sign and np.sign give 0 there, which would drop weights).
"""
import numpy as np

from .base import QuantizedBlob, Quantizer, channel_matrix, from_channel_matrix, register_quantizer


def sign_codes(array):
    """+1 where array >= 0 (zero included), -1 elsewhere, as int8."""
    return np.where(np.asarray(array) >= 0, np.int8(1), np.int8(-1)).astype(np.int8, copy=False)


@register_quantizer
class Binary(Quantizer):
    name = "binary"
    bits = 1
    default_keep_ends = True

    def quantize(self, array, axis=0, groups=1):
        w = np.asarray(array, np.float32)
        if axis is None:
            axis = 0 if w.ndim else None
        mat = channel_matrix(w, axis, groups)
        # mean in float64 so the per-channel alpha does not depend on summation order
        alpha = np.abs(mat).mean(axis=1, dtype=np.float64).astype(np.float32) if mat.shape[1] \
            else np.zeros(mat.shape[0], np.float32)
        codes = from_channel_matrix(sign_codes(mat), w.shape, axis, groups)
        return QuantizedBlob("binary", axis, alpha, codes, groups)


def pack_signs(codes):
    """+/-1 codes -> bit-packed uint8 (bit k of byte i is element 8i+k, little bit order; 1 = +1)."""
    return np.packbits(np.asarray(codes).reshape(-1) > 0, bitorder="little")


def unpack_signs(packed, shape):
    n = int(np.prod(shape, dtype=np.int64))
    bits = np.unpackbits(np.asarray(packed, np.uint8), count=n, bitorder="little")
    return (bits.astype(np.int8) * 2 - 1).astype(np.int8).reshape(shape)
