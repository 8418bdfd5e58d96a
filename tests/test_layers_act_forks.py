"""Single-fork layers of act_forks.py, each as its fork computes it at TEST: RReLU (ducha-aiki/caffe
rrelu_layer.cpp), APL (Learned-Activation-Functions-Source apl_layer.cpp), GuidedDropout (Cysu/caffe
guided_dropout_layer.cpp) and yihui-he/caffe-pro's one-bottom Filter (filter_layer.cu).

References are float64 numpy loops written here from the forks' code; each layer runs in torch,
onnxruntime and the generated model.py.
"""
import math

import numpy as np
import pytest
from conftest import assert_close, check_everywhere, net, node_of, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text


def check_backends(model, feeds, tmp_path, refs, atol=1e-5, rtol=1e-5):
    """torch, onnxruntime (default opset) and model.py against refs."""
    check_everywhere(model, feeds, refs, tmp_path, atol, rtol, opsets=(None,))


# ---- RReLU -----------------------------------------------------------------------------------

def rrelu_ref(x, lb, ub):
    """rrelu_layer.cpp TEST: max(x, 0) + min(x, 0) / mean_slope, mean_slope = (ub-lb)/(ln|ub|-ln|lb|)."""
    mean_slope = (ub - lb) / (math.log(abs(ub)) - math.log(abs(lb)))
    y = np.empty(x.shape)
    for i, v in np.ndenumerate(x.astype(np.float64)):
        y[i] = max(v, 0.0) + min(v, 0.0) / mean_slope
    return y


@pytest.mark.parametrize("params, lb, ub", [("rrelu_param { lb: 10 ub: 30 }", 10.0, 30.0),
                                            ("", 5.0, 10.0),                    # the fork's defaults
                                            ("rrelu_param { lb: -8 ub: -3 }", -8.0, -3.0)])
def test_rrelu_divides_by_the_logarithmic_mean(params, lb, ub, tmp_path):
    x = rng(1).standard_normal((2, 3, 4, 5)).astype(np.float32) * 4
    model = load_from_text(net(f'layer {{ name: "r" type: "RReLU" bottom: "x" top: "o" {params} }}',
                               inputs={"x": x.shape}))
    ref = rrelu_ref(x, lb, ub)
    # the fork's TEST slope is not the arithmetic mean of the bounds
    arithmetic = np.where(x > 0, x, x / ((lb + ub) / 2))
    assert np.abs(ref - arithmetic).max() > 1e-3
    check_backends(model, {"x": x}, tmp_path, {"o": ref})


@pytest.mark.parametrize("params, field", [("lb: 3 ub: 3", "rrelu_param.ub"), ("lb: 0 ub: 3", "rrelu_param.lb"),
                                           ("lb: -4 ub: 4", "same magnitude")])
def test_rrelu_bad_bounds(params, field):
    with pytest.raises(LayerError, match=field):
        load_from_text(net(f'layer {{ name: "r" type: "RReLU" bottom: "x" top: "o" rrelu_param {{ {params} }} }}',
                           inputs={"x": (1, 2, 3, 4)}))


# ---- APL -------------------------------------------------------------------------------------

def apl_ref(x, slope, offset, sums):
    """apl_layer.cpp Forward_cpu: K = count / num, parameter index k * sums + s."""
    n = x.shape[0]
    flat = x.astype(np.float64).reshape(n, -1)
    a, b = slope.astype(np.float64).ravel(), offset.astype(np.float64).ravel()
    y = np.empty_like(flat)
    for e in range(n):
        for k in range(flat.shape[1]):
            v = flat[e, k]
            t = max(v, 0.0)
            for s in range(sums):
                t += a[k * sums + s] * max(-v + b[k * sums + s], 0.0)
            y[e, k] = t
    return y.reshape(x.shape)


