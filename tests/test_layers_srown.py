"""LeYangNwpu/SROWN 47f59d5: its 4-bottom LinearSum (caffe-master/src/caffe/layers/linear_sum_layer.cpp
Forward_cpu, LayerSetUp's CHECKs) against the fork's per-sample gemv loop in numpy float32, and its two-top
TripletImageData (triplet_image_data_layer.cpp) in the real net that uses both."""
from pathlib import Path

import numpy as np
import pytest
from conftest import check_everywhere, model_py_outputs, net, node_of, onnx_session, rng

import caffeq
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32
REALWORLD = Path(__file__).parent / "fixtures" / "realworld"
TRI_TVS = REALWORLD / "LeYangNwpu__SROWN__network_semantic_ranking__tri_TVS_train_val.prototxt"


def linear_sum_ref(x, fore, back, flag):
    """Forward_cpu: per sample i, flag_value = static_cast<int>(flag[i]); the background map (bottom 2) where
    flag_value == 1 and (i + 1) % 3 == 0, else the foreground map; Y_i = X_i (C x K) * W_i (K), float sums."""
    n, c = x.shape[:2]
    rows = x.reshape(n, c, -1)
    fores, backs = fore.reshape(n, -1), back.reshape(n, -1)
    out = np.zeros((n, c, 1, 1), F)
    for i in range(n):
        flag_value = int(flag.reshape(-1)[i])          # C++'s truncation toward zero
        w = backs[i] if flag_value == 1 and (i + 1) % 3 == 0 else fores[i]
        for ch in range(c):
            acc = F(0)
            for k in range(rows.shape[2]):
                acc = F(acc + rows[i, ch, k] * w[k])
            out[i, ch, 0, 0] = acc
    return out


def linear_sum_net(x_shape, fore_shape=None, back_shape=None, flag_shape=None, extra=""):
    one = (1,) * (len(x_shape) - 1)
    shapes = {"x": x_shape, "fore": fore_shape or x_shape[:1] + (1,) + x_shape[2:],
              "back": back_shape or x_shape[:1] + (1,) + x_shape[2:], "flag": flag_shape or x_shape[:1] + one}
    return net('layer { name: "ls" type: "LinearSum" bottom: "x" bottom: "fore" bottom: "back" bottom: "flag" '
               f'{extra}top: "o" }}', inputs=shapes), shapes


def feeds_for(shapes, flags):
    r = rng(7)
    feeds = {k: r.standard_normal(s).astype(F) for k, s in shapes.items() if k != "flag"}
    feeds["flag"] = np.asarray(flags, F).reshape(shapes["flag"])
    return feeds


# flags at samples 0..6: the thirds are samples 2 and 5; 1.7 truncates to 1, 0.999 and -0.5 to 0, 2 stays 2
FLAGS = [1.0, 0.0, 1.7, 1.0, 2.0, 1.0, 1.0]


@pytest.mark.parametrize("x_shape", [(7, 3, 4, 5), (7, 5, 6), (7, 4)])
def test_linear_sum_is_the_forks_per_sample_gemv(x_shape, tmp_path):
    text, shapes = linear_sum_net(x_shape)
    model = load_from_text(text)
    assert model.blob_shapes["o"] == (7, x_shape[1], 1, 1)
    assert node_of(model, "ls").expected_param_shapes is None
    feeds = feeds_for(shapes, FLAGS)
    want = linear_sum_ref(feeds["x"], feeds["fore"], feeds["back"], feeds["flag"])
    check_everywhere(model, feeds, {"o": want}, tmp_path, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("flags, backs", [
    ([0.999, -0.5, 2.0, 1.0, 1.0, 1.999, 5.0], [5]),        # truncation: 1.999 -> 1, 0.999 -> 0
    ([1.0] * 7, [2, 5]),                                      # every third sample, counted over the whole batch
    ([0.0] * 7, []),
])
def test_linear_sum_picks_the_background_map_where_the_fork_does(flags, backs, tmp_path):
    text, shapes = linear_sum_net((7, 3, 4, 5))
    feeds = feeds_for(shapes, flags)
    out = load_from_text(text).run(feeds)["o"]
    x = feeds["x"].reshape(7, 3, -1)
    for i in range(7):
        w = (feeds["back"] if i in backs else feeds["fore"]).reshape(7, -1)[i]
        np.testing.assert_allclose(out[i, :, 0, 0], x[i] @ w, rtol=1e-5, atol=1e-6)
    check_everywhere(load_from_text(text), feeds, {"o": linear_sum_ref(feeds["x"], feeds["fore"], feeds["back"],
                                                                       feeds["flag"])}, tmp_path, atol=1e-6, rtol=1e-5)


def test_linear_sum_counts_positions_in_the_batch_it_is_run_with(tmp_path):
    """ONNX's dim 0 is symbolic and model.py takes any batch: a net declared with 4 samples run with 7 still
    takes the background map at samples 2 and 5 (the positions come from the run's batch)."""
    text, _ = linear_sum_net((4, 3, 4, 5))
    model = load_from_text(text)
    _, shapes = linear_sum_net((7, 3, 4, 5))
    feeds = feeds_for(shapes, [1.0] * 7)
    want = linear_sum_ref(feeds["x"], feeds["fore"], feeds["back"], feeds["flag"])
    sess = onnx_session(model, tmp_path / "m.onnx")
    got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {k: feeds[k] for k in model.inputs})))
    np.testing.assert_allclose(got["o"], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model_py_outputs(model, feeds, tmp_path)["o"], want, rtol=1e-5, atol=1e-6)


