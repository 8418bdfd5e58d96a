"""The optimized module is the default of Model.run, run and eval; exact=True / --exact and
all_blobs give the layer-by-layer one."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

import caffeq
from caffeq.evaluate import evaluate

REPO = Path(__file__).resolve().parents[1]
DIGITS = REPO / "examples" / "digits"


def _digits():
    return caffeq.load(DIGITS / "deploy.prototxt", DIGITS / "model.caffemodel")


def _inputs(n=7):
    return np.random.default_rng(1).uniform(-0.5, 0.5, (n, 1, 16, 16)).astype(np.float32)


def test_default_is_folded_and_exact_is_caffes_order():
    model = _digits()
    x = _inputs()
    fast = model.run(x)["prob"]
    gm = model.run_cache[2]
    kinds = {m.caffe_type for m in gm.modules() if hasattr(m, "caffe_type")}
    assert "BatchNorm" not in kinds and "Scale" not in kinds          # folded into the convolutions
    if torch.backends.mkldnn.is_available():
        from caffeq.backends.torch_backend import PackedConv2d
        assert isinstance(gm.conv1, PackedConv2d) and gm.conv1.relu     # packed once, ReLU fused
        assert not hasattr(gm, "relu1")
    else:
        assert gm.conv1.blob_tensors()[0].is_contiguous(memory_format=torch.channels_last)
    exact = model.run(x, exact=True)["prob"]
    with torch.inference_mode():
        plain = model.to_torch()(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(exact, plain)                        # exact: the plain module
    np.testing.assert_allclose(fast, exact, rtol=1e-5, atol=1e-6)
    every = model.run(x, all_blobs=True)                               # every blob: exact too
    assert set(every) == set(model.blob_shapes)
    np.testing.assert_array_equal(every["prob"], exact)


def test_module_is_built_once_and_follows_new_weights():
    model = _digits()
    x = _inputs(3)
    a = model.run(x)["prob"]
    first = model.run_cache[2]
    model.run(x)
    assert model.run_cache[2] is first                                # reused
    ip2 = next(n for n in model.graph.nodes if n.name == "ip2")
    ip2.blobs = [ip2.blobs[0], np.asarray(ip2.blobs[1]) + np.arange(10, dtype=np.float32)]
    b = model.run(x)["prob"]
    assert model.run_cache[2] is not first                            # new weights, new module
    assert not np.allclose(a, b)
    model.clear_cache()
    assert model.run_cache is None


def test_run_cli_exact_and_default(tmp_path):
    x = _inputs(5)
    np.save(tmp_path / "x.npy", x)
    model = _digits()
    for flags, want in (([], model.run(x)["prob"]), (["--exact"], model.run(x, exact=True)["prob"])):
        out = tmp_path / "y.npz"
        res = subprocess.run([sys.executable, str(REPO / "cli.py"), "run", DIGITS / "deploy.prototxt", "--weights",
                              DIGITS / "model.caffemodel", "-i", tmp_path / "x.npy", "-o", out, *flags],
                             capture_output=True, text=True, timeout=300, check=False)
        assert res.returncode == 0, res.stderr
        with np.load(out) as z:
            np.testing.assert_array_equal(z["prob"], want)


def test_eval_default_and_exact_give_caffes_numbers():
    kw = {"weights": str(DIGITS / "model.caffemodel"), "limit": 200, "batch_size": 50}
    fast = evaluate(str(DIGITS / "train_val.prototxt"), **kw)["results"]["fp32"]
    exact = evaluate(str(DIGITS / "train_val.prototxt"), exact=True, **kw)["results"]["fp32"]
    assert fast["top1"] == exact["top1"]
    assert abs(fast["layers"]["loss"] - exact["layers"]["loss"]) <= 1e-5 * abs(exact["layers"]["loss"])


def test_in_place_reuse_never_overwrites_a_blob_read_elsewhere():
    """The optimized module writes ReLU / Eltwise SUM results into their input only when nothing
    else reads it: here the convolution's output also feeds a Concat and a second Eltwise."""
    text = """
    name: "shared"
    input: "data" input_shape { dim: 2 dim: 3 dim: 5 dim: 4 }
    layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
            convolution_param { num_output: 4 kernel_size: 1 } }
    layer { name: "conv2" type: "Convolution" bottom: "data" top: "conv2"
            convolution_param { num_output: 4 kernel_size: 1 } }
    layer { name: "relu" type: "ReLU" bottom: "conv" top: "r" }
    layer { name: "sum" type: "Eltwise" bottom: "conv2" bottom: "conv" top: "s" }
    layer { name: "relu2" type: "ReLU" bottom: "s" top: "s" }
    layer { name: "cat" type: "Concat" bottom: "conv" bottom: "r" bottom: "s" bottom: "conv2" top: "out" }
    """
    from caffeq.model import load_from_text
    model = load_from_text(text, random_weights=True, seed=3)
    x = np.random.default_rng(0).standard_normal((2, 3, 5, 4)).astype(np.float32)
    fast = model.run(x)["out"]
    gm = model.run_cache[2]
    in_place = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert in_place == [torch.relu_]                  # only relu2, on the Eltwise's own output
    assert hasattr(gm, "relu")                        # conv's ReLU is neither in place nor fused
    w1, b1 = (np.asarray(b, np.float64) for b in model.params["conv"])
    w2, b2 = (np.asarray(b, np.float64) for b in model.params["conv2"])
    xd = x.astype(np.float64)
    conv = np.einsum("oc,nchw->nohw", w1[:, :, 0, 0], xd) + b1[None, :, None, None]
    conv2 = np.einsum("oc,nchw->nohw", w2[:, :, 0, 0], xd) + b2[None, :, None, None]
    want = np.concatenate([conv, np.maximum(conv, 0), np.maximum(conv2 + conv, 0), conv2], axis=1)
    np.testing.assert_allclose(fast, want, rtol=1e-5, atol=1e-5)