@pytest.mark.parametrize("sums", [2, 3])
@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (3, 7)])
def test_apl(sums, shape, tmp_path):
    x = rng(2).standard_normal(shape).astype(np.float32)
    model = load_from_text(net(f'layer {{ name: "a" type: "APL" bottom: "x" top: "o" apl_param {{ sums: {sums} }} }}',
                               inputs={"x": shape}), random_weights=True)
    node = node_of(model, "a")
    k = math.prod(shape[1:])
    assert node.expected_param_shapes == [(1, 1, sums, k)] * 2
    slope = rng(3).uniform(-1, 1, (1, 1, sums, k)).astype(np.float32)
    offset = rng(4).standard_normal((1, 1, sums, k)).astype(np.float32)
    node.blobs[0], node.blobs[1] = slope, offset
    check_backends(model, {"x": x}, tmp_path, {"o": apl_ref(x, slope, offset, sums)})


def test_apl_fillers_and_bad_sums():
    text = net('layer { name: "a" type: "APL" bottom: "x" top: "o" apl_param { sums: 2 '
               'slope_filler { type: "constant" value: 0.25 } offset_filler { type: "uniform" min: 1 max: 2 } } }',
               inputs={"x": (2, 3, 2, 2)})
    node = node_of(load_from_text(text, random_weights=True), "a")
    assert np.all(node.blobs[0] == 0.25)
    assert node.blobs[1].min() >= 1 and node.blobs[1].max() <= 2
    # the fork's defaults: uniform(+-0.5 / sums) slopes
    node = node_of(load_from_text(net('layer { name: "a" type: "APL" bottom: "x" top: "o" apl_param { sums: 5 } }',
                                      inputs={"x": (2, 3, 2, 2)}), random_weights=True), "a")
    assert np.abs(node.blobs[0]).max() <= 0.1
    with pytest.raises(LayerError, match="apl_param.sums"):
        load_from_text(net('layer { name: "a" type: "APL" bottom: "x" top: "o" apl_param { sums: 0 } }',
                           inputs={"x": (2, 3)}))


# ---- GuidedDropout ---------------------------------------------------------------------------

def guided_ref(x, guidance, threshold):
    """guided_dropout_layer.cpp deterministic: mask = guidance > thr, x * mask * C / kept when kept > 0."""
    n, c = x.shape[:2]
    dim = x[0, 0].size
    flat, g = x.astype(np.float64).reshape(n, c, dim), guidance.reshape(n, c)
    y = np.empty_like(flat)
    for i in range(n):
        kept = sum(1 for ch in range(c) if g[i, ch] > threshold)
        for ch in range(c):
            for d in range(dim):
                v = flat[i, ch, d] * (1.0 if g[i, ch] > threshold else 0.0)
                y[i, ch, d] = v * c / kept if kept > 0 else v
    return y.reshape(x.shape)


@pytest.mark.parametrize("shape, gshape", [((3, 4, 2, 5), (3, 4, 1, 1)), ((3, 6), (3, 6))])
@pytest.mark.parametrize("threshold", [0.0, 0.3])
def test_guided_dropout_deterministic(shape, gshape, threshold, tmp_path):
    x = rng(5).standard_normal(shape).astype(np.float32)
    g = rng(6).standard_normal(gshape).astype(np.float32)
    g.reshape(shape[0], -1)[1] = -1.0          # sample 1 keeps no channel: its output is zero
    text = net('layer { name: "d" type: "GuidedDropout" bottom: "x" bottom: "g" top: "o" '
               f'guided_dropout_param {{ guidance_threshold: {threshold} }} }}', inputs={"x": shape, "g": gshape})
    model = load_from_text(text)
    ref = guided_ref(x, g, np.float32(threshold))
    assert np.all(ref[1] == 0)
    check_backends(model, {"x": x, "g": g}, tmp_path, {"o": ref})


