"""synopsys-caffe's DetectionOutput with per-level bottoms (foss-for-synopsys-dwc-arc-processors/
synopsys-caffe 977ba36a, detection_output_layer.cpp LayerSetUp / Reshape / Forward_cpu).

With at least `nbottom` (default 6) bottoms the fork reads, per level n < nbottom, bottom[n] as
that level's conf and bottom[nbottom + n] as its loc; then either one concatenated prior blob at
bottom[2 * nbottom] (fewer than 3 * nbottom bottoms, or nbottom 1) or one per level after the
locs.  Each level is read in one of three layouts, by the index arithmetic of its CPU loops:

- plain (neither flag): SSD's flattened layout per level, channels() numbers: loc
  [prior][loc class][4], conf [prior][class]; per-level priors as PriorBox writes them.
- `ratio_permute`: loc [4][prior], conf [class][prior] (count = channels() / 4 or / num_classes);
  the concatenated priors are read with the permute "merged" into the index: level n's priors
  (count = loc channels / 4, the ratio `ratio<n>`) in the order [ratio][cell] where PriorBox wrote
  [cell][ratio]; per-level priors are read [4][prior] for the boxes, then [4][prior] for the
  variances.
- `no_permute`: loc straight from the conv, (N, R * 4, H, W) read [ratio][4][cell]; conf (N,
  num_classes, R, H * W) (the conv's scores reshaped to (R, classes, -1), permuted (0, 2, 1, 3)
  and put through Softmax over axis 1) read [class][ratio][cell]; priors in the order [level]
  [ratio][cell], gathered from PriorBox's [cell][ratio] as above.

caffeq gathers the levels into SSD's concatenated loc (N, P * 4), conf (N, P * C) and priors
(1, 2, 4P), in the fork's prior order (which decides NMS ties), and then runs SSD's
DetectionOutput unchanged (the fork's DecodeBBox, ApplyNMSFast and keep_top_k are SSD's).  What
a plain concatenation of permuted levels would not reproduce:

- the prior boxes are permuted but their variances are read at the unpermuted index (the fork's
  `(num_priors_ + i) * 4`): prior i keeps the variance of PriorBox's i-th prior;
- every image is decoded from image 0's conf and loc (the loops read `cpu_data()` with no
  per-image offset), so a batch of N gives image 0's detections N times, ids 0..N-1;
- with `no_permute` the concatenated priors may hold more priors than the levels predict (the
  fork reads the first ones and takes the variances from the second half's start).

The GPU Forward of the fork reads bottom[0] / [1] / [2] as SSD's loc / conf / priors whatever the
count (its per-level reading exists only on the CPU), so it cannot run these nets; caffeq follows
the CPU.  Refused, each with one line: RefineDet's per-level arm bottoms (`arm_conf_no_concat`,
`arm_loc_no_concat`), `tflite_detection`, both layout flags at once, per-level conf with a
concatenated loc (nbottom <= bottoms < 2 * nbottom + 1: the fork's Reshape sizes neither), per-level
priors with `no_permute` (the fork has no reading for them), share_location false with either
flag, and shapes the fork would read past or that its checks reject.
"""
import math

import torch

from ..registry import LayerError
from .common import legacy_hw, proto_field


def level_reading(lp):
    """The fork's per-level reading of this DetectionOutput, or None for SSD's 3 to 5 bottoms."""
    p = lp.detection_output_param
    if proto_field(p, "tflite_detection", False):
        raise LayerError("detection_output_param.tflite_detection (synopsys-caffe's TFLite box decoding) "
                         "is not supported")
    if proto_field(p, "arm_conf_no_concat", False) or proto_field(p, "arm_loc_no_concat", False):
        raise LayerError("detection_output_param.arm_conf_no_concat / arm_loc_no_concat (synopsys-caffe's "
                         "per-level RefineDet bottoms) are not supported")
    nb = int(proto_field(p, "nbottom", 6))
    count = len(lp.bottom)
    if count < nb:
        return None   # SSD's concatenated loc, conf, priors (the fork's conf_concat_)
    if nb < 1:
        raise LayerError(f"detection_output_param.nbottom must be >= 1, got {nb}")
    if count < 2 * nb + 1 and nb != 1:
        if not any(proto_field(p, f) is not None for f in ("nbottom", "no_permute", "ratio_permute")):
            return None   # no fork field: SSD's bottom count error
        raise LayerError(f"{count} bottoms with nbottom {nb}: per-level conf with a concatenated loc "
                         f"(fewer than 2 * nbottom + 1 = {2 * nb + 1} bottoms) is not read by the fork")
    ratio_permute = bool(proto_field(p, "ratio_permute", False))
    no_permute = bool(proto_field(p, "no_permute", False))
    if ratio_permute and no_permute:
        raise LayerError("detection_output_param.ratio_permute and no_permute are both set; the fork "
                         "checks one layout and reads the other")
    mode = "ratio" if ratio_permute else "cell" if no_permute else "plain"
    if mode != "plain" and not p.share_location:
        raise LayerError(f"detection_output_param.{'ratio_permute' if ratio_permute else 'no_permute'} "
                         f"needs share_location: true (the fork's priors then outnumber its boxes)")
    per_level_priors = count >= 3 * nb and nb != 1
    if per_level_priors and mode == "cell":
        raise LayerError(f"no_permute with per-level priors ({count} bottoms >= 3 * nbottom): the fork "
                         f"reads no priors then")
    ratios = [int(proto_field(p, f"ratio{k}", 3 if k == 0 else 6)) for k in range(6)]
    if mode == "ratio" and not per_level_priors and nb > 6:
        raise LayerError(f"ratio_permute with concatenated priors has ratio0..ratio5 only, nbottom is {nb}")
    return {"mode": mode, "nbottom": nb, "per_level_priors": per_level_priors, "ratios": ratios}