def test_a_relu_with_a_mask_top_is_never_made_in_place():
    """DecoupledNet's V1 ReLU also gives its mask (`top: "fc6" top: "relu6-mask"`): the default path keeps it a
    layer of two tops (it used to become relu_, one tensor, and the run failed indexing its second top)."""
    text = """
    input: "x" input_shape { dim: 2 dim: 2 dim: 5 dim: 4 }
    layers { bottom: "x" top: "c" name: "c" type: CONVOLUTION convolution_param { kernel_size: 1 num_output: 3 } }
    layers { bottom: "c" top: "c" top: "mask" name: "relu" type: RELU }
    layers { bottom: "c" top: "d" name: "d" type: CONVOLUTION convolution_param { kernel_size: 1 num_output: 2 } }
    """
    from caffeq.model import load_from_text
    model = load_from_text(text, random_weights=True, seed=4)
    x = np.random.default_rng(1).standard_normal((2, 2, 5, 4)).astype(np.float32)
    fast = model.run(x)
    (w1, b1), (w2, b2) = ([np.asarray(b, np.float64) for b in model.params[k]] for k in ("c", "d"))
    conv = np.einsum("oc,nchw->nohw", w1[:, :, 0, 0], x.astype(np.float64)) + b1[None, :, None, None]
    relu = np.maximum(conv, 0)
    want = np.einsum("oc,nchw->nohw", w2[:, :, 0, 0], relu) + b2[None, :, None, None]
    np.testing.assert_array_equal(fast["mask"], (relu > 0).astype(np.float32))   # of the output, in place
    np.testing.assert_allclose(fast["d"], want, rtol=1e-5, atol=1e-5)


def test_residual_sum_and_relu_run_in_the_convolution():
    """A ResNet block: the Eltwise SUM of a convolution (read by nothing else) and the shortcut,
    then ReLU, becomes one oneDNN convolution with the sum and ReLU in its epilogue."""
    text = """
    name: "block"
    input: "data" input_shape { dim: 2 dim: 3 dim: 7 dim: 5 }
    layer { name: "conv0" type: "Convolution" bottom: "data" top: "x" convolution_param { num_output: 6 kernel_size: 3 pad: 1 } }
    layer { name: "relu0" type: "ReLU" bottom: "x" top: "x" }
    layer { name: "conv1" type: "Convolution" bottom: "x" top: "y1" convolution_param { num_output: 4 kernel_size: 1 } }
    layer { name: "relu1" type: "ReLU" bottom: "y1" top: "y1" }
    layer { name: "conv2" type: "Convolution" bottom: "y1" top: "y2" convolution_param { num_output: 6 kernel_size: 3 pad: 1 } }
    layer { name: "sum" type: "Eltwise" bottom: "y2" bottom: "x" top: "s" }
    layer { name: "relu2" type: "ReLU" bottom: "s" top: "s" }
    layer { name: "proj" type: "Convolution" bottom: "s" top: "p" convolution_param { num_output: 6 kernel_size: 1 } }
    layer { name: "sum2" type: "Eltwise" bottom: "s" bottom: "p" top: "out" }
    """
    from caffeq.model import load_from_text
    model = load_from_text(text, random_weights=True, seed=4)
    x = np.random.default_rng(2).standard_normal((2, 3, 7, 5)).astype(np.float32)
    fast = model.run(x)["out"]
    gm = model.run_cache[2]
    exact = model.run(x, exact=True)["out"]
    if torch.backends.mkldnn.is_available():
        from caffeq.backends.torch_backend import PackedConv2d
        assert [n.op for n in gm.graph.nodes].count("call_function") == 0     # no add_, no relu_ left
        calls = {n.target: len(n.args) for n in gm.graph.nodes if n.op == "call_module"}
        assert calls["conv2"] == 2 and gm.conv2.relu                           # + x, then ReLU
        assert calls["proj"] == 2 and not gm.proj.relu                         # + s, no ReLU after
        assert all(isinstance(getattr(gm, k), PackedConv2d) for k in calls)
    w = {k: [np.asarray(b, np.float64) for b in v] for k, v in model.params.items()}

    def conv(t, name, pad):
        wt, b = w[name]
        return torch.nn.functional.conv2d(torch.from_numpy(t), torch.from_numpy(wt), torch.from_numpy(b),
                                          padding=pad).numpy()
    xd = np.maximum(conv(x.astype(np.float64), "conv0", 1), 0)
    s = np.maximum(conv(np.maximum(conv(xd, "conv1", 0), 0), "conv2", 1) + xd, 0)
    want = s + conv(s, "proj", 0)
    np.testing.assert_allclose(fast, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(fast, exact, rtol=1e-5, atol=1e-6)


def test_cuda_runs_turn_tf32_off_and_give_the_users_flags_back():
    """PyTorch lets cuDNN round float32 convolutions to TF32 by default (errors near 1e-3 against
    Caffe on Ampere and later GPUs): caffeq's runs on CUDA switch it off, then restore the flags."""
    import torch

    from caffeq.backends.torch_backend import caffe_fp32
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
        with caffe_fp32("cpu"):
            assert torch.backends.cudnn.allow_tf32 and torch.backends.cuda.matmul.allow_tf32
        with caffe_fp32(torch.device("cuda", 0)):
            assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
        assert torch.backends.cudnn.allow_tf32 and torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