def test_guided_dropout_stochastic_is_identity_at_test(tmp_path):
    x = rng(7).standard_normal((2, 3, 4, 5)).astype(np.float32)
    g = rng(8).standard_normal((2, 3)).astype(np.float32)
    text = net('layer { name: "d" type: "GuidedDropout" bottom: "x" bottom: "g" top: "o" '
               'guided_dropout_param { type: "stochastic" sigmoid_scaler: 2 } }', inputs={"x": x.shape, "g": g.shape})
    check_backends(load_from_text(text), {"x": x, "g": g}, tmp_path, {"o": x}, 0, 0)


@pytest.mark.parametrize("param, gshape, match", [('type: "random"', (2, 3), "guided_dropout_param.type"),
                                                  ("", (2, 4), "guidance"), ("", (2, 3, 2, 1), "guidance")])
def test_guided_dropout_errors(param, gshape, match):
    text = net(f'layer {{ name: "d" type: "GuidedDropout" bottom: "x" bottom: "g" top: "o" '
               f'guided_dropout_param {{ {param} }} }}', inputs={"x": (2, 3, 4, 5), "g": gshape})
    with pytest.raises(LayerError, match=match):
        load_from_text(text)


# ---- yihui-he's Filter (filter_param) ----------------------------------------------------------

def select_ref(x, selector):
    """filter_layer.cu: top channel n = bottom channel indices_to_forward_[n] (non-zero selector entries)."""
    kept = [c for c in range(x.shape[1]) if selector[c] != 0]
    y = np.empty((x.shape[0], len(kept)) + x.shape[2:])
    for n, c in enumerate(kept):
        y[:, n] = x[:, c]
    return y


def test_selector_filter_one_and_two_bottoms(tmp_path):
    x = rng(9).standard_normal((2, 5, 3, 4)).astype(np.float32)
    z = rng(10).standard_normal((3, 5, 2, 1)).astype(np.float32)
    text = net('layer { name: "f" type: "Filter" bottom: "x" top: "o" param { lr_mult: 0 } '
               'filter_param { num_output: 3 } }',
               'layer { name: "f2" type: "Filter" bottom: "x" bottom: "z" top: "p" top: "q" '
               'filter_param { num_output: 2 axis: -3 } }', inputs={"x": x.shape, "z": z.shape})
    model = load_from_text(text, random_weights=True)
    f, f2 = node_of(model, "f"), node_of(model, "f2")
    assert f.expected_param_shapes == [(5,)] and model.blob_shapes["o"] == (2, 3, 3, 4)
    assert model.blob_shapes["q"] == (3, 2, 2, 1)
    assert list(f.blobs[0]) == [1, 1, 1, 0, 0]            # without weights: the first num_output channels
    f.blobs[0] = np.array([0, 1, 1, 0, 2], np.float32)
    f2.blobs[0] = np.array([0, 0, -1, 0, 1], np.float32)
    refs = {"o": select_ref(x, f.blobs[0]), "p": select_ref(x, f2.blobs[0]), "q": select_ref(z, f2.blobs[0])}
    check_backends(model, {"x": x, "z": z}, tmp_path, refs, 0, 0)


def test_selector_filter_errors():
    one = 'layer {{ name: "f" type: "Filter" bottom: "x" top: "o" {} }}'
    with pytest.raises(LayerError, match="filter_param.num_output"):
        load_from_text(net(one.format("filter_param { axis: 1 }"), inputs={"x": (2, 5, 3, 4)}))
    with pytest.raises(LayerError, match="filter_param.num_output 6 exceeds"):
        load_from_text(net(one.format("filter_param { num_output: 6 }"), inputs={"x": (2, 5, 3, 4)}))
    with pytest.raises(LayerError, match="filter_param.axis"):
        load_from_text(net(one.format("filter_param { num_output: 1 axis: 2 }"), inputs={"x": (2, 5, 3, 4)}))
    with pytest.raises(LayerError, match="4-axis"):
        load_from_text(net(one.format("filter_param { num_output: 1 }"), inputs={"x": (2, 5)}))
    # no filter_param and one bottom: BVLC's Filter, whose error points at the fork's message
    with pytest.raises(LayerError, match="filter_param"):
        load_from_text(net(one.format(""), inputs={"x": (2, 5, 3, 4)}))
    # filter_param with BVLC's bottoms-minus-one tops
    with pytest.raises(LayerError, match="one top per bottom"):
        load_from_text(net('layer { name: "f" type: "Filter" bottom: "x" bottom: "s" top: "o" '
                           'filter_param { num_output: 1 } }', inputs={"x": (2, 5, 3, 4), "s": (2, 1)}))
    # a selector that keeps another number of channels than num_output: the fork's CHECK, as an error
    model = load_from_text(net(one.format("filter_param { num_output: 2 }"), inputs={"x": (2, 5, 3, 4)}),
                           random_weights=True)
    node_of(model, "f").blobs[0] = np.array([1, 1, 1, 0, 0], np.float32)
    with pytest.raises(LayerError, match="keeps 3 channels"):
        model.run({"x": np.zeros((2, 5, 3, 4), np.float32)})


