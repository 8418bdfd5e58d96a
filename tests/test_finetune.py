"""Binary-weight fine-tuning: the STE gradient, per-step alpha/sign, BatchNorm re-estimation, a short
run on examples/digits, the CLI."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import one_error_line

import caffeq
from caffeq.__main__ import main
from caffeq.finetune import (
    BinarizeWeight,
    binarize_module,
    binarize_ste,
    caffe_layers,
    clip_latent,
    finetune,
    reestimate_batchnorm,
)
from caffeq.model import load_from_text

REPO = Path(__file__).resolve().parents[1]
DIGITS = REPO / "examples" / "digits"
TRAIN_VAL = str(DIGITS / "train_val.prototxt")
WEIGHTS = str(DIGITS / "model.caffemodel")

IP_NET = """
name: "tiny_ip"
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 1 dim: 3 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" inner_product_param { num_output: 2 } }
"""

# w: a value outside the STE window (1.5) and a zero (sign(0) = +1)
W = np.array([[0.5, -0.25, 1.5], [-0.2, 0.0, 0.4]], np.float32)


def _ip_model():
    m = load_from_text(IP_NET, random_weights=True)
    node = m.graph.node("ip")
    node.blobs = [W.copy(), np.array([0.1, -0.1], np.float32)]
    return m


# ---- the straight-through estimator ---------------------------------------------------------

def test_ste_forward_and_gradient_by_hand():
    w = torch.tensor(W, requires_grad=True)
    g = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    wb = binarize_ste(w, axis=0)
    # alpha_0 = (0.5 + 0.25 + 1.5) / 3 = 0.75; alpha_1 = (0.2 + 0 + 0.4) / 3 = 0.2; sign(0) = +1
    np.testing.assert_allclose(wb.detach().numpy(), [[0.75, -0.75, 0.75], [-0.2, 0.2, 0.2]], rtol=1e-6)
    (wb * g).sum().backward()
    # dL/dw_i = alpha * g_i * [|w_i| <= 1] + s_i / n * sum_j g_j s_j
    # row 0: s = (+1, -1, +1), sum g s = 1 - 2 + 3 = 2, mask (1, 1, 0)
    #        (0.75 + 2/3, 1.5 - 2/3, 0 + 2/3)
    # row 1: s = (-1, +1, +1), sum g s = -4 + 5 + 6 = 7, mask (1, 1, 1)
    #        (0.8 - 7/3, 1.0 + 7/3, 1.2 + 7/3)
    expected = [[0.75 + 2 / 3, 1.5 - 2 / 3, 2 / 3], [0.8 - 7 / 3, 1.0 + 7 / 3, 1.2 + 7 / 3]]
    np.testing.assert_allclose(w.grad.numpy(), expected, rtol=1e-6, atol=1e-7)


def test_ste_gradient_through_an_innerproduct_layer():
    m = _ip_model()
    gm = m.to_torch()
    binarize_module(gm, m, ["ip"])
    mod = caffe_layers(gm)["ip"]
    latent = mod.parametrizations.weight.original
    x = torch.tensor([[1.0, 2.0, -1.0]])
    y = gm(x)
    # W_b = [[.75, -.75, .75], [-.2, .2, .2]]: y = W_b x + b = (-1.5 + 0.1, 0 - 0.1)
    np.testing.assert_allclose(y.detach().numpy(), [[-1.4, -0.1]], rtol=1e-6, atol=1e-7)
    r = torch.tensor([[1.0, -1.0]])
    (y * r).sum().backward()
    # G = dL/dW_b = r^T x = [[1, 2, -1], [-1, -2, 1]]
    # row 0: sum g s = 1 - 2 - 1 = -2 -> (0.75 - 2/3, 1.5 + 2/3, 0 - 2/3)
    # row 1: sum g s = 1 - 2 + 1 = 0 -> 0.2 * (-1, -2, 1)
    expected = [[0.75 - 2 / 3, 1.5 + 2 / 3, -2 / 3], [-0.2, -0.4, 0.2]]
    np.testing.assert_allclose(latent.grad.numpy(), expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(mod.bias.grad.numpy(), [1.0, -1.0])


def test_ste_forward_matches_the_quantizer_on_every_layer_kind():
    """The training forward uses the same alpha * sign(W) (axes, groups) as caffeq.quantize."""
    text = """
