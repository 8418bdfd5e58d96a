"""CTCGreedyDecoder: best-path decoding of CRNN-style OCR nets (caffe_ocr, TextBoxes++ and the
caffes derived from them, e.g. Caffe_SSD_LSTM_LPR).

The input holds per-step class scores, T x N x C (time first).  Per item n and step t the decoder
takes the first class of maximal score (the forks' strict `>` loop), drops the blank class and,
with ctc_merge_repeated, a class equal to the one of the step before (a blank in between keeps a
repeat: "a - a" gives "aa").  The top is N x T x 1 x 1: item n's labels first, then -1.

The layer comes in three forms, told apart by its bottoms and tops:

- one bottom (caffe_ocr's deploy nets): decode every step.  An unset blank_index is 0 there
  (caffe_ocr's caffe.proto default; its WarpCTCLoss trains with blank 0);
- two bottoms whose second is T x N (TextBoxes++): the second is the sequence indicators; item n
  ends before the first step t >= 1 with indicator 0.  An optional second top holds each item's
  score, the sum over its steps of minus the maximal score.  An unset blank_index is -1 there;
- two bottoms whose second is N x L, one top (caffe_ocr's TEST-phase "acc" layer): the second is
  the label (L labels per item, ended by a negative one); the top, 1 x 2 x 1 x 1, holds
  1 - mean(edit distance / longer length) and the fraction of items decoded exactly.  Evaluation
  only: it runs in torch and is refused by the exporters.

A negative blank_index means the last class, C - 1, as in both forks.
"""

import numpy as np
import torch

from .registry import Layer, LayerError, register_layer, torch_sources

DECODE, INDICATORS, ACCURACY = "decode", "indicators", "accuracy"


# ---- torch (also copied into model.py) -------------------------------------------------------

def ctc_best_path(x, blank: int, merge_repeated: bool, indicators=None):
    """Greedy CTC decoding of x (T, N, C, ...): returns (labels (N, T, 1, 1) as floats, padded with
    -1, and scores (N, 1, 1, 1): the sum over the decoded steps of minus the maximal score)."""
    steps, batch, classes = x.shape[0], x.shape[1], x.shape[2]
    # the forks read the C values at offset (t, n): the first C of each (t, n) chunk
    probs = x.reshape(steps, batch, -1)[:, :, :classes]
    best, best_class = probs.max(dim=2)  # first maximum wins, as the forks' strict '>' loop
    best_class = best_class.t()  # (N, T)
    best = best.t()
    time = torch.arange(steps, device=x.device).unsqueeze(0)
    if indicators is None:
        valid = torch.ones_like(best_class, dtype=torch.bool)
    else:
        ind = indicators.reshape(indicators.shape[0], indicators.shape[1], -1)[:, :, 0].t()
        # item n stops before the first step t >= 1 whose indicator is 0; step 0 always counts
        stopped = torch.cumsum((ind[:, 1:] == 0).to(torch.int64), dim=1) > 0
        valid = torch.cat([torch.ones_like(stopped[:, :1]), ~stopped], dim=1)
    keep = valid & (best_class != blank)
    if merge_repeated:
        previous = torch.cat([torch.full_like(best_class[:, :1], -1), best_class[:, :-1]], dim=1)
        keep = keep & (best_class != previous)
    # move the kept steps to the front in time order: kept steps sort by t, the others after them
    key = torch.where(keep, time, time + steps)
    sorted_key, order = torch.sort(key, dim=1)
    labels = torch.where(sorted_key < steps, best_class.gather(1, order), torch.full_like(order, -1))
    scores = -(best * valid.to(best.dtype)).sum(dim=1)
    return labels.to(x.dtype).reshape(batch, steps, 1, 1), scores.reshape(batch, 1, 1, 1)


def _edit_distance(a, b):
    """Levenshtein distance of two label lists (the forks' EditDistance)."""
    row = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        diagonal, row[0] = row[0], i
        for j in range(1, len(b) + 1):
            substitute = diagonal + (a[i - 1] != b[j - 1])
            diagonal, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, substitute)
    return row[len(b)]


def ctc_label_accuracy(labels, target, blank: int):
    """caffe_ocr's accuracy top (1, 2, 1, 1) from decoded labels (N, T, 1, 1) and targets (N, L, ...):
    1 - mean over items of edit distance / longer length, and the fraction of exact items."""
    batch = labels.shape[0]
    decoded = labels.reshape(batch, -1).tolist()
    wanted = target.reshape(batch, target.shape[1], -1)[:, :, 0].tolist()
    edit_sum, exact = 0.0, 0
    for got_row, want_row in zip(decoded, wanted):
        got = [int(v) for v in got_row if v >= 0]
        want = []
        for v in want_row:
            if v < 0:
                break  # the target ends at its first negative label
            label = int(0.5 + v)
            if label != blank:
                want.append(label)
        longer = max(len(got), len(want))
        if longer == 0:
            continue  # caffe_ocr skips the item: no edit cost, and not counted as exact
        distance = _edit_distance(want, got)
        edit_sum += distance / longer
        exact += distance == 0
    out = torch.tensor([1.0 - edit_sum / batch, exact / batch], dtype=labels.dtype, device=labels.device)
    return out.reshape(1, 2, 1, 1)


