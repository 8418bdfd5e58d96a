"""Accuracy and the BVLC loss layers.

They exist for training and evaluation: they are marked `is_training_only` and dropped on export.
A loss top holds the unweighted loss, as Caffe's top blob does; `attrs["loss_weight"]` (one per
top, Caffe's defaults: 1 for a loss layer's first top) tells a trainer how to weight it.  Labels
arrive as floats and are truncated to int, as Caffe's static_cast does.  An Accuracy with 3 bottoms is
xiaolonw/caffe-3dnormal_joint_past's (4af389e, src/caffe/layers/accuracy_layer.cpp): a (1, 2, 1, 1) top that its
forward never writes (zeros).
"""
import math
import os

import numpy as np
import torch

from ..errors import CaffeqError, DataError
from ..io.caffemodel import read_blobproto
from .misc import eager_checks, need_bottom_count
from .norm import legacy_shape
from .registry import (
    Layer,
    LayerError,
    ReadOnlyLayer,
    canonical_axis,
    claim_layers,
    count,
    legacy_nchw,
    positive_field,
    register_layer,
)

FLT_MIN = 1.1754943508222875e-38
LOG_FLT_MIN = math.log(FLT_MIN)
LOG_THRESHOLD = math.log(1e-20)  # Caffe's kLOG_THRESHOLD in the multinomial/infogain losses

FULL, VALID, BATCH_SIZE, NONE = 0, 1, 2, 3
_NORM_NAMES = {FULL: "FULL", VALID: "VALID", BATCH_SIZE: "BATCH_SIZE", NONE: "NONE"}


def _check_labels(labels, valid, num_labels, what):
    if not eager_checks() or labels.numel() == 0:
        return
    bad = valid & ((labels < 0) | (labels >= num_labels))
    if bool(bad.any()):
        value = int(labels[bad][0])
        raise DataError(f"{what}: label {value} is outside [0, {num_labels}) "
                        f"(set ignore_label to skip such labels)")


def _ste(value, clamped):
    """`clamped` in the forward pass, the gradient of `value` backward (Caffe's loss gradients
    ignore the FLT_MIN / kLOG_THRESHOLD clamps of their forward passes)."""
    return value + (clamped - value).detach()


def _loss_weights(lp, n_tops, default_first):
    """loss_weight per top.  A loss layer that names no top gets an anonymous one in Caffe
    (LossLayer::AutoTopBlobs), which a single loss_weight may weigh; caffeq does not add it, so
    that weight goes with it (fine-tuning counts the losses whose tops the net names)."""
    if len(lp.loss_weight) > max(n_tops, 1):
        raise LayerError(f"{len(lp.loss_weight)} loss_weight values for {n_tops} top(s)")
    if not n_tops:
        return []
    if lp.loss_weight:
        return [float(w) for w in lp.loss_weight] + [0.0] * (n_tops - len(lp.loss_weight))
    return [float(default_first)] + [0.0] * (n_tops - 1) if n_tops else []


def _tops(lp, lo, hi, type_name):
    n = len(lp.top)
    if not lo <= n <= hi:
        want = str(lo) if lo == hi else f"{lo} to {hi}"
        raise LayerError(f"{type_name} produces {want} top(s); the prototxt names {n}")
    return n


def _normalization(lp, default, allow_legacy=True):
    """Caffe's loss normalization: `normalization`, else the legacy `normalize` flag, else default."""
    p = lp.loss_param
    if p.HasField("normalization"):
        mode = int(p.normalization)
    elif p.HasField("normalize"):
        if not allow_legacy:
            raise LayerError("loss_param.normalize is deprecated for this layer; use normalization")
        mode = VALID if p.normalize else BATCH_SIZE
    else:
        mode = default
    if mode not in _NORM_NAMES:
        raise LayerError(f"unknown loss_param.normalization {mode}")
    return mode


