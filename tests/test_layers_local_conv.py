"""Local, the locally connected layer, against the loops of BVLC/caffe's local-layer branch
(local_layer.cpp at 5967fa4), in torch, onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, net

from caffeq.layers import LayerError
from caffeq.model import load_from_text

f32 = np.float32


def local_ref(x, weight, bias, kernel, stride, pad):
    """im2col of each image (rows: channel, kernel row, kernel column), then for each output m the
    column sums of col * W[m] (caffe_mul, then a ones-vector gemm), plus the bias (1, 1, M, P)."""
    n, c, h, w = x.shape
    oh, ow = (h + 2 * pad - kernel) // stride + 1, (w + 2 * pad - kernel) // stride + 1
    m = weight.shape[0]
    padded = np.zeros((n, c, h + 2 * pad, w + 2 * pad), np.float64)
    padded[:, :, pad:pad + h, pad:pad + w] = x
    out = np.zeros((n, m, oh * ow), np.float64)
    for i in range(n):
        col = np.empty((c * kernel * kernel, oh * ow), np.float64)
        for ch in range(c):
            for ki in range(kernel):
                for kj in range(kernel):
                    row = (ch * kernel + ki) * kernel + kj
                    for p in range(oh * ow):
                        y, xx = divmod(p, ow)
                        col[row, p] = padded[i, ch, y * stride + ki, xx * stride + kj]
        for j in range(m):
            out[i, j] = (col * weight[j, 0]).sum(axis=0)
        if bias is not None:
            out[i] += bias[0, 0]
    return out.reshape(n, m, oh, ow)


@pytest.mark.parametrize("param, bias", [
    ("num_output: 4 kernel_size: 3", True),
    ("num_output: 2 kernel_size: 2 stride: 2 pad: 1", True),
    ("num_output: 3 kernel_size: 1 bias_term: false", False),
], ids=["k3", "k2s2p1", "k1_nobias"])
def test_local_gives_each_position_its_own_filter(param, bias, tmp_path):
    shape = (2, 3, 5, 6)
    model = load_from_text(net(f'layer {{ name: "l" type: "Local" bottom: "x" top: "y" local_param {{ {param} }} }}',
                               inputs={"x": shape}), random_weights=True)
    node = next(nd for nd in model.graph.nodes if nd.name == "l")
    g = np.random.default_rng(8)
    node.blobs = [g.standard_normal(s).astype(f32) for s in node.expected_param_shapes]
    vals = dict(zip(param.split()[::2], param.split()[1::2]))
    k, s, p = int(vals["kernel_size:"]), int(vals.get("stride:", 1)), int(vals.get("pad:", 0))
    m = int(vals["num_output:"])
    oh, ow = (5 + 2 * p - k) // s + 1, (6 + 2 * p - k) // s + 1
    assert node.expected_param_shapes == [(m, 1, 3 * k * k, oh * ow)] + [(1, 1, m, oh * ow)] * bias
    x = g.standard_normal(shape).astype(f32)
    ref = local_ref(x, node.blobs[0], node.blobs[1] if bias else None, k, s, p)
    assert model.blob_shapes["y"] == (2, m, oh, ow)
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=1e-5, rtol=1e-5)


def test_v1_local_reads_as_local():
    text = ('input: "x" input_dim: 1 input_dim: 2 input_dim: 4 input_dim: 4\n'
            'layers { bottom: "x" top: "y" name: "l" type: LOCAL blobs_lr: 1 blobs_lr: 2\n'
            '  local_param { num_output: 3 kernel_size: 1 } }\n')
    model = load_from_text(text)
    assert model.blob_shapes["y"] == (1, 3, 4, 4)
    assert any("V1 layer type LOCAL" in w for w in model.warnings)


@pytest.mark.parametrize("param, shape, msg", [
    ("num_output: 2", (1, 1, 4, 4), "kernel_size must be set"),
    ("kernel_size: 2", (1, 1, 4, 4), "num_output must be > 0"),
    ("num_output: 2 kernel_size: 5 pad: 1", (1, 1, 4, 4), "smaller than the kernel"),
])
def test_local_refusals(param, shape, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net(f'layer {{ name: "l" type: "Local" bottom: "x" top: "y" local_param {{ {param} }} }}',
                           inputs={"x": shape}))
