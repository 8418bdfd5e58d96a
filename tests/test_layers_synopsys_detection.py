"""synopsys-caffe's DetectionOutput with per-level bottoms (`nbottom`, `no_permute`,
`ratio_permute`; foss-for-synopsys-dwc-arc-processors/synopsys-caffe 977ba36a).

The reference is the fork's Forward_cpu loops (detection_output_layer.cpp), written here in numpy:
they give the loc predictions, scores, prior boxes and variances in the fork's order, which are
then fed, flattened as SSD lays them out, to a plain DetectionOutput.  The per-level net must give
the same rows as that plain net, in torch, onnxruntime and model.py.
"""
import numpy as np
import pytest
from conftest import backend_outputs, inputs_text, rng

from caffeq.layers import LayerError
from caffeq.layers.ssd.detection_levels import gather_levels
from caffeq.model import load_from_text

C = 3   # classes
PARAMS = ("num_classes: 3 background_label_id: 0 code_type: CENTER_SIZE "
          "nms_param { nms_threshold: 0.45 top_k: 20 } keep_top_k: 12 confidence_threshold: 0.2")


def legacy(shape):
    """Caffe's channels, height, width (1 past the last axis)."""
    s = list(shape) + [1] * (4 - len(shape))
    return s[1], s[2], s[3]