def _normalizer(mode, outer, inner, valid_count, dtype=torch.float32):
    if mode == FULL:
        n = outer * inner
    elif mode == VALID:
        n = valid_count
    elif mode == BATCH_SIZE:
        n = outer
    else:
        n = 1
    if torch.is_tensor(n):
        return n.to(dtype).clamp_min(1.0)
    return float(max(1, n))  # Caffe: max(1, normalizer) so an all-ignored batch gives 0, not NaN


def _label_attrs(lp, field):
    p = getattr(lp, field)
    return int(p.ignore_label) if p.HasField("ignore_label") else None


def _valid(labels, ignore):
    if ignore is None:
        return torch.ones_like(labels, dtype=torch.bool)
    return labels != ignore


class _TrainingOnly(Layer):
    is_training_only = True


# ---- Accuracy ------------------------------------------------------------------------------

@register_layer("Accuracy")
class Accuracy(_TrainingOnly):
    def parse(self, lp):
        p = lp.accuracy_param
        positive_field(p.top_k, "accuracy_param.top_k")
        n = _tops(lp, 1, 2, "Accuracy")
        return {"top_k": int(p.top_k), "axis": int(p.axis), "ignore_label": _label_attrs(lp, "accuracy_param"),
                "tops": n, "loss_weight": _loss_weights(lp, n, 0.0),
                "min_is_better": bool(p.min_is_better)}

    def infer(self, attrs, in_shapes):
        need_bottom_count(in_shapes, 2, "Accuracy")
        s, ls = tuple(in_shapes[0]), tuple(in_shapes[1])
        if count(ls) == 0 or attrs["top_k"] > count(s) // count(ls):
            raise LayerError(f"accuracy_param.top_k {attrs['top_k']} exceeds the number of classes "
                             f"({count(s)} predictions for {count(ls)} labels)")
        axis = _label_axis(attrs, s, ls, "accuracy_param.axis", "Accuracy")
        shapes = [()]
        if attrs["tops"] > 1:
            shapes.append((s[axis],))
        return shapes

    def forward(self, attrs, params, scores, labels):
        axis = attrs["_axis"]
        c = scores.shape[axis]
        outer = math.prod(scores.shape[:axis])
        x = scores.reshape(outer, c, -1)
        if attrs.get("min_is_better"):   # happynear's fork: the smallest score (a distance) wins
            x = -x
        lab = labels.reshape(outer, -1).long()
        valid = _valid(lab, attrs["ignore_label"])
        _check_labels(lab, valid, c, "Accuracy")
        safe = torch.where(valid, lab, torch.zeros_like(lab))
        true = x.gather(1, safe.unsqueeze(1))
        # Caffe counts every class scoring >= the true one, the true class included
        better = (x >= true).sum(dim=1) - 1
        correct = (better < attrs["top_k"]) & valid
        n_valid = valid.sum()
        acc = torch.where(n_valid > 0, correct.sum().to(scores.dtype) / n_valid.clamp_min(1).to(scores.dtype),
                          torch.zeros((), dtype=scores.dtype, device=scores.device))
        if attrs["tops"] == 1:
            return acc
        per_label = torch.zeros(c, dtype=scores.dtype, device=scores.device)
        hits = torch.zeros(c, dtype=scores.dtype, device=scores.device)
        per_label.index_add_(0, safe[valid], torch.ones_like(safe[valid], dtype=scores.dtype))
        hits.index_add_(0, safe[correct], torch.ones_like(safe[correct], dtype=scores.dtype))
        per_class = torch.where(per_label > 0, hits / per_label.clamp_min(1), torch.zeros_like(hits))
        return acc, per_class


@claim_layers("Accuracy", lambda lp: len(lp.top) == 3)
class RecallPrecisionAccuracy(ReadOnlyLayer):
    """knub/sentence-boundary-detection-nn's scorer: accuracy, then per-class recall and precision, from a Caffe
    whose source is not public (BVLC's Accuracy gives at most 2 tops).  Sized as BVLC's accuracy and per-class
    tops; a test-phase scorer, dropped from inference graphs, not run."""

    is_training_only = True

    def parse(self, lp):
        attrs = Accuracy().parse(_first_tops(lp, 2))
        return dict(attrs, name=lp.name, kind="Accuracy with 3 tops", tops=3)

    def infer(self, attrs, in_shapes):
        scalar, per_class = Accuracy().infer(dict(attrs, tops=2), in_shapes)
        return [scalar, per_class, per_class]

    def why_not_run(self, attrs):
        return ("the fork that gives Accuracy a third top (per-class recall and precision) is not public, so "
                "what it computes is not known")


