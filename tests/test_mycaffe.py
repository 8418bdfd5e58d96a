"""MyCaffe (MyCaffe/MyCaffe b8922aa, C#): its dialect of the text format (RUN phase, IMAGEDB, unquoted text values),
its RUN net (ProjectEx.CreateModelForRunning) and the layers its files use at TEST / RUN: the noisy InnerProduct
(InnerProductLayer.cs), Normalization2 (Normalization2Layer.cs), Decode (DecodeLayer.cs) and LstmAttention
(LSTMAttentionLayer.cs with math.cu's lstm_fwd kernels).  References written from those forwards in numpy, compared
in torch, onnxruntime and the generated model.py."""
import os

import numpy as np
import pytest
from conftest import REPO, check_everywhere, net, node_of, rng

from caffeq.errors import CaffeqError
from caffeq.io.prototxt import read_prototxt
from caffeq.model import load, load_from_text

f32 = np.float32
RUN_MARK = 'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "y" bottom: "lbl" top: "loss" exclude { phase: RUN } }\n'


def _set(model, name, *blobs):
    node_of(model, name).blobs = [np.asarray(b, f32) for b in blobs]


# ---- noisy InnerProduct --------------------------------------------------------------------------------------

def test_noisy_inner_product_uses_weight_and_bias_only(tmp_path):
    text = net('layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" inner_product_param { num_output: 3 '
               'bias_term: True axis: 1 enable_noise: True sigma_init: 0.17 } }', inputs={"x": (2, 5, 3)})
    model = load_from_text(text, random_weights=True)
    assert [tuple(b.shape) for b in node_of(model, "ip").blobs] == [(3, 15), (3,), (3, 15), (3,)]
    r = rng(1)
    w, b = r.standard_normal((3, 15)).astype(f32), r.standard_normal(3).astype(f32)
    sw, sb = r.standard_normal((3, 15)).astype(f32), r.standard_normal(3).astype(f32)
    _set(model, "ip", w, b, sw, sb)
    x = r.standard_normal((2, 5, 3)).astype(f32)
    ref = (x.reshape(2, 15).astype(np.float64) @ w.T + b).astype(f32)   # TEST / RUN: no sigma * eps term
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=1e-5, rtol=1e-5)


def test_noisy_inner_product_initial_sigma():
    text = net('layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" inner_product_param { num_output: 4 '
               'enable_noise: True sigma_init: 0.5 } }', inputs={"x": (2, 9)})
    blobs = node_of(load_from_text(text, random_weights=True), "ip").blobs
    np.testing.assert_allclose(blobs[2], np.full((4, 9), 0.5 / 3, f32))   # sigma_init / sqrt(fan in)
    np.testing.assert_allclose(blobs[3], np.full(4, 0.5 / 2, f32))        # sigma_init / sqrt(num_output)


# ---- Normalization2 ------------------------------------------------------------------------------------------

def _norm_ref(x, scale, across, shared, eps):
    x64 = x.astype(np.float64)
    if across:
        norm = np.sqrt((x64 ** 2).reshape(len(x), -1).sum(1) + eps).reshape(-1, 1, 1, 1)
    else:
        norm = np.sqrt((x64 ** 2).sum(1, keepdims=True) + eps)
    s = scale.reshape(()) if shared else scale.reshape(1, -1, 1, 1)
    return (x64 / norm * s).astype(f32)


@pytest.mark.parametrize("across,shared", [(False, False), (True, True), (False, True)])
def test_normalization2(tmp_path, across, shared):
    text = net(f'layer {{ name: "n" type: "Normalization2" bottom: "x" top: "y" normalization2_param {{ '
               f'across_spatial: {across} channel_shared: {shared} esp: 1E-10 eps: 0.01 '
               f'scale_filler {{ type: "constant" value: 20 }} }} }}', inputs={"x": (2, 3, 5, 4)})
    model = load_from_text(text, random_weights=True)
    r = rng(2)
    scale = r.uniform(1, 3, () if shared else (3,)).astype(f32)
    _set(model, "n", scale)
    x = r.standard_normal((2, 3, 5, 4)).astype(f32)
    check_everywhere(model, {"x": x}, {"y": _norm_ref(x, scale, across, shared, 0.01)}, tmp_path,
                     atol=1e-5, rtol=1e-5)


