"""limuhit/CCN and Nonlocal-CCN layers (caffeq/layers/limuhit_ccn.py) against loops written here from
ml_quant_layer.cpp, decoder_quant_layer.cu, dynamic_mask_data_layer.cpp, split_channel_layer.cpp and
nolocal_gemm_v4_{pre,post}_layer.cu, in torch, onnxruntime (where emitted) and model.py."""
import math

import numpy as np
import pytest
from conftest import assert_close, check_everywhere, model_py_outputs, net, node_of, rng

from caffeq.errors import CaffeqError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F32 = np.float32


def walk_ref(x, steps):
    """ml_quant_single_cpu_forward_kernel for one value and its channel's steps (float32 throughout)."""
    L = len(steps)
    tmp = F32(x - steps[0])
    if tmp < 0:
        return steps[0], 0
    j = 1
    while j < L:
        tmp = F32(tmp - steps[j])
        if tmp < 0:
            break
        j += 1
    if j == L:
        j -= 1
    if F32(F32(tmp + tmp) + steps[j]) < 0:
        tmp = F32(tmp + steps[j])
        j -= 1
    return F32(x - tmp), j


def mlquant_ref(x, raw, L, neighbor):
    n, c, h, w = x.shape
    steps = raw.reshape(-1, c, L).astype(F32).copy()
    steps[..., 1:] = np.exp(steps[..., 1:])
    top, q = np.zeros_like(x), np.zeros_like(x)
    for i in np.ndindex(x.shape):
        top[i], q[i] = walk_ref(x[i], steps[0, i[1]])
    if not neighbor:
        return top, q
    qf = q.astype(int)
    for b, ch, y, z in np.ndindex(x.shape):
        up = qf[b, ch, y - 1, z] if y > 0 else L
        left = qf[b, ch, y, z - 1] if z > 0 else L
        top[b, ch, y, z], q[b, ch, y, z] = walk_ref(x[b, ch, y, z], steps[1 + up * (L + 1) + left, ch])
    return top, q


@pytest.mark.parametrize("method", ["SINGLE", "NEIGHBOR"])
def test_mlquant_walks_the_learned_levels(method, tmp_path):
    L, shape = 4, (2, 3, 3, 5)
    r = rng(7)
    model = load_from_text(net(f'layer {{ name: "q" type: "MLQuant" bottom: "x" top: "q" top: "i" mlquant_param {{ '
                               f'groups: {L} method: {method} }} }}', inputs={"x": shape}), random_weights=True)
    node = node_of(model, "q")
    raw = r.uniform(-2.0, -0.5, node.blobs[0].shape).astype(F32)
    raw[..., 0] = r.uniform(-0.2, 0.1, raw[..., 0].shape)
    node.blobs[0] = raw
    node.blobs[1] = np.array([1, 0.999, 7, 200, 0], F32).reshape(5, 1, 1, 1)   # counter 7: no table check
    x = r.uniform(-0.5, 1.5, shape).astype(F32)
    top, q = mlquant_ref(x, raw, L, method == "NEIGHBOR")
    ours = model.run({"x": x})
    assert_close(ours["q"], top, 1e-6, 0, "torch q")   # float32 exp: numpy and torch differ by an ulp
    assert_close(ours["i"], q, 0, 0, "torch i")
    got = model_py_outputs(model, {"x": x}, tmp_path)
    assert_close(got["q"], top, 1e-6, 0, "model.py q")
    assert_close(got["i"], q, 0, 0, "model.py i")


def test_mlquant_rewrites_its_tables_when_the_counter_hits_the_period():
    L, shape = 4, (2, 2, 3, 5)
    r = rng(8)
    model = load_from_text(net(f'layer {{ name: "q" type: "MLQuant" bottom: "x" top: "q" mlquant_param {{ groups: {L} }} }}',
                               inputs={"x": shape}), random_weights=True)
    node = node_of(model, "q")
    raw = np.array([[0.0, -1.0, -1.2, -0.9], [0.1, -0.8, -1.1, -1.3]], F32).reshape(1, 2, 1, L)
    counts = np.array([[0, 3, 2, 0], [5, 1, 0, 0]], F32).reshape(1, 2, 1, L)
    node.blobs[0], node.blobs[2] = raw, counts
    node.blobs[1] = np.array([1, 0.999, 400, 200, 0], F32).reshape(5, 1, 1, 1)
    fixed = raw.reshape(2, L).astype(np.float64)          # ml_quant_check_weight, channel by channel
    for i in range(2):
        j = L - 1
        while j > 1 and not counts.reshape(2, L)[i, j] > 0:
            j -= 1
        fixed[i, j:] = F32(fixed[i, j] - math.log(L - j))
        if counts.reshape(2, L)[i, 0] < 1:
            e1, e2 = np.exp(F32(fixed[i, 1])), np.exp(F32(fixed[i, 2]))
            fixed[i, 0] = F32(fixed[i, 0] + e1)
            fixed[i, 1] = fixed[i, 2] = np.log(F32((e1 + e2) / 2))
    x = r.uniform(-0.5, 1.5, shape).astype(F32)
    top, _ = mlquant_ref(x, fixed.astype(F32), L, False)
    assert_close(model.run({"x": x})["q"], top, 1e-6, 0, "torch q")


