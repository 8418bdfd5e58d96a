"""Kevinduan23/caffe's label-smoothed SoftmaxWithLoss (2c1e6b3: src/caffe/layers/softmax_loss_layer.cpp,
softmax_param.label_smooth / label_smooth_factor).

With label_smooth and label_smooth_factor f > 0, each position whose label l is not ignored adds
-sum over the C classes of coeff_c * log(max(prob_c, FLT_MIN)), coeff_l = 1 - f and every other
coeff_c = f / C (the label's own share is not raised by f / C); the count of those positions and the
normalization are BVLC's.  The backward gives prob - coeff per position (the gradient of the cross-entropy
with those targets, whose sum 1 - f / C falls short of 1), scaled as BVLC's: the torch forward here has that
gradient.  The fork's GPU kernel takes a default argument before plain ones, which no compiler accepts, so
its CPU forward is the one described.  Without label_smooth, or with f <= 0, the loss is BVLC's.
"""
import torch

from .losses import LOG_FLT_MIN, SoftmaxWithLoss, _label_log_probs, _normalizer, _outputs, _ste
from .registry import LayerError, claim_layers


@claim_layers("SoftmaxWithLoss", lambda lp: lp.softmax_param.label_smooth)
class LabelSmoothSoftmaxWithLoss(SoftmaxWithLoss):
    types = ("SoftmaxWithLoss",)

    def parse(self, lp):
        if len(lp.bottom) != 2 or len(lp.top) > 2:
            raise LayerError(f"softmax_param.label_smooth: Kevinduan23/caffe's SoftmaxWithLoss takes 2 bottoms and "
                             f"at most 2 tops, got {len(lp.bottom)} and {len(lp.top)}")
        attrs = super().parse(lp)
        attrs["smooth"] = float(lp.softmax_param.label_smooth_factor)   # a float32 value
        return attrs

    def forward(self, attrs, params, scores, labels):
        if not attrs["smooth"] > 0:
            return super().forward(attrs, params, scores, labels)
        logp, lab, valid = _label_log_probs(attrs, scores, labels, "SoftmaxWithLoss")
        safe = torch.where(valid, lab, torch.zeros_like(lab))
        coeff = smoothed_targets(logp, safe, attrs["smooth"])
        loss = -(coeff * logp.clamp_min(LOG_FLT_MIN)).sum(1)
        # the fork's backward, prob - coeff: the gradient of logsumexp(z) - sum(coeff * z)
        lse = torch.logsumexp(scores, dim=attrs["_axis"]).reshape(lab.shape)
        follows = -(coeff * logp).sum(1) + (1 - coeff.sum(1)) * lse
        each = torch.where(valid, _ste(follows, loss), torch.zeros_like(loss))
        norm = _normalizer(attrs["normalization"], lab.shape[0], lab.shape[1], valid.sum(), scores.dtype)
        return _outputs(attrs, each.sum() / norm, scores)


def smoothed_targets(logp, labels, factor: float):
    """(outer, C, inner) coefficients as the fork's floats: 1 - f at the label, f / C elsewhere."""
    f = torch.tensor(factor, dtype=torch.float32)
    coeff = torch.full_like(logp, float(f / logp.shape[1]))
    return coeff.scatter(1, labels.unsqueeze(1), float(1 - f))