def test_normalization2_reads_eps_not_esp():
    # Normalization2Parameter.cs writes `esp` but reads back only `eps` (default 1e-10)
    text = net('layer { name: "n" type: "Normalization2" bottom: "x" top: "y" normalization2_param { '
               'across_spatial: False esp: 0.5 } }', inputs={"x": (1, 3, 2, 2)})
    assert node_of(load_from_text(text, random_weights=True), "n").attrs["eps"] == pytest.approx(1e-10)


def test_normalization2_fills_scale_from_filler():
    text = net('layer { name: "n" type: "Normalization2" bottom: "x" top: "y" normalization2_param { '
               'across_spatial: False channel_shared: False scale_filler { type: "constant" value: 20 } } }',
               inputs={"x": (1, 3, 2, 2)})
    np.testing.assert_array_equal(node_of(load_from_text(text, random_weights=True), "n").blobs[0], np.full(3, 20, f32))


# ---- Decode --------------------------------------------------------------------------------------------------

DECODE = ('layer { name: "d" type: "Decode" bottom: "fa" bottom: "lbl" top: "y" decode_param { '
          'centroid_output_iteration: 100 enable_centroid_update: True cache_size: 100 target: CENTROID '
          'pregen_label_count: 5 k: 5 IGNORE } }\n')


def _decode_ref(x, centroids, ignore):
    flat = x.reshape(len(x), -1).astype(np.float64)
    c = centroids.reshape(len(centroids), -1).astype(np.float64)
    d = ((flat[:, None, :] - c[None]) ** 2).sum(2).astype(f32)
    d[:, ignore] = np.finfo(f32).max
    return d.reshape(len(x), len(c), 1, 1)


@pytest.mark.parametrize("ignore", [[], [2]])
def test_decode_centroid_distances(tmp_path, ignore):
    text = net(DECODE.replace("IGNORE", " ".join(f"ignore_labels: {i}" for i in ignore)),
               RUN_MARK.replace('"y"', '"fa"'), inputs={"fa": (3, 2, 3), "lbl": (3,)})
    model = load_from_text(text, random_weights=True)
    assert list(node_of(model, "d").inputs) == ["fa"]   # RUN: the labels bottom is dropped
    r = rng(3)
    centroids = r.standard_normal((5, 6, 1, 1)).astype(f32)
    _set(model, "d", centroids, np.ones((5, 1, 1, 1)), np.zeros((5, 1, 1, 1)))
    x = r.standard_normal((3, 2, 3)).astype(f32)
    feeds = {"fa": x, "lbl": np.zeros(3, f32)}
    check_everywhere(model, feeds, {"y": _decode_ref(x, centroids, ignore)}, tmp_path, atol=1e-5, rtol=1e-5)


def test_decode_refuses_knn_and_unknown_label_count():
    base = net(DECODE.replace("IGNORE", ""), RUN_MARK, inputs={"fa": (3, 6), "lbl": (3,)})
    with pytest.raises(CaffeqError, match="target KNN"):
        load_from_text(base.replace("target: CENTROID", "target: KNN"), random_weights=True)
    with pytest.raises(CaffeqError, match="pregen_label_count must give the label count"):
        load_from_text(base.replace("pregen_label_count: 5", ""), random_weights=True)


# ---- LstmAttention -------------------------------------------------------------------------------------------

