"""DenseBlock (senlinuc/caffe_ocr's fused DenseNet block, after Tongcheng's memory-efficient fork).

The reference is a numpy re-derivation written here from the fork's own formulas
(src/caffe/layers/DenseBlock_layer.cpp/.cu at 81642f61): cuDNN's inference batch normalization
scale * (x - mean) / sqrt(var + 1e-5) + bias with the stored statistics as they are (the GPU path;
the factor blob is never read there), ReLU, and the convolution indexed as the fork's CPU
convolution_Fwd does, out[h, w] += W[fx, fy] * in[h + k/2 - fx, w + k/2 - fy] (a true convolution,
as cuDNN's CUDNN_CONVOLUTION mode on the GPU), each new map appended after the channels so far.
"""
import importlib.util
import warnings

import numpy as np
import pytest
import torch
from conftest import (
    REPO,
    assert_close,
    backend_outputs,
    inputs_text,
    load_model_py,
    onnx_outputs,
    rng,
)

import caffeq
from caffeq.backends.pytorch_source import export_pytorch
from caffeq.io.caffemodel import BlobData
from caffeq.io.prototxt import parse_prototxt_text
from caffeq.io.writer import write_caffemodel
from caffeq.layers import LayerError
from caffeq.model import load_from_text

SHAPE = (2, 3, 5, 7)       # N, C, H, W all different
T, G = 3, 4                # numTransition, growthRate: 3 + 3 * 4 = 15 channels out


def block_text(extra="", bottom="x", param=""):
    # initChannel deliberately wrong: caffe_ocr takes the bottom's channel count
    return (f'layer {{ name: "db" type: "DenseBlock" bottom: "{bottom}" top: "o" {param} '
            f'denseblock_param {{ numTransition: {T} initChannel: 64 growthRate: {G} {extra} }} }}')


def block_net(extra="", shape=SHAPE):
    return inputs_text(x=shape) + block_text(extra)


def fork_blobs(c0, use_bc, seed=1):
    """Random blobs in the fork's order and shapes (LayerSetUp): filters, scales, biases, means,
    variances, [BC filters, BC scales, biases, means, variances], factor."""
    g = rng(seed)
    widths = [c0 + i * G for i in range(T)]
    conv_in = [4 * G] * T if use_bc else widths
    blobs = [g.standard_normal((G, c, 3, 3)) / np.sqrt(9 * c) for c in conv_in]
    blobs += [g.uniform(0.5, 1.5, (1, c, 1, 1)) for c in widths]
    blobs += [g.uniform(-0.5, 0.5, (1, c, 1, 1)) for c in widths]
    blobs += [g.uniform(-0.3, 0.3, (1, c, 1, 1)) for c in widths]
    blobs += [g.uniform(0.5, 2.0, (1, c, 1, 1)) for c in widths]
    if use_bc:
        blobs += [g.standard_normal((4 * G, c, 1, 1)) / np.sqrt(c) for c in widths]
        blobs += [g.uniform(0.5, 1.5, (1, 4 * G, 1, 1)) for _ in range(T)]
        blobs += [g.uniform(-0.5, 0.5, (1, 4 * G, 1, 1)) for _ in range(T)]
        blobs += [g.uniform(-0.3, 0.3, (1, 4 * G, 1, 1)) for _ in range(T)]
        blobs += [g.uniform(0.5, 2.0, (1, 4 * G, 1, 1)) for _ in range(T)]
    # a factor that is neither 0 nor 1: the GPU path (followed here) never divides by it
    blobs.append(np.array([7.5]))
    return [b.astype(np.float32) for b in blobs]


def ref_bn(x, scale, bias, mean, var):
    c = x.shape[1]
    return (scale.reshape(1, c, 1, 1) * (x - mean.reshape(1, c, 1, 1)) / np.sqrt(var.reshape(1, c, 1, 1) + 1e-5)
            + bias.reshape(1, c, 1, 1))


def ref_conv(x, w):
    """The fork's convolution_Fwd: same-size output, zero padding k/2, input index h + k/2 - fx."""
    n, _, h, wd = x.shape
    k = w.shape[2]
    r = k // 2
    out = np.zeros((n, w.shape[0], h, wd))
    for i in range(h):
        for j in range(wd):
            for fx in range(k):
                for fy in range(k):
                    si, sj = i + r - fx, j + r - fy
                    if 0 <= si < h and 0 <= sj < wd:
                        out[:, :, i, j] += x[:, :, si, sj] @ w[:, :, fx, fy].T
    return out


