"""opencv/training_toolbox_caffe (789ff8dd): GRN with grn_param (caffeq/layers/grn.py), ScaleFilter and
AnchorEmbeddingExtractor (caffeq/layers/training_toolbox.py) against numpy loops written here from
grn_layer.cpp, scale_filter_layer.cpp and anchor_embedding_extractor_layer.cpp."""
import numpy as np
import pytest
import torch
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError, get_spec
from caffeq.model import load_from_text

F = np.float32


# ---- GRN (grn_layer.cpp Forward_cpu) -----------------------------------------------------------

def grn_ref(x, bias):
    """At each (n, h, w): the sum over channels of x^2, plus bias, square-rooted, divides every channel."""
    shape = x.shape
    x4 = x.reshape(shape[0], shape[1], -1).astype(np.float64)
    out = np.empty_like(x4)
    for n in range(x4.shape[0]):
        for s in range(x4.shape[2]):
            norm = np.sqrt((x4[n, :, s] ** 2).sum() + bias)
            out[n, :, s] = x4[n, :, s] / norm
    return out.reshape(shape).astype(F)


def grn_layer(bias):
    return f'layer {{ name: "g" type: "GRN" bottom: "x" top: "o" grn_param {{ bias: {bias} }} }}'


@pytest.mark.parametrize("shape", [(2, 5, 3, 7), (2, 6)])
def test_grn_param_normalizes_each_position_with_the_bias_under_the_root(shape, tmp_path):
    bias = 0.75   # large enough that adding it before the root (not after) shows
    model = load_from_text(net(grn_layer(bias), inputs={"x": shape}))
    x = rng(3).standard_normal(shape).astype(F)
    x[1, :, ...] *= 0.1    # small norms in the second item, where the bias weighs most
    want = grn_ref(x, bias)
    after_root = x / (np.sqrt((x.astype(np.float64) ** 2).sum(1, keepdims=True)) + bias)
    assert np.abs(want - after_root).max() > 1e-2
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path, atol=1e-6, rtol=1e-5)


def test_grn_param_default_bias_is_the_forks(tmp_path):
    model = load_from_text(net('layer { name: "g" type: "GRN" bottom: "x" top: "o" grn_param { } }',
                               inputs={"x": (2, 4, 5, 3)}))
    x = rng(4).standard_normal((2, 4, 5, 3)).astype(F)
    x[0, :, 1, 2] = 0    # an all-zero position: 0 / sqrt(1e-7), not NaN
    want = grn_ref(x, float(np.float32(1e-7)))
    assert np.all(want[0, :, 1, 2] == 0)
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path, atol=1e-6, rtol=1e-5)


def test_grn_negative_bias_is_refused():
    with pytest.raises(LayerError, match="grn_param.bias must be >= 0"):
        load_from_text(net(grn_layer(-0.5), inputs={"x": (2, 3, 4, 5)}))


# ---- ScaleFilter (scale_filter_layer.cpp) --------------------------------------------------------

SCALE_FILTER = ('layer { name: "s" type: "ScaleFilter" bottom: "x" top: "o" '
                'scale_filter_param { min_scale: 0.9 max_scale: 1.1 } }')


def test_scale_filter_copies_at_test(tmp_path):
    model = load_from_text(net(SCALE_FILTER, inputs={"x": (2, 3, 5, 7)}))
    x = rng(5).standard_normal((2, 3, 5, 7)).astype(F)
    check_everywhere(model, {"x": x}, {"o": x}, tmp_path)


def test_scale_filter_scales_each_map_in_training():
    spec = get_spec("ScaleFilter")
    attrs = {"min_scale": 0.9, "max_scale": 1.1}
    x = torch.from_numpy(rng(6).uniform(1, 2, (2, 3, 5, 7)).astype(F))
    torch.manual_seed(0)
    y = spec.forward(attrs, [], x, training=True)
    ratio = (y / x).numpy()
    per_map = ratio.reshape(2, 3, -1)
    # one scale per (n, c), shared by the whole map, drawn from [min_scale, max_scale]
    np.testing.assert_allclose(per_map, per_map[:, :, :1].repeat(35, axis=2), rtol=1e-6)
    assert per_map.min() >= 0.9 - 1e-6 and per_map.max() <= 1.1 + 1e-6
    assert len(np.unique(per_map[:, :, 0].round(6))) > 1


def test_scale_filter_needs_a_4_axis_bottom():
    with pytest.raises(LayerError, match="4-axis bottom"):
        load_from_text(net(SCALE_FILTER, inputs={"x": (2, 3, 5)}))


# ---- AnchorEmbeddingExtractor (anchor_embedding_extractor_layer.cpp) ------------------------------

E, H, W, N = 6, 3, 5, 2


def extractor(tops=("emb", "lab"), extra="num_valid_actions: 3", label_src_pos=8, num_anchors=4):
    bottoms = " ".join(f'bottom: "{b}"' for b in ["det", "a0", "a1", "a2", "a3"])
    top_text = " ".join(f'top: "{t}"' for t in tops)
    return (f'layer {{ name: "ex" type: "AnchorEmbeddingExtractor" {bottoms} {top_text} embedding_extractor_param '
            f'{{ num_anchors: {num_anchors} label_src_pos: {label_src_pos} {extra} }} }}')