def _sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def _lstm_ref(x, clip, wi, wh, b):
    steps, batch = x.shape[:2]
    hidden = wh.shape[1]
    if clip is None:
        clip = np.repeat((np.arange(steps) > 0).astype(np.float64)[:, None], batch, 1)
    clip = clip.reshape(steps, batch).astype(np.float64)
    pre = x.reshape(steps, batch, -1).astype(np.float64) @ wi.T.astype(np.float64) + b
    h, c = np.zeros((batch, hidden)), np.zeros((batch, hidden))
    top = np.zeros((steps, batch, hidden))
    max_t = steps
    if clip.size > 1:   # calculate_maxT
        max_t = int(clip.sum(0).max()) + (1 if clip[0, 0] == 0 else 0)
    for t in range(min(max_t, steps)):
        g = pre[t] + clip[t][:, None] * (h @ wh.T.astype(np.float64))
        i, f, o = _sigmoid(g[:, :hidden]), _sigmoid(g[:, hidden:2 * hidden]), _sigmoid(g[:, 2 * hidden:3 * hidden])
        gg = np.tanh(g[:, 3 * hidden:])
        c = clip[t][:, None] * f * c + i * gg
        h = o * np.tanh(c)
        top[t] = h
    return top.astype(f32)


LSTM = ('layer { name: "l" type: "LstmAttention" BOTTOMS top: "y" lstm_attention_param { num_output: 4 '
        'weight_filler { type: "uniform" min: -0.01 max: 0.01 } bias_filler { type: "constant" value: 0 } } }\n')


@pytest.mark.parametrize("clip", [
    np.array([[0, 0], [1, 1], [1, 0], [1, 1], [1, 1]]),   # a new sequence in item 1 at t = 2
    np.array([[0, 0], [1, 1], [0, 0], [0, 0], [0, 0]]),   # maxT = 2: the last 3 steps never run
    None])                                                # no clip bottom: clip_t = (t > 0)
def test_lstm_attention(tmp_path, clip):
    bottoms = 'bottom: "x" bottom: "clip"' if clip is not None else 'bottom: "x"'
    inputs = {"x": (5, 2, 3, 1)} | ({"clip": (5, 2)} if clip is not None else {})
    model = load_from_text(net(LSTM.replace("BOTTOMS", bottoms), RUN_MARK, inputs=inputs), random_weights=True)
    r = rng(4)
    wi, wh, b = (r.standard_normal(s).astype(f32) * f32(0.7) for s in ((16, 3), (16, 4), (16,)))
    _set(model, "l", wi, wh, b)
    x = r.standard_normal((5, 2, 3, 1)).astype(f32)
    feeds = {"x": x} | ({"clip": clip.astype(f32)} if clip is not None else {})
    check_everywhere(model, feeds, {"y": _lstm_ref(x, clip, wi, wh, b)}, tmp_path, atol=2e-6, rtol=1e-5)


def test_lstm_attention_output_projection_shapes():
    text = net(LSTM.replace("BOTTOMS", 'bottom: "x" bottom: "clip"').replace("num_output: 4", "num_output: 4 "
               "num_output_ip: 5"), RUN_MARK, inputs={"x": (5, 2, 3), "clip": (5, 2)})
    model = load_from_text(text, random_weights=True)
    assert [tuple(b.shape) for b in node_of(model, "l").blobs] == [(16, 3), (16, 4), (16,), (4, 5), (1, 5)]
    assert model.graph.tensors["y"].shape == (5, 2, 5)


def test_lstm_attention_bad_parameters():
    text = net(LSTM.replace("BOTTOMS", 'bottom: "x" bottom: "clip"'), RUN_MARK, inputs={"x": (5, 2, 3), "clip": (5, 2)})
    with pytest.raises(CaffeqError, match="lstm_attention_param.num_output is required"):
        load_from_text(text.replace("num_output: 4", ""), random_weights=True)
    model = load_from_text(text.replace("num_output: 4", "num_output: 4 enable_attention: True"), random_weights=True)
    with pytest.raises(CaffeqError, match=r"layer 'l' \(LstmAttention\): enable_attention .* not run by caffeq"):
        model.run({"x": np.zeros((5, 2, 3), f32), "clip": np.ones((5, 2), f32)})


