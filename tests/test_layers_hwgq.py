"""zhaoweicai/hwgq ebc706b (HWGQ, Cai et al. CVPR 2017): BinaryConvolution, BinaryInnerProduct and
Quant.  The references are loops written from the fork's forward (binary_conv_layer.cpp Forward_cpu,
binary_inner_product_layer.cpp Forward_cpu, quant_layer.cpp LayerSetUp and Forward_cpu): weights
binarized per output row (w >= 0 -> +alpha, alpha = float32(1 / row length) * sum |w| with
use_alpha, else 1), then Caffe's convolution / inner product in float64; Quant value by value.
Compared in torch, onnxruntime and the generated model.py."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, backend_outputs, check_everywhere, conv_ref, net, node_of, rng

from caffeq.layers import LayerError
from caffeq.layers.hwgq import hwgq_binarize, hwgq_quant, hwgq_thresholds
from caffeq.model import load_from_text

f32 = np.float32
FLT_MAX = float(np.finfo(np.float32).max)
CORPUS = Path("/work/corpus29b")
EXAMPLES = ["res18-hwgq-3ne-clip-poly-320k__deploy", "google-hwgq-3ne-clip-poly-320k__deploy",
            "dark19-hwgq-3ne-clip-poly-320k__train_val"]
# the example nets' quantizer: 2 bits, three positive levels (res18 / google / dark19)
QUANT_3NE = 'quant_param { forward_func: "hwgq" backward_func: "relu" centers: 0.538 centers: 1.076 ' \
            'centers: 1.614 clip_thr: 1.614 }'


# ---- references ------------------------------------------------------------------------------------

def binarize_ref(w, use_alpha, use_binarization=True):
    """Forward_cpu's binary_weights_: a copy of the blob; with use_binarization each row i (count /
    num weights) becomes (w >= 0 ? 1 : -1) * alphas_[i], alphas_ being 1 or, with use_alpha, gemv's
    (1. / weight_dim as a float) * sum of |w|."""
    w = np.asarray(w, np.float32)
    out = w.copy().reshape(w.shape[0], -1)
    if not use_binarization:
        return out.reshape(w.shape)
    rows = w.reshape(w.shape[0], -1)
    dim = rows.shape[1]
    for i in range(rows.shape[0]):
        alpha = f32(1)
        if use_alpha:
            total = f32(0)
            for v in rows[i]:
                total = f32(total + f32(abs(v)))
            alpha = f32(f32(1.0 / dim) * total)
        for j in range(dim):
            out[i, j] = (f32(1) if rows[i, j] >= 0 else f32(-1)) * alpha
    return out.reshape(w.shape)


def std_max(a, b):
    """std::max: (a < b) ? b : a."""
    return b if a < b else a


def std_min(a, b):
    """std::min: (b < a) ? b : a."""
    return b if b < a else a


def quant_ref(x, func, centers=(), negative_slope=0.0):
    """quant_layer.cpp: the top set to 0, then value by value as Forward_cpu."""
    x = np.asarray(x, np.float32)
    c = [f32(v) for v in centers]
    thrs = [f32(0.5 * float(f32(c[i] + c[i + 1]))) for i in range(len(c) - 1)] + [f32(FLT_MAX)]
    ns = f32(negative_slope)
    out = np.zeros(x.size, np.float32)
    for i, v in enumerate(x.ravel()):
        if func == "sign":
            out[i] = 1 if v >= 0 else -1
        elif func == "hard_tanh":
            out[i] = std_min(std_max(v, f32(-1)), f32(1))
        elif func == "hwgq":
            if v <= 0:
                out[i] = -ns
            else:
                for t, cj in zip(thrs, c):
                    if v <= t:
                        out[i] = cj
                        break
        else:
            with np.errstate(invalid="ignore"):
                out[i] = f32(std_max(v, f32(0)) + f32(ns * std_min(v, f32(0))))
    return out.reshape(x.shape)


def one_layer(type_, shape, params):
    return load_from_text(net(f'layer {{ name: "q" type: "{type_}" bottom: "x" top: "y" {params} }}',
                              inputs={"x": shape}), random_weights=True)


def set_blobs(model, *blobs):
    node = node_of(model, "q")
    node.blobs = [np.asarray(b, np.float32) for b in blobs]
    model.clear_cache()


def dyadic(r, shape, scale=16):
    """Small multiples of 1/scale: their sums are exact in float32 whatever the order."""
    return (r.integers(-24, 25, size=shape) / scale).astype(np.float32)


# ---- Quant -----------------------------------------------------------------------------------------

def quant_edges(centers):
    thrs = hwgq_thresholds(centers)
    vals = [0.0, -0.0, -1.0, -1e-30, 1e-45, 1e30, FLT_MAX, np.inf, -np.inf, np.nan]
    for t in thrs[:-1] + list(centers):
        vals += [t, float(np.nextafter(f32(t), f32(np.inf))), float(np.nextafter(f32(t), f32(-np.inf)))]
    return np.array(vals, np.float32)


def test_thresholds_are_float32_midpoints():
    assert hwgq_thresholds([0.538, 1.076, 1.614]) == [float(f32(f32(0.538) + f32(1.076)) * f32(0.5)),
                                                       float(f32(f32(1.076) + f32(1.614)) * f32(0.5)),
                                                       FLT_MAX]


@pytest.mark.parametrize("centers, slope", [([0.538, 1.076, 1.614], 0.0), ([0.453, 1.51], 0.25),
                                            ([1.0, 0.5, 2.0], 0.0), ([0.7], 0.1)])
def test_hwgq_function_edges(centers, slope):
    x = np.concatenate([quant_edges(centers), (rng(1).standard_normal(300) * 1.5).astype(np.float32)])
    cs = [float(f32(c)) for c in centers]
    got = hwgq_quant(torch.from_numpy(x), hwgq_thresholds(cs), cs, -float(f32(slope))).numpy()
    np.testing.assert_array_equal(got, quant_ref(x, "hwgq", cs, slope))
    # x <= 0 (and -0) gives -negative_slope itself; +inf and NaN keep the top's 0
    assert got[0] == got[1] == got[2] == -f32(slope)
    assert got[7] == 0 and got[9] == 0 and got[6] == f32(cs[-1])   # FLT_MAX: only the last threshold holds it


@pytest.mark.parametrize("params", [
    QUANT_3NE,
    'quant_param { forward_func: "hwgq" centers: 0.453 centers: 1.51 negative_slope: 0.125 }',
    'quant_param { centers: 1.0 centers: 0.5 centers: 2.0 }',               # unsorted: first threshold wins
    'quant_param { forward_func: "sign" backward_func: "hard_tanh" clip_thr: 1.0 }',
    'quant_param { forward_func: "hard_tanh" }',
    'quant_param { forward_func: "relu" negative_slope: 0.1 }',
    'quant_param { forward_func: "relu" }',
])
def test_quant_everywhere(params, tmp_path):
    shape = (2, 3, 4, 5)
    model = one_layer("Quant", shape, params)
    a = node_of(model, "q").attrs
    x = (rng(2).standard_normal(shape) * 1.2).astype(np.float32)
    edges = quant_edges(a.get("centers", [0.5, 1.0]))
    edges = edges[np.isfinite(edges) & (np.abs(edges) < 1e20)]      # finite: assert_close takes no NaN
    flat = x.reshape(-1)
    flat[:len(edges)] = edges
    ref = quant_ref(x, a["func"], a.get("centers", ()), a["negative_slope"])
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path)


@pytest.mark.parametrize("params", [QUANT_3NE, 'quant_param { forward_func: "sign" }',
                                    'quant_param { forward_func: "relu" negative_slope: 0.5 }'])
def test_quant_inf_and_nan_everywhere(params, tmp_path):
    model = one_layer("Quant", (1, 2, 3, 4), params)
    a = node_of(model, "q").attrs
    x = np.linspace(-3, 3, 24, dtype=np.float32).reshape(1, 2, 3, 4)
    x.reshape(-1)[:5] = [np.inf, -np.inf, np.nan, FLT_MAX, -FLT_MAX]
    ref = quant_ref(x, a["func"], a.get("centers", ()), a["negative_slope"])
    for backend, got in backend_outputs(model, {"x": x}, tmp_path, "y").items():
        np.testing.assert_array_equal(got, ref, err_msg=backend)


def test_quant_after_batchnorm_in_place_as_the_examples(tmp_path):
    text = net('layer { name: "bn" type: "BatchNorm" bottom: "x" top: "x" batch_norm_param { use_global_stats: true } }',
               f'layer {{ name: "q" type: "Quant" bottom: "x" top: "y" {QUANT_3NE} }}', inputs={"x": (2, 3, 2, 3)})
    model = load_from_text(text, random_weights=True)
    node = node_of(model, "bn")
    node.blobs = [np.zeros(3, np.float32), np.ones(3, np.float32), np.ones(1, np.float32)]
    model.clear_cache()
    x = (rng(3).standard_normal((2, 3, 2, 3)) * 2).astype(np.float32)
    bn = (x / np.sqrt(f32(1) + f32(1e-5))).astype(np.float32)
    ref = quant_ref(bn, "hwgq", [0.538, 1.076, 1.614])
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path)


@pytest.mark.parametrize("params, words", [
    ('quant_param { forward_func: "tanh" }', "forward_func must be one of"),
    ('quant_param { forward_func: "hwgq" }', "centers is required"),
    ('quant_param { centers: 0.5 centers: 0 }', "must all be > 0"),
])
def test_quant_bad_params(params, words):
    with pytest.raises(LayerError, match=words):
        one_layer("Quant", (1, 2, 3, 4), params)


def test_quant_takes_one_bottom():
    text = net(f'layer {{ name: "q" type: "Quant" bottom: "x" bottom: "z" top: "y" {QUANT_3NE} }}',
               inputs={"x": (1, 2, 3, 4), "z": (1, 2, 3, 4)})
    with pytest.raises(LayerError, match="Quant takes one bottom"):
        load_from_text(text)


# ---- binary weights ------------------------------------------------------------------------------

def test_binarize_rows_zeros_and_alpha():
    w = np.array([[0.0, -0.0, 0.5, -1.5], [-0.25, -0.25, 0.0, 2.0], [np.nan, 1.0, -1.0, 3.0]], np.float32)
    for use_alpha in (False, True):
        got = hwgq_binarize(torch.from_numpy(w), use_alpha).numpy()
        np.testing.assert_array_equal(got, binarize_ref(w, use_alpha))
    got = hwgq_binarize(torch.from_numpy(w[:2]), True).numpy()
    np.testing.assert_array_equal(got, [[0.5, 0.5, 0.5, -0.5], [-0.625, -0.625, 0.625, 0.625]])
    # a row of 3 weights: float32(1/3) * sum, as gemv's float alpha
    w3 = np.array([[0.1, -0.2, 0.4]], np.float32)
    alpha = f32(f32(1.0 / 3) * f32(f32(f32(0.1) + f32(0.2)) + f32(0.4)))
    np.testing.assert_array_equal(hwgq_binarize(torch.from_numpy(w3), True).numpy(), [[alpha, -alpha, alpha]])


@pytest.mark.parametrize("binary, bias", [
    ("binary_convolution_param { use_alpha: true }", True),
    ("", True),                                                   # use_alpha false: +-1 weights
    ("binary_convolution_param { use_alpha: true }", False),
    ("binary_convolution_param { use_alpha: true use_binarization: false }", True),   # float weights
])
def test_binary_convolution(binary, bias, tmp_path):
    shape = (2, 4, 7, 6)
    params = ("convolution_param { num_output: 6 kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 pad_h: 1 "
              f"pad_w: 0 group: 2 {'' if bias else 'bias_term: false'} }} {binary}")
    model = one_layer("BinaryConvolution", shape, params)
    r = rng(4)
    w = dyadic(r, (6, 2, 3, 2))
    w[0, 0, 0, 0], w[1, 1, 2, 1], w[2, 0, 1, 0] = 0.0, -0.0, 0.0
    blobs = [w] + ([dyadic(r, (6,))] if bias else [])
    set_blobs(model, *blobs)
    x = r.standard_normal(shape).astype(np.float32)
    a = node_of(model, "q").attrs
    wb = binarize_ref(w, a["use_alpha"], a["binarize"])
    ref = conv_ref(x, wb, blobs[1] if bias else None, (2, 1), (1, 0), 2)
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=2e-5)


@pytest.mark.parametrize("params, use_alpha, note", [
    # zzqiuzz/caffe-zz's BWN nets: its debug_param marks its layers, which always scale by mean |w|
    ("debug_param { xnorno_grad: false }", True, "read as caffe-zz's binary-weight layer"),
    ("", False, "no binary_convolution_param: read as zhaoweicai/hwgq's default"),
])
def test_binary_convolution_without_its_param_says_which_fork_it_is_read_as(params, use_alpha, note, tmp_path):
    shape = (1, 3, 6, 5)
    model = one_layer("BinaryConvolution", shape,
                      f"convolution_param {{ num_output: 4 kernel_size: 3 bias_term: false }} {params}")
    assert node_of(model, "q").attrs["use_alpha"] is use_alpha
    assert any(note in w for w in model.warnings)
    r = rng(6)
    w = dyadic(r, (4, 3, 3, 3))
    set_blobs(model, w)
    x = r.standard_normal(shape).astype(np.float32)
    ref = conv_ref(x, binarize_ref(w, use_alpha), None, (1, 1), (0, 0), 1)
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=2e-5)


def test_caffe_zz_net_and_relax_fields_change_nothing_at_test(tmp_path):
    # caffe-zz faa98ea: is_quantization is only logged, binary_relax mixes in the float weights at TRAIN only
    layer = ('layer { name: "q" type: "BinaryInnerProduct" bottom: "x" top: "y" inner_product_param { '
             'num_output: 3 bias_term: false } debug_param { binary_relax: true } }')
    model = load_from_text("is_quantization: true\n" + net(layer, inputs={"x": (2, 5)}), random_weights=True)
    r = rng(7)
    w = dyadic(r, (3, 5))
    set_blobs(model, w)
    x = r.standard_normal((2, 5)).astype(np.float32)
    wb = binarize_ref(w, True)
    check_everywhere(model, {"x": x}, {"y": x.astype(np.float64) @ wb.T.astype(np.float64)}, tmp_path, atol=2e-6)


def test_caffe_zz_weight_recentring_is_refused():
    with pytest.raises(LayerError, match="xnorno_grad"):
        one_layer("BinaryConvolution", (1, 3, 6, 5),
                  "convolution_param { num_output: 4 kernel_size: 3 } debug_param { xnorno_grad: true }")


def test_binary_convolution_keeps_convolution_blobs(tmp_path):
    model = one_layer("BinaryConvolution", (1, 3, 5, 5),
                      "convolution_param { num_output: 4 kernel_size: 3 dilation: 2 pad: 1 } "
                      "binary_convolution_param { use_alpha: true }")
    node = node_of(model, "q")
    assert [b.shape for b in node.blobs] == [(4, 3, 3, 3), (4,)]
    assert model.graph.shape("y") == (1, 4, 3, 3)   # 5 + 2 - (2 * 2 + 1) + 1


@pytest.mark.parametrize("binary, transpose", [
    ("binary_inner_product_param { use_alpha: true }", False),
    ("", False),
    ("binary_inner_product_param { use_alpha: true }", True),     # transpose is never read
])
def test_binary_inner_product(binary, transpose, tmp_path):
    shape = (3, 2, 3, 4)
    params = f"inner_product_param {{ num_output: 5 {'transpose: true' if transpose else ''} }} {binary}"
    model = one_layer("BinaryInnerProduct", shape, params)
    node = node_of(model, "q")
    assert [b.shape for b in node.blobs] == [(5, 24), (5,)]
    assert any("never reads inner_product_param.transpose" in n for n in model.warnings) == transpose
    r = rng(5)
    w, b = dyadic(r, (5, 24)), dyadic(r, (5,))
    w[3, 7] = 0.0
    set_blobs(model, w, b)
    x = r.standard_normal(shape).astype(np.float32)
    wb = binarize_ref(w, node.attrs["use_alpha"]).astype(np.float64)
    ref = x.reshape(3, -1).astype(np.float64) @ wb.T + b
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=2e-5)


def test_binary_inner_product_takes_one_bottom():
    text = net('layer { name: "q" type: "BinaryInnerProduct" bottom: "x" bottom: "z" top: "y" top: "w" '
               'inner_product_param { num_output: 2 } }', inputs={"x": (1, 4), "z": (1, 4)})
    with pytest.raises(LayerError, match="BinaryInnerProduct takes one bottom"):
        load_from_text(text)


def test_resnet_block_as_the_examples(tmp_path):
    """BatchNorm -> Quant (in place of nothing: a new top) -> BinaryConvolution, as res18's blocks."""
    text = net(f'layer {{ name: "qt" type: "Quant" bottom: "x" top: "qx" {QUANT_3NE} }}',
               'layer { name: "q" type: "BinaryConvolution" bottom: "qx" top: "y" convolution_param { '
               'num_output: 3 kernel_size: 3 pad: 1 bias_term: false } binary_convolution_param { use_alpha: true } }',
               inputs={"x": (2, 5, 4, 3)})
    model = load_from_text(text, random_weights=True)
    r = rng(6)
    w = dyadic(r, (3, 5, 3, 3))
    set_blobs(model, w)
    x = (r.standard_normal((2, 5, 4, 3)) * 1.3).astype(np.float32)
    q = quant_ref(x, "hwgq", [0.538, 1.076, 1.614])
    ref = conv_ref(q, binarize_ref(w, True), None, (1, 1), (1, 1), 1)
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=2e-5)


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_nets_inspect(name):
    path = CORPUS / f"zhaoweicai__hwgq__examples__imagenet__{name}.prototxt"
    if not path.exists():
        pytest.skip("not shipped: licence (zhaoweicai/hwgq's LICENSE allows educational, research and "
                    "non-profit use only)")
    res = subprocess.run([sys.executable, "cli.py", "inspect", str(path)], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "BinaryConvolution" in res.stdout and "Quant" in res.stdout
