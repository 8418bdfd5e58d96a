"""hujie-frank/GENet's CuDNNBatchNorm (ae791f8, src/caffe/layers/cudnn_batch_norm_layer.cpp / .cu; also in
implus/SKNet's nets, whose caffe.proto gives it batch_norm_param with the same fields): blobs scale, bias, mean, variance, each (1, C, 1, 1).  At TEST (or frozen) it calls
cudnnBatchNormalizationForwardInference: scale (x - mean) / sqrt(variance + eps) + bias, eps at least
cuDNN's minimum 1e-5.  That is yjxiong's (TSN's) BN with those blobs, which caffeq computes as
(x - mean) / sqrt(variance + eps) * scale + bias: cuDNN's own order of operations is not published, so
the last bits may differ.  While training (not frozen) it normalizes by the batch, as TSN's BN does in
caffeq's train mode; cuDNN's momentum is the share of the running statistics kept.
"""
from .registry import LayerError, need_blobs, register_layer
from .segmentation import BN, TSN

CUDNN_BN_MIN_EPSILON = 1e-5


@register_layer("CuDNNBatchNorm")
class CuDNNBatchNorm(BN):
    def parse(self, lp):
        need_blobs(lp, "CuDNNBatchNorm", 1, 1)
        p = lp.cudnn_batch_norm_param
        if lp.HasField("batch_norm_param") and not lp.HasField("cudnn_batch_norm_param"):   # SKNet's proto
            q = lp.batch_norm_param
            clashing = [f for f in ("use_global_stats", "moving_average_fraction") if q.HasField(f)]
            if clashing:
                raise LayerError(f"CuDNNBatchNorm reads batch_norm_param's frozen, momentum and eps (SKNet's proto), "
                                 f"not {clashing[0]}")
            p = q
        if not 0 <= p.momentum <= 1 or not p.eps >= 0:
            raise LayerError(f"cudnn_batch_norm_param.momentum {p.momentum} must be in [0, 1] and eps {p.eps} >= 0")
        return {"variant": TSN, "eps": max(float(p.eps), CUDNN_BN_MIN_EPSILON), "momentum": 1.0 - float(p.momentum),
                "frozen": bool(p.frozen)}