CHAR_RNN = ('layer { name: "embed" type: "Embed" bottom: "data" top: "vec" embed_param { num_output: 5 input_dim: 11 '
            'bias_term: True } }\n'
            'layer { name: "l1" type: "LstmAttention" bottom: "vec" bottom: "clip" top: "l1" '
            'lstm_attention_param { num_output: 4 } }\n'
            'layer { name: "drop" type: "Dropout" bottom: "l1" top: "l1d" dropout_param { dropout_ratio: 0.4 } }\n'
            'layer { name: "l2" type: "LstmAttention" bottom: "l1d" bottom: "clip" top: "l2" '
            'lstm_attention_param { num_output: 4 } }\n'
            'layer { name: "rs" type: "Reshape" bottom: "l2" top: "l2r" reshape_param { shape { dim: -1 dim: 1 '
            'dim: 4 } } }\n'
            'layer { name: "ip" type: "InnerProduct" bottom: "l2r" top: "y" inner_product_param { num_output: 3 } }\n')


def test_char_rnn_embed_lstm_attention_inner_product_model_py(tmp_path):
    # the layers of MyCaffe's char_rnn lstm_attention train_val: two LstmAttention layers share one model.py helper
    from conftest import model_py_outputs
    model = load_from_text(net(CHAR_RNN, RUN_MARK, inputs={"data": (7, 2), "clip": (7, 2)}), random_weights=True)
    r = rng(7)
    ew, eb = node_of(model, "embed").blobs
    l1 = [r.standard_normal(s).astype(f32) * f32(0.6) for s in ((16, 5), (16, 4), (16,))]
    l2 = [r.standard_normal(s).astype(f32) * f32(0.6) for s in ((16, 4), (16, 4), (16,))]
    _set(model, "l1", *l1)
    _set(model, "l2", *l2)
    iw, ib = node_of(model, "ip").blobs
    data = r.integers(0, 11, (7, 2)).astype(f32)
    clip = np.array([[0, 0], [1, 1], [1, 1], [1, 0], [1, 1], [1, 1], [1, 1]], f32)
    feeds = {"data": data, "clip": clip}
    vec = ew[data.astype(int)].astype(np.float64) + eb
    h2 = _lstm_ref(_lstm_ref(vec, clip, *l1), clip, *l2)
    ref = (h2.reshape(14, 4).astype(np.float64) @ iw.T.astype(np.float64) + ib).astype(f32)
    check_everywhere(model, feeds, {"y": ref}, tmp_path, atol=2e-6, rtol=1e-5)
    got = model_py_outputs(model, feeds, tmp_path / "again")
    np.testing.assert_allclose(got["y"], model.run(feeds)["y"], atol=1e-6, rtol=1e-6)
    source = (tmp_path / "again" / "py" / "model.py").read_text()
    assert source.count("def mycaffe_lstm(") == 1 and "def parse(" not in source


def test_model_py_helper_source_edited_since_import_is_refused(tmp_path, monkeypatch):
    # what broke model.py for the char_rnn file: the benchmark's long-lived process had imported mycaffe.py, the
    # file was edited on disk before the export, and inspect.getsource read the new file at the old line, so
    # model.py defined Decode's `parse(self, lp)` and called it as the LSTM helper with 5 arguments
    import importlib

    from caffeq.backends.pytorch_emit import imported_source
    from caffeq.errors import ExportError
    before = ("class Spec:\n    def parse(self, lp):\n        return {'n': lp}\n\n\n"
              "def helper(x, clip, a, b, c):\n    return x * 2.0 + a\n")
    path = tmp_path / "edited_helper.py"
    path.write_text(before)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("edited_helper")
    assert imported_source(module.helper).startswith("def helper(x, clip")
    path.write_text('"""Three lines\nmore\nhere."""\n' + before)          # the old line is now inside parse
    with pytest.raises(ExportError, match=r"edited_helper\.helper in .* no longer the code imported"):
        imported_source(module.helper)
    path.write_text(before.replace("x * 2.0", "x * 3.25"))                 # same lines, another body
    with pytest.raises(ExportError, match="no longer the code imported"):
        imported_source(module.helper)
    path.write_text(before)
    assert "x * 2.0" in imported_source(module.helper)