def fork_loops(mode, confs, locs, priors, num_loc=1, ratios=(3, 6, 6, 6, 6, 6)):
    """The fork's loops: (loc preds (N, P, num_loc, 4), scores (N, P, C), prior boxes (P, 4),
    variances (P, 4)).  Every image reads its blobs from the start (cpu_data(), no offset)."""
    num, nb = confs[0].shape[0], len(confs)
    L = num_loc
    loc_preds = [[[] for _ in range(L)] for _ in range(num)]
    scores = [[[] for _ in range(C)] for _ in range(num)]
    for i in range(num):
        for n in range(nb):
            d = locs[n].reshape(-1)
            ch, h, w = legacy(locs[n].shape)
            if mode == "plain":
                for p in range(ch // L // 4):
                    for c in range(L):
                        s = p * L * 4 + c * 4
                        loc_preds[i][c].append([d[s + k] for k in range(4)])
            elif mode == "ratio":
                count = ch // L // 4
                for p in range(count):
                    for c in range(L):
                        loc_preds[i][c].append([d[p * L + c * count + k * count] for k in range(4)])
            else:
                count = h * w
                for r in range(ch // 4 // L):
                    for p in range(count):
                        for c in range(L):
                            s = r * L * 4 * count + c * 4 * count + p
                            loc_preds[i][c].append([d[s + k * count] for k in range(4)])
            d = confs[n].reshape(-1)
            ch, h, w = legacy(confs[n].shape)
            if mode == "plain":
                for p in range(ch // C):
                    for c in range(C):
                        scores[i][c].append(d[p * C + c])
            elif mode == "ratio":
                count = ch // C
                for p in range(count):
                    for c in range(C):
                        scores[i][c].append(d[p + c * count])
            else:
                for c in range(C):
                    for r in range(h):
                        for p in range(w):
                            scores[i][c].append(d[c * h * w + r * w + p])
    boxes, variances = [], []
    if len(priors) == 1:   # one concatenated prior blob
        pd = priors[0].reshape(-1)
        total = legacy(priors[0].shape)[1] // 4
        if mode == "plain":
            for i in range(total):
                boxes.append(pd[i * 4:i * 4 + 4])
                variances.append(pd[(total + i) * 4:(total + i) * 4 + 4])
        else:
            start = 0
            for n in range(nb):
                ch, h, w = legacy(locs[n].shape)
                if mode == "ratio":
                    count, ratio = ch // 4, ratios[n]
                else:
                    count, ratio = ch // 4 * h * w, ch // 4 // L
                xy = count // ratio
                for i in range(start, start + count):
                    pi = (i - start) % xy * ratio + (i - start) // xy
                    boxes.append(pd[(pi + start) * 4:(pi + start) * 4 + 4])
                for i in range(start, start + count):
                    variances.append(pd[(total + i) * 4:(total + i) * 4 + 4])
                start += count
    else:
        for blob in priors:
            pd = blob.reshape(-1)
            count = legacy(blob.shape)[1] // 4
            for i in range(count):
                if mode == "plain":
                    boxes.append(pd[i * 4:i * 4 + 4])
                    variances.append(pd[(count + i) * 4:(count + i) * 4 + 4])
                else:
                    boxes.append([pd[i + j * count] for j in range(4)])
                    variances.append([pd[count * 4 + i + j * count] for j in range(4)])
    loc = np.array(loc_preds, np.float32).transpose(0, 2, 1, 3)        # (N, P, L, 4)
    conf = np.array(scores, np.float32).transpose(0, 2, 1)             # (N, P, C)
    return loc, conf, np.array(boxes, np.float32), np.array(variances, np.float32)


def random_priors(r, count):
    """Prior boxes with positive sizes, and a different variance per prior (so that reading a
    variance at the wrong index shows)."""
    cx, cy = r.uniform(0.1, 0.9, count), r.uniform(0.1, 0.9, count)
    w, h = r.uniform(0.1, 0.4, count), r.uniform(0.1, 0.4, count)
    box = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], 1)
    var = r.uniform(0.05, 0.3, (count, 4))
    return box.astype(np.float32), var.astype(np.float32)


def scores(r, shape, axis):
    e = np.exp(r.normal(0, 2, shape))
    return (e / e.sum(axis=axis, keepdims=True)).astype(np.float32)


# levels: (ratios, H, W), asymmetric on purpose
LEVELS = [(2, 3, 5), (3, 2, 2), (1, 1, 3)]


def level_blobs(mode, per_level_priors=False, num=2, seed=0, num_loc=1):
    """{name: array} of the per-level bottoms, and the bottom names in the fork's order."""
    r = rng(seed)
    feeds, conf_names, loc_names, prior_names = {}, [], [], []
    prior_parts = []
    for n, (ratio, h, w) in enumerate(LEVELS):
        count = ratio * h * w
        if mode == "cell":
            conf = scores(r, (num, C, ratio, h * w), 1)
            loc = r.normal(0, 1, (num, ratio * 4, h, w)).astype(np.float32)
        else:   # flattened levels: (N, count * C), (N, count * 4)
            conf = scores(r, (num, count, C), 2).reshape(num, -1)
            loc = r.normal(0, 1, (num, count * num_loc * 4)).astype(np.float32)
        feeds[f"conf{n}"], feeds[f"loc{n}"] = conf, loc
        conf_names.append(f"conf{n}")
        loc_names.append(f"loc{n}")
        box, var = random_priors(r, count)
        if per_level_priors:
            if mode == "ratio":   # [4][prior] boxes, then [4][prior] variances
                blob = np.concatenate([box.T.reshape(-1), var.T.reshape(-1)])
            else:
                blob = np.concatenate([box.reshape(-1), var.reshape(-1)])
            feeds[f"prior{n}"] = blob.reshape(1, 2, -1)
            prior_names.append(f"prior{n}")
        else:
            prior_parts.append((box, var))
    if not per_level_priors:
        box = np.concatenate([b for b, _ in prior_parts])
        var = np.concatenate([v for _, v in prior_parts])
        feeds["prior"] = np.stack([box.reshape(-1), var.reshape(-1)]).reshape(1, 2, -1)
        prior_names = ["prior"]
    return feeds, conf_names + loc_names + prior_names


FLAGS = {"plain": "", "ratio": "ratio_permute: true ratio0: 2 ratio1: 3 ratio2: 1",
         "cell": "no_permute: true"}


def level_model(mode, feeds, bottoms, extra=""):
    text = inputs_text(**{k: v.shape for k, v in feeds.items()})
    text += ('layer { name: "det" type: "DetectionOutput" ' + " ".join(f'bottom: "{b}"' for b in bottoms)
             + f' top: "o" detection_output_param {{ {PARAMS} nbottom: 3 {FLAGS[mode]} {extra} }} }}')
    return load_from_text(text)


def plain_model(loc, conf, prior, extra=""):
    text = inputs_text(loc=loc.shape, conf=conf.shape, prior=prior.shape)
    text += ('layer { name: "det" type: "DetectionOutput" bottom: "loc" bottom: "conf" bottom: "prior" '
             f'top: "o" detection_output_param {{ {PARAMS} {extra} }} }}')
    return load_from_text(text)


def reference_bottoms(mode, feeds, bottoms, num_loc=1):
    nb = 3
    confs = [feeds[b] for b in bottoms[:nb]]
    locs = [feeds[b] for b in bottoms[nb:2 * nb]]
    priors = [feeds[b] for b in bottoms[2 * nb:]]
    loc, conf, box, var = fork_loops(mode, confs, locs, priors, num_loc, ratios=(2, 3, 1))
    num = loc.shape[0]
    prior = np.stack([box.reshape(-1), var.reshape(-1)]).reshape(1, 2, -1)
    return loc.reshape(num, -1), conf.reshape(num, -1), prior


CASES = [("cell", False), ("ratio", False), ("ratio", True), ("plain", False), ("plain", True)]


@pytest.mark.parametrize("mode,per_level", CASES)
def test_gather_matches_the_fork_loops(mode, per_level):
    import torch
    feeds, bottoms = level_blobs(mode, per_level)
    model = level_model(mode, feeds, bottoms)
    pieces = next(n for n in model.layers if n.name == "det").attrs["pieces"]
    got = gather_levels(tuple(torch.from_numpy(feeds[b]) for b in bottoms), pieces)
    for g, w in zip(got, reference_bottoms(mode, feeds, bottoms)):
        np.testing.assert_array_equal(g.numpy(), w)


@pytest.mark.parametrize("mode,per_level", CASES)
def test_rows_match_the_plain_layer_everywhere(mode, per_level, tmp_path):
    feeds, bottoms = level_blobs(mode, per_level)
    model = level_model(mode, feeds, bottoms)
    loc, conf, prior = reference_bottoms(mode, feeds, bottoms)
    plain = plain_model(loc, conf, prior)
    want = backend_outputs(plain, {"loc": loc, "conf": conf, "prior": prior}, tmp_path / "plain")
    got = backend_outputs(model, feeds, tmp_path / "levels")
    assert model.blob_shapes["o"] == (1, 1, 24, 7)
    for backend in got:
        np.testing.assert_array_equal(got[backend], want[backend], err_msg=backend)
    rows = got["torch"][0, 0]
    assert len(rows) > 2 and set(rows[:, 0]) == {0.0, 1.0}
    # image 1 is decoded from image 0's blobs, as the fork's loops read them
    first, second = rows[rows[:, 0] == 0], rows[rows[:, 0] == 1]
    np.testing.assert_array_equal(first[:, 1:], second[:, 1:])


@pytest.mark.parametrize("per_level", [False, True])
def test_plain_levels_with_a_box_per_class(per_level, tmp_path):
    """Plain per-level bottoms with share_location: false: [prior][class][4] per level."""
    feeds, bottoms = level_blobs("plain", per_level, num_loc=C, seed=4)
    model = level_model("plain", feeds, bottoms, "share_location: false")
    loc, conf, prior = reference_bottoms("plain", feeds, bottoms, num_loc=C)
    plain = plain_model(loc, conf, prior, "share_location: false")
    want = backend_outputs(plain, {"loc": loc, "conf": conf, "prior": prior}, tmp_path / "plain")
    got = backend_outputs(model, feeds, tmp_path / "levels")
    for backend in got:
        np.testing.assert_array_equal(got[backend], want[backend], err_msg=backend)
    assert len(got["torch"][0, 0]) > 2


def test_no_permute_variances_stay_unpermuted():
    """The boxes of the concatenated priors are gathered [ratio][cell], the variances are not."""
    import torch
    feeds, bottoms = level_blobs("cell")
    model = level_model("cell", feeds, bottoms)
    pieces = next(n for n in model.layers if n.name == "det").attrs["pieces"]
    _, _, prior = gather_levels(tuple(torch.from_numpy(feeds[b]) for b in bottoms), pieces)
    np.testing.assert_array_equal(prior[0, 1].numpy(), feeds["prior"][0, 1])
    assert not np.array_equal(prior[0, 0].numpy(), feeds["prior"][0, 0])


def test_no_permute_reads_the_first_of_more_priors():
    """no_permute: a prior blob holding more priors than the levels predict is read from its start."""
    feeds, bottoms = level_blobs("cell", num=1)
    p = feeds["prior"].reshape(2, -1, 4)
    extra = np.tile(np.array([[0.1, 0.1, 0.5, 0.5]], np.float32), (5, 1))
    feeds["prior"] = np.stack([np.concatenate([p[0], extra]), np.concatenate([p[1], extra])]).reshape(1, 2, -1)
    model = level_model("cell", feeds, bottoms)
    out = model.run(feeds)["o"]
    assert out.shape[2] > 0


def refusal(mode, feeds, bottoms, extra=""):
    with pytest.raises(LayerError) as err:
        level_model(mode, feeds, bottoms, extra)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_bad_parameters_give_one_line():
    feeds, bottoms = level_blobs("cell")
    assert "share_location" in refusal("cell", feeds, bottoms, "share_location: false")
    assert "both set" in refusal("cell", feeds, bottoms, "ratio_permute: true")
    assert "tflite_detection" in refusal("cell", feeds, bottoms, "tflite_detection: true")
    assert "arm_conf_no_concat" in refusal("cell", feeds, bottoms, "arm_conf_no_concat: true")
    assert "concatenated loc" in refusal("cell", feeds, bottoms[:5])
    feeds_p, bottoms_p = level_blobs("ratio", True)
    assert "per-level priors" in refusal("cell", feeds_p, bottoms_p)


def test_bad_shapes_give_one_line():
    feeds, bottoms = level_blobs("cell")
    feeds["conf1"] = feeds["conf1"][:, :, :2]
    assert "no_permute level 1" in refusal("cell", feeds, bottoms)
    feeds, bottoms = level_blobs("cell")
    feeds["prior"] = feeds["prior"][:, :, :-8]
    assert "priors" in refusal("cell", feeds, bottoms)
    feeds, bottoms = level_blobs("ratio")
    feeds["loc0"] = feeds["loc0"][:, :-4]   # 29 priors at level 0, not a multiple of ratio0 2
    feeds["conf0"] = feeds["conf0"][:, :-C]
    assert "ratio0" in refusal("ratio", feeds, bottoms)
    feeds, bottoms = level_blobs("plain")
    feeds["loc0"] = feeds["loc0"][:, :-4]
    assert "do not match" in refusal("plain", feeds, bottoms)


def test_fewer_bottoms_than_nbottom_stay_ssd():
    """Below nbottom bottoms the fork concatenates (SSD's reading), the flags unread."""
    r = rng(3)
    box, var = random_priors(r, 6)
    prior = np.stack([box.reshape(-1), var.reshape(-1)]).reshape(1, 2, -1)
    text = inputs_text(loc=(1, 24), conf=(1, 18), prior=prior.shape)
    text += ('layer { name: "det" type: "DetectionOutput" bottom: "loc" bottom: "conf" bottom: "prior" '
             f'top: "o" detection_output_param {{ {PARAMS} no_permute: true }} }}')
    model = load_from_text(text)
    assert "levels" not in next(n for n in model.layers if n.name == "det").attrs