@claim_layers("Accuracy", lambda lp: len(lp.bottom) == 3 and len(lp.top) == 1)
class UnwrittenAccuracy(_TrainingOnly):
    """xiaolonw/caffe-3dnormal_joint_past 4af389e (src/caffe/layers/accuracy_layer.cpp): its Accuracy takes any
    bottoms (its checks are commented out; its 3-D normal nets give prediction, probabilities and label) and
    shapes its one top (1, 2, 1, 1), as 2014's BVLC did for accuracy and log-probability, but its Forward_cpu
    computes nothing (the loop is commented out) and returns 0: the top keeps the zeros a new blob holds.  BVLC's
    Accuracy takes 2 bottoms.  The other 3-bottom Accuracy, olivernina/lisa-caffe-public's (LRCN_model 8d19f1d:
    scores, a label per item, a weight per item), is told apart by that label, whose shape leads the scores'
    (trailing 1s aside; xiaolonw's nets give probabilities (N, K) there): it is refused (its weighted accuracy
    is not computed here), as BVLC's Accuracy refuses 3 bottoms.  A read one sets attrs["unwritten"], so that eval never takes its bottoms for scores and a label."""

    def parse(self, lp):
        return {"loss_weight": _loss_weights(lp, 1, 0.0)}

    def infer(self, attrs, in_shapes):
        s, second = tuple(in_shapes[0]), list(in_shapes[1])
        while second and second[-1] == 1:
            second.pop()
        if len(second) < len(s) and tuple(second) == s[:len(second)]:
            # the second bottom's shape leads the scores' (trailing 1s aside): labels, as LRCN's nets give it
            raise LayerError(f"Accuracy with 3 bottoms whose second {list(in_shapes[1])} is a label per item: "
                             f"olivernina/lisa-caffe-public's (LRCN) accuracy weighted by the third bottom, which "
                             f"caffeq does not compute (xiaolonw/caffe-3dnormal_joint_past's gives probabilities "
                             f"there)")
        attrs["unwritten"] = True
        attrs["reading_notes"] = ["an Accuracy with 3 bottoms (the second not a label per item) read as "
                                  "xiaolonw/caffe-3dnormal_joint_past's: a (1, 2, 1, 1) top its forward never "
                                  "writes (zeros)"]
        return [(1, 2, 1, 1)]

    def forward(self, attrs, params, *bottoms):
        return bottoms[0].new_zeros((1, 2, 1, 1))


def _first_tops(lp, n):
    """A copy of layer `lp` keeping its first n tops (a fork's longer top list read as BVLC's)."""
    short = type(lp)()
    short.CopyFrom(lp)
    del short.top[n:]
    return short


# ---- Loss layers -------------------------------------------------------------------------

def _loss_common_infer(in_shapes, n, type_name):
    need_bottom_count(in_shapes, n, type_name)
    s0, s1 = in_shapes[0], in_shapes[1]
    if not s0 or not s1 or s0[0] != s1[0]:
        raise LayerError(f"{type_name}: the data and label should have the same first dimension, "
                         f"got {list(s0)} and {list(s1)}")


def _label_axis(attrs, s, ls, axis_field, type_name):
    """The class axis of predictions `s` (kept in attrs["_axis"]), checked to leave one label of `ls`
    per remaining position, as Caffe's Reshape checks."""
    axis = canonical_axis(attrs["axis"], len(s), axis_field)
    attrs["_axis"] = axis
    if count(s, 0, axis) * count(s, axis + 1) != count(ls):
        raise LayerError(f"{type_name}: the number of labels must match the predictions: predictions "
                         f"{list(s)} along axis {axis} need {count(s, 0, axis) * count(s, axis + 1)} labels, "
                         f"got {list(ls)}")
    return axis


