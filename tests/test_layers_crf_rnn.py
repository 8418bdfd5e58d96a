"""CRF-RNN's MultiStageMeanfield (caffeq/layers/crf_rnn.py) and its permutohedral lattice
(caffeq/layers/permutohedral.py), against a reference written here from the fork's C++ (torrvision/crfasrnn
caffe-crfrnn: modified_permutohedral.cpp's SSE path, meanfield_iteration.cpp, multi_stage_meanfield.cpp):
float32 loops point by point, a dict in insertion order for the fork's hash table.  ARL's
MultiStageMeanfieldAU3 runs the same inference over its feature channels.
"""
import numpy as np
import pytest
import torch
from conftest import check_everywhere, net, node_of, onnx_outputs, rng
from permutohedral_reference import F32, fork_filter, fork_lattice

from caffeq.errors import CaffeqError, ExportError
from caffeq.layers import LayerError
from caffeq.layers.permutohedral import permutohedral_filter, permutohedral_lattice
from caffeq.model import load_from_text


def fork_meanfield(first, second, guide, blobs, iterations, theta_alpha, theta_beta, theta_gamma, continuous=False):
    """MultiStageMeanfieldLayer::Forward_cpu with MeanfieldIteration::Forward_cpu, image by image; with
    continuous, ContinuousCRF-CNN's MultiContinuousMeanfieldLayer with ContinuousMeanfieldIteration
    (first: the hidden variables, second: the observations)."""
    n, c, h, w = first.shape
    p = np.arange(h * w)
    xy = np.stack([p % w, p // w], 1).astype(F32)
    ones = np.ones((1, h * w), F32)
    spatial = fork_lattice(xy / F32(theta_gamma))
    spatial_norm = F32(1) / (fork_filter(spatial, ones)[0] + F32(1e-20))
    ws, wb = (b.reshape(c, c) for b in blobs[:2])
    tops = []
    for b in range(n):
        feats = np.concatenate([xy / F32(theta_alpha), guide[b].reshape(guide.shape[1], -1).T / F32(theta_beta)], 1)
        bilateral = fork_lattice(feats.astype(F32))
        bilateral_norm = F32(1) / (fork_filter(bilateral, ones)[0] + F32(1e-20))

        def message(x):
            return ws @ (spatial_norm * fork_filter(spatial, x)) + wb @ (bilateral_norm * fork_filter(bilateral, x))

        start, given = first[b].reshape(c, -1), second[b].reshape(c, -1)
        if continuous:
            norm_out = F32(1) / (message(np.ones((c, h * w), F32)) + F32(1))   # PowerLayer(power -1) of 1 + M(1)
            z = start
            for _ in range(iterations):
                z = (given + message(z)) * norm_out      # Eltwise SUM, then PROD
        else:
            z = given
            for _ in range(iterations):
                e = np.exp(z - z.max(0))
                z = start - blobs[2].reshape(c, c) @ message(e / e.sum(0))
        tops.append(z.reshape(c, h, w))
    return np.stack(tops)


def ours_filter(features, values):
    lattice = permutohedral_lattice(torch.from_numpy(features))
    return permutohedral_filter(torch.from_numpy(values), *lattice).numpy()


# ---- the lattice ---------------------------------------------------------------------------------

@pytest.mark.parametrize("d, channels", [(2, 1), (2, 3), (5, 1), (5, 2), (5, 4), (3, 3)])
def test_lattice_filter_matches_the_forks(d, channels):
    r = rng(d * 10 + channels)
    feats = (r.standard_normal((37, d)) * 2).astype(F32)   # 37: the SSE loop pads its last block
    feats[5] = 0                      # ties everywhere: the later coordinate ranks higher
    feats[9] = feats[3]               # two points on the same vertices
    feats[11, :2] = feats[12, :2]
    values = r.standard_normal((channels, 37)).astype(F32)
    ref = fork_filter(fork_lattice(feats), values)
    np.testing.assert_allclose(ours_filter(feats, values), ref, rtol=1e-6, atol=1e-6)


def test_lattice_keeps_the_padded_points_vertices():
    # 7 points near the origin: the SSE build hashes one padded point there; its vertices carry values in
    # the blur, so leaving them out changes the result
    feats = (rng(6).standard_normal((7, 2)) * 0.6 + 0.8).astype(F32)
    values = rng(1).standard_normal((3, 7)).astype(F32)
    padded = fork_filter(fork_lattice(feats), values)
    assert np.abs(padded - fork_filter(fork_lattice(feats, pad_to_blocks=False), values)).max() > 1e-3
    np.testing.assert_allclose(ours_filter(feats, values), padded, rtol=1e-6, atol=1e-6)


def test_lattice_wraps_keys_as_the_forks_shorts():
    # features far apart give keys past +-32767: the fork's short keys wrap (and the lookup stays exact)
    feats = (rng(2).standard_normal((21, 3)) * 4000).astype(F32)
    values = rng(3).standard_normal((3, 21)).astype(F32)
    np.testing.assert_allclose(ours_filter(feats, values), fork_filter(fork_lattice(feats), values),
                               rtol=1e-6, atol=1e-6)


# ---- MultiStageMeanfield ---------------------------------------------------------------------------

MEANFIELD = ('layer {{ name: "crf" type: "MultiStageMeanfield" bottom: "unary" bottom: "q0" bottom: "img" top: "o" '
             'multi_stage_meanfield_param {{ num_iterations: {it} theta_alpha: 160 theta_beta: 3 theta_gamma: 3 }} }}')


def image(r, shape):
    """A test image: integer colours (so pixels tie) with a flat patch."""
    img = r.integers(0, 40, shape).astype(F32)
    img[:, :, 1:3, 2:5] = 17
    return img


@pytest.mark.parametrize("classes, it", [(3, 5), (2, 3)])
def test_meanfield_matches_the_forks_iterations(classes, it, tmp_path):
    shapes = {"unary": (2, classes, 5, 7), "q0": (2, classes, 5, 7), "img": (2, 4, 5, 7)}
    model = load_from_text(net(MEANFIELD.format(it=it), inputs=shapes), random_weights=True)
    assert model.graph.tensors["o"].shape == (2, classes, 5, 7)
    r = rng(classes)
    crf = node_of(model, "crf")
    crf.blobs = [r.standard_normal((1, 1, classes, classes)).astype(F32) for _ in range(3)]
    feeds = {"unary": r.standard_normal(shapes["unary"]).astype(F32) * 2,
             "q0": r.standard_normal(shapes["unary"]).astype(F32), "img": image(r, shapes["img"])}
    # the fourth image channel is not read: only the first three are colours
    ref = fork_meanfield(feeds["unary"], feeds["q0"], feeds["img"][:, :3], crf.blobs, it, 160, 3, 3)
    check_everywhere(model, feeds, {"o": ref}, tmp_path, atol=1e-5, rtol=1e-5, opsets=(16, None))


def test_meanfield_onnx_sums_every_splat_of_a_larger_image(tmp_path):
    """On a 64 x 48 image with 21 classes (thousands of splats per vertex row), onnxruntime gives torch's
    numbers: the splat adds rows one by one (onnxruntime's ScatterND(add) loses sums in its threads)."""
    shapes = {"unary": (1, 21, 64, 48), "q0": (1, 21, 64, 48), "img": (1, 3, 64, 48)}
    model = load_from_text(net(MEANFIELD.format(it=2), inputs=shapes), random_weights=True)
    r = rng(7)
    unary = (r.standard_normal(shapes["unary"]) * 1e-3).astype(F32)   # near-uniform: the messages decide
    feeds = {"unary": unary, "q0": unary, "img": r.standard_normal(shapes["img"]).astype(F32)}
    ours = model.run(feeds)["o"]
    np.testing.assert_allclose(onnx_outputs(model, feeds, tmp_path)["o"], ours, rtol=1e-5, atol=1e-7)


def test_meanfield_onnx_needs_opset_16(tmp_path):
    shapes = {"unary": (1, 2, 3, 3), "q0": (1, 2, 3, 3), "img": (1, 3, 3, 3)}
    model = load_from_text(net(MEANFIELD.format(it=2), inputs=shapes), random_weights=True)
    with pytest.raises(ExportError, match="'crf' .MultiStageMeanfield.*reduction='add' .ONNX opset 16.*--opset 16"):
        model.export_onnx(str(tmp_path / "m.onnx"), opset=13)
    assert not (tmp_path / "m.onnx").exists()


def test_meanfield_refuses_an_image_without_three_channels():
    shapes = {"unary": (1, 2, 3, 3), "q0": (1, 2, 3, 3), "img": (1, 2, 3, 3)}
    model = load_from_text(net(MEANFIELD.format(it=2), inputs=shapes), random_weights=True)
    with pytest.raises(CaffeqError, match="'crf' .MultiStageMeanfield.*image's first 3 channels, and it has 2"):
        model.run({k: np.zeros(s, F32) for k, s in shapes.items()})


AU3 = ('layer {{ name: "crf" type: "MultiStageMeanfieldAU3" bottom: "u" bottom: "q" bottom: "f" top: "o" '
       "multi_stage_meanfield_au3_param {{ num_iterations: {it} theta_alpha: 160 theta_beta: 3 "
       "theta_gamma: 3 }} }}")


@pytest.mark.parametrize("features", [1, 2, 4])
def test_meanfield_au3_compares_every_feature_channel(features, tmp_path):
    """ARL's MultiStageMeanfieldAU3: the bilateral lattice has 2 + K dimensions, one per feature channel."""
    shapes = {"u": (2, 2, 5, 7), "q": (2, 2, 5, 7), "f": (2, features, 5, 7)}
    model = load_from_text(net(AU3.format(it=4), inputs=shapes), random_weights=True)
    assert [tuple(b.shape) for b in node_of(model, "crf").blobs] == [(1, 1, 2, 2)] * 3
    r = rng(features)
    feeds = {"u": r.standard_normal(shapes["u"]).astype(F32), "q": r.standard_normal(shapes["u"]).astype(F32),
             "f": image(r, shapes["f"])}
    ref = fork_meanfield(feeds["u"], feeds["q"], feeds["f"], node_of(model, "crf").blobs, 4, 160, 3, 3)
    check_everywhere(model, feeds, {"o": ref}, tmp_path, atol=1e-5, rtol=1e-5, opsets=(None,))


# ---- the forks' fields -------------------------------------------------------------------------

def test_crfasrnn_is_reshape_reads_as_the_same_layer():
    # zimenglan-sysu-512/crfasrnn's is_reshape (its field 11, danxuhk's spatial_weight here) only sets the
    # layer up again for a new input size: CRF-RNN's three (1, 1, C, C) blobs, not the continuous fork's two
    shapes = {"unary": (2, 5, 6, 7), "q0": (2, 5, 6, 7), "img": (2, 3, 6, 7)}
    text = MEANFIELD.format(it=5).replace("theta_gamma: 3", "theta_gamma: 3 is_reshape: true")
    model = load_from_text(net(text, inputs=shapes), random_weights=True)
    assert not node_of(model, "crf").attrs["continuous"]
    assert [tuple(b.shape) for b in node_of(model, "crf").blobs] == [(1, 1, 5, 5)] * 3


@pytest.mark.parametrize("classes", [1, 3])
def test_continuous_crf_matches_the_forks_iterations(classes, tmp_path):
    """danxuhk/ContinuousCRF-CNN's MultiStageMeanfield (its deploy files' name; MultiContinuousMeanfield in
    its code): spatial_weight / bilateral_weight (fields 11, 12) seed the diagonals of its two (1, 1, C, C)
    blobs, there is no compatibility matrix, and Z = (U + message(Z)) / (1 + message(1))."""
    shapes = {"unary": (2, classes, 6, 7), "q0": (2, classes, 6, 7), "img": (2, 3, 6, 7)}
    text = MEANFIELD.format(it=4).replace("theta_gamma: 3", "theta_gamma: 3 spatial_weight: 4 bilateral_weight: 4.2")
    model = load_from_text(net(text, inputs=shapes), random_weights=True)
    crf = node_of(model, "crf")
    assert crf.attrs["continuous"]
    np.testing.assert_array_equal(np.asarray(crf.blobs[0]), 4 * np.eye(classes, dtype=F32).reshape(1, 1, classes, classes))
    np.testing.assert_array_equal(np.asarray(crf.blobs[1]), F32(4.2) * np.eye(classes, dtype=F32).reshape(1, 1, classes, classes))
    r = rng(classes + 10)
    crf.blobs = [r.uniform(0, 1, (1, 1, classes, classes)).astype(F32) for _ in range(2)]
    feeds = {"unary": r.uniform(0, 5, shapes["unary"]).astype(F32), "q0": r.uniform(0, 5, shapes["unary"]).astype(F32),
             "img": image(r, shapes["img"])}
    ref = fork_meanfield(feeds["unary"], feeds["q0"], feeds["img"], crf.blobs, 4, 160, 3, 3, continuous=True)
    check_everywhere(model, feeds, {"o": ref}, tmp_path, atol=1e-5, rtol=1e-5, opsets=(None,))


SEGNET_CRF = """layer {
  name: "crfrnn" #if you set name "inference1", code will load parameters from caffemodel.
  type: "MultiStageMeanfield"
  bottom: "unary"
  bottom: "q0"
  bottom: "img"
  top: "crfrnn"
  param { lr_mult: 10000 }
  param { lr_mult: 10000 }
  param { lr_mult: 1000 }
  multi_stage_meanfield_param {
   num_iterations: 3
   compatibility_mode: POTTS#Initialize the compatilibity transform matrix with a matrix whose diagonal is -1.
   threshold: 2
   theta_alpha: 160
   theta_beta: 3
   theta_gamma: 3
   spatial_filter_weights_str: "3 1 3 1"
   bilateral_filter_weights_str: "3 1 3 1" %s
  }
}"""


def test_segnet_crf_fork_weight_strings_seed_the_diagonals():
    """nathanin/caffe-segnet-crf 41e60779's MultiStageMeanfield block (its deploy-SegNet-CRFRNN.prototxt,
    4 classes; the file itself is CC BY-NC and not copied): spatial_filter_weights_str /
    bilateral_filter_weights_str (fields 19, 20) and force_cpu (29) read; without weights the two
    strings seed the kernel weights' diagonals and the compatibility starts at -identity."""
    shapes = {"unary": (1, 4, 6, 7), "q0": (1, 4, 6, 7), "img": (1, 3, 6, 7)}
    model = load_from_text(net(SEGNET_CRF % "force_cpu: true", inputs=shapes), random_weights=True)
    crf = node_of(model, "crfrnn")
    assert not crf.attrs["continuous"] and model.graph.tensors["crfrnn"].shape == (1, 4, 6, 7)
    blobs = [np.asarray(b) for b in crf.blobs]
    diag = np.diag(np.array([3, 1, 3, 1], np.float32)).reshape(1, 1, 4, 4)
    np.testing.assert_array_equal(blobs[0], diag)
    np.testing.assert_array_equal(blobs[1], diag)
    np.testing.assert_array_equal(blobs[2], -np.eye(4, dtype=np.float32).reshape(1, 1, 4, 4))
    feeds = {"unary": rng(5).standard_normal(shapes["unary"]).astype(F32), "img": image(rng(6), shapes["img"])}
    feeds["q0"] = feeds["unary"]
    ref = fork_meanfield(feeds["unary"], feeds["q0"], feeds["img"], blobs, 3, 160, 3, 3)
    np.testing.assert_allclose(model.run(feeds)["crfrnn"], ref, rtol=1e-5, atol=1e-5)
    # shapes read without weights; five classes need five values once the fork seeds its blobs
    five = {"unary": (1, 5, 6, 7), "q0": (1, 5, 6, 7), "img": (1, 3, 6, 7)}
    assert load_from_text(net(SEGNET_CRF % "", inputs=five)).graph.tensors["crfrnn"].shape == (1, 5, 6, 7)
    with pytest.raises(LayerError, match="spatial_filter_weights_str '3 1 3 1': the fork reads 5"):
        load_from_text(net(SEGNET_CRF % "", inputs=five), random_weights=True)


def test_meanfield_needs_more_than_one_iteration():
    shapes = {"unary": (1, 2, 3, 3), "q0": (1, 2, 3, 3), "img": (1, 3, 3, 3)}
    with pytest.raises(LayerError, match="num_iterations must be > 1"):
        load_from_text(net(MEANFIELD.format(it=1), inputs=shapes))


def test_meanfield_v1_enum_upgrades():
    text = ('input: "unary" input_dim: 1 input_dim: 4 input_dim: 3 input_dim: 5\n'
            'input: "img" input_dim: 1 input_dim: 3 input_dim: 3 input_dim: 5\n'
            'layers { name: "split" type: SPLIT bottom: "unary" top: "u" top: "q0" }\n'
            'layers { name: "crf" type: MULTI_STAGE_MEANFIELD bottom: "u" bottom: "q0" bottom: "img" top: "o"\n'
            '  multi_stage_meanfield_param { num_iterations: 10 theta_alpha: 160 } }')
    model = load_from_text(text)
    crf = node_of(model, "crf")
    assert crf.type == "MultiStageMeanfield" and crf.attrs["theta_alpha"] == 160
    assert model.graph.tensors["o"].shape == (1, 4, 3, 5)