def test_bvlc_filter_still_selects_items(tmp_path):
    x = rng(11).standard_normal((4, 3, 2)).astype(np.float32)
    sel = np.array([[1], [0], [2], [0]], np.float32)
    model = load_from_text(net('layer { name: "f" type: "Filter" bottom: "x" bottom: "s" top: "o" }',
                               inputs={"x": x.shape, "s": sel.shape}))
    assert node_of(model, "f").expected_param_shapes is None
    assert_close(model.run({"x": x, "s": sel})["o"], x[[0, 2]], 0, 0, "torch")


# ---- MinReLU (ALISCIFP/caffe minrelu_layer.cpp) ----------------------------------------------

def min_relu_ref(x, slope):
    """Forward_cpu: min(x, 0) + positive_slope * max(x, 0), element by element."""
    y = np.empty(x.shape)
    for i, v in np.ndenumerate(x.astype(np.float64)):
        y[i] = min(v, 0.0) + slope * max(v, 0.0)
    return y


@pytest.mark.parametrize("params, slope", [("", 0.0), ("minrelu_param { positive_slope: 0.25 }", 0.25),
                                           ("minrelu_param { positive_slope: -1.5 engine: CAFFE }", -1.5)])
def test_min_relu(params, slope, tmp_path):
    x = rng(21).standard_normal((2, 3, 4, 5)).astype(np.float32) * 3
    model = load_from_text(net(f'layer {{ name: "m" type: "MinReLU" bottom: "x" top: "o" {params} }}',
                               inputs={"x": x.shape}))
    ref = min_relu_ref(x, slope)
    assert (ref[x > 0] == 0).all() if slope == 0 else True
    check_backends(model, {"x": x}, tmp_path, {"o": ref})


def test_min_relu_in_place_and_cudnn_note(tmp_path):
    x = rng(22).standard_normal((3, 2, 5)).astype(np.float32)
    model = load_from_text(net('layer { name: "m" type: "MinReLU" bottom: "x" top: "x" '
                               'minrelu_param { engine: CUDNN } }', inputs={"x": x.shape}))
    assert any("plain ReLU" in n for n in model.warnings)
    assert_close(model.run({"x": x})["x"], np.minimum(x, 0), 0, 0, "in place")


def brelu_ref(x, lo, hi):
    """brelu_layer.cpp's Forward_cpu, element by element: std::min(std::max(x, minval), maxval)."""
    y = np.empty(x.shape, np.float32)
    for i, v in np.ndenumerate(x):
        y[i] = min(max(v, np.float32(lo)), np.float32(hi))
    return y


@pytest.mark.parametrize("params, lo, hi", [("", 0.0, 1.0), ("brelu_param { minval: 0 maxval: 1 }", 0.0, 1.0),
                                            ("brelu_param { minval: -0.5 maxval: 2.5 }", -0.5, 2.5)])
