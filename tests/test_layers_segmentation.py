"""Segmentation and classification fork layers: Pooling's mask top and ceil_mode, SegNet's
Upsample, the two BN layers (SegNet / ENet, PSPNet), CropCenter, Mish and SeLu.

Each reference is a numpy loop written here from the fork's C++ (caffe-segnet's pooling_layer.cpp
and upsample_layer.cpp, the forks' bn_layer.cpp, jolibrain's crop_center_layer.cpp, the Mish and
SeLu layers), on shapes where N, C, H and W all differ, and is checked in torch (caffeq's
forward), in onnxruntime (the exported ONNX) and in the generated standalone model.py.
"""
import math

import numpy as np
import pytest
import torch
from conftest import assert_close, load_model_py, model_py_outputs, net, onnx_outputs

from caffeq.layers import LayerError
from caffeq.model import load_from_text

FLT_MAX = float(np.finfo(np.float32).max)


def check_everywhere(model, feeds, refs, tmp_path, atol=0.0, rtol=0.0, opsets=(13, None)):
    """caffeq's forward, onnxruntime (each opset) and model.py against the references {top: array}."""
    ours = model.run(feeds, all_blobs=True)
    for k, ref in refs.items():
        assert_close(ours[k], ref, atol, rtol, f"torch {k}")
    for opset in opsets:
        got = onnx_outputs(model, feeds, tmp_path, opset)
        for k, ref in refs.items():
            if k in got:
                assert_close(got[k], ref, atol, rtol, f"onnx opset {opset} {k}")
    got = model_py_outputs(model, feeds, tmp_path)
    for k, ref in refs.items():
        if k in got:
            assert_close(got[k], ref, atol, rtol, f"model.py {k}")


# ---- Pooling with a mask top ---------------------------------------------------------------