# ---- the dialect and the RUN net -----------------------------------------------------------------------------

RUN_NET = r'''name: "TripletNet"
layer { name: "data" type: "Data" top: "data1" top: "label" include { phase: TRAIN }
  transform_param { scale: 0.00390625 use_imagedb_mean: True color_order: RGB }
  data_param { source: MNIST.training batch_size: 4 backend: IMAGEDB enable_random_selection: True } }
layer { name: "data" type: "Data" top: "data1" top: "label" include { phase: TEST }
  data_param { source: C:\ProgramData\MyCaffe\mnist.testing batch_size: 4 backend: IMAGEDB } }
layer { name: "seq" type: "DataSequence" bottom: "data1" bottom: "label" top: "data" top: "lbl" exclude { phase: RUN }
  data_sequence_param { cache_size: 64 k: 1 } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "fa" freeze_learning: True
  inner_product_param { num_output: 3 bias_term: True } }
layer { name: "only_run" type: "ReLU" bottom: "fa" top: "r" include { phase: RUN } }
layer { name: "acc" type: "AccuracyDecode" bottom: "r" bottom: "lbl" top: "acc" include { phase: TEST } }
'''


def test_run_net_dialect(tmp_path):
    path = tmp_path / "mycaffe.prototxt"
    path.write_text(RUN_NET)
    warnings = []
    parsed = read_prototxt(str(path), warnings=warnings)
    assert parsed.layer[1].data_param.source == r"C:\ProgramData\MyCaffe\mnist.testing"
    assert parsed.layer[0].data_param.source == "MNIST.training"
    assert any("MyCaffe (MyCaffe/MyCaffe, C#) model file" in w for w in warnings)
    model = load(str(path), random_weights=True, input_shapes={"data1": (2, 1, 3, 2)})
    assert [n.name for n in model.layers] == ["data", "ip", "only_run"]
    assert list(node_of(model, "ip").inputs) == ["data1"]   # the first layer's bottom named after the input
    x = rng(5).standard_normal((2, 1, 3, 2)).astype(f32)
    w, b = node_of(model, "ip").blobs
    out = model.run({"data1": x, "label": np.zeros(model.graph.tensors["label"].shape, f32)})
    ref = np.maximum(x.reshape(2, 6).astype(np.float64) @ w.T.astype(np.float64) + b, 0).astype(f32)
    np.testing.assert_allclose(out["r"], ref, atol=1e-6, rtol=1e-6)


def test_other_files_keep_their_reading(tmp_path):
    path = tmp_path / "plain.prototxt"
    path.write_text('layer { name: "d" type: "Data" top: "x" data_param { source: C:\\db batch_size: 2 } }')
    with pytest.raises(CaffeqError):
        read_prototxt(str(path))


# ---- the corpus files ----------------------------------------------------------------------------------------

CORPUS_DIR = REPO / "tests" / "fixtures" / "realworld"
CORPUS = [(CORPUS_DIR / "MyCaffe__MyCaffe__MyCaffe.app__Resources__triplet_train_val.prototxt", {"data1": (1, 1, 28, 28)},
           {"decode1": (1, 10, 1, 1)}),
          (CORPUS_DIR / ("MyCaffe__MyCaffe__MyCaffe.test__test_data__models__rnn__char_rnn__lstm_attention__train_val"
                         ".prototxt"), None, {"ip1": (75, 128)}),
          (CORPUS_DIR / ("MyCaffe__MyCaffe__MyCaffe.test__test_data__models__reinforcement__cartpole.noisy.dqn__"
                         "train_val.prototxt"), None, {"logits": (32, 2)})]