def ref_dense_block(x, blobs, use_bc):
    stack = x.astype(np.float64)
    b = [np.asarray(v, np.float64) for v in blobs]
    for i in range(T):
        h = np.maximum(ref_bn(stack, b[T + i], b[2 * T + i], b[3 * T + i], b[4 * T + i]), 0)
        if use_bc:
            h = ref_conv(h, b[5 * T + i])
            h = np.maximum(ref_bn(h, b[6 * T + i], b[7 * T + i], b[8 * T + i], b[9 * T + i]), 0)
        stack = np.concatenate([stack, ref_conv(h, b[i])], axis=1)
    return stack


def exact_model_py(model, folder):
    """model.py exported with exact_batchnorm=True, imported, its weights loaded."""
    export_pytorch(model, folder, exact_batchnorm=True)
    spec = importlib.util.spec_from_file_location(f"db_{folder.name}", folder / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.load(str(folder / "weights.safetensors"))


def loaded(extra="", use_bc=False):
    model = load_from_text(block_net(extra), random_weights=True)
    node = model.graph.node("db")
    node.blobs = fork_blobs(SHAPE[1], use_bc)
    return model, node


@pytest.mark.parametrize("use_bc", [False, True], ids=["plain", "BC"])
def test_torch_onnx_and_model_py_follow_the_forks_formula(use_bc, tmp_path):
    model, node = loaded("use_BC: true" if use_bc else "", use_bc)
    assert model.blob_shapes["o"] == (2, 3 + T * G, 5, 7)
    x = rng(2).standard_normal(SHAPE).astype(np.float32)
    want = ref_dense_block(x, node.blobs, use_bc)
    for backend, got in backend_outputs(model, {"x": x}, tmp_path).items():
        assert_close(got, want, 1e-5, 1e-5, backend)
    assert_close(onnx_outputs(model, {"x": x}, tmp_path, opset=13)["o"], want, 1e-5, 1e-5, "onnx opset 13")
    # at another batch size than the prototxt's
    x3 = rng(3).standard_normal((3,) + SHAPE[1:]).astype(np.float32)
    assert_close(model.run({"x": x3})["o"], ref_dense_block(x3, node.blobs, use_bc), 1e-5, 1e-5, "batch 3")


def test_the_kernel_is_rotated_not_correlated():
    """One transition, one input channel, a kernel with a single 1 at (0, 0): the fork's true
    convolution reads in[h + 1, w + 1] there, where Caffe's Convolution would read in[h - 1, w - 1]."""
    model = load_from_text(inputs_text(x=(1, 1, 4, 5)) + 'layer { name: "db" type: "DenseBlock" bottom: "x" '
                           'top: "o" denseblock_param { numTransition: 1 growthRate: 1 } }', random_weights=True)
    node = model.graph.node("db")
    w = np.zeros((1, 1, 3, 3), np.float32)
    w[0, 0, 0, 0] = 1
    node.blobs = [w, np.ones((1, 1, 1, 1), np.float32), np.zeros((1, 1, 1, 1), np.float32),
                  np.zeros((1, 1, 1, 1), np.float32), np.full((1, 1, 1, 1), 1 - 1e-5, np.float32),
                  np.zeros(1, np.float32)]
    x = np.arange(20, dtype=np.float32).reshape(1, 1, 4, 5) + 1
    out = model.run({"x": x})["o"]
    shifted = np.zeros((4, 5), np.float32)
    shifted[:-1, :-1] = x[0, 0, 1:, 1:]
    np.testing.assert_array_equal(out[0, 0], x[0, 0])
    np.testing.assert_allclose(out[0, 1], shifted, rtol=1e-6)


def test_model_py_with_exact_batchnorm_is_bit_for_bit(tmp_path):
    for use_bc in (False, True):
        model, node = loaded("use_BC: true" if use_bc else "", use_bc)
        x = rng(4).standard_normal(SHAPE).astype(np.float32)
        net = exact_model_py(model, tmp_path / f"bc{use_bc}")
        with torch.no_grad():
            got = net(torch.from_numpy(x)).numpy()
        assert np.array_equal(got, model.run({"x": x}, exact=True)["o"])
        # the nn.Conv2d weights are the caffemodel's kernels rotated by 180 degrees
        conv = net.db.transitions[1].conv.weight.detach().numpy()
        assert np.array_equal(conv, node.blobs[1][:, :, ::-1, ::-1])


def write_fork_caffemodel(path, text, blobs):
    write_caffemodel(parse_prototxt_text(text), {"db": [BlobData(b) for b in blobs]}, path)


@pytest.mark.parametrize("use_bc", [False, True], ids=["plain", "BC"])
def test_weights_attach_in_the_forks_blob_order(use_bc, tmp_path):
    extra = "use_BC: true" if use_bc else ""
    blobs = fork_blobs(SHAPE[1], use_bc, seed=5)
    assert len(blobs) == (10 if use_bc else 5) * T + 1
    proto = tmp_path / "db.prototxt"
    proto.write_text(block_net(extra))
    weights = tmp_path / "db.caffemodel"
    write_fork_caffemodel(weights, block_text(extra), blobs)
    model = caffeq.load(proto, weights)
    for got, want in zip(model.params["db"], blobs):
        assert np.array_equal(got, want)
    x = rng(6).standard_normal(SHAPE).astype(np.float32)
    assert_close(model.run({"x": x})["o"], ref_dense_block(x, blobs, use_bc), 1e-5, 1e-5, "from caffemodel")
    # the statistics are buffers, the filters and BN affine blobs trainable parameters
    layer = dict(model.to_torch().named_modules())["db"]
    params = dict(layer.named_parameters())
    buffers = dict(layer.named_buffers())
    assert {"filter0", "scale2", "bias1"} <= set(params) and {"mean0", "variance2", "factor"} <= set(buffers)
    if use_bc:
        assert {"bc_filter1", "bc_scale0"} <= set(params) and {"bc_mean2", "bc_variance0"} <= set(buffers)


def test_weights_in_another_order_are_refused(tmp_path):
    blobs = fork_blobs(SHAPE[1], False)
    blobs[0], blobs[T] = blobs[T], blobs[0]   # a scale where the first filter belongs
    proto = tmp_path / "db.prototxt"
    proto.write_text(block_net())
    weights = tmp_path / "db.caffemodel"
    write_fork_caffemodel(weights, block_text(), blobs)
    with pytest.raises(caffeq.CaffeqError, match=r"layer 'db' \(DenseBlock\) blob 0: .*\[4, 3, 3, 3\]"):
        caffeq.load(proto, weights)


def test_training_mode_uses_batch_statistics_and_moves_the_stored_ones():
    """TRAIN (torch train mode): cuDNN's training BN, then stat = maf * batch + (1 - maf) * stat
    (caffe_gpu_axpby(EMA_decay, batch, 1 - EMA_decay, global)) with the unbiased batch variance."""
    model, node = loaded("moving_average_fraction: 0.25")
    before = [b.copy() for b in node.blobs]
    net = model.to_torch().train()
    x = rng(7).standard_normal(SHAPE).astype(np.float32)
    out = net(torch.from_numpy(x)).detach().numpy().astype(np.float64)
    # the first transition sees the input itself
    m = SHAPE[0] * SHAPE[2] * SHAPE[3]
    bm = x.astype(np.float64).mean(axis=(0, 2, 3))
    bv = x.astype(np.float64).var(axis=(0, 2, 3))
    h = np.maximum(ref_bn(x, before[T], before[2 * T], bm, bv), 0)
    assert_close(out[:, 3:3 + G], ref_conv(h, before[0]), 1e-5, 1e-5, "first transition, batch stats")
    layer = dict(net.named_modules())["db"]
    assert_close(layer.mean0.numpy().ravel(), 0.25 * bm + 0.75 * before[3 * T].ravel(), 1e-6, 1e-6, "mean")
    assert_close(layer.variance0.numpy().ravel(), 0.25 * bv * m / (m - 1) + 0.75 * before[4 * T].ravel(),
                 1e-6, 1e-6, "variance")
    assert layer.factor.item() == before[-1].item()


def test_dropout_only_while_training():
    model, _ = loaded("use_dropout: true dropout_amount: 0.5")
    plain, _ = loaded()
    x = rng(8).standard_normal(SHAPE).astype(np.float32)
    assert np.array_equal(model.run({"x": x})["o"], plain.run({"x": x})["o"])
    torch.manual_seed(0)
    out = model.to_torch().train()(torch.from_numpy(x)).detach().numpy()
    assert np.array_equal(out[:, :3], x)                  # the input is copied, never dropped
    new = out[:, 3:]
    assert 0.3 < float((new == 0).mean()) < 0.7


def test_model_py_trains_like_caffeq(tmp_path):
    """exact_batchnorm model.py in train mode: same output and same statistics updates."""
    model, _ = loaded("use_BC: true", use_bc=True)
    net = exact_model_py(model, tmp_path / "train").train()
    ours = model.to_torch().train()
    x = torch.from_numpy(rng(9).standard_normal(SHAPE).astype(np.float32))
    assert torch.equal(net(x), ours(x))
    layer = dict(ours.named_modules())["db"]
    t1 = net.db.transitions[1]
    assert torch.allclose(t1.norm.running_mean, layer.mean1.reshape(-1), rtol=1e-6, atol=1e-7)
    assert torch.allclose(t1.bottleneck[1].running_var, layer.bc_variance1.reshape(-1), rtol=1e-6, atol=1e-7)


def test_model_py_default_gradients_script_and_export(tmp_path):
    model, _ = loaded("use_BC: true", use_bc=True)
    net, _ = load_model_py(model, tmp_path / "o")
    x = torch.from_numpy(rng(10).standard_normal(SHAPE).astype(np.float32)).requires_grad_(True)
    net.train()(x).sum().backward()
    assert all(p.grad is not None for p in net.parameters()) and x.grad is not None
    net.eval()
    with torch.no_grad():
        want = net(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scripted = torch.jit.script(net)
    assert torch.equal(scripted(x), want)
    ep = torch.export.export(net, (x.detach(),), dynamic_shapes=({0: torch.export.Dim("N", min=1, max=8)},))
    assert torch.equal(ep.module()(x.detach()), want)


@pytest.mark.parametrize("target", ["int8", "binary", "fp16"])
def test_quantized_block_exports_to_onnx(target, tmp_path):
    """Quantized filters reach ONNX as their dequantized form, rotated by a Slice."""
    model, _ = loaded("use_BC: true", use_bc=True)
    q = caffeq.quantize(model, target, keep="none")
    qnode = q.graph.node("db")
    if target != "fp16":
        assert set(qnode.quant) == set(range(T)) | set(range(5 * T, 6 * T))   # the filters only
    x = rng(11).standard_normal(SHAPE).astype(np.float32)
    want = q.run({"x": x})["o"]
    assert_close(want, ref_dense_block(x, qnode.blobs, True), 1e-5, 1e-5, f"{target} torch")
    assert_close(onnx_outputs(q, {"x": x}, tmp_path)["o"], want, 1e-5, 1e-5, f"{target} onnx")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_the_forks_formula():
    model, node = loaded("use_BC: true", use_bc=True)
    x = rng(13).standard_normal(SHAPE).astype(np.float32)
    assert_close(model.run({"x": x}, device="cuda")["o"], ref_dense_block(x, node.blobs, True), 1e-5, 1e-5, "cuda")


@pytest.mark.parametrize("text, field", [
    (block_net("numTransition: 0").replace(f"numTransition: {T} ", ""), "denseblock_param.numTransition"),
    (block_net("growthRate: -2").replace(f"growthRate: {G} ", ""), "denseblock_param.growthRate"),
    (block_net("use_dropout: true dropout_amount: 1.5"), "denseblock_param.dropout_amount"),
    (block_net("moving_average_fraction: -1"), "denseblock_param.moving_average_fraction"),
    (inputs_text(x=SHAPE) + block_text(param="param { lr_mult: 1 }"), "param"),
    (inputs_text(x=(2, 3, 5)) + block_text(), "4-axis"),
    (inputs_text(x=SHAPE, y=SHAPE) + block_text().replace('bottom: "x"', 'bottom: "x" bottom: "y"'), "one bottom"),
], ids=["numTransition", "growthRate", "dropout_amount", "maf", "param", "3-axis", "two-bottoms"])
def test_bad_parameters_name_the_field(text, field):
    with pytest.raises(LayerError, match=r"layer 'db' \(DenseBlock\).*" + field.replace(".", r"\.")):
        load_from_text(text, random_weights=True)


# ---- caffe_ocr's own nets ---------------------------------------------------------------------

REALWORLD = REPO / "tests" / "fixtures" / "realworld"
OCR = "senlinuc__caffe_ocr__examples__ocr__densenet__"


@pytest.mark.parametrize("name", ["densenet-no-blstm_deploy", "densenet-res-blstm_deploy"])
def test_caffe_ocr_deploy_nets_load(name):
    model = caffeq.load(REALWORLD / f"{OCR}{name}.prototxt", random_weights=True)
    # three blocks of 8 x 8 new channels; the first reads conv1's 64, the others a 128-channel
    # transition although every block says initChannel: 64
    assert model.blob_shapes["DenseBlock1"] == (1, 128, 16, 140)
    assert model.blob_shapes["DenseBlock2"] == (1, 192, 8, 70)
    assert model.blob_shapes["DenseBlock3"] == (1, 192, 4, 35)
    assert [len(model.params[f"DenseBlock{i}"]) for i in (1, 2, 3)] == [41, 41, 41]


def test_caffe_ocr_train_val_net_loads_and_runs():
    """The train_val file: its multi-label Data layer (no dataset here) given shapes."""
    model = caffeq.load(REALWORLD / f"{OCR}densenet-sum-blstm-full-res-blstm_train-val.prototxt",
                        random_weights=True, input_shapes={"data": (2, 3, 32, 48), "label": (2, 10)})
    feeds = {"data": rng(12).standard_normal((2, 3, 32, 48)).astype(np.float32),
             "label": np.ones((2, 10), np.float32)}
    out = model.run(feeds)
    assert model.blob_shapes["DenseBlock3"] == (2, 256, 4, 6)   # 192 channels in, 8 x 8 new
    assert out and all(np.isfinite(v).all() for v in out.values())