class CTCGreedyDecoder(torch.nn.Module):
    """Caffe's CTCGreedyDecoder: labels (N, T, 1, 1) padded with -1, and with `scores` also each
    item's score (N, 1, 1, 1); see ctc_best_path."""

    def __init__(self, blank, merge_repeated=True, scores=False):
        super().__init__()
        self.blank, self.merge_repeated, self.scores = blank, merge_repeated, scores

    def forward(self, x, indicators=None):
        labels, scores = ctc_best_path(x, self.blank, self.merge_repeated, indicators)
        return (labels, scores) if self.scores else labels


TORCH_CTC = torch_sources(ctc_best_path, CTCGreedyDecoder)


# ---- spec ---------------------------------------------------------------------------------

@register_layer("CTCGreedyDecoder")
class CTCGreedyDecoderSpec(Layer):
    def parse(self, lp):
        p = lp.ctc_decoder_param
        bottoms, tops = len(lp.bottom), len(lp.top)
        if not 1 <= bottoms <= 2:
            raise LayerError(f"CTCGreedyDecoder takes 1 bottom (scores) or 2 (scores and sequence "
                             f"indicators, or scores and labels); the prototxt names {bottoms}"
                             + (" (TextBoxes++'s accuracy form with target sequences is not supported)"
                                if bottoms == 3 else ""))
        if not 1 <= tops <= 2 or (tops == 2 and bottoms == 1):
            raise LayerError(f"CTCGreedyDecoder produces 1 top (2 with sequence indicators: labels and "
                             f"scores); the prototxt names {tops} with {bottoms} bottom(s)")
        return {"blank_index": int(p.blank_index) if p.HasField("blank_index") else None,
                "merge_repeated": bool(p.ctc_merge_repeated), "tops": tops}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) < 3:
            raise LayerError(f"CTCGreedyDecoder needs scores shaped T x N x C (time first), got {list(s)}")
        steps, batch, classes = s[0], s[1], s[2]
        if min(steps, batch, classes) < 1:
            raise LayerError(f"CTCGreedyDecoder needs T, N and C of at least 1, got {list(s)}")
        form = DECODE
        if len(in_shapes) == 2:
            second = tuple(in_shapes[1])
            if len(second) >= 2 and second[:2] == (steps, batch):
                form = INDICATORS
            elif len(second) >= 2 and second[0] == batch and attrs["tops"] == 1:
                form = ACCURACY
            else:
                raise LayerError(f"CTCGreedyDecoder's second bottom must be the sequence indicators "
                                 f"(T x N = {steps} x {batch}) or the labels (N x L, N = {batch}), "
                                 f"got {list(second)}")
        attrs["_form"] = form
        blank = attrs["blank_index"]
        if blank is None:
            # unset: caffe_ocr's default 0 (the one-bottom and label forms only run there),
            # TextBoxes++'s -1 with sequence indicators
            blank = -1 if form == INDICATORS else 0
        if blank < 0:
            blank = classes - 1
        if blank >= classes:
            raise LayerError(f"ctc_decoder_param.blank_index {attrs['blank_index']} is out of range "
                             f"for {classes} classes (C = shape[2] of {list(s)})")
        attrs["_blank"] = blank
        if form == ACCURACY:
            return [(1, 2, 1, 1)]
        shapes = [(batch, steps, 1, 1)]
        if attrs["tops"] == 2:
            shapes.append((batch, 1, 1, 1))
        return shapes

    def forward(self, attrs, params, x, second=None):
        form = attrs["_form"]
        labels, scores = ctc_best_path(x, attrs["_blank"], attrs["merge_repeated"],
                                       second if form == INDICATORS else None)
        if form == ACCURACY:
            return ctc_label_accuracy(labels, second, attrs["_blank"])
        return (labels, scores) if attrs["tops"] == 2 else labels

    def onnx(self, ctx, node):
        from ..errors import ExportError
        a = node.attrs
        if a["_form"] == ACCURACY:
            raise ExportError(f"layer '{node.name}' (CTCGreedyDecoder): the label form computes an "
                              f"edit-distance accuracy for evaluation; export the deploy net instead")
        emit_ctc_onnx(ctx, node)

    def pytorch_source(self, node, emit):
        a = node.attrs
        if a["_form"] == ACCURACY:
            return None
        args = [str(a["_blank"]), f"merge_repeated={a['merge_repeated']}"]
        if a["tops"] == 2:
            args.append("scores=True")
        m = emit.module(f"{emit.helper(TORCH_CTC)}({', '.join(args)})")
        call = f"{m}({', '.join(emit.inputs)})"
        if a["tops"] == 2:
            out = emit.tmp("ctc")
            emit.stmt(f"{out} = {call}")
            return [f"{out}[0]", f"{out}[1]"]
        return call


