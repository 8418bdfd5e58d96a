"""junhyukoh/caffe-lstm's first LSTM (b193dfb0 lstm_layer.cpp: V1 `type: LSTM` with one bottom, sized by
inner_product_param) against a loop written here from its Forward_cpu, in torch, onnxruntime and model.py;
the same fork's windowed ImageData (711ecdab) and matex-org/caffe-intel's remote-index DataParameter
(35c1a3d3) as graph inputs; BVLC's and lisa-caffe's LSTM still read as before."""

import numpy as np
import pytest
from conftest import REPO, check_everywhere, node_of, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

F = np.float32
CORPUS = REPO / "tests" / "fixtures" / "realworld"


def exp_tanh(v):
    e = np.exp(F(2) * v.astype(F), dtype=F)
    return ((e - F(1)) / (e + F(1))).astype(F)


def sigmoid(v):
    return (1.0 / (1.0 + np.exp(-v.astype(np.float64)))).astype(F)


def ref_lstm(x, w_i, w_h, b):
    """Forward_cpu of b193dfb0: pre_gate = x W_i^T (+ b), then per step + W_h h_{t-1}; gates i f o g."""
    t, hd = x.shape[0], w_h.shape[2]
    rows = x.reshape(t, -1).astype(np.float64)
    pre = rows @ w_i.reshape(4 * hd, -1).T.astype(np.float64)
    if b is not None:
        pre = pre + b.reshape(4 * hd)
    w_rec = w_h.reshape(4 * hd, hd).astype(np.float64)
    h = np.zeros(hd, F)
    c = np.zeros(hd, F)
    top = np.zeros((t, hd, 1, 1), F)
    for step in range(t):
        g = (pre[step] + w_rec @ h).astype(F)
        i, f, o = sigmoid(g[:hd]), sigmoid(g[hd:2 * hd]), sigmoid(g[2 * hd:3 * hd])
        c = f * c + i * exp_tanh(g[3 * hd:])
        h = o * exp_tanh(c)
        top[step, :, 0, 0] = h
    return top


def v1_lstm_net(shape, hidden, bias=True, second=None):
    dims = " ".join(f"input_dim: {d}" for d in shape)
    more = "" if bias else "bias_term: false"
    text = (f'input: "x" {dims}\n'
            f'layers {{ name: "l1" type: LSTM bottom: "x" top: "y" blobs_lr: 1 blobs_lr: 1 blobs_lr: 1 '
            f'inner_product_param {{ num_output: {hidden} {more} weight_filler {{ type: "gaussian" std: 0.1 }} }} '
            f'lstm_param {{ clipping_threshold: 0.1 }} }}\n')
    if second:
        text += (f'layers {{ name: "l2" type: LSTM bottom: "y" top: "z" inner_product_param {{ num_output: {second} }} '
                 f'lstm_param {{ clipping_threshold: 0.1 }} }}\n')
    return text


def fill(model, name, r, scale=0.9):
    node = node_of(model, name)
    for k in range(len(node.blobs)):
        node.blobs[k] = r.uniform(-scale, scale, np.shape(node.blobs[k])).astype(F)
    return [np.asarray(b) for b in node.blobs]


def test_one_bottom_lstm_matches_the_forks_loop(tmp_path):
    r = rng(3)
    model = load_from_text(v1_lstm_net((7, 3, 5, 2), 6, second=5), random_weights=True)
    n1, n2 = node_of(model, "l1"), node_of(model, "l2")
    assert [tuple(np.shape(b)) for b in n1.blobs] == [(1, 4, 6, 30), (1, 4, 6, 6), (1, 1, 4, 6)]
    assert [tuple(np.shape(b)) for b in n2.blobs] == [(1, 4, 5, 6), (1, 4, 5, 5), (1, 1, 4, 5)]
    b1, b2 = fill(model, "l1", r), fill(model, "l2", r)
    x = r.uniform(-1, 1, (7, 3, 5, 2)).astype(F)
    y = ref_lstm(x, *b1)
    z = ref_lstm(y, *b2)
    assert y.shape == (7, 6, 1, 1) and z.shape == (7, 5, 1, 1)
    check_everywhere(model, {"x": x}, {"z": z}, tmp_path, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(model.run({"x": x}, all_blobs=True)["y"], y, atol=2e-6, rtol=1e-5)


def test_without_bias_term_two_blobs(tmp_path):
    r = rng(4)
    model = load_from_text(v1_lstm_net((5, 3, 1, 1), 4, bias=False), random_weights=True)
    w = fill(model, "l1", r, scale=1.5)
    assert len(w) == 2
    x = r.uniform(-2, 2, (5, 3, 1, 1)).astype(F)
    check_everywhere(model, {"x": x}, {"y": ref_lstm(x, w[0], w[1], None)}, tmp_path, atol=2e-6, rtol=1e-5)


def test_tanh_is_the_forks_exp_formula(tmp_path):
    """(e^2v - 1) / (e^2v + 1) in float32: NaN where e^2v overflows (v > 44.36), where tanh would give 1."""
    r = rng(5)
    model = load_from_text(v1_lstm_net((4, 2, 1, 1), 3), random_weights=True)
    w_i, w_h, b = fill(model, "l1", r, scale=0.5)
    w_i[0, 3, 0] = [60, 0]                    # unit 0's g row: pre-activation 60 x[t, 0]
    node_of(model, "l1").blobs[0] = w_i
    x = r.uniform(-0.05, 0.05, (4, 2, 1, 1)).astype(F)
    x[1, 0], x[3, 0] = -1, 1                  # g = -60 at step 1 (-1 either way), +60 at the last step
    with np.errstate(over="ignore", invalid="ignore"):
        ref = ref_lstm(x, w_i, w_h, b)
    assert np.isnan(ref[3, 0]).all() and np.isfinite(np.delete(ref.reshape(-1), 9)).all()
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=2e-6, rtol=1e-5)