def test_brelu_clamps_to_its_bounds(params, lo, hi, tmp_path):
    """FPCNet's bilateral ReLU (brelu_param minval 0, maxval 1)."""
    x = rng(23).standard_normal((2, 3, 5, 4)).astype(np.float32) * 2
    model = load_from_text(net(f'layer {{ name: "b" type: "BReLU" bottom: "x" top: "o" {params} }}',
                               inputs={"x": x.shape}))
    assert any("GPU kernel" in n for n in model.warnings) == ((lo, hi) != (0.0, 1.0))
    ref = brelu_ref(x, lo, hi)
    assert (ref == lo).any() and (ref == hi).any() and ((ref > lo) & (ref < hi)).any()
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path)


def test_hashnet_scale_tanh_is_tanh_of_the_initial_scale(tmp_path):
    # thuml/HashNet's train_val nets: the "continuation" layer, scale_tanh_param as they write it
    x = rng(11).standard_normal((3, 5)).astype(np.float32) * 3
    text = net('layer { name: "c" type: "ScaleTanH" bottom: "x" top: "y" scale_tanh_param { init_scale: 0.75 '
               'step_size: 200 gamma: 0.005 power: 0.5 } }', inputs={"x": x.shape})
    model = load_from_text(text)
    ref = np.tanh(x.astype(np.float64) * np.float32(0.75))
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=1e-6, rtol=1e-6)
    assert any("the fork raises its scale every 200 forwards" in w for w in model.warnings)
    plain = load_from_text(text.replace(" gamma: 0.005 power: 0.5", ""))
    assert not any("raises its scale" in w for w in plain.warnings)


# ---- GELU (kaveena/caffe-pruning gelu_layer.cpp) -----------------------------------------------

def gelu_ref(x, coeff):
    """Forward_cpu: tanh of a double argument stored as float, then coeff * 0.5 * x * (1 + t) in double."""
    out = np.empty_like(x)
    for i, v in enumerate(x.reshape(-1)):
        v = float(v)
        t = np.float32(math.tanh(0.7978845608 * v + 0.7978845608 * 0.044715 * v * v * v))
        out.reshape(-1)[i] = np.float32(float(np.float32(coeff)) * 0.5 * v * float(np.float32(1) + t))
    return out


@pytest.mark.parametrize("param, coeff", [("", 1.0), ("gelu_param { coeff: 1.7015043497085571 }", 1.7015043497085571)])
def test_gelu_is_the_forks_tanh_approximation(param, coeff, tmp_path):
    import torch
    x = (rng(31).standard_normal((2, 3, 4, 5)) * 3).astype(np.float32)
    model = load_from_text(net(f'layer {{ name: "g" type: "GELU" bottom: "x" top: "y" {param} }}',
                               inputs={"x": x.shape}))
    ref = gelu_ref(x, coeff)
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=1e-6, rtol=2e-7)
    # the same curve as PyTorch's tanh-approximate GELU, up to the fork's 10-digit sqrt(2 / pi)
    tanh_gelu = torch.nn.functional.gelu(torch.from_numpy(x).double(), approximate="tanh").numpy() * np.float32(coeff)
    np.testing.assert_allclose(ref, tanh_gelu, rtol=1e-6, atol=1e-6)


def test_reluplus_is_relu_in_a_forward(tmp_path):
    """liuxianming/caffe_feedback's V1 RELUPLUS: max(x, 0) times a gate every ordinary forward resets to 1."""
    text = ('input: "x" input_dim: 2 input_dim: 3 input_dim: 4 input_dim: 5\n'
            'layers { name: "copy" type: POWER bottom: "x" top: "p" }\n'
            'layers { name: "relu" type: RELUPLUS bottom: "p" top: "r" }\n'
            'layers { name: "relu2" type: RELUPLUS bottom: "r" top: "r" }')
    model = load_from_text(text)
    assert [n.type for n in model.graph.nodes][-2:] == ["ReLUPlus", "ReLUPlus"]
    x = rng(3).standard_normal((2, 3, 4, 5)).astype(np.float32)
    check_everywhere(model, {"x": x}, {"r": np.maximum(x, 0)}, tmp_path)


