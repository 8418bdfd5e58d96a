"""fp16 weights: every float blob rounded to IEEE half precision.

Values beyond +-65504 are clamped (and counted); nonzero values that round to
zero are counted as underflows.  BatchNorm is folded (or at least its moving
average factor divided out) in fp32 *before* rounding, because Caffe stores
raw accumulators (mean and variance times ~999.98) that fp16 would distort.
"""
import numpy as np

from .base import QuantizedBlob, Quantizer, register_quantizer

FP16_MAX = float(np.finfo(np.float16).max)   # 65504


class Fp16Stats:
    def __init__(self):
        self.clamped = 0
        self.underflow = 0
        self.subnormal = 0

    def to_dict(self):
        return {"clamped": self.clamped, "underflow": self.underflow, "subnormal": self.subnormal}


def round_fp16(array, stats=None):
    w = np.asarray(array, np.float32)
    over = np.abs(w) > FP16_MAX
    clamped = np.clip(w, -FP16_MAX, FP16_MAX) if over.any() else w
    codes = clamped.astype(np.float16)
    if stats is not None:
        stats.clamped += int(np.count_nonzero(over & np.isfinite(w)))
        stats.underflow += int(np.count_nonzero((codes == 0) & (w != 0)))
        tiny = np.finfo(np.float16).tiny
        stats.subnormal += int(np.count_nonzero((np.abs(codes) < tiny) & (codes != 0)))
    return codes


@register_quantizer
class Float16(Quantizer):
    name = "fp16"
    bits = 16
    weights_only = False   # biases, BatchNorm, Scale, PReLU ... all go to fp16

    def __init__(self):
        self.stats = Fp16Stats()

    def quantize(self, array, axis=None, groups=1):
        return QuantizedBlob("fp16", None, None, round_fp16(array, self.stats), 1)