@pytest.mark.parametrize("path,shapes,tops", CORPUS)
def test_corpus_files_run(path, shapes, tops):
    model = load(path, random_weights=True, input_shapes=shapes)
    feeds = {name: np.zeros(model.graph.tensors[name].shape, f32) for name in model.inputs}
    out = model.run(feeds)
    for top, shape in tops.items():
        assert out[top].shape == shape and np.isfinite(out[top]).all()


# ---- review: the dialect never fires on other files; the RUN net as CreateModelForRunning builds it ---------

REALWORLD = os.path.join(os.path.dirname(__file__), "fixtures", "realworld")
OTHER_FILES = ["1694439208__Res18_SSD__train.prototxt",
               "871864580__RefineDet__models__VGGNet__VOC0712__refinedet_vgg16_320x320__deploy.prototxt",
               "ALISCIFP__bvlc_alexnet_VReLU__train_val.prototxt",
               "FreeApe__VGG-or-MobileNet-SSD__template__MobileNetSSD_deploy_bn_template.prototxt",
               "TheLegendAli__DeepLab-Context__voc12__config__vgg128_noup__test.prototxt",
               "BVLC__caffe__examples__pycaffe__linreg.prototxt"]


def _read_both_ways(path, monkeypatch):
    """(message bytes, warnings) read with the MyCaffe repairs and with them switched off."""
    import caffeq.io.prototxt as prototxt
    out = []
    for repairs in (True, False):
        with monkeypatch.context() as m:
            if not repairs:
                m.setattr(prototxt, "mycaffe_text", lambda text, path, warnings: text)
                m.setattr(prototxt, "mycaffe_bare_string", lambda *a: None)
            warnings, pending = [], []
            try:
                net_ = read_prototxt(path, warnings=warnings, placeholders=pending)
                out.append((net_.SerializeToString(deterministic=True), warnings, [str(p) for p in pending]))
            except CaffeqError as e:
                out.append(("error", str(e)))
    return out


@pytest.mark.parametrize("name", OTHER_FILES)
def test_repairs_change_nothing_in_other_files(name, monkeypatch):
    path = os.path.join(REALWORLD, name)
    with_repairs, without = _read_both_ways(path, monkeypatch)
    assert with_repairs == without
    assert not any("MyCaffe" in w for w in with_repairs[1])


def test_no_realworld_fixture_reads_as_mycaffe():
    from caffeq.io.text_repairs import is_mycaffe_text
    # MyCaffe's own files are fixtures too: the check is on every other repository's
    names = [n for n in os.listdir(REALWORLD) if n.endswith(".prototxt") and not n.startswith("MyCaffe__MyCaffe__")]
    assert len(names) > 100
    for path, _, _ in CORPUS:
        assert is_mycaffe_text(path.read_text(encoding="utf-8")), path.name
    for name in names:
        with open(os.path.join(REALWORLD, name), encoding="utf-8", errors="replace") as f:
            assert not is_mycaffe_text(f.read()), name


def test_mark_in_a_comment_or_string_is_not_mycaffe(tmp_path, monkeypatch):
    # another fork's file that mentions MyCaffe's words in comments and names: read as before, its Windows path
    # still refused (MyCaffe's unquoted values are not read in it)
    text = ('# phase: RUN when deployed; enable_noise is MyCaffe\'s\n'
            'layer { name: "backend: IMAGEDB" type: "Data" top: "x"  # freeze_learning: True\n'
            '  data_param { source: C:\\db batch_size: 2 } }\n')
    path = tmp_path / "other.prototxt"
    path.write_text(text)
    with_repairs, without = _read_both_ways(str(path), monkeypatch)
    assert with_repairs == without and with_repairs[0] == "error"
    path.write_text(text.replace("C:\\db", '"C:/db"'))
    with_repairs, without = _read_both_ways(str(path), monkeypatch)
    assert with_repairs == without and with_repairs[0] != "error"
    # the same words as fields make it MyCaffe's
    path.write_text(text + 'layer { name: "r" type: "ReLU" bottom: "x" top: "x" include { phase: RUN } }\n')
    assert read_prototxt(str(path)).layer[0].data_param.source == "C:\\db"