# ---- PENLU (xncaffe/caffe_penlu penlu_layer.cpp Forward_cpu) ----------------------------------------------

def penlu_ref(x, alpha, beta, eta, shared=False):
    out = np.empty_like(x)
    for idx in np.ndindex(x.shape):
        k = 0 if shared else idx[1]
        v = x[idx]
        a, b, e = (np.float32(p.reshape(-1)[k]) for p in (alpha, beta, eta))
        pos = np.float32(np.power(max(v, np.float32(0)), e)) * np.float32(v > 0)
        neg = a * (np.float32(np.exp(b * min(v, np.float32(0)))) - np.float32(1)) * np.float32(v <= 0)
        out[idx] = pos + neg
    return out


@pytest.mark.parametrize("shared", [False, True])
def test_penlu(tmp_path, shared):
    g = rng(61)
    shape = (2, 3, 4, 5)
    text = ('layer { name: "p" type: "PENLU" bottom: "x" top: "o" penlu_param { alpha_filler { type: "constant" '
            f'value: 0.25 }} channel_shared: {str(shared).lower()} }} }}')
    model = load_from_text(net(text, inputs={"x": shape}), random_weights=True)
    blob_shape = () if shared else (3,)
    assert [np.shape(b) for b in node_of(model, "p").blobs] == [blob_shape] * 3
    assert np.all(node_of(model, "p").blobs[0] == 0.25) and np.all(node_of(model, "p").blobs[2] == 1)
    alpha = g.uniform(0.2, 3, blob_shape).astype(np.float32)
    beta = g.uniform(0.5, 1.5, blob_shape).astype(np.float32)
    eta = g.uniform(0.8, 1.1, blob_shape).astype(np.float32)
    node_of(model, "p").blobs = [alpha, beta, eta]
    x = g.standard_normal(shape).astype(np.float32)
    x[0, 0, 0, :2] = 0.0
    check_everywhere(model, {"x": x}, {"o": penlu_ref(x, alpha, beta, eta, shared)}, tmp_path, atol=1e-6, rtol=1e-6)


# ---- Leaky (shishichang/caffe leaky_layer.cpp) ----------------------------------------------------

def leaky_ref(x):
    """leaky_layer.cpp: x > 0 ? x : 0.1 * x, the literal a double, rounded once to float."""
    y = np.empty(x.shape, np.float32)
    for i, v in np.ndenumerate(x):
        y[i] = v if v > 0 else np.float32(0.1 * float(v))
    return y


def test_leaky_scales_negatives_by_a_double_tenth(tmp_path):
    x = (rng(41).standard_normal((2, 3, 5, 4)) * 7).astype(np.float32)
    model = load_from_text(net('layer { name: "l" type: "Leaky" bottom: "x" top: "o" }', inputs={"x": x.shape}))
    ref = leaky_ref(x)
    # the double literal matters: float32's 0.1f * x differs in the last bit for some of these values
    assert (np.where(x > 0, x, np.float32(0.1) * x) != ref).any()
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path, atol=0, rtol=0)


def test_leaky_in_place_reads_as_the_fork_would_compute_it():
    """The fork CHECKs that Leaky is not in place; caffeq computes the same value either way."""
    x = (rng(42).standard_normal((2, 3, 5)) * 7).astype(np.float32)
    model = load_from_text(net('layer { name: "l" type: "Leaky" bottom: "x" top: "x" }', inputs={"x": x.shape}))
    assert_close(model.run({"x": x})["x"], leaky_ref(x), 0, 0, "in place")


def test_leaky_takes_one_bottom():
    with pytest.raises(LayerError, match="Leaky"):
        load_from_text(net('layer { name: "l" type: "Leaky" bottom: "x" bottom: "x" top: "o" }',
                           inputs={"x": (1, 2, 3, 3)}))