def _softmax_loss_infer(attrs, in_shapes, axis_field, type_name):
    s, ls = tuple(in_shapes[0]), tuple(in_shapes[1])
    _label_axis(attrs, s, ls, axis_field, type_name)
    shapes = [()]
    if attrs["tops"] > 1:
        shapes.append(s)
    return shapes[:attrs["tops"]]


def _label_log_probs(attrs, scores, labels, what):
    """(log-softmax reshaped (outer, C, inner), labels (outer, inner) long, valid mask)."""
    axis = attrs["_axis"]
    c = scores.shape[axis]
    outer = math.prod(scores.shape[:axis])
    logp = torch.log_softmax(scores, dim=axis).reshape(outer, c, -1)
    lab = labels.reshape(outer, -1).long()
    valid = _valid(lab, attrs["ignore_label"])
    _check_labels(lab, valid, c, what)
    return logp, lab, valid


def _outputs(attrs, loss, scores):
    if attrs["tops"] == 0:
        return ()
    if attrs["tops"] == 1:
        return loss
    return loss, torch.softmax(scores, dim=attrs["_axis"])


@register_layer("SoftmaxWithLoss")
class SoftmaxWithLoss(_TrainingOnly):
    """R-FCN's fork (daijifeng001/caffe-rfcn softmax_loss_layer) adds a third top: each position's
    loss -log(max(prob, FLT_MIN)) (0 where the label is ignored), shaped like the labels.
    Faster R-CNN's MATLAB Caffe (ShaoqingRen/caffe faster-R-CNN 062f243, softmax_loss_layer.cpp) takes
    a third bottom, per-position weights shaped like the labels: the loss is the weighted sum, divided
    by the weights' sum over the labels not ignored with loss_param.normalize (0 when that sum is 0),
    else by the outer count."""

    def parse(self, lp):
        n = _tops(lp, 0, 3, "SoftmaxWithLoss")
        weighted = len(lp.bottom) == 3
        if weighted and lp.loss_param.HasField("normalization"):
            raise LayerError("a weighted SoftmaxWithLoss (3 bottoms, Faster R-CNN's MATLAB Caffe) reads "
                             "loss_param.normalize, not normalization")
        if weighted and n == 3:
            raise LayerError("a weighted SoftmaxWithLoss (3 bottoms) gives at most 2 tops")
        return {"axis": int(lp.softmax_param.axis), "ignore_label": _label_attrs(lp, "loss_param"),
                "normalization": _normalization(lp, VALID), "tops": n, "weighted": weighted,
                "loss_weight": _loss_weights(lp, n, 1.0)}

    def infer(self, attrs, in_shapes):
        _loss_common_infer(in_shapes, 3 if attrs["weighted"] else 2, "SoftmaxWithLoss")
        if attrs["weighted"] and legacy_nchw(in_shapes[2], "weights") != legacy_nchw(in_shapes[1], "labels"):
            raise LayerError(f"SoftmaxWithLoss: the weights (bottom 2) must be shaped as the labels, got "
                             f"{list(in_shapes[2])} and {list(in_shapes[1])}")
        shapes = _softmax_loss_infer(attrs, in_shapes, "softmax_param.axis", "SoftmaxWithLoss")
        return shapes + [tuple(in_shapes[1])] if attrs["tops"] == 3 else shapes

    def forward(self, attrs, params, scores, labels, weights=None):
        logp, lab, valid = _label_log_probs(attrs, scores, labels, "SoftmaxWithLoss")
        safe = torch.where(valid, lab, torch.zeros_like(lab))
        picked = logp.gather(1, safe.unsqueeze(1)).squeeze(1)
        picked = _ste(picked, picked.clamp_min(LOG_FLT_MIN))  # Caffe: log(max(prob, FLT_MIN))
        each = -torch.where(valid, picked, torch.zeros_like(picked))
        if weights is not None:
            w = torch.where(valid, weights.reshape(lab.shape).to(each.dtype), torch.zeros_like(each))
            total = (w * each).sum()
            if attrs["normalization"] == VALID:
                wsum = w.sum()
                return _outputs(attrs, torch.where(wsum == 0, torch.zeros_like(total), total / wsum), scores)
            return _outputs(attrs, total / lab.shape[0], scores)
        norm = _normalizer(attrs["normalization"], lab.shape[0], lab.shape[1], valid.sum(), scores.dtype)
        if attrs["tops"] == 3:
            return each.sum() / norm, torch.softmax(scores, dim=attrs["_axis"]), each.reshape(labels.shape)
        return _outputs(attrs, each.sum() / norm, scores)