RUN_RULES = r'''name: "rules"
layer { name: "data" type: "Data" top: "data" top: "label" include { phase: TRAIN }
  data_param { source: MNIST.training batch_size: 4 backend: IMAGEDB } }
layer { name: "data" type: "Data" top: "data" top: "label" include { phase: TEST }
  data_param { source: MNIST.testing batch_size: 4 backend: IMAGEDB } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 3 } }
layer { name: "not_test" type: "Scale" bottom: "ip" top: "s" exclude { phase: TEST }
  scale_param { bias_term: True } }
layer { name: "test_only" type: "ReLU" bottom: "s" top: "s" include { phase: TEST } }
layer { name: "dbg" type: "Debug" bottom: "s" top: "dbg" }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "s" bottom: "label" top: "prob" softmax_param { axis: 1 }
  loss_weight: 1 }
layer { name: "decode1" type: "Decode" bottom: "s" bottom: "label" top: "decode1"
  decode_param { target: CENTROID pregen_label_count: 2 } }
'''


def test_run_net_keeps_what_mycaffe_keeps(tmp_path):
    from caffeq.ir import filter_layers
    from caffeq.model import read_net
    path = tmp_path / "rules.prototxt"
    path.write_text(RUN_RULES)
    warnings = []
    net_ = read_net(str(path), warnings=warnings)
    run = {lp.name: lp for lp in filter_layers(net_, "TEST")}
    # an exclude at TEST keeps a layer at RUN; include TEST only and Debug are dropped; the loss is a Softmax
    # of its first bottom; Decode reads its encodings only
    assert list(run) == ["data", "ip", "not_test", "loss", "decode1"]
    assert run["loss"].type == "Softmax" and list(run["loss"].bottom) == ["s"] and not run["loss"].loss_weight
    assert list(run["decode1"].bottom) == ["s"]
    assert any("SoftmaxWithLoss read as a Softmax" in w for w in warnings)
    train = {lp.name: lp for lp in filter_layers(net_, "TRAIN")}   # the TRAIN net as written
    assert list(train) == ["data", "ip", "not_test", "dbg", "loss", "decode1"]
    assert train["loss"].type == "SoftmaxWithLoss" and list(train["loss"].bottom) == ["s", "label"]
    assert list(train["decode1"].bottom) == ["s", "label"]
    model = load(str(path), random_weights=True, input_shapes={"data": (2, 5)})
    r = rng(6)
    x = r.standard_normal((2, 5)).astype(f32)
    w, b = node_of(model, "ip").blobs
    _set(model, "not_test", r.uniform(0.5, 2, 3), r.standard_normal(3))
    scale, shift = node_of(model, "not_test").blobs
    feeds = {"data": x, "label": np.zeros(model.graph.tensors["label"].shape, f32)}
    out = model.run(feeds)
    s = (x.astype(np.float64) @ w.T + b) * scale + shift
    e = np.exp(s - s.max(1, keepdims=True))
    np.testing.assert_allclose(out["prob"], (e / e.sum(1, keepdims=True)).astype(f32), atol=1e-6, rtol=1e-5)


def test_run_net_drops_the_loss_where_a_softmax_runs(tmp_path):
    from caffeq.ir import filter_layers
    from caffeq.model import read_net
    path = tmp_path / "rules.prototxt"
    path.write_text(RUN_RULES.replace('layer { name: "loss"',
                                      'layer { name: "sm" type: "Softmax" bottom: "s" top: "sm" }\nlayer { name: "loss"'))
    net_ = read_net(str(path))
    assert [lp.name for lp in filter_layers(net_, "TEST")] == ["data", "ip", "not_test", "sm", "decode1"]
    assert "loss" in [lp.name for lp in filter_layers(net_, "TRAIN")]