name: "kinds"
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 dim: 4 dim: 5 dim: 6 } } }
layer { name: "conv" type: "Convolution" bottom: "x" top: "c" convolution_param { num_output: 6 kernel_size: 3 group: 2 } }
layer { name: "deconv" type: "Deconvolution" bottom: "c" top: "d" convolution_param { num_output: 4 kernel_size: 2 stride: 2 group: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "d" top: "i" inner_product_param { num_output: 5 } }
layer { name: "ipt" type: "InnerProduct" bottom: "i" top: "o" inner_product_param { num_output: 3 transpose: true } }
"""
    m = load_from_text(text, random_weights=True, seed=3)
    q = caffeq.quantize(m, "binary", keep="none")
    assert sorted(q.quant_report.changed) == ["conv", "deconv", "ip", "ipt"]
    gm = m.to_torch()
    binarize_module(gm, m, ["conv", "deconv", "ip", "ipt"])
    mods = caffe_layers(gm)
    for name in ("conv", "deconv", "ip", "ipt"):
        got = mods[name].weight.detach().numpy()
        np.testing.assert_allclose(got, q.graph.node(name).blobs[0], rtol=1e-6, atol=1e-7, err_msg=name)


def test_alpha_and_sign_recomputed_from_latent_weights_each_step():
    m = _ip_model()
    gm = m.to_torch()
    mods = binarize_module(gm, m, ["ip"])
    mod = caffe_layers(gm)["ip"]
    latent = mod.parametrizations.weight.original
    opt = torch.optim.SGD([latent], lr=0.3)
    x = torch.tensor([[1.0, 2.0, -1.0]])
    alphas = [np.abs(W.astype(np.float64)).mean(axis=1)]
    for _ in range(3):
        opt.zero_grad()
        (gm(x) * torch.tensor([[1.0, -1.0]])).sum().backward()
        opt.step()
        clip_latent(mods)
        lw = latent.detach().numpy().astype(np.float64)
        assert np.abs(lw).max() <= 1.0                    # clipped to the STE window
        s = np.where(lw >= 0, 1.0, -1.0)
        alpha = np.abs(lw).mean(axis=1, keepdims=True)
        # the layer computes with alpha * sign of the *current* latent weights
        np.testing.assert_allclose(mod.weight.detach().numpy(), alpha * s, rtol=1e-6, atol=1e-7)
        y = gm(x).detach().numpy()
        np.testing.assert_allclose(y[0], (alpha * s) @ [1.0, 2.0, -1.0] + [0.1, -0.1], rtol=1e-5, atol=1e-6)
        alphas.append(alpha[:, 0])
    # step 1 by hand: row 0 latent (0.5, -0.25, 1.5) - 0.3 * (1/12, 13/6, -2/3) = (0.475, -0.9, 1.7),
    # clipped to (0.475, -0.9, 1.0): alpha_0 = 2.375 / 3
    np.testing.assert_allclose(alphas[1][0], 2.375 / 3, rtol=1e-6)
    # a sign flip in the latent weights shows at the next forward, with a new alpha
    with torch.no_grad():
        latent[1, 0] = 0.3
    lw = latent.detach().numpy().astype(np.float64)
    np.testing.assert_allclose(mod.weight.detach().numpy()[1],
                               np.abs(lw[1]).mean() * np.where(lw[1] >= 0, 1.0, -1.0), rtol=1e-6)
    assert mod.weight[1, 0] > 0


def test_parametrization_is_a_plain_module():
    p = BinarizeWeight(axis=0)
    w = torch.tensor([[0.0, -2.0]])
    np.testing.assert_array_equal(p(w).numpy(), [[1.0, -1.0]])   # alpha = 1, sign(0) = +1


# ---- BatchNorm re-estimation ------------------------------------------------------------------

BN_NET = """
name: "bn_toy"
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 4 dim: 2 dim: 3 dim: 5 } } }
layer { name: "conv" type: "Convolution" bottom: "x" top: "c" convolution_param { num_output: 3 kernel_size: 1 } }
layer { name: "bn" type: "BatchNorm" bottom: "c" top: "c" %s }
layer { name: "sc" type: "Scale" bottom: "c" top: "c" scale_param { bias_term: true } }
"""


@pytest.mark.parametrize("bn_param", ["", "batch_norm_param { use_global_stats: true }"])
def test_batchnorm_reestimation_reproduces_batch_statistics(bn_param):
    m = load_from_text(BN_NET % bn_param, random_weights=True, seed=1)
    conv = m.graph.node("conv")
    w = np.array([[1.0, -2.0], [0.5, 0.25], [-1.0, 3.0]], np.float32).reshape(3, 2, 1, 1)
    b = np.array([0.5, -1.0, 2.0], np.float32)
    conv.blobs = [w, b]
    m.graph.node("bn").blobs = [np.full(3, 7.0, np.float32), np.full(3, 9.0, np.float32),
                                np.array([999.98], np.float32)]
    gm = m.to_torch()
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(n, 2, 3, 5)).astype(np.float32) * 3 + 1 for n in (4, 3, 5)]
    info = reestimate_batchnorm(gm, [(torch.from_numpy(x),) for x in xs])
    assert info == {"layers": ["bn"], "batches": 3, "items": 12}
    # independent numpy: the 1x1 convolution's outputs over all batches, per channel
    conv_out = np.concatenate([np.einsum("oc,nchw->nohw", w[:, :, 0, 0].astype(np.float64), x) +
                               b[None, :, None, None] for x in xs])
    vals = conv_out.transpose(1, 0, 2, 3).reshape(3, -1)
    mod = caffe_layers(gm)["bn"]
    mean, var, factor = (t.detach().numpy() for t in mod.blob_tensors())
    np.testing.assert_allclose(mean, vals.mean(1), rtol=1e-6)
    np.testing.assert_allclose(var, vals.var(1), rtol=1e-6)           # population variance
    np.testing.assert_array_equal(factor, [1.0])                       # Caffe divides by it: 1

    # one batch: the TEST-phase output with the stored statistics equals the training-mode
    # output (batch statistics) of the same batch
    gm1 = m.to_torch()
    x = torch.from_numpy(xs[0])
    reestimate_batchnorm(gm1, [(x,)])
    test_out = gm1.eval()(x).detach().numpy()
    bnmod = caffe_layers(gm1)["bn"]
    bnmod.attrs = dict(bnmod.attrs, use_global_stats=None)
    gm1.train()
    with torch.no_grad():
        train_out = gm1(x).numpy()
    np.testing.assert_allclose(test_out, train_out, rtol=1e-5, atol=1e-5)


def test_batchnorm_reestimation_written_in_caffe_layout(tmp_path):
    """After --bn-only, the written caffemodel holds mean, variance, factor 1, and caffeq (Caffe's rule:
    blob / factor) reads back the same outputs."""
    out = tmp_path / "bn.caffemodel"
    rc = main(["finetune", TRAIN_VAL, "--weights", WEIGHTS, "--bn-only", "--bn-batches", "3",
               "--no-progress", "-o", str(out)])
    assert rc == 0
    assert (tmp_path / "bn.prototxt").exists()
    back = caffeq.load(TRAIN_VAL, str(out))   # the written prototxt names sources relative to examples/
    for name in ("bn1", "bn2"):
        blobs = back.graph.node(name).blobs
        assert blobs[2].tolist() == [1.0]
        assert (blobs[1] > 0).all()


# ---- a short fine-tune on the shipped example ----------------------------------------------

@pytest.mark.slow
def test_short_finetune_beats_post_training_binarization():
    r = finetune(TRAIN_VAL, WEIGHTS, iters=6, bn_batches=4, seed=0)
    # the binarized model before any step (first/last layers fp32) is Caffe's 85.25%
    assert r.fp32 == pytest.approx(0.99)
    assert r.post_training == pytest.approx(0.8525)
    assert r.binarized == ["conv2", "ip1"]
    # six steps beat both post-training binarization and BatchNorm re-estimation alone (epoch 0)
    assert r.best_epoch == 1
    assert r.best_metric > r.bn_reestimated > r.post_training
    assert r.best_metric >= 0.95
    # the written model is a proper binary model; eval on it confirms the accuracy
    q = r.model
    for name in ("conv2", "ip1"):
        node = q.graph.node(name)
        assert node.quant[0].scheme == "binary"
        w = node.blobs[0].reshape(node.blobs[0].shape[0], -1)
        np.testing.assert_allclose(np.abs(w), np.abs(w[:, :1]) * np.ones_like(w), rtol=1e-6)
    assert not getattr(q.graph.node("conv1"), "quant", None)       # kept fp32
    res = caffeq.evaluate(q, workers=0)
    assert res["results"]["binary"]["top1"] == pytest.approx(r.best_metric)


def test_finetune_is_reproducible_and_bn_only_never_steps(tmp_path):
    data, val, proto, weights = _toy(tmp_path)
    kw = {"data": data, "val": val, "keep": "none", "iters": 5, "batch_size": 8, "bn_batches": 2, "seed": 7}
    a = finetune(proto, weights, **kw)
    b = finetune(proto, weights, **kw)
    for na, nb in zip(a.model.graph.nodes, b.model.graph.nodes):
        for x, y in zip(na.blobs or [], nb.blobs or []):
            np.testing.assert_array_equal(x, y)
    c = finetune(proto, weights, **dict(kw, seed=8))
    assert any(not np.array_equal(x, y) for na, nc in zip(a.model.graph.nodes, c.model.graph.nodes)
               for x, y in zip(na.blobs or [], nc.blobs or []))
    bn = finetune(proto, weights, **dict(kw, bn_only=True))
    assert [h["epoch"] for h in bn.history] == [0]
    src = caffeq.load(proto, weights)
    q = caffeq.quantize(src, "binary", keep="none")
    for name in ("conv", "ip"):      # no gradient step: the weights are the post-training ones
        np.testing.assert_array_equal(bn.model.graph.node(name).blobs[0], q.graph.node(name).blobs[0])
    assert bn.model.graph.node("bn").blobs[2].tolist() == [1.0]


# ---- the toy deploy net (arrays, no data layers) ----------------------------------------------

TOY = """
name: "toy"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 1 dim: 4 dim: 4 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" convolution_param { num_output: 4 kernel_size: 3 pad: 1 } }
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv" }
layer { name: "sc" type: "Scale" bottom: "conv" top: "conv" scale_param { bias_term: true } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip" inner_product_param { num_output: 3 } }
layer { name: "prob" type: "Softmax" bottom: "ip" top: "prob" }
"""


def _toy(tmp_path, n=48):
    from caffeq.io.writer import write_model_caffemodel
    proto = tmp_path / "toy.prototxt"
    proto.write_text(TOY)
    m = caffeq.load(str(proto), random_weights=True, seed=2)
    weights = tmp_path / "toy.caffemodel"
    write_model_caffemodel(m, str(weights))
    rng = np.random.default_rng(5)
    x = rng.normal(size=(n, 1, 4, 4)).astype(np.float32)
    y = np.argmax(np.stack([x[:, 0, :2].mean((1, 2)), x[:, 0, 2:].mean((1, 2)), x[:, 0, :, :2].mean((1, 2))]), 0)
    np.savez(tmp_path / "train.npz", data=x, label=y)
    np.savez(tmp_path / "val.npz", data=x[:16], label=y[:16])
    return str(tmp_path / "train.npz"), str(tmp_path / "val.npz"), str(proto), str(weights)


def test_deploy_net_without_loss_trains_cross_entropy(tmp_path):
    data, val, proto, weights = _toy(tmp_path)
    r = finetune(proto, weights, data=data, val=val, keep="none", epochs=2, batch_size=8, bn_batches=2)
    assert any("cross-entropy on 'ip'" in n for n in r.notes)    # on the Softmax's input
    assert len(r.history) == 3 and r.history[1]["loss"] > 0
    assert sorted(r.binarized) == ["conv", "ip"]


def test_what_reading_the_weights_said_reaches_the_notes(tmp_path):
    """A layer of the caffemodel whose parameters do not parse (a fork's numbering) is kept with a warning; the
    fine-tune passes it on with its own notes."""
    from caffeq.io.wire import encode_key, encode_varint

    def message_field(number, payload):
        return encode_key(number, 2) + encode_varint(len(payload)) + payload
    data, val, proto, weights = _toy(tmp_path)
    stray = message_field(1, b"fork_ip") + message_field(100, b"\x07")   # name, then a transform_param
    with open(weights, "ab") as f:
        f.write(message_field(100, stray))                                  # one more NetParameter.layer
    r = finetune(proto, weights, data=data, val=val, keep="none", epochs=1, batch_size=8, bn_batches=2)
    assert any("layer 'fork_ip': its parameters do not parse" in n for n in r.notes)


# ---- the command line ---------------------------------------------------------------------------

@pytest.mark.slow
def test_cli_end_to_end_subprocess(tmp_path):
    out = tmp_path / "digits_bwn.onnx"
    rep = tmp_path / "r.json"
    cmd = [sys.executable, str(REPO / "cli.py"), "finetune", TRAIN_VAL, "--weights", WEIGHTS, "--to", "binary",
           "--keep", "none", "--iters", "4", "--bn-batches", "2", "--batch-size", "32", "--seed", "1",
           "-o", str(out), "--json", str(rep), "--no-progress"]
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "binary layers: conv1, conv2, ip1, ip2" in p.stdout
    r = json.loads(rep.read_text())
    assert r["binarized"] == ["conv1", "conv2", "ip1", "ip2"]
    assert r["post_training"] == pytest.approx(0.6075)
    assert r["history"][-1]["steps"] == 4
    # compact binary weights in the ONNX file, and onnxruntime agrees with the fine-tuned accuracy
    import onnx
    import onnxruntime as ort
    model = onnx.load(str(out))
    float_bytes = sum(np.prod(t.dims) * 4 for t in model.graph.initializer if t.data_type == 1)
    assert float_bytes < 0.25 * 4 * (16 * 9 + 32 * 16 * 9 + 64 * 512 + 640)
    from caffeq.data import DataTransformer, Preprocess, open_dataset
    ds = open_dataset(str(DIGITS / "test_lmdb"), "lmdb",
                      Preprocess(DataTransformer(scale=1 / 256, mean_file=str(DIGITS / "mean.binaryproto"))))
    x = np.stack([ds[i][1] for i in range(len(ds))])
    y = np.array([ds[i][2] for i in range(len(ds))])
    sess = ort.InferenceSession(str(out))
    feeds = {i.name: (x if i.name == "data" else y.astype(np.float32)) for i in sess.get_inputs()}
    names = [o.name for o in sess.get_outputs()]
    scores = sess.run(None, feeds)[names.index("ip2")]
    assert (scores.argmax(1) == y).mean() == pytest.approx(r["best_metric"], abs=0.0025)


@pytest.mark.parametrize("extra, needle", [
    (["--to", "int8"], "binary weights only"),
    (["-o", "out.txt"], "unknown output format"),
    (["--keep", "nosuch"], "nosuch"),
    (["--epochs", "-1"], "--epochs"),
    (["--lr", "fast"], "--lr"),
    (["--optimizer", "rmsprop"], "--optimizer"),
    (["--budget", "1", "--keep", "none"], "--budget"),
    (["--data", "/nonexistent/lmdb"], "not found"),
    (["--keep", "conv1", "--only", "ip1"], "cannot be combined"),
])
def test_cli_bad_inputs_giveone_error_line(capsys, tmp_path, extra, needle):
    argv = ["finetune", TRAIN_VAL, "--weights", WEIGHTS, "--iters", "1", "--no-progress",
            "-o", str(tmp_path / "x.caffeq")] + extra
    if "-o" in extra:
        argv = argv[:-2 - len(extra)] + extra
    msg = one_error_line(capsys, argv)
    assert needle in msg
    assert not os.path.exists(tmp_path / "x.caffeq")


def test_cli_missing_files(capsys, tmp_path):
    assert "no such file" in one_error_line(capsys, ["finetune", str(tmp_path / "none.prototxt"),
                                                      "--weights", WEIGHTS])
    _data, _val, proto, weights = _toy(tmp_path)
    # a deploy net has no training data of its own
    assert "--data" in one_error_line(capsys, ["finetune", proto, "--weights", weights, "--keep", "none",
                                                "--no-progress", "-o", str(tmp_path / "t.caffeq")])


def test_training_crops_are_random_per_epoch_and_seeded(tmp_path):
    """Caffe's TRAIN transform: random crop (and mirror) per item, drawn anew each epoch, the same for
    the same seed; validation takes the centre crop."""
    from caffeq.data import DataTransformer, Preprocess, open_dataset
    from caffeq.finetune import EpochSampler, EpochView
    x = np.arange(8 * 6 * 6, dtype=np.float32).reshape(8, 1, 6, 6)
    np.savez(tmp_path / "a.npz", data=x, label=np.arange(8) % 3)

    def view(seed):
        t = DataTransformer(crop_size=4, mirror=True, phase="TRAIN")
        return EpochView(open_dataset(str(tmp_path / "a.npz"), "array", Preprocess(t)), seed)

    v, w = view(1), view(1)
    epoch0 = [v[i][1] for i in range(8)]
    epoch1 = [v[8 + i][1] for i in range(8)]
    assert all(a.shape == (1, 4, 4) for a in epoch0)
    assert any(not np.array_equal(a, b) for a, b in zip(epoch0, epoch1))
    assert all(np.array_equal(a, w[i][1]) for i, a in enumerate(epoch0))
    other = view(2)
    assert any(not np.array_equal(a, other[i][1]) for i, a in enumerate(epoch0))
    # every crop is a window of the image (mirrored or not)
    for i, a in enumerate(epoch0 + epoch1):
        img = x[i % 8, 0]
        windows = [img[h:h + 4, c:c + 4] for h in range(3) for c in range(3)]
        assert any(np.array_equal(a[0], win) or np.array_equal(a[0], win[:, ::-1]) for win in windows)
    s = EpochSampler(8, seed=3)
    s.set_epoch(2)
    keys = list(s)
    assert sorted(keys) == list(range(16, 24))
    s2 = EpochSampler(8, seed=3)
    s2.set_epoch(2)
    assert list(s2) == keys


@pytest.mark.slow
def test_cli_budget_keeps_the_most_sensitive_layers(capsys, tmp_path, monkeypatch):
    from caffeq.sensitivity import choose_keep, layer_sensitivity
    expected_keep = choose_keep(layer_sensitivity(TRAIN_VAL, weights=WEIGHTS, cumulative=False), 1.0)
    out = tmp_path / "b.caffeq"
    rc = main(["finetune", TRAIN_VAL, "--weights", WEIGHTS, "--budget", "1.0", "--iters", "2", "--bn-batches", "2",
               "--no-progress", "-o", str(out), "--json", str(tmp_path / "b.json")])
    assert rc == 0
    r = json.loads((tmp_path / "b.json").read_text())
    assert r["budget"]["keep"] == expected_keep
    assert sorted(r["kept"]) == sorted(expected_keep)
    assert f"budget 1 points: kept fp32 {', '.join(expected_keep)}" in capsys.readouterr().out
    monkeypatch.chdir(DIGITS)       # the train_val's data sources are relative to examples/digits
    back = caffeq.load(str(out))    # a .caffeq keeps the compact binary form
    binary = sorted(n.name for n in back.graph.nodes if n.quant)
    assert binary == sorted({"conv1", "conv2", "ip1", "ip2"} - set(expected_keep))


# ---- Ctrl-C -------------------------------------------------------------------------------------

def _interrupt_at_step(monkeypatch, n):
    """Ctrl-C (KeyboardInterrupt) right after the n-th training step."""
    import caffeq.finetune as ft
    calls = []
    real = ft.clip_latent

    def clip_then_interrupt(mods):
        real(mods)
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt

    monkeypatch.setattr(ft, "clip_latent", clip_then_interrupt)


@pytest.mark.slow
def test_interrupted_finetune_returns_the_best_epoch_so_far(tmp_path, monkeypatch):
    data, val, proto, weights = _toy(tmp_path)
    kw = {"data": data, "val": val, "keep": "none", "epochs": 4, "batch_size": 8, "bn_batches": 2, "seed": 3}
    _interrupt_at_step(monkeypatch, 6 * 2 + 3)                # 48 items / 8: 6 steps an epoch; cut in epoch 3
    cut = finetune(proto, weights, **kw)
    assert cut.interrupted
    assert [h["epoch"] for h in cut.history] == [0, 1, 2]
    assert any("interrupted after 2 complete epoch(s)" in n for n in cut.notes)
    best = max(cut.history, key=lambda h: h["top1"])
    assert cut.best_epoch == best["epoch"] and cut.best_metric == best["top1"]
    # the uninterrupted run went the same way up to the cut
    monkeypatch.undo()
    full = finetune(proto, weights, **kw)
    assert not full.interrupted
    assert [h["top1"] for h in full.history[:3]] == [h["top1"] for h in cut.history]
    if full.best_epoch <= 2:
        for a, b in zip(full.model.graph.nodes, cut.model.graph.nodes):
            for x, y in zip(a.blobs or [], b.blobs or []):
                np.testing.assert_array_equal(x, y)


def test_cli_ctrl_c_writes_the_best_epoch_and_exits_130(tmp_path, monkeypatch, capsys):
    data, val, proto, weights = _toy(tmp_path)
    _interrupt_at_step(monkeypatch, 6 + 2)                    # in epoch 2
    out = tmp_path / "cut.caffeq"
    rc = main(["finetune", proto, "--weights", weights, "--data", data, "--val", val, "--keep", "none",
               "--epochs", "3", "--batch-size", "8", "--bn-batches", "2", "--no-progress", "-o", str(out),
               "--json", str(tmp_path / "cut.json")])
    assert rc == 130
    err = capsys.readouterr().err
    r = json.loads((tmp_path / "cut.json").read_text())
    assert r["interrupted"] is True and [h["epoch"] for h in r["history"]] == [0, 1]
    assert f"interrupted: wrote the best epoch so far (epoch {r['best_epoch']})" in err
    back = caffeq.load(str(out))
    assert sorted(n.name for n in back.graph.nodes if n.quant) == ["conv", "ip"]