def pool_out(size, k, s, p, ceil):
    span = size + 2 * p - k
    out = (math.ceil(span / s) if ceil else span // s) + 1
    return out


def max_pool_mask_ref(x, kh, kw, sh, sw, ph, pw, ceil=True):
    """caffe-segnet's PoolingLayer::Forward_cpu, MAX with top[1]: loops, strict '>' from -FLT_MAX."""
    n, c, h, w = x.shape
    oh, ow = pool_out(h, kh, sh, ph, ceil), pool_out(w, kw, sw, pw, ceil)
    if ph or pw:
        oh -= (oh - 1) * sh >= h + ph
        ow -= (ow - 1) * sw >= w + pw
    top = np.full((n, c, oh, ow), -FLT_MAX, np.float32)
    mask = np.full((n, c, oh, ow), -1, np.float32)
    for i in range(n):
        for j in range(c):
            for a in range(oh):
                for b in range(ow):
                    hs, ws = a * sh - ph, b * sw - pw
                    he, we = min(hs + kh, h), min(ws + kw, w)
                    for yy in range(max(hs, 0), he):
                        for xx in range(max(ws, 0), we):
                            if x[i, j, yy, xx] > top[i, j, a, b]:
                                top[i, j, a, b] = x[i, j, yy, xx]
                                mask[i, j, a, b] = yy * w + xx
    return top, mask


POOL_CASES = [
    # (pooling_param, kernel/stride/pad as (kh, kw, sh, sw, ph, pw), ceil)
    ("kernel_size: 2 stride: 2", (2, 2, 2, 2, 0, 0), True),                        # SegNet / ENet
    ("kernel_size: 3 stride: 2 pad: 1", (3, 3, 2, 2, 1, 1), True),                  # overlapping windows
    ("kernel_h: 3 kernel_w: 2 stride_h: 1 stride_w: 3 pad_h: 1 pad_w: 0", (3, 2, 1, 3, 1, 0), True),
    ("kernel_h: 1 kernel_w: 2 stride_h: 3 stride_w: 2", (1, 2, 3, 2, 0, 0), True),  # empty windows (ceil)
    ("kernel_size: 3 stride: 2 round_mode: FLOOR", (3, 3, 2, 2, 0, 0), False),
]


@pytest.mark.parametrize("param, geometry, ceil", POOL_CASES, ids=[f"p{i}" for i in range(len(POOL_CASES))])
def test_max_pooling_mask_top(param, geometry, ceil, tmp_path):
    g = np.random.default_rng(1)
    # few distinct values: ties, where Caffe keeps the first maximum in row-major order
    x = g.integers(-3, 4, (2, 3, 8, 11)).astype(np.float32)
    x[0, 0, :3, :3] = -np.inf      # windows with nothing above -FLT_MAX keep -1
    model = load_from_text(net(f'layer {{ name: "p" type: "Pooling" bottom: "x" top: "p" top: "m" '
                               f'pooling_param {{ pool: MAX {param} }} }}', inputs={"x": x.shape}))
    top, mask = max_pool_mask_ref(x, *geometry, ceil=ceil)
    assert model.blob_shapes["p"] == model.blob_shapes["m"] == top.shape
    assert (mask == -1).any() and (mask >= 0).any()
    check_everywhere(model, {"x": x}, {"p": top, "m": mask}, tmp_path)


def test_pooling_mask_needs_max():
    with pytest.raises(LayerError, match="AVE and STOCHASTIC pooling takes 1 top"):
        load_from_text(net('layer { name: "p" type: "Pooling" bottom: "x" top: "p" top: "m" '
                           'pooling_param { pool: AVE kernel_size: 2 } }', inputs={"x": (1, 2, 4, 4)}))
    with pytest.raises(LayerError, match="1 or 2 tops"):
        load_from_text(net('layer { name: "p" type: "Pooling" bottom: "x" top: "p" top: "m" top: "q" '
                           'pooling_param { pool: MAX kernel_size: 2 } }', inputs={"x": (1, 2, 4, 4)}))


# ---- SegNet's Upsample ---------------------------------------------------------------------

def unpool_ref(x, mask, oh, ow):
    """caffe-segnet's UpsampleLayer::Forward_cpu: zeros, then top[int(mask[i])] = x[i] in order."""
    n, c = x.shape[:2]
    top = np.zeros((n, c, oh * ow), np.float32)
    for i in range(n):
        for j in range(c):
            for src, idx in zip(x[i, j].ravel(), mask[i, j].ravel()):
                top[i, j, int(idx)] = src
    return top.reshape(n, c, oh, ow)


@pytest.mark.parametrize("pool, upsample, size", [
    ("kernel_size: 2 stride: 2", "scale: 2", (8, 10)),
    ("kernel_size: 2 stride: 2", "scale: 2 pad_out_h: true", (7, 10)),        # 7 rows pool to 4
    ("kernel_size: 3 stride: 2 pad: 1", "upsample_h: 7 upsample_w: 10", (7, 10)),  # shared argmaxes
    ("kernel_size: 3 stride: 2 pad: 1", "upsample_h: 7 upsample_w: 10 scale: 5 pad_out_h: true", (7, 10)),
    ("kernel_h: 2 kernel_w: 3 stride_h: 2 stride_w: 3", "scale_h: 2 scale_w: 3 upsample_h: 5", (8, 9)),
], ids=["segnet", "pad_out", "overlap_last_wins", "size_wins", "scale_hw_one_size_ignored"])
def test_segnet_pool_and_upsample(pool, upsample, size, tmp_path):
    g = np.random.default_rng(2)
    h, w = size
    x = g.integers(-2, 3, (2, 3, h, w)).astype(np.float32)
    text = net(f'layer {{ name: "p" type: "Pooling" bottom: "x" top: "p" top: "m" pooling_param {{ pool: MAX {pool} }} }}',
               inputs={"x": x.shape})
    pooled = load_from_text(text).blob_shapes["p"]
    d = g.standard_normal(pooled).astype(np.float32)   # decoder features, unlike the pooled values
    model = load_from_text(text + net(f'layer {{ name: "u" type: "Upsample" bottom: "d" bottom: "m" top: "u" '
                                      f'upsample_param {{ {upsample} }} }}', inputs={"d": pooled}))
    _, mask = max_pool_mask_ref(x, *_geometry(pool))
    if "pad: 1" in pool:   # overlapping windows share argmaxes: the last write must win
        assert any(np.unique(plane).size < plane.size for plane in mask.reshape(6, -1))
    ref = unpool_ref(d, mask, h, w)
    assert model.blob_shapes["u"] == (2, 3, h, w)
    check_everywhere(model, {"x": x, "d": d}, {"u": ref}, tmp_path)


def _geometry(pool):
    """(kh, kw, sh, sw, ph, pw) of a pooling_param text such as "kernel_size: 3 stride: 2 pad: 1"."""
    toks = pool.split()
    vals = {key.rstrip(":"): int(val) for key, val in zip(toks[::2], toks[1::2])}
    kh = vals.get("kernel_h", vals.get("kernel_size"))
    kw = vals.get("kernel_w", vals.get("kernel_size"))
    sh = vals.get("stride_h", vals.get("stride", 1))
    sw = vals.get("stride_w", vals.get("stride", 1))
    p = vals.get("pad", 0)
    return kh, kw, sh, sw, p, p


def test_upsample_bad_params():
    two = {"x": (1, 2, 3, 4), "m": (1, 2, 3, 4)}
    with pytest.raises(LayerError, match="scale_h and scale_w"):
        load_from_text(net('layer { name: "u" type: "Upsample" bottom: "x" bottom: "m" top: "u" '
                           'upsample_param { scale: 2 scale_h: 2 scale_w: 2 } }', inputs=two))
    with pytest.raises(LayerError, match="must be > 1"):
        load_from_text(net('layer { name: "u" type: "Upsample" bottom: "x" bottom: "m" top: "u" '
                           'upsample_param { upsample_h: 1 upsample_w: 6 } }', inputs=two))
    with pytest.raises(LayerError, match="scale must be > 1"):
        load_from_text(net('layer { name: "u" type: "Upsample" bottom: "x" bottom: "m" top: "u" '
                           'upsample_param { scale: 1 } }', inputs=two))


# ---- Mish, SeLu ----------------------------------------------------------------------------

def mish_ref(x):
    """The YOLOv4 fork's mish: x * tanh(softplus(x)), darknet's softplus with threshold 20."""
    x = x.astype(np.float64)
    soft = np.where(x > 20, x, np.where(x < -20, np.exp(x), np.log1p(np.exp(np.minimum(x, 20)))))
    return x * np.tanh(soft)


def selu_ref(x, lam=1.050700987, alpha=1.67326324):
    x = x.astype(np.float64)
    return np.where(x > 0, lam * x, lam * alpha * (np.exp(np.minimum(x, 0)) - 1))


def _activation_input():
    g = np.random.default_rng(3)
    x = (g.standard_normal((2, 3, 5, 7)) * 4).astype(np.float32)
    x.flat[:8] = [0.0, -0.0, 25.0, -25.0, 90.0, -90.0, 1e-7, -1e-7]
    return x


@pytest.mark.parametrize("kind, ref", [("Mish", mish_ref), ("SeLu", selu_ref)])
def test_fork_activations(kind, ref, tmp_path):
    x = _activation_input()
    model = load_from_text(net(f'layer {{ name: "a" type: "{kind}" bottom: "x" top: "a" }}', inputs={"x": x.shape}))
    check_everywhere(model, {"x": x}, {"a": ref(x)}, tmp_path, atol=1e-6, rtol=1e-6, opsets=(13, 18))


# ---- BN (SegNet / ENet, PSPNet), CropCenter, SeLu's parameters: fork fields of caffe.proto -----

def _has_field(name, message="LayerParameter"):
    """Whether this checkout's caffe.proto declares the fork field (helper "schema" adds them)."""
    from caffeq.io.schema import caffe_pb2
    return name in getattr(caffe_pb2, message).DESCRIPTOR.fields_by_name


needs_bn = pytest.mark.skipif(not _has_field("bn_param"), reason="caffe.proto without bn_param")
needs_selu = pytest.mark.skipif(not _has_field("selu_param"), reason="caffe.proto without selu_param")
needs_crop = pytest.mark.skipif(not _has_field("crop_center_param"), reason="caffe.proto without crop_center_param")


def bn_text(params, tops=("b",), nparams=0):
    top = " ".join(f'top: "{t}"' for t in tops)
    specs = "param { lr_mult: 1 } " * nparams
    return net(f'layer {{ name: "b" type: "BN" bottom: "x" {top} {specs}bn_param {{ {params} }} }}',
               inputs={"x": (2, 3, 5, 7)})


def _bn_model(text, blobs):
    model = load_from_text(text, random_weights=True)
    node = next(n for n in model.layers if n.name == "b")
    node.blobs = [b.reshape(1, -1, 1, 1).astype(np.float32) for b in blobs]
    return model


@needs_bn
def test_segnet_bn_inference(tmp_path):
    g = np.random.default_rng(4)
    x = g.standard_normal((2, 3, 5, 7)).astype(np.float32)
    scale, shift = g.uniform(0.5, 2, 3), g.standard_normal(3)
    model = _bn_model(bn_text("bn_mode: INFERENCE"), [scale, shift])
    ref = np.empty_like(x)
    for c in range(3):   # bn_layer.cpp INFERENCE: top = bottom * scale + shift
        ref[:, c] = x[:, c] * np.float32(scale[c]) + np.float32(shift[c])
    check_everywhere(model, {"x": x}, {"b": ref}, tmp_path, atol=1e-6, rtol=1e-6)


@needs_bn
def test_segnet_bn_learn_uses_the_batch_statistics_at_test(tmp_path):
    g = np.random.default_rng(5)
    x = (g.standard_normal((2, 3, 5, 7)) * 3 + 1).astype(np.float32)
    scale, shift = g.uniform(0.5, 2, 3), g.standard_normal(3)
    model = _bn_model(bn_text("scale_filler { type: 'constant' value: 1 }", tops=("b", "mean", "var")),
                      [scale, shift])
    xd = x.astype(np.float64)
    ref, means, vars_ = np.empty_like(xd), np.empty(3), np.empty(3)
    for c in range(3):   # var(X) = E(X^2) - (EX)^2 over N, H, W; eps 1e-9
        m = xd[:, c].mean()
        v = (xd[:, c] ** 2).mean() - m * m
        ref[:, c] = (xd[:, c] - m) / np.sqrt(v + 1e-9) * scale[c] + shift[c]
        means[c], vars_[c] = m, v
    assert model.blob_shapes["mean"] == model.blob_shapes["var"] == (1, 3, 1, 1)
    check_everywhere(model, {"x": x}, {"b": ref, "mean": means.reshape(1, 3, 1, 1),
                                       "var": vars_.reshape(1, 3, 1, 1)}, tmp_path, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["LEARN", "INFERENCE"])
def test_bnplus_is_segnets_bn(mode, tmp_path):
    # ArcherFMY/caffe-sal-ensemble's BNplus: bnplus_layer.cpp is SegNet's BN, its mode in bnplus_param
    g = np.random.default_rng(7)
    x = (g.standard_normal((2, 3, 5, 7)) * 2 + 0.5).astype(np.float32)
    scale, shift = g.uniform(0.5, 2, 3), g.standard_normal(3)
    text = net(f'layer {{ name: "b" type: "BNplus" bottom: "x" top: "b" bnplus_param {{ bnplus_mode: {mode} }} }}',
               inputs={"x": x.shape})
    model = _bn_model(text, [scale, shift])
    xd = x.astype(np.float64)
    ref = np.empty_like(xd)
    for c in range(3):
        if mode == "LEARN":
            m = xd[:, c].mean()
            ref[:, c] = (xd[:, c] - m) / np.sqrt((xd[:, c] ** 2).mean() - m * m + 1e-9) * scale[c] + shift[c]
        else:
            ref[:, c] = xd[:, c] * np.float32(scale[c]) + np.float32(shift[c])
    check_everywhere(model, {"x": x}, {"b": ref}, tmp_path, atol=1e-5, rtol=1e-5)


def pspnet_ref(x, slope, bias, mean, var, eps=1e-5):
    out = np.empty(x.shape, np.float64)
    for c in range(x.shape[1]):
        out[:, c] = (x[:, c] - mean[c]) / np.sqrt(var[c] + eps) * slope[c] + bias[c]
    return out


@needs_bn
@pytest.mark.parametrize("params, nparams, eps", [("frozen: true momentum: 0.95", 0, 1e-5),
                                                  ("eps: 0.001", 0, 1e-3),
                                                  ("", 4, 1e-5)], ids=["frozen", "eps", "four_params"])
def test_pspnet_bn_uses_the_stored_statistics(params, nparams, eps, tmp_path):
    g = np.random.default_rng(6)
    x = (g.standard_normal((2, 3, 5, 7)) * 2 + 0.5).astype(np.float32)
    slope, bias, mean, var = g.uniform(0.5, 2, 3), g.standard_normal(3), g.standard_normal(3), g.uniform(0.1, 3, 3)
    model = _bn_model(bn_text(params, nparams=nparams), [slope, bias, mean, var])
    node = next(n for n in model.layers if n.name == "b")
    assert node.attrs["variant"] == "pspnet" and node.expected_param_shapes == [(1, 3, 1, 1)] * 4
    ref = pspnet_ref(x.astype(np.float64), *(np.float32(a).astype(np.float64) for a in (slope, bias, mean, var)),
                     eps=np.float32(eps))
    check_everywhere(model, {"x": x}, {"b": ref}, tmp_path, atol=1e-5, rtol=1e-5)


@needs_bn
def test_robert0812s_bn_reads_its_1_by_c_blobs_with_eps_1e_7(tmp_path):
    # Robert0812/caffe mybn (BestiVictory/ILGnet): slope_filler, bias_filler and moving_average together;
    # blobs gamma, beta, mean, variance stored (1, C); y = (x - mean) / sqrt(var + 1e-7) * gamma + beta
    from caffeq.io.prototxt import parse_prototxt_text
    from caffeq.io.writer import write_caffemodel
    from caffeq.model import load
    text = bn_text('slope_filler { type: "constant" value: 1 } bias_filler { type: "constant" value: 0.001 } '
                   'moving_average: true', nparams=4)
    g = np.random.default_rng(8)
    slope, bias, mean = (g.standard_normal(3).astype(np.float32) for _ in range(3))
    var = g.uniform(1e-6, 1e-5, 3).astype(np.float32)        # small: eps 1e-7 matters
    (tmp_path / "n.prototxt").write_text(text)
    write_caffemodel(parse_prototxt_text(text), {"b": [v.reshape(1, 3) for v in (slope, bias, mean, var)]},
                     tmp_path / "n.caffemodel")
    model = load(str(tmp_path / "n.prototxt"), weights=str(tmp_path / "n.caffemodel"))
    x = g.standard_normal((2, 3, 5, 7)).astype(np.float32)
    ref = pspnet_ref(x.astype(np.float64), *(a.astype(np.float64) for a in (slope, bias, mean, var)),
                     eps=float(np.float32(1e-7)))
    check_everywhere(model, {"x": x}, {"b": ref}, tmp_path, atol=1e-4, rtol=1e-5)
    with pytest.raises(LayerError, match="moving_average false"):
        load_from_text(text.replace("moving_average: true", "moving_average: false"))


@needs_bn
@pytest.mark.parametrize("params, nparams", [("bn_mode: INFERENCE", 0), ("frozen: true", 0)], ids=["segnet", "pspnet"])
def test_bn_of_an_n_by_c_input_is_per_channel(params, nparams, tmp_path):
    # the forks read num/channels/height/width: an (N, C) bottom (after an InnerProduct, as in
    # wy1iu's LargeMargin nets) is (N, C, 1, 1); the top keeps the bottom's shape
    g = np.random.default_rng(7)
    x = (g.standard_normal((4, 3)) * 2 + 0.5).astype(np.float32)
    a, b, mean, var = g.uniform(0.5, 2, 3), g.standard_normal(3), g.standard_normal(3), g.uniform(0.1, 3, 3)
    text = bn_text(params, nparams=nparams).replace("dim: 2 dim: 3 dim: 5 dim: 7", "dim: 4 dim: 3")
    blobs = [a, b] if "INFERENCE" in params else [a, b, mean, var]
    model = _bn_model(text, blobs)
    assert model.blob_shapes["b"] == (4, 3)
    xd = x.astype(np.float64)
    f = [np.float32(v).astype(np.float64) for v in blobs]
    ref = xd * f[0] + f[1] if len(f) == 2 else pspnet_ref(xd[:, :, None, None], *f).reshape(4, 3)
    check_everywhere(model, {"x": x}, {"b": ref}, tmp_path, atol=1e-5, rtol=1e-5)


@needs_bn
def test_pspnet_bn_training_normalizes_by_the_batch_and_updates_the_averages():
    g = np.random.default_rng(7)
    x = torch.from_numpy((g.standard_normal((2, 3, 5, 7)) * 2 + 1).astype(np.float32))
    model = load_from_text(bn_text("momentum: 0.8"), random_weights=True)
    node = next(n for n in model.layers if n.name == "b")
    params = [torch.from_numpy(g.uniform(0.5, 2, (1, 3, 1, 1)).astype(np.float32)) for _ in range(4)]
    before = [p.clone() for p in params]
    y = node.spec.forward(node.attrs, params, x, training=True)
    xd = x.double().numpy()
    bm = np.array([xd[:, c].mean() for c in range(3)])
    bv = np.array([((xd[:, c] - bm[c]) ** 2).mean() for c in range(3)])
    ref = pspnet_ref(xd, before[0].double().flatten().numpy(), before[1].double().flatten().numpy(), bm, bv)
    assert_close(y.numpy(), ref, 1e-5, 1e-5, "train-mode output")
    assert_close(params[2].flatten().numpy(), 0.8 * before[2].flatten().numpy() + 0.2 * bm, 1e-6, 1e-6, "mean")
    assert_close(params[3].flatten().numpy(), 0.8 * before[3].flatten().numpy() + 0.2 * bv, 1e-6, 1e-6, "var")


@needs_bn
def test_pspnet_bn_train_mode_in_model_py_matches_caffeq(tmp_path):
    """The generated PSPNetBN in train mode: batch statistics and PSPNet's running averages."""
    g = np.random.default_rng(12)
    x = (g.standard_normal((2, 3, 5, 7)) * 2 + 1).astype(np.float32)
    blobs = [g.uniform(0.5, 2, 3) for _ in range(4)]
    model = _bn_model(bn_text("momentum: 0.7"), blobs)
    node = next(n for n in model.layers if n.name == "b")
    module = load_model_py(model, tmp_path / "py")[0].train()
    got = module(torch.from_numpy(x))
    params = [torch.from_numpy(np.asarray(b, np.float32).copy()) for b in node.blobs]
    want = node.spec.forward(node.attrs, params, torch.from_numpy(x), training=True)
    assert torch.equal(got.detach(), want)
    bn = next(m for m in module.modules() if type(m).__name__ == "PSPNetBN")
    assert torch.equal(bn.mean, params[2]) and torch.equal(bn.variance, params[3])
    assert not torch.equal(params[2], torch.from_numpy(np.asarray(node.blobs[2], np.float32)))


@needs_bn
@pytest.mark.parametrize("params, eps", [("scale_filler { type: \"constant\" value: 1 } moving_average: true "
                                          "decay: 0.05", 1e-10),
                                         ("var_eps: 0.001 frozen: true", 1e-3)], ids=["segstereo", "var_eps"])
def test_yjxiong_bn_divides_by_the_history_deviation(params, eps, tmp_path):
    # yjxiong/caffe's BN (TSN; yangguorun/SegStereo's deploy files) at TEST with use_history_in_test:
    # x minus the history mean, over sqrt(history variance + var_eps), times scale, plus shift
    g = np.random.default_rng(9)
    x = (g.standard_normal((2, 3, 5, 7)) * 2 + 0.5).astype(np.float32)
    blobs = [g.uniform(0.5, 2, 3), g.standard_normal(3), g.standard_normal(3), g.uniform(0.1, 3, 3)]
    model = _bn_model(bn_text(params), blobs)
    node = next(n for n in model.layers if n.name == "b")
    assert node.attrs["variant"] == "tsn" and node.expected_param_shapes == [(1, 3, 1, 1)] * 4
    assert node.attrs["momentum"] == pytest.approx(0.95)   # history = 0.05 batch + 0.95 history
    ref = pspnet_ref(x.astype(np.float64), *(np.float32(a).astype(np.float64) for a in blobs), eps=np.float32(eps))
    check_everywhere(model, {"x": x}, {"b": ref}, tmp_path, atol=1e-5, rtol=1e-5)
    with pytest.raises(LayerError, match="use_history_in_test false"):
        load_from_text(bn_text(params + " use_history_in_test: false"))
    with pytest.raises(LayerError, match="mixes yjxiong/caffe's BN fields with bn_mode"):
        load_from_text(bn_text(params + " bn_mode: INFERENCE"))


@needs_bn
def test_hole_convolution_is_convolution_with_its_hole_as_dilation(tmp_path):
    # yangguorun/SegStereo's HoleConvolution (hole_conv_layer.cpp): effective kernel k + (k - 1)(hole - 1)
    from conftest import conv_ref
    g = np.random.default_rng(10)
    x = g.standard_normal((1, 2, 9, 8)).astype(np.float32)
    model = load_from_text(net('layer { name: "h" type: "HoleConvolution" bottom: "x" top: "h" convolution_param { '
                               'num_output: 3 kernel_size: 3 pad: 2 hole: 2 bias_term: false } }',
                               inputs={"x": x.shape}), random_weights=True)
    node = next(n for n in model.layers if n.name == "h")
    w = np.asarray(node.blobs[0], np.float32)
    dilated = np.zeros((3, 2, 5, 5), np.float32)
    dilated[:, :, ::2, ::2] = w      # the hole spreads the taps two pixels apart
    assert model.blob_shapes["h"] == (1, 3, 9, 8)
    check_everywhere(model, {"x": x}, {"h": conv_ref(x, dilated, None, (1, 1), (2, 2))}, tmp_path,
                     atol=1e-5, rtol=1e-5)


@needs_bn
@pytest.mark.parametrize("text, msg", [
    (bn_text(""), "say which"),
    (bn_text("bn_mode: INFERENCE frozen: true"), "mixes"),
    (bn_text("bn_mode: INFERENCE", tops=("b", "m")), "at most 1"),
    (bn_text("eps: 0"), "eps must be > 0"),
])
def test_bn_bad_params(text, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(text)


@needs_selu
def test_selu_parameters(tmp_path):
    x = _activation_input()
    model = load_from_text(net('layer { name: "a" type: "SeLu" bottom: "x" top: "a" '
                               'selu_param { lambda: 2 alpha: 0.5 } }', inputs={"x": x.shape}))
    check_everywhere(model, {"x": x}, {"a": selu_ref(x, 2.0, 0.5)}, tmp_path, atol=1e-6, rtol=1e-6)


@needs_crop
@pytest.mark.parametrize("shape, crop", [((2, 3, 7, 9), (0, 1, 2, 3)), ((4, 3, 5, 7), (1, 1, 2, 3))])
def test_crop_center(shape, crop, tmp_path):
    x = np.random.default_rng(8).standard_normal(shape).astype(np.float32)
    sizes = " ".join(f"crop_size: {c}" for c in crop)
    model = load_from_text(net(f'layer {{ name: "c" type: "CropCenter" bottom: "x" top: "c" '
                               f'crop_center_param {{ {sizes} }} }}', inputs={"x": shape}))
    ref = x.copy()
    for axis, k in enumerate(crop):   # crop_copy: indices crop .. size - crop on every axis
        ref = np.take(ref, np.arange(k, shape[axis] - k), axis=axis)
    check_everywhere(model, {"x": x}, {"c": ref}, tmp_path)


@needs_crop
def test_crop_center_bad_sizes():
    with pytest.raises(LayerError, match="one value per axis"):
        load_from_text(net('layer { name: "c" type: "CropCenter" bottom: "x" top: "c" '
                           'crop_center_param { crop_size: 1 } }', inputs={"x": (2, 3, 7, 9)}))
    with pytest.raises(LayerError, match="leaves nothing"):
        load_from_text(net('layer { name: "c" type: "CropCenter" bottom: "x" top: "c" '
                           'crop_center_param { crop_size: 0 crop_size: 1 crop_size: 4 crop_size: 0 } }',
                           inputs={"x": (2, 3, 7, 9)}))


# ---- ceil_mode (DenseNet, DPN, ResNeXt, R-FCN, Inception conversions) ----------------------

needs_ceil_mode = pytest.mark.skipif(not _has_field("ceil_mode", "PoolingParameter"),
                                     reason="caffe.proto without pooling_param.ceil_mode")


def ave_pool_ref(x, k, s, p, ceil):
    """BVLC's AVE loop: windows clipped to H + pad give the divisor, then to the input for the sum."""
    n, c, h, w = x.shape
    oh, ow = pool_out(h, k, s, p, ceil), pool_out(w, k, s, p, ceil)
    if p:
        oh -= (oh - 1) * s >= h + p
        ow -= (ow - 1) * s >= w + p
    out = np.zeros((n, c, oh, ow), np.float64)
    for a in range(oh):
        for b in range(ow):
            hs, ws = a * s - p, b * s - p
            he, we = min(hs + k, h + p), min(ws + k, w + p)
            size = (he - hs) * (we - ws)
            out[:, :, a, b] = x[:, :, max(hs, 0):min(he, h), max(ws, 0):min(we, w)].sum(axis=(2, 3)) / size
    return out


@needs_ceil_mode
@pytest.mark.parametrize("ceil", [False, True])
@pytest.mark.parametrize("pool", ["MAX", "AVE"])
def test_ceil_mode(ceil, pool, tmp_path):
    x = np.random.default_rng(9).standard_normal((2, 3, 8, 11)).astype(np.float32)
    model = load_from_text(net(f'layer {{ name: "p" type: "Pooling" bottom: "x" top: "p" pooling_param {{ '
                               f'pool: {pool} kernel_size: 3 stride: 2 pad: 1 ceil_mode: {str(ceil).lower()} }} }}',
                               inputs={"x": x.shape}))
    ref = max_pool_mask_ref(x, 3, 3, 2, 2, 1, 1, ceil)[0] if pool == "MAX" else ave_pool_ref(x, 3, 2, 1, ceil)
    # 8 rows: ceil gives 5 windows, floor 4 (the 11 columns give 6 either way)
    assert model.blob_shapes["p"] == (2, 3, 5 if ceil else 4, 6)
    check_everywhere(model, {"x": x}, {"p": ref}, tmp_path, atol=1e-6, rtol=1e-6)


@needs_ceil_mode
def test_ceil_mode_contradicting_round_mode():
    with pytest.raises(LayerError, match="contradicts"):
        load_from_text(net('layer { name: "p" type: "Pooling" bottom: "x" top: "p" pooling_param { '
                           'kernel_size: 3 stride: 2 ceil_mode: false round_mode: CEIL } }', inputs={"x": (1, 2, 8, 8)}))


@pytest.mark.parametrize("floor", [False, True])
def test_apollos_cmp_out_shape_floor_as_conv(floor, tmp_path):
    # Baidu Apollo's traffic-light nets: true sizes the output with floor, as a convolution; false is BVLC's ceil
    x = np.random.default_rng(10).standard_normal((1, 2, 8, 11)).astype(np.float32)
    model = load_from_text(net(f'layer {{ name: "p" type: "Pooling" bottom: "x" top: "p" pooling_param {{ pool: MAX '
                               f'kernel_size: 3 stride: 2 pad: 1 cmp_out_shape_floor_as_conv: {str(floor).lower()} }} }}',
                               inputs={"x": x.shape}))
    assert model.blob_shapes["p"] == (1, 2, 4 if floor else 5, 6)
    check_everywhere(model, {"x": x}, {"p": max_pool_mask_ref(x, 3, 3, 2, 2, 1, 1, not floor)[0]}, tmp_path)
    # the message names the field that differs, not the last one given
    with pytest.raises(LayerError, match="cmp_out_shape_floor_as_conv: true contradicts round_mode: CEIL"):
        load_from_text(net('layer { name: "p" type: "Pooling" bottom: "x" top: "p" pooling_param { kernel_size: 3 '
                           'stride: 2 round_mode: CEIL cmp_out_shape_floor_as_conv: true } }', inputs={"x": (1, 2, 8, 8)}))
    with pytest.raises(LayerError, match="ceil_mode: false contradicts round_mode: CEIL"):
        load_from_text(net('layer { name: "p" type: "Pooling" bottom: "x" top: "p" pooling_param { kernel_size: 3 '
                           'stride: 2 round_mode: CEIL ceil_mode: false cmp_out_shape_floor_as_conv: false } }',
                           inputs={"x": (1, 2, 8, 8)}))

# ---- Unpooling (DeconvNet) -------------------------------------------------------------------


needs_unpool = pytest.mark.skipif(not _has_field("unpooling_param"), reason="caffe.proto without unpooling_param")


def deconvnet_unpool_ref(x, mask, method, kh, kw, sh, sw, oh, ow):
    """HyeonwooNoh/caffe UnpoolingLayer::Forward_cpu (pad 0), from a zeroed top."""
    n, c, h, w = x.shape
    top = np.zeros((n, c, oh, ow), np.float64)
    for i in range(n):
        for j in range(c):
            flat = top[i, j].reshape(-1)
            for ph in range(h):
                for pw in range(w):
                    v = np.float64(x[i, j, ph, pw])
                    if method == "MAX":
                        if mask is not None:
                            flat[int(mask[i, j, ph, pw])] = v
                        else:
                            flat[max(0, min(ph * sh, oh - 1)) * ow + max(0, min(pw * sw, ow - 1))] = v
                        continue
                    hs, ws = ph * sh, pw * sw
                    he, we = min(hs + kh, oh), min(ws + kw, ow)
                    area = (he - hs) * (we - ws)
                    for yy in range(hs, he):
                        for xx in range(ws, we):
                            flat[yy * ow + xx] += v / area if method == "AVE" else v
    return top


@needs_unpool
@pytest.mark.parametrize("method, param, mask", [
    ("MAX", "kernel_size: 2 stride: 2 unpool_h: 7 unpool_w: 9", True),
    ("MAX", "kernel_size: 2 stride: 2 unpool_h: 5 unpool_w: 9", False),      # rows clamp: last write wins
    ("AVE", "kernel_size: 3 stride: 2 unpool_h: 10 unpool_w: 12", False),    # overlap, zero-padded
    ("AVE", "kernel_size: 3 stride: 2 unpool_size: 6", False),               # cropped, areas clipped
    ("TILE", "kernel_h: 2 kernel_w: 3 stride_h: 2 stride_w: 1 unpool_h: 7 unpool_w: 6", False),
], ids=["max_mask", "max_grid", "ave_pad", "ave_crop", "tile"])
def test_deconvnet_unpooling(method, param, mask, tmp_path):
    g = np.random.default_rng(10)
    x = g.integers(-2, 3, (2, 3, 7, 9)).astype(np.float32)
    d = g.standard_normal((2, 3, 4, 5)).astype(np.float32)
    layers = [('layer { name: "p" type: "Pooling" bottom: "x" top: "p" top: "m" '
               'pooling_param { pool: MAX kernel_size: 2 stride: 2 } }')]
    bottoms = 'bottom: "d" bottom: "m"' if mask else 'bottom: "d"'
    layers.append(f'layer {{ name: "u" type: "Unpooling" {bottoms} top: "u" '
                  f'unpooling_param {{ unpool: {method} {param} }} }}')
    model = load_from_text(net(*layers, inputs={"x": x.shape, "d": d.shape}))
    geometry = _geometry(param)
    toks = param.split()
    vals = {k.rstrip(":"): int(v) for k, v in zip(toks[::2], toks[1::2])}
    oh, ow = vals.get("unpool_h", vals.get("unpool_size")), vals.get("unpool_w", vals.get("unpool_size"))
    m = max_pool_mask_ref(x, 2, 2, 2, 2, 0, 0)[1] if mask else None
    ref = deconvnet_unpool_ref(d, m, method, *geometry[:4], oh, ow)
    assert model.blob_shapes["u"] == (2, 3, oh, ow)
    check_everywhere(model, {"x": x, "d": d}, {"u": ref}, tmp_path, atol=1e-6, rtol=1e-6)


@needs_unpool
def test_deconvnet_unpooling_walks_a_mask_of_more_channels_plane_by_plane(tmp_path):
    # zbzb00zbzb/vision_lane_detection's ENet: the mask of a 5-channel pooling unpools 3 channels.
    # DeconvNet's loop checks no shapes and moves the mask on one plane per data plane, so data
    # plane (n, c) takes the mask's plane n * 3 + c
    g = np.random.default_rng(12)
    x = g.integers(-2, 3, (2, 5, 8, 10)).astype(np.float32)
    d = g.standard_normal((2, 3, 4, 5)).astype(np.float32)
    layers = ['layer { name: "p" type: "Pooling" bottom: "x" top: "p" top: "m" '
              'pooling_param { pool: MAX kernel_size: 2 stride: 2 } }',
              'layer { name: "u" type: "Unpooling" bottom: "d" bottom: "m" top: "u" '
              'unpooling_param { unpool: MAX kernel_size: 2 stride: 2 unpool_h: 8 unpool_w: 10 } }']
    model = load_from_text(net(*layers, inputs={"x": x.shape, "d": d.shape}))
    assert any("the mask [2, 5, 4, 5] has more channels than the data [2, 3, 4, 5]" in w for w in model.warnings)
    planes = max_pool_mask_ref(x, 2, 2, 2, 2, 0, 0)[1].reshape(-1, 4, 5)
    walked = np.stack([planes[i * 3:(i + 1) * 3] for i in range(2)])
    ref = deconvnet_unpool_ref(d, walked, "MAX", 2, 2, 2, 2, 8, 10)
    check_everywhere(model, {"x": x, "d": d}, {"u": ref}, tmp_path, atol=1e-6, rtol=1e-6)
    # planes of another size, or too few values, are still refused
    with pytest.raises(LayerError, match="must be shaped like the data"):
        load_from_text(net(*layers, inputs={"x": x.shape, "d": (2, 3, 4, 4)}))
    with pytest.raises(LayerError, match="must be shaped like the data"):
        load_from_text(net(*layers, inputs={"x": x.shape, "d": (2, 6, 4, 5)}))


@needs_unpool
@pytest.mark.parametrize("method, param, out", [
    ("MAX", "kernel_size: 2 stride: 2", (8, 10)),            # objectContourDetector's form
    ("AVE", "kernel_h: 3 kernel_w: 2 stride: 2", (9, 10)),
], ids=["max", "ave"])
def test_caffe_cedn_unpooling_is_sized_like_a_deconvolution(method, param, out, tmp_path):
    # jimeiyang/objectContourDetector's caffe-cedn: no unpool_size; (size - 1) * stride + kernel - 2 * pad
    g = np.random.default_rng(11)
    x = g.integers(-2, 3, (2, 3, 8, 10)).astype(np.float32)
    d = g.standard_normal((2, 3, 4, 5)).astype(np.float32)
    mask = method == "MAX"
    mask_bottom = 'bottom: "m"' if mask else ""
    layers = [('layer { name: "p" type: "Pooling" bottom: "x" top: "p" top: "m" '
               'pooling_param { pool: MAX kernel_size: 2 stride: 2 } }'),
              f'layer {{ name: "u" type: "Unpooling" bottom: "d" {mask_bottom} top: "u" '
              f'unpooling_param {{ unpool: {method} {param} }} }}']
    model = load_from_text(net(*layers, inputs={"x": x.shape, "d": d.shape}))
    assert model.blob_shapes["u"] == (2, 3) + out
    kh, kw, sh, sw = _geometry(param)[:4]
    m = max_pool_mask_ref(x, 2, 2, 2, 2, 0, 0)[1] if mask else None
    ref = deconvnet_unpool_ref(d, m, method, kh, kw, sh, sw, *out)
    check_everywhere(model, {"x": x, "d": d}, {"u": ref}, tmp_path, atol=1e-6, rtol=1e-6)
    if mask:   # a pad only narrows MAX's output (AVE with a pad is refused)
        padded = load_from_text(net(layers[0], layers[1].replace(param, "kernel_size: 3 stride: 2 pad: 1"),
                                    inputs={"x": x.shape, "d": d.shape}))
        assert padded.blob_shapes["u"] == (2, 3, 7, 9)   # (4 - 1) * 2 + 3 - 2, (5 - 1) * 2 + 3 - 2


@needs_unpool
@pytest.mark.parametrize("param, msg", [
    ("unpool: MAX kernel_size: 2 stride: 2", "needs the max-pooling mask"),
    ("unpool: TILE kernel_size: 2 stride: 2", "STOCHASTIC"),
    ("unpool: AVE kernel_size: 2 pad: 1", "with pad is not supported")])
def test_caffe_cedn_unpooling_refusals(param, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net(f'layer {{ name: "u" type: "Unpooling" bottom: "x" top: "u" unpooling_param {{ {param} }} }}',
                           inputs={"x": (1, 2, 3, 4)}))


@needs_unpool
@pytest.mark.parametrize("param, msg", [("kernel_size: 2 stride: 2 unpool_h: 4", "unpool_size, or unpool_h"),
                                        ("kernel_size: 2 unpool_size: 4 unpool_h: 4", "not both"),
                                        ("kernel_size: 2 pad: 1 unpool_size: 4", "pad must be 0"),
                                        ("stride: 2 unpool_size: 4", "kernel_size")])
def test_unpooling_bad_params(param, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net(f'layer {{ name: "u" type: "Unpooling" bottom: "x" top: "u" unpooling_param {{ {param} }} }}',
                           inputs={"x": (1, 2, 3, 4)}))


@needs_unpool
@pytest.mark.parametrize("param, out", [("output_h: 9 output_w: 11", (9, 11)),     # FuseNet's NYU nets
                                        ("scale: 2", (8, 10)),                     # its SUN RGB-D net
                                        ("output_h: 8 output_w: 10 scale: 3", (8, 10))])   # both: output_h/w
def test_fusenet_unpooling_scatters_by_the_mask(param, out, tmp_path):
    # tum-vision/fusenet unpooling_layer.cpp: a zeroed top, top[mask[i]] = data[i] plane by plane
    g = np.random.default_rng(13)
    x = g.integers(-2, 3, (2, 3, 8, 10)).astype(np.float32)
    d = g.standard_normal((2, 3, 4, 5)).astype(np.float32)
    layers = ['layer { name: "p" type: "Pooling" bottom: "x" top: "p" top: "m" '
              'pooling_param { pool: MAX kernel_size: 2 stride: 2 } }',
              f'layer {{ name: "u" type: "Unpooling" bottom: "d" bottom: "m" top: "u" unpooling_param {{ {param} }} }}']
    model = load_from_text(net(*layers, inputs={"x": x.shape, "d": d.shape}))
    assert model.blob_shapes["u"] == (2, 3) + out
    ref = deconvnet_unpool_ref(d, max_pool_mask_ref(x, 2, 2, 2, 2, 0, 0)[1], "MAX", 1, 1, 1, 1, *out)
    check_everywhere(model, {"x": x, "d": d}, {"u": ref}, tmp_path, atol=1e-6, rtol=1e-6)


@needs_unpool
@pytest.mark.parametrize("param, bottoms, msg", [
    ("output_h: 9", 2, "needs unpooling_param output_h and output_w, or scale"),
    ("scale: 0", 2, "scale must be > 0"),
    ("scale: 2", 1, "takes 2 bottoms"),
    ("scale: 2 kernel_size: 2", 2, "kernel_size is another fork's")])
def test_fusenet_unpooling_refusals(param, bottoms, msg):
    b = 'bottom: "x" bottom: "m"' if bottoms == 2 else 'bottom: "x"'
    with pytest.raises(LayerError, match=msg):
        load_from_text(net(f'layer {{ name: "u" type: "Unpooling" {b} top: "u" unpooling_param {{ {param} }} }}',
                           inputs={"x": (1, 2, 3, 4), "m": (1, 2, 3, 4)}))


# ---- CUDA ------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_segmentation_layers_on_cuda_match_cpu():
    """The mask top, the last-write-wins unpooling (scatter_reduce, deterministic on the GPU too),
    Mish and SeLu give the CPU's results on CUDA."""
    g = np.random.default_rng(11)
    x = g.integers(-2, 3, (2, 3, 7, 10)).astype(np.float32)
    d = g.standard_normal((2, 3, 4, 6)).astype(np.float32)
    model = load_from_text(net(
        'layer { name: "p" type: "Pooling" bottom: "x" top: "p" top: "m" '
        'pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 } }',
        'layer { name: "u" type: "Upsample" bottom: "d" bottom: "m" top: "u" '
        'upsample_param { upsample_h: 7 upsample_w: 10 } }',
        'layer { name: "mish" type: "Mish" bottom: "d" top: "mish" }',
        'layer { name: "selu" type: "SeLu" bottom: "d" top: "selu" }', inputs={"x": x.shape, "d": d.shape}))
    cpu = model.run({"x": x, "d": d}, all_blobs=True)
    gpu = model.run({"x": x, "d": d}, all_blobs=True, device="cuda")
    for k in ("p", "m", "u"):
        np.testing.assert_array_equal(gpu[k], cpu[k], err_msg=k)
    for k in ("mish", "selu"):
        assert_close(gpu[k], cpu[k], 1e-6, 1e-6, f"cuda {k}")


def ref_pooling_param_unpool(x, mask, out_h, out_w):
    """mariolew/caffe-unpooling UnpoolingLayer::Forward_cpu: a zeroed top; per (n, c) plane, in row-major order,
    top_plane[int(mask_plane[i])] = data_plane[i] (later writes win)."""
    n, c, h, w = x.shape
    top = np.zeros((n, c, out_h * out_w), np.float32)
    for i in range(n):
        for j in range(c):
            for k in range(h * w):
                top[i, j, int(mask[i, j].reshape(-1)[k])] = x[i, j].reshape(-1)[k]
    return top.reshape(n, c, out_h, out_w)


@pytest.mark.parametrize("size, pool, out", [
    ((6, 8), "kernel_size: 2 stride: 2", (6, 8)),              # the DeconvNet VGG16's 2 x 2 / 2 unpooling
    ((7, 5), "kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1", (7, 5)),
    ((6, 9), "kernel_size: 3 stride: 2 pad: 1", (6, 9)),      # with a pad, (4 - 1) * 2 + 3 - 2 = 7 less 1 (even)
])
def test_unpooling_with_pooling_param_is_mariolews(size, pool, out, tmp_path):
    from conftest import check_everywhere

    from caffeq.layers.unpooling import pooling_unpooled_size
    x = torch.randn((2, 3) + size, generator=torch.Generator().manual_seed(4)).numpy()
    text = net(f'layer {{ name: "pool" type: "Pooling" bottom: "x" top: "p" top: "m" pooling_param {{ pool: MAX {pool} }} }}',
               f'layer {{ name: "unpool" type: "Unpooling" bottom: "p" bottom: "m" top: "u" '
               f'pooling_param {{ pool: MAX {pool} }} }}', inputs={"x": (2, 3) + size})
    model = load_from_text(text)
    pooled = model.run({"x": x}, all_blobs=True)
    p, m = pooled["p"], pooled["m"]
    oh, ow = model.blob_shapes["u"][2:]
    assert (oh, ow) == out
    assert pooling_unpooled_size(4, 3, 2, 1) == 6 and pooling_unpooled_size(5, 3, 2, 1) == 9   # the fork: 7 - 1, 9
    assert pooling_unpooled_size(4, 2, 2, 1) == 6   # 6, 5 for an even input, then 6 as (4 - 1) * 2 >= 5 + 1
    if m.max() < oh * ow:
        check_everywhere(model, {"x": x}, {"u": ref_pooling_param_unpool(p, m, oh, ow)}, tmp_path)
    else:   # a mask index past the smaller unpooled plane: the fork writes outside it, caffeq refuses
        with pytest.raises(LayerError, match="mask index out of range"):
            model.run({"x": x})


def test_unpooling_with_pooling_param_refuses_what_the_fork_does_not_implement():
    for pool, message in (("pool: AVE kernel_size: 2", r"pooling_param.pool AVE: .* MAX unpooling only"),
                          ("pool: MAX stride: 2", r"pooling_param.kernel_size \(or kernel_h/kernel_w\) is required"),
                          ("pool: MAX kernel_size: 2 pad: 2", r"pooling_param.pad \[2, 2\] must be below the kernel")):
        with pytest.raises(LayerError, match=message):
            load_from_text(net(f'layer {{ name: "u" type: "Unpooling" bottom: "x" bottom: "m" top: "u" '
                               f'pooling_param {{ {pool} }} }}', inputs={"x": (1, 2, 4, 4), "m": (1, 2, 4, 4)}))