@register_layer("InfogainLoss")
class InfogainLoss(_TrainingOnly):
    """Softmax, then -sum_l H[label, l] log(max(prob_l, 1e-20)); H from a 3rd bottom or a
    BlobProto file (infogain_loss_param.source, relative to the working directory as in Caffe)."""

    def parse(self, lp):
        p = lp.infogain_loss_param
        n = _tops(lp, 0, 2, "InfogainLoss")
        attrs = {"axis": int(p.axis), "ignore_label": _label_attrs(lp, "loss_param"),
                 "normalization": _normalization(lp, VALID, allow_legacy=False), "tops": n,
                 "loss_weight": _loss_weights(lp, n, 1.0), "H": None}
        if len(lp.bottom) < 3:
            if not p.HasField("source"):
                raise LayerError("infogain_loss_param.source (the H matrix) is required "
                                 "without a third bottom")
            if not os.path.exists(p.source):   # as a dataset: reading the net does not need it
                attrs["H_missing"] = p.source
                attrs["reading_notes"] = [f"its H matrix infogain_loss_param.source {p.source!r} is not here; "
                                          f"the loss (training only) needs it, nothing else does"]
                return attrs
            try:  # Caffe opens the path relative to the working directory
                attrs["H"] = np.array(read_blobproto(p.source), np.float32).reshape(-1)   # a writable copy
            except CaffeqError as e:
                raise LayerError(f"infogain_loss_param.source: {e}") from None
        return attrs

    def infer(self, attrs, in_shapes):
        _loss_common_infer(in_shapes, (2, 3), "InfogainLoss")
        shapes = _softmax_loss_infer(attrs, in_shapes, "infogain_loss_param.axis", "InfogainLoss")
        c = in_shapes[0][attrs["_axis"]]
        if len(in_shapes) < 3 and attrs["H"] is None:   # the file is not here: checked when it is
            return shapes
        h_count = count(in_shapes[2]) if len(in_shapes) > 2 else attrs["H"].size
        if h_count != c * c:
            raise LayerError(f"InfogainLoss: H must be {c}x{c}, it has {h_count} values")
        return shapes

    def forward(self, attrs, params, scores, labels, h=None):
        logp, lab, valid = _label_log_probs(attrs, scores, labels, "InfogainLoss")
        c = logp.shape[1]
        if h is None:
            if attrs["H"] is None:
                raise LayerError(f"InfogainLoss: its H matrix infogain_loss_param.source "
                                 f"{attrs['H_missing']!r} is not here (Caffe opens it from the working directory)")
            h = torch.from_numpy(attrs["H"]).to(device=scores.device, dtype=scores.dtype)
        h = h.reshape(c, c)
        logp = _ste(logp, logp.clamp_min(LOG_THRESHOLD))
        safe = torch.where(valid, lab, torch.zeros_like(lab))
        rows = h[safe]                                   # (outer, inner, C)
        per = (rows * logp.transpose(1, 2)).sum(dim=-1)  # (outer, inner)
        total = -torch.where(valid, per, torch.zeros_like(per)).sum()
        norm = _normalizer(attrs["normalization"], lab.shape[0], lab.shape[1], valid.sum(), scores.dtype)
        return _outputs(attrs, total / norm, scores)


