"""chuckcho/video-caffe's cuDNN N-D layers (fc232b3e): NdConvolution and NdPooling with the BlobShape fields
kernel_shape / stride_shape / pad_shape.  References are numpy loops written from the fork's code:
cudnn_ndconv_layer.cpp (cross-correlation, extents (n + 2p - k) / s + 1 rounded down, an extent of 1 left
out of the top) and cudnn_ndpooling_layer.cpp (ceil extents, one less on a padded axis whose last window
would start at or past n + p; cuDNN's MAX and AVE with the padding counted), on (N, C, D, H, W) shapes
whose axes all differ."""
import itertools
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import backend_outputs, check_everywhere, net, node_of, rng

import caffeq
from caffeq.layers import LayerError
from caffeq.model import load_from_text

REALWORLD = Path(__file__).parent / "fixtures" / "realworld"


def dims(values):
    return "{ " + " ".join(f"dim: {v}" for v in values) + " }"


def window_text(kernel, stride=None, pad=None):
    text = f"kernel_shape {dims(kernel)}"
    if stride is not None:
        text += f" stride_shape {dims(stride)}"
    if pad is not None:
        text += f" pad_shape {dims(pad)}"
    return text


# ---- NdConvolution --------------------------------------------------------------------------------

def ndconv_ref(x, w, b, stride, pad, group):
    """Each output cell: the zero-padded window times the filter of its group, summed, plus the bias;
    then the fork's compute_output_shape: every spatial extent of 1 is left out of the top."""
    n, c = x.shape[:2]
    o, cg = w.shape[:2]
    kernel = w.shape[2:]
    xp = np.pad(x.astype(np.float64), [(0, 0), (0, 0)] + [(p, p) for p in pad])
    outs = [(size + 2 * p - k) // s + 1 for size, k, s, p in zip(x.shape[2:], kernel, stride, pad)]
    y = np.zeros((n, o) + tuple(outs))
    og = o // group
    for index in itertools.product(*[range(v) for v in outs]):
        sl = tuple(slice(i * s, i * s + k) for i, s, k in zip(index, stride, kernel))
        for g in range(group):
            patch = xp[(slice(None), slice(g * cg, (g + 1) * cg)) + sl]
            y[(slice(None), slice(g * og, (g + 1) * og)) + index] = np.einsum(
                "ncdhw,ocdhw->no", patch, w[g * og:(g + 1) * og].astype(np.float64))
    if b is not None:
        y += b.reshape((1, -1) + (1,) * len(outs))
    return y.reshape((n, o) + tuple(v for v in outs if v > 1))


def ndconv_net(shape, body, tops=("c",), bottoms=("x",)):
    ins = " ".join(f'bottom: "{b}"' for b in bottoms)
    outs = " ".join(f'top: "{t}"' for t in tops)
    return net(f'layer {{ name: "c" type: "NdConvolution" {ins} {outs} convolution_param {{ {body} }} }}',
               inputs={b: shape for b in bottoms})


@pytest.mark.parametrize("shape, kernel, stride, pad, group, out, bias", [
    ((2, 4, 5, 7, 6), (2, 3, 2), (1, 2, 1), (0, 1, 1), 1, 3, True),
    ((2, 4, 6, 5, 7), (3, 1, 2), (2, 1, 3), (1, 0, 0), 2, 6, True),
    ((3, 2, 4, 6, 5), (1, 2, 3), None, None, 1, 5, False),           # stride_shape / pad_shape default
    ((2, 4, 3, 6, 5), (3, 3, 2), (1, 2, 1), (0, 1, 0), 2, 4, True),  # D' = 1: a 4-axis top
    ((2, 3, 4, 5, 3), (2, 5, 3), (1, 1, 1), (0, 0, 0), 1, 2, True),  # H' = W' = 1: (N, O, D')
])
def test_ndconvolution_matches_the_forks_formula(shape, kernel, stride, pad, group, out, bias, tmp_path):
    x = rng(1).standard_normal(shape).astype(np.float32)
    body = f"num_output: {out} group: {group} bias_term: {str(bias).lower()} {window_text(kernel, stride, pad)}"
    model = load_from_text(ndconv_net(shape, body), random_weights=True)
    node = node_of(model, "c")
    w = node.blobs[0]
    assert w.shape == (out, shape[1] // group) + kernel
    b = None
    if bias:
        b = rng(2).standard_normal((out,)).astype(np.float32)   # a bias that is not zero
        node.blobs = [w, b]
    else:
        assert len(node.blobs) == 1
    ref = ndconv_ref(x, w, b, stride or (1,) * 3, pad or (0,) * 3, group)
    assert model.graph.shape("c") == ref.shape
    check_everywhere(model, {"x": x}, {"c": ref}, tmp_path, atol=1e-5, rtol=1e-5)


def test_ndconvolution_two_bottoms_share_the_filters(tmp_path):
    shape = (2, 3, 4, 6, 5)
    x, z = (rng(s).standard_normal(shape).astype(np.float32) for s in (3, 4))
    text = ndconv_net(shape, f"num_output: 2 {window_text((2, 3, 2), (1, 1, 2), (1, 0, 1))}",
                      tops=("c", "d"), bottoms=("x", "z"))
    model = load_from_text(text, random_weights=True)
    w, b = node_of(model, "c").blobs
    refs = {top: ndconv_ref(v, w, b, (1, 1, 2), (1, 0, 1), 1) for top, v in (("c", x), ("d", z))}
    check_everywhere(model, {"x": x, "z": z}, refs, tmp_path, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("body, shape, message", [
    ("num_output: 2 kernel_size: 3", (1, 2, 4, 5, 6), "convolution_param.kernel_shape is required by NdConvolution"),
    (f"num_output: 2 {window_text((2, 2, 2), (1, 1))}", (1, 2, 4, 5, 6), "stride_shape has 2 dims, kernel_shape 3"),
    (f"num_output: 2 {window_text((2, 0, 2))}", (1, 2, 4, 5, 6), "kernel_shape dims must be > 0"),
    (f"num_output: 2 engine: CAFFE {window_text((2, 2, 2))}", (1, 2, 4, 5, 6), "CAFFE is not implemented"),
    (f"num_output: 2 {window_text((2, 2))}", (1, 2, 4, 5, 6), "kernel_shape has 2 dims but the input"),
    (f"num_output: 3 group: 2 {window_text((2, 2, 2))}", (1, 2, 4, 5, 6), "num_output 3 not divisible by group 2"),
    (f"num_output: 2 {window_text((5, 2, 2))}", (1, 2, 4, 5, 6), "output would be empty"),
])
def test_ndconvolution_refuses_what_the_fork_refuses(body, shape, message):
    with pytest.raises(LayerError, match=message):
        load_from_text(ndconv_net(shape, body), random_weights=True)


def test_ndconvolution_notes_the_bvlc_fields_it_ignores():
    model = load_from_text(ndconv_net((1, 2, 4, 5, 6), f"num_output: 2 pad: 1 {window_text((2, 2, 2))}"),
                           random_weights=True)
    assert model.graph.shape("c") == (1, 2, 3, 4, 5)   # pad: 1 is not applied
    assert any("pad is ignored" in w for w in model.warnings)


# ---- NdPooling ------------------------------------------------------------------------------------

def pooled_axis(n, k, s, p):
    out = math.ceil((n + 2 * p - k) / s) + 1
    if p > 0 and (out - 1) * s >= n + p:
        out -= 1
    return out


def ndpool_ref(x, method, kernel, stride, pad):
    """MAX: the largest cell of the window inside the input; AVE: the window's input cells summed,
    divided by the kernel volume (cuDNN's AVERAGE_COUNT_INCLUDE_PADDING)."""
    sizes = x.shape[2:]
    outs = [pooled_axis(n, k, s, p) for n, k, s, p in zip(sizes, kernel, stride, pad)]
    y = np.zeros(x.shape[:2] + tuple(outs))
    xd = x.astype(np.float64)
    for index in itertools.product(*[range(o) for o in outs]):
        starts = [i * s - p for i, s, p in zip(index, stride, pad)]
        cells = tuple(slice(max(a, 0), min(a + k, n)) for a, k, n in zip(starts, kernel, sizes))
        window = xd[(slice(None), slice(None)) + cells].reshape(x.shape[0], x.shape[1], -1)
        y[(slice(None), slice(None)) + index] = window.max(-1) if method == "MAX" \
            else window.sum(-1) / math.prod(kernel)
    return y


def ndpool_net(shape, body):
    return net(f'layer {{ name: "p" type: "NdPooling" bottom: "x" top: "p" pooling_param {{ {body} }} }}',
               inputs={"x": shape})


@pytest.mark.parametrize("method, shape, kernel, stride, pad", [
    ("MAX", (2, 3, 5, 7, 7), (2, 3, 2), (1, 2, 2), (0, 1, 0)),   # W: ceil gives a last window past the input
    ("MAX", (2, 3, 6, 5, 7), (3, 2, 3), (2, 2, 3), (1, 1, 1)),   # H: the pad rule drops a window
    ("MAX", (1, 2, 4, 9, 8), (1, 3, 3), (1, 3, 3), None),         # the violence-c3d windows
    ("AVE", (2, 3, 5, 6, 7), (3, 2, 3), (2, 2, 1), (1, 1, 1)),
    ("AVE", (2, 2, 4, 6, 5), (2, 3, 1), (2, 3, 1), (0, 0, 0)),
])
def test_ndpooling_matches_the_forks_formula(method, shape, kernel, stride, pad, tmp_path):
    x = rng(5).standard_normal(shape).astype(np.float32)
    model = load_from_text(ndpool_net(shape, f"pool: {method} {window_text(kernel, stride, pad)}"))
    ref = ndpool_ref(x, method, kernel, stride or (1,) * 3, pad or (0,) * 3)
    assert model.graph.shape("p") == ref.shape
    check_everywhere(model, {"x": x}, {"p": ref}, tmp_path, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("method", ["MAX", "AVE"])
def test_ndpooling_global_takes_the_whole_volume(method, tmp_path):
    shape = (2, 3, 4, 5, 6)
    x = rng(6).standard_normal(shape).astype(np.float32)
    model = load_from_text(ndpool_net(shape, f"pool: {method} global_pooling: true {window_text((1, 1, 1))}"))
    flat = x.astype(np.float64).reshape(2, 3, -1)
    ref = (flat.max(-1) if method == "MAX" else flat.mean(-1)).reshape(2, 3, 1, 1, 1)
    check_everywhere(model, {"x": x}, {"p": ref}, tmp_path, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("body, shape, message", [
    (f"pool: STOCHASTIC {window_text((2, 2, 2))}", (1, 2, 4, 5, 6), "MAX and AVE only"),
    ("pool: MAX kernel_size: 2", (1, 2, 4, 5, 6), "pooling_param.kernel_shape is required by NdPooling"),
    (f"pool: MAX {window_text((2, 2, 2), None, (1, 1))}", (1, 2, 4, 5, 6), "pad_shape has 2 dims"),
    (f"pool: MAX {window_text((2, 2))}", (1, 2, 5, 6), "caffeq runs NdPooling on 3 spatial axes"),
    (f"pool: MAX {window_text((2, 2, 2), None, (0, 2, 0))}", (1, 2, 4, 5, 6), "pad 2 >= kernel 2"),
    # ceil: the last W window [6, 8) runs past the 7 cells; cuDNN's AVE divisor there is not known
    (f"pool: AVE {window_text((2, 2, 2), (2, 2, 2))}", (1, 2, 4, 6, 7), "AVE: the last window of axis 4"),
    (f"pool: MAX {window_text((1, 1, 2), (1, 1, 3))}", (1, 2, 4, 5, 6), "starts past the input"),
])
def test_ndpooling_refusals(body, shape, message):
    with pytest.raises(LayerError, match=message):
        load_from_text(ndpool_net(shape, body))


# ---- the real files: lcylmhlcy/violence-c3d-caffe ---------------------------------------------------

def test_violence_c3d_deploy_reads_with_the_forks_shapes():
    model = caffeq.load(str(REALWORLD / "lcylmhlcy__violence-c3d-caffe__c3d_deploy.prototxt"))
    shapes = {n.name: model.graph.shape(n.outputs[0]) for n in model.layers}
    assert shapes["conv1a"] == (1, 7, 36, 54, 84)
    assert shapes["pool1"] == (1, 7, 36, 18, 28)
    assert shapes["pool2"] == (1, 35, 32, 7, 12)
    assert shapes["conv3a"] == (1, 5, 30, 5, 10)
    assert shapes["prob"] == (1, 2)


def test_violence_c3d_train_test_reads_the_video_caffe_clips():
    model = caffeq.load(str(REALWORLD / "lcylmhlcy__violence-c3d-caffe__c3d_train_test.prototxt"),
                        stages=["test-on-val"])
    assert model.inputs == {"data": (20, 3, 40, 60, 90), "label": (20,)}
    assert model.graph.shape("conv3a") == (20, 5, 30, 5, 10)


def test_violence_c3d_runs_the_same_everywhere(tmp_path):
    """At 12 x 33 x 38 frames conv3a's H is 1: the fork leaves it out and fc512 reads (1, 5, 2, 2)."""
    model = caffeq.load(str(REALWORLD / "lcylmhlcy__violence-c3d-caffe__c3d_deploy.prototxt"),
                        random_weights=True, input_shapes={"data": (1, 3, 12, 33, 38)})
    assert model.graph.shape("conv3a") == (1, 5, 2, 2)
    x = rng(7).standard_normal((1, 3, 12, 33, 38)).astype(np.float32)
    got = backend_outputs(model, {"data": x}, tmp_path, top="prob")
    for name in ("onnx", "model.py"):
        np.testing.assert_allclose(got[name], got["torch"], rtol=1e-4, atol=1e-6, err_msg=name)