def _legacy(shape, what):
    """Caffe's num, channels, height, width of a bottom (1 past its last axis; at most 4 axes)."""
    shape = tuple(int(d) for d in shape)
    if len(shape) > 4:
        raise LayerError(f"{what} {list(shape)} has more than 4 axes (the fork reads its legacy shape)")
    h, w = legacy_hw(shape)
    return (shape[0] if shape else 1), (shape[1] if len(shape) > 1 else 1), h, w


def level_pieces(attrs, in_shapes):
    """How the gather builds SSD's loc, conf, prior boxes and prior variances: for each, a list of
    pieces [bottom, start, stop, shape, perm] (item 0's flat numbers [start:stop], reshaped to
    shape, permuted by perm, flattened, the pieces concatenated).  Checks the fork's Reshape."""
    lv = attrs["levels"]
    nb, mode, C = lv["nbottom"], lv["mode"], attrs["num_classes"]
    L = 1 if attrs["share_location"] else C
    loc, conf, pbox, pvar = [], [], [], []
    sum_loc = sum_conf = 0
    n_loc = n_conf = 0          # priors the loc / conf pieces hold
    cells = []                  # no_permute: (ratios, cells) per level, for the priors
    loc_channels = []
    for n in range(nb):
        cn, cc, ch, cw = _legacy(in_shapes[n], f"conf bottom {n}")
        ln, lc, lh, lw = _legacy(in_shapes[nb + n], f"loc bottom {nb + n}")
        if cn != ln:
            raise LayerError(f"level {n}: conf {list(in_shapes[n])} and loc {list(in_shapes[nb + n])} "
                             f"disagree on the batch")
        sum_loc, sum_conf = sum_loc + lc, sum_conf + cc
        loc_channels.append(lc)
        if mode == "cell":
            ratio, hw = lc // 4 // L, lh * lw
            if cc != C or ch != ratio or cw != hw:
                raise LayerError(f"no_permute level {n}: conf {list(in_shapes[n])} is not (N, num_classes "
                                 f"{C}, {ratio} ratios, {hw} cells) for loc {list(in_shapes[nb + n])}")
            loc.append([nb + n, 0, ratio * 4 * hw, [ratio, 4, hw], [0, 2, 1]])
            conf.append([n, 0, C * ratio * hw, [C, ratio * hw], [1, 0]])
            cells.append((ratio, hw))
            n_loc, n_conf = n_loc + ratio * hw, n_conf + ratio * hw
            continue
        if lc % (4 * L) or cc % C:
            raise LayerError(f"level {n}: loc channels {lc} are not a multiple of 4 x {L} or conf channels "
                             f"{cc} of {C} classes")
        k_loc, k_conf = lc // (4 * L), cc // C
        if mode == "plain":
            loc.append([nb + n, 0, lc, [lc], [0]])
            conf.append([n, 0, cc, [cc], [0]])
        else:   # ratio: [4][prior], [class][prior]
            loc.append([nb + n, 0, lc, [4, k_loc], [1, 0]])
            conf.append([n, 0, cc, [C, k_conf], [1, 0]])
        n_loc, n_conf = n_loc + k_loc, n_conf + k_conf
    if lv["per_level_priors"]:
        total = 0
        for n in range(nb):
            shape = in_shapes[2 * nb + n]
            _, _, ph, _ = _legacy(shape, f"prior bottom {2 * nb + n}")
            k = ph // 4
            if math.prod(shape[1:]) < 8 * k:
                raise LayerError(f"priors {list(shape)} (bottom {2 * nb + n}) do not hold boxes and variances "
                                 f"of {k} priors")
            if mode == "plain":
                pbox.append([2 * nb + n, 0, 4 * k, [4 * k], [0]])
                pvar.append([2 * nb + n, 4 * k, 8 * k, [4 * k], [0]])
            else:
                pbox.append([2 * nb + n, 0, 4 * k, [4, k], [1, 0]])
                pvar.append([2 * nb + n, 4 * k, 8 * k, [4, k], [1, 0]])
            total += k
        n_prior = total
    else:
        shape = in_shapes[2 * nb]
        _, _, ph, _ = _legacy(shape, f"prior bottom {2 * nb}")
        total = ph // 4
        if math.prod(shape[1:]) < 8 * total:
            raise LayerError(f"priors {list(shape)} (bottom {2 * nb}) are not (1, 2, 4 * num_priors)")
        if mode == "plain":
            pbox.append([2 * nb, 0, 4 * total, [4 * total], [0]])
            pvar.append([2 * nb, 4 * total, 8 * total, [4 * total], [0]])
            n_prior = total
        else:
            # boxes gathered [ratio][cell] from PriorBox's [cell][ratio]; variances unpermuted
            start = 0
            for n in range(nb):
                if mode == "cell":
                    ratio, hw = cells[n]
                    count = ratio * hw
                else:
                    count, ratio = loc_channels[n] // 4, lv["ratios"][n]
                    if ratio < 1 or count % ratio:
                        raise LayerError(f"ratio_permute level {n}: {count} priors are not a multiple of "
                                         f"ratio{n} {ratio}")
                    hw = count // ratio
                pbox.append([2 * nb, 4 * start, 4 * (start + count), [hw, ratio, 4], [1, 0, 2]])
                start += count
            if start > total:
                raise LayerError(f"the levels predict {start} priors, the priors bottom {list(shape)} holds "
                                 f"{total}")
            pvar.append([2 * nb, 4 * total, 4 * (total + start), [4 * start], [0]])
            n_prior = start
    if mode != "cell" and (total * L * 4 != sum_loc or total * C != sum_conf):
        raise LayerError(f"the priors ({total}) do not match the levels' loc channels ({sum_loc} = priors x "
                         f"{L} x 4) and conf channels ({sum_conf} = priors x {C})")
    if not n_loc == n_conf == n_prior:
        raise LayerError(f"the levels hold {n_loc} boxes, {n_conf} score sets and {n_prior} priors")
    return [loc, conf, pbox, pvar], n_prior


