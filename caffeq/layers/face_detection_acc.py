"""stupiding/face-detection (89e1ab4) Accuracy with accuracy_param.thred (src/caffe/proto/caffe.proto: repeated
float thred = 4, 110004 here; src/caffe/layers/accuracy_layer.cpp).  Claimed only where thred is set: the
fork's cascade nets gate each stage's accuracy on the earlier stages' sigmoid outputs.

Bottoms: scores, labels, then one gate per thred value (the fork's CHECK: bottoms - 2 == thred count), each
with the scores' count.  Where the scores hold one value per sample (count == num), the fork's binary
branch: labels must be 0 or 1 (its CHECK); sample i counts where every gate j has g_j[i] >= thred[j]; a
counted sample is right where (label 1 and score > 0) or (label 0 and score <= 0); top = right / counted
(0 / 0 gives NaN, as the fork's float division).  A second top (per class) stays 0: the branch never fills it.
Otherwise (class scores) the fork's gate loop increments j instead of k and never ends once the first gate
passes: caffeq reads the layer and refuses to run it.  A TEST metric, dropped from inference graphs.
The losses' loss_param.thred (110004 here) only trains: read and ignored.
"""
import torch

from . import registry
from .losses import Accuracy
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
registry._CLAIMS.insert(0, registry._CLAIMS.pop())


def thresholded_accuracy(scores, labels, gates: list, thred: list, tops: int, classes: int):
    n = scores.shape[0]
    x = scores.reshape(n)
    lab = labels.reshape(n).long()
    if bool(((lab != 0) & (lab != 1)).any()):
        raise LayerError("Accuracy (accuracy_param.thred): the fork's binary branch takes labels 0 or 1 only")
    passed = torch.ones(n, dtype=torch.bool, device=scores.device)
    for g, t in zip(gates, thred):
        passed = passed & (g.reshape(-1)[:n] >= t)
    right = ((lab == 1) & (x > 0)) | ((lab == 0) & (x <= 0))
    acc = (right & passed).sum().to(scores.dtype) / passed.sum().to(scores.dtype)
    if tops == 1:
        return acc
    return acc, scores.new_zeros(classes)


__all__ = ["ThresholdedAccuracy", "thresholded_accuracy"]