def test_random_weights_set_the_forget_bias_to_five():
    model = load_from_text(v1_lstm_net((3, 2, 1, 1), 4), random_weights=True)
    b = np.asarray(node_of(model, "l1").blobs[2]).reshape(4, 4)
    assert (b[1] == 5).all() and (b[[0, 2, 3]] == 0).all()


def test_bad_num_output_is_one_line():
    text = v1_lstm_net((3, 2, 1, 1), 4).replace("num_output: 4", "num_output: 0")
    with pytest.raises(CaffeqError, match="inner_product_param.num_output"):
        load_from_text(text, random_weights=True)


def test_lisa_and_bvlc_lstm_still_read():
    lisa = ('input: "x" input_dim: 6 input_dim: 3 input_dim: 1 input_dim: 1\n'
            'input: "m" input_dim: 6 input_dim: 1 input_dim: 1 input_dim: 1\n'
            'layers { name: "l" type: LSTM bottom: "x" bottom: "m" top: "y" '
            'lstm_param { hidden_dim: 4 buffer_size: 2 } }')
    m = load_from_text(lisa, random_weights=True)
    assert [tuple(np.shape(b)) for b in node_of(m, "l").blobs] == [(16, 3), (16,), (16, 4)]
    bvlc = ('layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 3 dim: 2 dim: 5 } } }\n'
            'layer { name: "c" type: "Input" top: "c" input_param { shape { dim: 3 dim: 2 } } }\n'
            'layer { name: "l" type: "LSTM" bottom: "x" bottom: "c" top: "y" recurrent_param { num_output: 4 } }')
    m = load_from_text(bvlc, random_weights=True)
    assert [tuple(np.shape(b)) for b in node_of(m, "l").blobs] == [(16, 5), (16,), (16, 4)]


def test_windowed_image_data_is_a_graph_input():
    text = ('layer { name: "images" type: "ImageData" top: "data" top: "label" top: "box" '
            'image_data_param { source: "nowhere.txt" batch_size: 2 window_h: 4 window_w: 3 max_windows_h: 5 '
            'max_windows_w: 7 min_scale: 0.1 max_scale: 0.5 } }\n'
            'layer { name: "s" type: "Silence" bottom: "box" bottom: "label" }\n'
            'layer { name: "r" type: "ReLU" bottom: "data" top: "out" }')
    model = load_from_text(text)
    assert tuple(model.blob_shapes["data"]) == (2, 3, 20, 21)
    assert tuple(model.blob_shapes["box"]) == (2, 7)
    with pytest.raises(CaffeqError, match="max_windows_h x window_h"):
        load_from_text(text.replace("max_windows_h: 5", "max_windows_h: 0"))


def test_remote_index_data_reads():
    text = ('layer { name: "data" type: "Data" top: "data" top: "label" data_param { source: "x" batch_size: 2 '
            'backend: REMOTE_INDEX_SFTP server: "s" username: "u" cache { size: 10 type: DISK disk_location: "/t" '
            'thread_safe: true } cache { size: 3 eviction_rate: 2 type: HBM } } }\n'
            'layer { name: "r" type: "ReLU" bottom: "data" top: "out" }')
    model = load_from_text(text, input_shapes={"data": (2, 3, 5, 4)})
    assert tuple(model.blob_shapes["out"]) == (2, 3, 5, 4)
    load_from_text(text.replace("REMOTE_INDEX_SFTP", "REMOTE_INDEX"), input_shapes={"data": (2, 3, 5, 4)})


@pytest.mark.parametrize("name, shapes", [
    ("junhyukoh__caffe-lstm__examples__lstm_sequence__deep_lstm.prototxt", {"data": (320, 1, 1, 1)}),
    ("matex-org__caffe-intel__cache_guide__sample.prototxt", {"data": (2, 3, 227, 227)}),
])
def test_corpus_files_read(name, shapes):
    model = load_from_text((CORPUS / name).read_text(), input_shapes=shapes)
    assert model.layers


def test_nvcaffes_cache_flag_and_matexs_cache_levels_both_read(tmp_path):
    # the same DataParameter name: NVCaffe's `cache: true`, matex-org/caffe-intel's `cache { ... }` levels
    for cache in ("cache: true", "cache { size: 4 type: DISK disk_location: \"/tmp\" } cache { size: 2 type: HEAP }"):
        path = tmp_path / "n.prototxt"
        path.write_text('layer { name: "data" type: "Data" top: "data" top: "label" data_param { source: "db" '
                        f'batch_size: 2 backend: LMDB {cache} }} transform_param {{ crop_size: 5 }} }}\n'
                        'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" '
                        'inner_product_param { num_output: 3 } }\n')
        model = load_from_text(path.read_text(), random_weights=True, input_shapes={"data": (2, 3, 5, 5)})
        assert "ip" in model.outputs
        assert any("cache" in w for w in model.warnings)