def gather_levels(bottoms, pieces):
    """synopsys-caffe's per-level bottoms as SSD's loc (N, P * 4), conf (N, P * C) and priors (1, 2, 4P).
    Every image gets image 0's loc and conf, as the fork's CPU loops read them (no per-image offset)."""
    num = bottoms[0].shape[0]

    def part(b, start, stop, shape, perm):
        x = bottoms[b].reshape(bottoms[b].shape[0], -1)[:1, start:stop]
        return x.reshape([1] + list(shape)).permute([0] + [a + 1 for a in perm]).reshape(1, -1)

    loc, conf, pbox, pvar = (torch.cat([part(*pc) for pc in group], dim=1) for group in pieces)
    return loc.expand(num, -1), conf.expand(num, -1), torch.stack([pbox, pvar], dim=1)


def emit_gather_onnx(ctx, node, pieces):
    """ONNX: gather_levels as Flatten / Slice / Reshape / Transpose / Concat / Expand; the names of
    loc, conf and the priors."""
    flat = {}
    out = []
    for g, group in enumerate(pieces):
        parts = []
        for b, start, stop, shape, perm in group:
            if b not in flat:
                flat[b] = ctx.op("Flatten", [node.inputs[b]], f"flat{b}", axis=1)
            x = ctx.op("Slice", [flat[b], ctx.i64([0, start]), ctx.i64([1, stop]), ctx.i64([0, 1])], f"g{g}_slice")
            x = ctx.op("Reshape", [x, ctx.i64([1] + list(shape))], f"g{g}_shape")
            if list(perm) != list(range(len(perm))):
                x = ctx.op("Transpose", [x], f"g{g}_perm", perm=[0] + [a + 1 for a in perm])
            parts.append(ctx.op("Reshape", [x, ctx.i64([1, -1])], f"g{g}_row"))
        out.append(parts[0] if len(parts) == 1 else ctx.op("Concat", parts, f"g{g}", axis=1))
    loc, conf, pbox, pvar = out
    n1 = ctx.op("Slice", [ctx.op("Shape", [node.inputs[0]], "in_shape"), ctx.i64([0]), ctx.i64([1])], "num")
    width = lambda group: sum(math.prod(pc[3]) for pc in group)
    loc = ctx.op("Expand", [loc, ctx.op("Concat", [n1, ctx.i64([width(pieces[0])])], "loc_shape", axis=0)], "loc")
    conf = ctx.op("Expand", [conf, ctx.op("Concat", [n1, ctx.i64([width(pieces[1])])], "conf_shape", axis=0)], "conf")
    prior = ctx.op("Reshape", [ctx.op("Concat", [pbox, pvar], "prior_cat", axis=1), ctx.i64([1, 2, -1])], "prior")
    return loc, conf, prior