def test_linear_sum_reads_only_its_first_four_bottoms(tmp_path):
    """The header's MinBottomBlobs is 2 and nothing caps the count: a fifth bottom loads and is never read."""
    shapes = {"x": (6, 3, 2, 5), "fore": (6, 1, 2, 5), "back": (6, 1, 2, 5), "flag": (6, 1, 1, 1), "z": (2, 9)}
    model = load_from_text(net('layer { name: "ls" type: "LinearSum" bottom: "x" bottom: "fore" bottom: "back" '
                               'bottom: "flag" bottom: "z" top: "o" }', inputs=shapes))
    feeds = feeds_for(shapes, [1, 1, 1, 0, 1, 1])
    want = linear_sum_ref(feeds["x"], feeds["fore"], feeds["back"], feeds["flag"])
    check_everywhere(model, feeds, {"o": want}, tmp_path, atol=1e-6, rtol=1e-5)


def test_transfernets_two_bottom_linear_sum_is_unchanged():
    model = load_from_text(net('layer { name: "ls" type: "LinearSum" bottom: "x" bottom: "w" top: "o" }',
                               inputs={"x": (2, 3, 4, 5), "w": (2, 1, 4, 5)}))
    assert model.blob_shapes["o"] == (2, 3)


@pytest.mark.parametrize("shapes, msg", [
    ({"fore": (7, 2, 4, 5)}, r"foreground weights \(bottom 1\) \[7, 2, 4, 5\] must be x's shape"),
    ({"back": (7, 1, 5, 4)}, r"background weights \(bottom 2\) \[7, 1, 5, 4\] must be x's shape"),
    ({"fore": (7, 1, 20)}, r"foreground weights \(bottom 1\) \[7, 1, 20\]"),
    ({"flag": (7,)}, r"class flag \(bottom 3\) \[7\] must be one value per sample"),
    ({"flag": (6, 1, 1, 1)}, r"class flag \(bottom 3\) \[6, 1, 1, 1\]"),
    ({"flag": (7, 2, 1, 1)}, r"class flag \(bottom 3\) \[7, 2, 1, 1\]"),
])
def test_linear_sum_refuses_what_setup_checks(shapes, msg):
    text, _ = linear_sum_net((7, 3, 4, 5), shapes.get("fore"), shapes.get("back"), shapes.get("flag"))
    with pytest.raises(LayerError, match=r"layer 'ls' \(LinearSum\).*" + msg):
        load_from_text(text)


def test_linear_sum_with_three_bottoms_names_the_four_it_reads():
    text = net('layer { name: "ls" type: "LinearSum" bottom: "x" bottom: "fore" bottom: "back" top: "o" }',
               inputs={"x": (2, 3, 4, 5), "fore": (2, 1, 4, 5), "back": (2, 1, 4, 5)})
    with pytest.raises(LayerError, match=r"LinearSum \(SROWN's\) takes at least 4 bottoms \(x, foreground weights, "
                                         r"background weights, class flag\)"):
        load_from_text(text)


# ---- the real net ------------------------------------------------------------------------------------------

def test_tri_tvs_reads_with_its_image_size():
    """The attention Reshapes fix 224 x 224 images (56 x 56 = 3136 at conv5_3); batch_size 4 triplets -> 12."""
    model = caffeq.load(TRI_TVS, input_shapes={"img": (12, 3, 224, 224), "mask": (12, 1, 224, 224)},
                        unknown_shapes_ok=True)
    shapes = model.blob_shapes
    assert shapes["labelMask"] == (12, 1, 1, 1)      # the fork's label top, one value per image
    for level, channels in ((5, 512), (4, 512), (3, 256), (2, 128), (1, 64)):
        assert shapes[f"softAtt_{level}"] == (12, channels, 1, 1)
        assert node_of(model, f"softAtt_{level}").type == "LinearSum"
    assert shapes["attForeMap_1"] == (12, 1, 224, 224) and shapes["attBackMap_2"] == (12, 1, 112, 112)


def test_tri_tvs_lists_without_shapes():
    model = caffeq.load(TRI_TVS, unknown_shapes_ok=True)
    assert [n.name for n in model.layers if n.type == "LinearSum"] == [f"softAtt_{i}" for i in (5, 4, 3, 2, 1)]
