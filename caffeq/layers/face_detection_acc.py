"""stupiding/face-detection (89e1ab4) Accuracy with accuracy_param.thred (src/caffe/proto/caffe.proto: repeated
float thred = 4, 110004 here; src/caffe/layers/accuracy_layer.cpp).  Claimed only where thred is set: the
fork's cascade nets gate each stage's accuracy on the earlier stages' sigmoid outputs.

Bottoms: scores, labels, then one gate per thred value (the fork's CHECK: bottoms - 2 == thred count), each
with the scores' count.  Where the scores hold one value per sample (count == num), the fork's binary
branch: labels must be 0 or 1 (its CHECK); sample i counts unless some gate j has g_j[i] < thred[j] (a NaN
gate passes); a counted sample is right where (label 1 and score > 0) or (label 0 and score <= 0); top =
right / counted (0 / 0 gives NaN, as the fork's float division).  A second top (per class) stays 0: the branch never fills it.
Otherwise (class scores) the fork's gate loop increments j instead of k and never ends once the first gate
passes (it ends only where gate 0 fails for every sample, giving NaN): caffeq reads the layer and refuses to run
it.  A TEST metric, dropped from inference graphs.
SigmoidCrossEntropyLoss with loss_param.thred (110004 here; sigmoid_cross_entropy_loss_layer.cpp), claimed
where thred is set: bottoms scores, targets, then gates (the fork checks that every bottom has the scores'
count, not the gate count: caffeq needs at least one gate per thred value, the fork reading past otherwise);
element i counts unless some gate j has g_j[i] < thred[j], the loss is the sum of Caffe's stable sigmoid
cross-entropy over the counted elements divided by their number (0 / 0 gives NaN; no ignore_label, no
normalization).  A loss: dropped from inference graphs, as BVLC's.
An Accuracy without thred stays BVLC's, though the fork runs the same binary branch wherever the scores hold
one value per sample (its 48in net's accuracy_1): nothing in such a layer tells the fork's from BVLC's.
"""
import torch

from . import registry
from .losses import Accuracy, SigmoidCrossEntropyLoss
from .registry import LayerError, claim_layers, count, need_blobs


@claim_layers("Accuracy", lambda lp: len(lp.accuracy_param.thred) > 0)
class ThresholdedAccuracy(Accuracy):
    def parse(self, lp):
        thred = [float(t) for t in lp.accuracy_param.thred]
        need_blobs(lp, "Accuracy (accuracy_param.thred)", 2 + len(thred), (1, 2),
                   "scores, labels, then one gate per thred value")
        short = type(lp)()
        short.CopyFrom(lp)
        del short.bottom[2:]
        return dict(super().parse(short), thred=thred, name=lp.name)

    def infer(self, attrs, in_shapes):
        shapes = super().infer(attrs, in_shapes[:2])
        s = tuple(in_shapes[0])
        for j, g in enumerate(in_shapes[2:]):
            if count(g) != count(s):
                raise LayerError(f"Accuracy gate (bottom {j + 2}) {list(g)} must have the scores' count "
                                 f"{count(s)} (the fork's CHECK)")
        attrs["binary"] = count(s) == s[0]
        return shapes

    def cannot_run(self, attrs, in_shapes):
        if not (count(in_shapes[0]) == in_shapes[0][0]):
            return ("with class scores (count != num) the fork's gate loop increments j, not k, and never ends once "
                    "the first gate passes")
        return None

    def forward(self, attrs, params, scores, labels, *gates):
        self.refuse_if_cannot_run(attrs["name"], attrs, [tuple(t.shape) for t in (scores, labels) + gates],
                                  LayerError)
        return thresholded_accuracy(scores, labels, list(gates), attrs["thred"], attrs["tops"],
                                    scores.shape[attrs["_axis"]])


# importing .losses registered its 3-bottom Accuracy claim (xiaolonw's) first: thred decides before it
_ENTRY = next(e for e in registry._CLAIMS if isinstance(e[2], ThresholdedAccuracy))
registry._CLAIMS.remove(_ENTRY)
registry._CLAIMS.insert(0, _ENTRY)


def thresholded_accuracy(scores, labels, gates: list, thred: list, tops: int, classes: int):
    n = scores.shape[0]
    x = scores.reshape(n)
    lab = labels.reshape(n).long()
    if bool(((lab != 0) & (lab != 1)).any()):
        raise LayerError("Accuracy (accuracy_param.thred): the fork's binary branch takes labels 0 or 1 only")
    passed = gates_passed(gates, thred, n, scores.device)   # a NaN gate passes
    right = ((lab == 1) & (x > 0)) | ((lab == 0) & (x <= 0))
    acc = (right & passed).sum().to(scores.dtype) / passed.sum().to(scores.dtype)
    if tops == 1:
        return acc
    return acc, scores.new_zeros(classes)


def gates_passed(gates: list, thred: list, n: int, device):
    """The fork's gate test: element i counts unless some gate j has gates[j][i] < thred[j]."""
    passed = torch.ones(n, dtype=torch.bool, device=device)
    for g, t in zip(gates, thred):
        passed = passed & ~(g.reshape(-1)[:n] < t)
    return passed


@claim_layers("SigmoidCrossEntropyLoss", lambda lp: len(lp.loss_param.thred) > 0)
class GatedSigmoidCrossEntropyLoss(SigmoidCrossEntropyLoss):
    bottoms = None

    def parse_param(self, lp):
        thred = [float(t) for t in lp.loss_param.thred]
        if len(lp.bottom) < 2 + len(thred):
            raise LayerError(f"SigmoidCrossEntropyLoss: loss_param.thred has {len(thred)} values for "
                             f"{len(lp.bottom) - 2} gate bottoms (the fork would read past its bottoms)")
        return {"thred": thred}

    def infer(self, attrs, in_shapes):
        for i, s in enumerate(in_shapes[1:], start=1):
            if count(s) != count(in_shapes[0]):
                raise LayerError(f"SigmoidCrossEntropyLoss (loss_param.thred): bottom {i} {list(s)} must have the "
                                 f"scores' count {count(in_shapes[0])} (the fork's CHECK)")
        return [()] * attrs["tops"]

    def loss(self, attrs, x, target, *gates):
        x = x.reshape(-1)
        t = target.reshape(-1).to(x.dtype)
        pos = (x >= 0).to(x.dtype)
        per = -(x * (t - pos) - torch.log1p(torch.exp(x - 2 * x * pos)))
        passed = gates_passed(list(gates), attrs["thred"], x.shape[0], x.device)
        return torch.where(passed, per, torch.zeros_like(per)).sum() / passed.sum().to(x.dtype)


__all__ = ["GatedSigmoidCrossEntropyLoss", "ThresholdedAccuracy", "thresholded_accuracy"]