class _ScalarLoss(_TrainingOnly):
    """A loss with 0 or 1 top (the scalar, loss_weight 1 unless set) over `bottoms` bottoms whose
    first dimensions agree; a subclass adds its parameters, shape checks and `loss`."""

    bottoms = 2

    def parse(self, lp):
        n = _tops(lp, 0, 1, self.types[0])
        return {**self.parse_param(lp), "tops": n, "loss_weight": _loss_weights(lp, n, 1.0)}

    def parse_param(self, lp):
        return {}

    def infer(self, attrs, in_shapes):
        _loss_common_infer(in_shapes, self.bottoms, self.types[0])
        self.check_shapes(in_shapes)
        return [()] * attrs["tops"]

    def check_shapes(self, in_shapes):
        """LayerError where Caffe's Reshape CHECK-fails on the bottoms."""

    def forward(self, attrs, params, *bottoms):
        loss = self.loss(attrs, *bottoms)
        return loss if attrs["tops"] else ()


@register_layer("SigmoidCrossEntropyLoss")
class SigmoidCrossEntropyLoss(_ScalarLoss):
    """daijifeng001/caffe-mnc (MNC) takes an optional third bottom: a weight per element, the loss then
    sum(weight * loss) / sum(weight) (its 3-bottom branch reads neither ignore_label nor normalization;
    a weight sum of 0 leaves its top as it was, 0 here)."""

    bottoms = (2, 3)

    def parse_param(self, lp):
        # unlike SoftmaxWithLoss, the default here is BATCH_SIZE
        return {"ignore_label": _label_attrs(lp, "loss_param"), "normalization": _normalization(lp, BATCH_SIZE)}

    def check_shapes(self, in_shapes):
        if count(in_shapes[0]) != count(in_shapes[1]):
            raise LayerError(f"SigmoidCrossEntropyLoss inputs must have the same count, got "
                             f"{list(in_shapes[0])} and {list(in_shapes[1])}")
        if len(in_shapes) == 3 and count(in_shapes[0]) != count(in_shapes[2]):
            raise LayerError(f"SigmoidCrossEntropyLoss: the weights (third bottom) must have the inputs' count, got "
                             f"{list(in_shapes[0])} and {list(in_shapes[2])}")

    def loss(self, attrs, x, target, weights=None):
        t = target.reshape(x.shape)
        pos = (x >= 0).to(x.dtype)
        # Caffe's stable form of -[t log s(x) + (1 - t) log(1 - s(x))]
        per = -(x * (t - pos) - torch.log1p(torch.exp(x - 2 * x * pos)))
        if weights is not None:
            w = weights.reshape(x.shape).to(x.dtype)
            total = w.sum()
            positive = total > 0
            return torch.where(positive, (w * per).sum() / torch.where(positive, total, torch.ones_like(total)),
                               torch.zeros_like(total))
        valid = _valid(t.long(), attrs["ignore_label"])
        total = torch.where(valid, per, torch.zeros_like(per)).sum()
        n = x.shape[0]
        return total / _normalizer(attrs["normalization"], n, x.numel() // max(n, 1), valid.sum(), x.dtype)


@register_layer("EuclideanLoss")
class EuclideanLoss(_ScalarLoss):
    """naibaf7/caffe (677e8440, PyGreentea's nets) takes a third bottom, element weights: the loss is then
    sum((w (a - b))^2) / 2 over its count(0), every element of the blob (not the batch)."""

    bottoms = (2, 3)

    def check_shapes(self, in_shapes):
        if count(in_shapes[0], 1) != count(in_shapes[1], 1):
            raise LayerError(f"EuclideanLoss inputs must have the same dimension, got "
                             f"{list(in_shapes[0])} and {list(in_shapes[1])}")
        if len(in_shapes) == 3 and count(in_shapes[2]) != count(in_shapes[0]):
            raise LayerError(f"EuclideanLoss's weights (bottom 2) need one value per element of "
                             f"{list(in_shapes[0])}, got {list(in_shapes[2])}")

    def loss(self, attrs, a, b, weights=None):
        d = a - b.reshape(a.shape)
        if weights is not None:
            d = d * weights.reshape(a.shape)
            return (d * d).sum() / d.numel() / 2
        return (d * d).sum() / a.shape[0] / 2


@register_layer("HingeLoss")
class HingeLoss(_ScalarLoss):
    L1, L2 = 1, 2

    def parse_param(self, lp):
        norm = int(lp.hinge_loss_param.norm)
        if norm not in (self.L1, self.L2):
            raise LayerError(f"unknown hinge_loss_param.norm {norm}")
        return {"norm": norm}

    def check_shapes(self, in_shapes):
        if count(in_shapes[1]) != in_shapes[0][0]:
            raise LayerError(f"HingeLoss needs one label per item, got labels {list(in_shapes[1])} "
                             f"for predictions {list(in_shapes[0])}")

    def loss(self, attrs, x, labels):
        n = x.shape[0]
        flat = x.reshape(n, -1)
        lab = labels.reshape(n).long()
        _check_labels(lab, torch.ones_like(lab, dtype=torch.bool), flat.shape[1], "HingeLoss")
        sign = torch.ones_like(flat).scatter(1, lab.unsqueeze(1), -1.0)  # the true class flips sign
        margin = torch.clamp_min(1 + flat * sign, 0)
        return (margin.sum() if attrs["norm"] == self.L1 else (margin * margin).sum()) / n


@register_layer("MultinomialLogisticLoss")
class MultinomialLogisticLoss(_ScalarLoss):
    """-mean log(max(prob[label], 1e-20)) over items; the input holds probabilities."""

    def check_shapes(self, in_shapes):
        ls = in_shapes[1]
        if len(ls) > 4 or any(d != 1 for d in legacy_shape(ls)[1:]):
            raise LayerError(f"MultinomialLogisticLoss needs labels shaped (N, 1, 1, 1), got {list(ls)}")

    def loss(self, attrs, prob, labels):
        n = prob.shape[0]
        flat = prob.reshape(n, -1)
        lab = labels.reshape(n).long()
        _check_labels(lab, torch.ones_like(lab, dtype=torch.bool), flat.shape[1], "MultinomialLogisticLoss")
        p = flat.gather(1, lab.unsqueeze(1)).squeeze(1)
        return -torch.log(p.clamp_min(1e-20)).sum() / n


@register_layer("ContrastiveLoss")
class ContrastiveLoss(_ScalarLoss):
    """Pairs (a, b) with similarity y: similar pairs add d^2, dissimilar max(margin - d, 0)^2
    (legacy_version: max(margin - d^2, 0)); the sum is divided by 2N."""

    bottoms = 3

    def parse_param(self, lp):
        p = lp.contrastive_loss_param
        return {"margin": float(p.margin), "legacy": bool(p.legacy_version)}

    def check_shapes(self, in_shapes):
        a, b, y = in_shapes
        if any(len(s) > 4 for s in in_shapes):
            raise LayerError("ContrastiveLoss inputs have at most 4 axes")
        la, lb, ly = legacy_shape(a), legacy_shape(b), legacy_shape(y)
        if la[1] != lb[1] or la[2:] != (1, 1) or lb[2:] != (1, 1) or ly[1:] != (1, 1, 1):
            raise LayerError(f"ContrastiveLoss needs features (N, C, 1, 1) twice and similarity "
                             f"(N, 1, 1, 1), got {list(a)}, {list(b)}, {list(y)}")

    def loss(self, attrs, a, b, y):
        n = a.shape[0]
        d = (a - b).reshape(n, -1)
        dist_sq = (d * d).sum(dim=1)
        similar = y.reshape(n).long() != 0
        m = attrs["margin"]
        if attrs["legacy"]:
            far = torch.clamp_min(m - dist_sq, 0)
        else:
            # the floor keeps the gradient finite where a pair coincides
            far = torch.clamp_min(m - torch.sqrt(dist_sq.clamp_min(1e-30)), 0) ** 2
        return torch.where(similar, dist_sq, far).sum() / n / 2


__all__ = ["Accuracy", "ContrastiveLoss", "EuclideanLoss", "HingeLoss", "InfogainLoss", "MultinomialLogisticLoss",
           "SigmoidCrossEntropyLoss", "SoftmaxWithLoss"]