# ---- ONNX ---------------------------------------------------------------------------------

def emit_ctc_onnx(ctx, node):
    """ArgMax over classes, keep = not blank (and not a repeat, and within the sequence),
    then the kept steps moved to the front by sorting the key t (kept) or T + t (dropped) with TopK."""
    a = node.attrs
    x = node.inputs[0]
    shape = ctx.shape(x)
    steps, classes = shape[0], shape[2]
    name = node.name

    probs = x
    if len(shape) > 3:
        probs = ctx.op("Reshape", [x, ctx.i64([steps, 0, -1])], "flat")
        if int(np.prod(shape[2:])) != classes:
            probs = ctx.op("Slice", [probs, ctx.i64([0]), ctx.i64([classes]), ctx.i64([2])], "probs")
    # ONNX ArgMax with select_last_index=0 returns the first maximum, as the forks do
    argmax = ctx.op("ArgMax", [probs], "argmax", axis=2, keepdims=1, select_last_index=0)
    best_class = ctx.op("Transpose", [ctx.op("Squeeze", [argmax, ctx.i64([2])], "argmax2")], "classes", perm=[1, 0])
    keep = ctx.op("Not", [ctx.op("Equal", [best_class, ctx.i64(a["_blank"])], "is_blank")], "not_blank")
    valid = None
    if a["_form"] == INDICATORS:
        ind = ctx.op("Reshape", [node.inputs[1], ctx.i64([0, 0, -1])], "ind3")
        ind = ctx.op("Slice", [ind, ctx.i64([1, 0]), ctx.i64([steps, 1]), ctx.i64([0, 2])], "ind_next")
        ind = ctx.op("Transpose", [ctx.op("Squeeze", [ind, ctx.i64([2])], "ind2")], "ind_nt", perm=[1, 0])
        zero = ctx.op("Cast", [ctx.op("Equal", [ind, ctx.const(np.array(0, np.float32))], "ind_zero")],
                      "ind_zero_i", to=7)  # INT64
        stopped = ctx.op("Greater", [ctx.op("CumSum", [zero, ctx.i64(1)], "ind_cum"), ctx.i64(0)], "stopped")
        # step 0 always counts: pad a "not stopped" column in front
        stopped = ctx.op("Pad", [ctx.op("Cast", [stopped], "stopped_i", to=7), ctx.i64([0, 1, 0, 0]), ctx.i64(0)],
                         "stopped_pad", mode="constant")
        valid = ctx.op("Equal", [stopped, ctx.i64(0)], "valid")
        keep = ctx.op("And", [keep, valid], "keep_valid")
    if a["merge_repeated"]:
        shifted = ctx.op("Pad", [best_class, ctx.i64([0, 1, 0, 0]), ctx.i64(-1)], "prev_pad", mode="constant")
        previous = ctx.op("Slice", [shifted, ctx.i64([0]), ctx.i64([steps]), ctx.i64([1])], "prev")
        keep = ctx.op("And", [keep, ctx.op("Not", [ctx.op("Equal", [best_class, previous], "repeat")], "no_repeat")],
                      "keep")
    time = ctx.i64(np.arange(steps).reshape(1, steps))
    key = ctx.op("Where", [keep, time, ctx.i64(np.arange(steps, 2 * steps).reshape(1, steps))], "key")
    sorted_key, order = ctx.tmp(f"{name}_sorted_key"), ctx.tmp(f"{name}_order")
    ctx.add_node("TopK", [key, ctx.i64([steps])], [sorted_key, order], axis=1, largest=0, sorted=1)
    gathered = ctx.op("GatherElements", [best_class, order], "gathered", axis=1)
    labels = ctx.op("Where", [ctx.op("Less", [sorted_key, ctx.i64(steps)], "is_kept"), gathered, ctx.i64(-1)], "labels")
    labels = ctx.op("Cast", [labels], "labels_f", to=1)  # FLOAT
    ctx.add_node("Unsqueeze", [labels, ctx.i64([2, 3])], [node.outputs[0]], name=name)
    if a["tops"] == 2:
        best = ctx.op("GatherElements", [probs, argmax], "max", axis=2)
        best = ctx.op("Transpose", [ctx.op("Squeeze", [best, ctx.i64([2])], "max2")], "max_nt", perm=[1, 0])
        best = ctx.op("Mul", [best, ctx.op("Cast", [valid], "valid_f", to=1)], "max_valid")
        total = ctx.op("ReduceSum", [best, ctx.i64([1])], "max_sum", keepdims=0)
        ctx.add_node("Reshape", [ctx.op("Neg", [total], "score"), ctx.i64([-1, 1, 1, 1])], [node.outputs[1]])