def records():
    """Matched detections (item, label, x_min, y_min, x_max, y_max, anchor, track, action, x, y), some
    fractional (C++'s int casts truncate them), some dropped (item < 0, action >= num_valid_actions)."""
    rows = [
        [1, 1, .10, .20, .30, .40, 2, 7, 0, 4, 2],
        [0, 1, .15, .25, .35, .45, 0, 7, 2.9, 1.8, 0.5],   # action 2 (kept), x 1, y 0
        [-1, 1, 0, 0, 1, 1, 1, 3, 0, 0, 0],                 # item < 0: dropped
        [0, 1, .5, .5, .6, .6, 3, 7, 1, 3, 1],              # same (track 7, item 0) as row 1
        [1.7, 1, .2, .1, .4, .3, 1, 9, 3, 0, 0],            # action 3 >= 3: dropped
        [-0.5, 1, .2, .2, .3, .3, 3.6, 2, 1.2, 2.4, 2.9],   # int(-0.5) is 0: kept; anchor 3, x 2, y 2
    ]
    return np.array(rows, F).reshape(1, 1, len(rows), 11)


def extractor_ref(det, maps, num_valid=3, label_src_pos=8):
    recs = det.reshape(-1, 11)
    kept = [r for r in recs if int(r[0]) >= 0 and (num_valid < 0 or int(r[8]) < num_valid)]
    if not kept:
        return np.zeros((1, E), F), np.full(1, -1, F), np.full(1, -1, F), np.full((1, 5), -1, F)
    emb = np.stack([maps[int(r[6])][int(r[0]), :, int(r[10]), int(r[9])] for r in kept])
    labels = np.array([int(r[label_src_pos]) for r in kept], F)
    ids = [int(r[7]) * 1000 + int(r[0]) for r in kept]
    weights = np.array([1.0 / ids.count(i) for i in ids], F)
    proposals = np.array([[int(r[0]), r[2], r[3], r[4], r[5]] for r in kept], F)
    return emb, labels, weights, proposals


def extractor_inputs(det):
    maps = [rng(10 + i).standard_normal((N, E, H, W)).astype(F) for i in range(4)]
    feeds = {"det": det, **{f"a{i}": m for i, m in enumerate(maps)}}
    return feeds, maps


def extractor_model(det_rows, layer):
    shapes = {"det": (1, 1, det_rows, 11), **{f"a{i}": (N, E, H, W) for i in range(4)}}
    return load_from_text(net(layer, inputs=shapes))


@pytest.mark.parametrize("mode", ["weights", "proposals"])
def test_anchor_embedding_extractor_gathers_the_kept_records(mode):
    det = records()
    field = "output_instance_weights" if mode == "weights" else "output_proposals"
    model = extractor_model(det.shape[2], extractor(("emb", "lab", "third"), f"num_valid_actions: 3 {field}: true"))
    feeds, maps = extractor_inputs(det)
    got = model.run(feeds, exact=True)
    emb, labels, weights, proposals = extractor_ref(det, maps)
    assert emb.shape == (4, E)
    np.testing.assert_array_equal(got["emb"], emb)
    np.testing.assert_array_equal(got["lab"], labels)
    np.testing.assert_array_equal(got["third"], weights if mode == "weights" else proposals)
    assert mode != "weights" or sorted(weights.tolist()) == [0.5, 0.5, 1.0, 1.0]


def test_anchor_embedding_extractor_label_position_and_all_actions():
    det = records()
    model = extractor_model(det.shape[2], extractor(extra="", label_src_pos=7))
    feeds, maps = extractor_inputs(det)
    got = model.run(feeds, exact=True)
    emb, labels, _, _ = extractor_ref(det, maps, num_valid=-1, label_src_pos=7)
    assert emb.shape == (5, E)
    np.testing.assert_array_equal(got["emb"], emb)
    np.testing.assert_array_equal(got["lab"], labels)


def test_anchor_embedding_extractor_with_nothing_kept():
    det = records()
    det[0, 0, :, 0] = -1
    model = extractor_model(det.shape[2], extractor(("emb", "lab", "w"), "output_instance_weights: true"))
    feeds, maps = extractor_inputs(det)
    got = model.run(feeds, exact=True)
    np.testing.assert_array_equal(got["emb"], np.zeros((1, E), F))
    np.testing.assert_array_equal(got["lab"], np.full(1, -1, F))
    np.testing.assert_array_equal(got["w"], np.full(1, -1, F))


def test_anchor_embedding_extractor_bad_parameters():
    with pytest.raises(LayerError, match="num_anchors 4 only"):
        extractor_model(6, extractor(num_anchors=3))
    with pytest.raises(LayerError, match="label_src_pos must be in"):
        extractor_model(6, extractor(label_src_pos=11))