def test_decoder_quant_mask_and_split_channel(tmp_path):
    L, shape = 5, (2, 3, 3, 5)
    r = rng(9)
    text = net(f'layer {{ name: "dq" type: "DecoderQuant" bottom: "k" top: "v" mlquant_param {{ groups: {L} }} }}',
               'layer { name: "m" type: "DynamicMaskData" bottom: "v" top: "m" }',
               'layer { name: "s" type: "SplitChannel" bottom: "v" top: "s" memory_data_param { channels: 2 } }',
               inputs={"k": shape})
    model = load_from_text(text, random_weights=True, outputs=["v", "m", "s"])
    raw = r.uniform(-1.5, 0.5, (1, 3, 1, L)).astype(F32)
    node_of(model, "dq").blobs[0] = raw
    node_of(model, "m").blobs[0] = np.full((1, 1, 1, 1), 1.9999995, F32)     # int(b + 1e-6) = 2
    k = r.integers(0, L, shape).astype(F32) + r.uniform(0, 0.9, shape).astype(F32)
    table = np.zeros((3, L), F32)
    for c in range(3):
        table[c, 0] = raw[0, c, 0, 0]
        for i in range(1, L):
            table[c, i] = F32(table[c, i - 1] + np.exp(raw[0, c, 0, i]))
    v = np.zeros(shape, F32)
    for i in np.ndindex(shape):
        v[i] = table[i[1], int(k[i])]
    mask = np.zeros(shape, F32)
    mask[:, :2] = 1
    check_everywhere(model, {"k": k}, {"v": v, "m": mask, "s": v[:, :2]}, tmp_path, atol=1e-6)


def test_nonlocal_pre_and_post(tmp_path):
    shape = (2, 3, 3, 4)
    n, c, h, w = shape
    hw = h * w
    r = rng(10)
    text = net('layer { name: "pre" type: "NolocalGemmV4Pre" bottom: "x" top: "d" }',
               'layer { name: "post" type: "NolocalGemmV4Post" bottom: "x" bottom: "d" top: "y" top: "wt" '
               'nonlocal_param { groups: 3 code: true mean: 3 margin: 0.5 } }', inputs={"x": shape})
    model = load_from_text(text, outputs=["d", "y", "wt"])
    x = r.uniform(-1, 1, shape).astype(F32)
    v = x.reshape(n, c, hw)
    d = np.zeros((n, c, hw, hw), F32)
    y, wt = np.zeros((n, c, hw), F32), np.zeros((n, c, hw), F32)
    for b, ch in np.ndindex(n, c):
        for a in range(hw):
            for e in range(hw):
                d[b, ch, a, e] = -F32(v[b, ch, a] - v[b, ch, e]) ** 2
        for a in range(hw):
            row = np.array([np.exp(d[b, ch, a, e]) if a // w + a % w > e // w + e % w else 0 for e in range(hw)], F32)
            s = row.sum(dtype=np.float64)
            p = row / F32(s) if s > 0 else row
            y[b, ch, a] = (p * v[b, ch]).sum()
            wt[b, ch, a] = (p * d[b, ch, a]).sum()
        y[b, ch, 0], wt[b, ch, 0] = 3, -0.25
    refs = {"d": d, "y": y.reshape(shape), "wt": wt.reshape(shape)}
    ours = model.run({"x": x})
    for k, ref in refs.items():
        assert_close(ours[k], ref, 1e-6, 1e-5, f"torch {k}")
    got = model_py_outputs(model, {"x": x}, tmp_path)
    for k, ref in refs.items():
        assert_close(got[k], ref, 1e-6, 1e-5, f"model.py {k}")
    pre = load_from_text(net('layer { name: "pre" type: "NolocalGemmV4Pre" bottom: "x" top: "d" }', inputs={"x": shape}))
    check_everywhere(pre, {"x": x}, {"d": d}, tmp_path)


def test_sequential_decoders_read_and_refuse_to_run():
    text = net('layer { name: "in" type: "DecoderInput" bottom: "x" top: "c" decoder_param { nchannels: 4 } }',
               'layer { name: "out" type: "DecoderOutput" bottom: "p" top: "t" decoder_param { nchannels: 4 } }',
               inputs={"x": (2, 1, 3, 5), "p": (2, 32, 3, 5)})
    model = load_from_text(text)
    assert model.blob_shapes["c"] == (2, 4, 3, 5) and model.blob_shapes["t"] == (31, 1, 1, 9)
    with pytest.raises(CaffeqError, match="sequential decoder step"):
        model.run({"x": np.zeros((2, 1, 3, 5), F32), "p": np.zeros((2, 32, 3, 5), F32)})


def test_bad_parameters_are_one_line_errors():
    with pytest.raises(LayerError, match="groups must equal the data's 3 channels"):
        load_from_text(net('layer { name: "d" type: "NolocalGemmV4Pre" bottom: "x" top: "d" }',
                           'layer { name: "p" type: "NolocalGemmV4Post" bottom: "x" bottom: "d" top: "y" top: "w" '
                           'nonlocal_param { groups: 2 } }', inputs={"x": (1, 3, 2, 3)}))
    with pytest.raises(LayerError, match="memory_data_param.channels 5 exceeds"):
        load_from_text(net('layer { name: "s" type: "SplitChannel" bottom: "x" top: "s" memory_data_param { channels: 5 } }',
                           inputs={"x": (1, 3, 2, 3)}))
