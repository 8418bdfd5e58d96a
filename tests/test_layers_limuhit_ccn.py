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


def expf(v):
    """The fork's float32 expf, taken as the correctly rounded one: float64 exp rounded to float32."""
    return np.exp(np.asarray(v, np.float64)).astype(F32)


def walk_ref(x, steps, seen):
    """ml_quant_single_cpu_forward_kernel for one value and its channel's steps (float32 throughout); `seen`
    collects the branches taken."""
    L = len(steps)
    tmp = F32(x - steps[0])
    if tmp < 0:
        seen.add("below")
        return steps[0], 0
    j = 1
    while j < L:
        tmp = F32(tmp - steps[j])
        if tmp < 0:
            break
        j += 1
    if j == L:
        seen.add("past the top")
        j -= 1
    if F32(F32(tmp + tmp) + steps[j]) < 0:
        seen.add("step back")
        tmp = F32(tmp + steps[j])
        j -= 1
    return F32(x - tmp), j


def mlquant_ref(x, raw, L, neighbor, seen):
    n, c, h, w = x.shape
    steps = raw.reshape(-1, c, L).astype(F32).copy()
    steps[..., 1:] = expf(steps[..., 1:])                 # cal_weight: r_0, exp(r_1), ...
    top, q = np.zeros_like(x), np.zeros_like(x)
    for i in np.ndindex(x.shape):
        top[i], q[i] = walk_ref(x[i], steps[0, i[1]], seen)
    if not neighbor:
        return top, q
    qf = q.astype(int)                                     # quantf_ from table 0; the kernel's base offsets
    for b, ch, y, z in np.ndindex(x.shape):
        up = qf[b, ch, y - 1, z] if y > 0 else L
        left = qf[b, ch, y, z - 1] if z > 0 else L
        top[b, ch, y, z], q[b, ch, y, z] = walk_ref(x[b, ch, y, z], steps[1 + up * (L + 1) + left, ch], seen)
    return top, q


def check_weight_ref(raw, counts, L):
    """ml_quant_check_weight over the flat blob, float32 arithmetic (expf, logf as the correctly rounded ones)."""
    v = raw.reshape(-1).astype(F32).copy()
    cnt = counts.reshape(-1)
    for i in range(v.size // L):
        j = L - 1
        while j > 1 and not cnt[i * L + j] > 0:
            j -= 1
        tmp = F32(np.float64(v[i * L + j]) - math.log(L - j))   # log of an int: double
        v[i * L + j:i * L + L] = tmp
        if cnt[i * L] < 1:
            v[i * L] = v[i * L] + expf(v[i * L + 1])
            tmp = np.log(np.float64((expf(v[i * L + 1]) + expf(v[i * L + 2])) / F32(2))).astype(F32)
            v[i * L + 1] = v[i * L + 2] = tmp
    return v.reshape(raw.shape)


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
    seen = set()
    top, q = mlquant_ref(x, raw, L, method == "NEIGHBOR", seen)
    assert seen == {"below", "past the top", "step back"}
    # exact: the same float32 steps and subtractions (expf as float64 exp rounded, in both)
    ours = model.run({"x": x})
    assert_close(ours["q"], top, 0, 0, "torch q")
    assert_close(ours["i"], q, 0, 0, "torch i")
    got = model_py_outputs(model, {"x": x}, tmp_path)
    assert_close(got["q"], top, 0, 0, "model.py q")
    assert_close(got["i"], q, 0, 0, "model.py i")


@pytest.mark.parametrize("L, counts", [
    (4, [[0, 3, 2, 0], [5, 1, 0, 0]]),
    # groups 2: the level-0 fold of row 0 writes position 2, the next row's r_0 (the fork's flat pointer)
    (2, [[0, 1], [2, 0]]),
])
def test_mlquant_rewrites_its_tables_when_the_counter_hits_the_period(L, counts, tmp_path):
    shape = (2, 2, 3, 5)
    r = rng(8)
    model = load_from_text(net(f'layer {{ name: "q" type: "MLQuant" bottom: "x" top: "q" mlquant_param {{ groups: {L} }} }}',
                               inputs={"x": shape}), random_weights=True)
    node = node_of(model, "q")
    raw = np.array([[0.0, -1.0, -1.2, -0.9], [0.1, -0.8, -1.1, -1.3]], F32)[:, :L].reshape(1, 2, 1, L)
    counts = np.array(counts, F32).reshape(1, 2, 1, L)
    node.blobs[0], node.blobs[2] = raw, counts
    node.blobs[1] = np.array([1, 0.999, 400, 200, 0], F32).reshape(5, 1, 1, 1)
    fixed = check_weight_ref(raw, counts, L)
    assert not np.array_equal(fixed, raw)
    x = r.uniform(-0.5, 1.5, shape).astype(F32)
    top, _ = mlquant_ref(x, fixed, L, False, set())
    assert_close(model.run({"x": x})["q"], top, 0, 0, "torch q")
    assert_close(model_py_outputs(model, {"x": x}, tmp_path)["q"], top, 0, 0, "model.py q")
    node.blobs[1] = np.array([1, 0.999, 401, 200, 0], F32).reshape(5, 1, 1, 1)   # not a multiple: as stored
    top, _ = mlquant_ref(x, raw, L, False, set())
    assert_close(model.run({"x": x})["q"], top, 0, 0, "torch q, no check")


def test_mlquant_check_past_the_blob_is_refused():
    model = load_from_text(net('layer { name: "q" type: "MLQuant" bottom: "x" top: "q" mlquant_param { groups: 2 } }',
                               inputs={"x": (1, 2, 2, 3)}), random_weights=True)
    node = node_of(model, "q")
    node.blobs[1] = np.array([1, 0.999, 200, 200, 0], F32).reshape(5, 1, 1, 1)
    node.blobs[2] = np.array([[3, 1], [0, 2]], F32).reshape(1, 2, 1, 2)   # last row's level 0 unused
    with pytest.raises(Exception, match="reads past the level blob"):
        model.run({"x": np.zeros((1, 2, 2, 3), F32)})


# DynamicMaskData's Reshape: channel_out_ = int(blobs[0] + 0.000001), truncated
@pytest.mark.parametrize("stored, keep", [(1.9999995, 2), (2.7, 2), (0.5, 0)])
def test_decoder_quant_mask_and_split_channel(stored, keep, tmp_path):
    L, shape = 5, (2, 3, 3, 5)
    r = rng(9)
    text = net(f'layer {{ name: "dq" type: "DecoderQuant" bottom: "k" top: "v" mlquant_param {{ groups: {L} }} }}',
               'layer { name: "m" type: "DynamicMaskData" bottom: "v" top: "m" }',
               'layer { name: "s" type: "SplitChannel" bottom: "v" top: "s" memory_data_param { channels: 2 } }',
               inputs={"k": shape})
    model = load_from_text(text, random_weights=True, outputs=["v", "m", "s"])
    raw = r.uniform(-1.5, 0.5, (1, 3, 1, L)).astype(F32)
    node_of(model, "dq").blobs[0] = raw
    node_of(model, "m").blobs[0] = np.full((1, 1, 1, 1), stored, F32)
    k = r.integers(0, L, shape).astype(F32) + r.uniform(0, 0.9, shape).astype(F32)
    k[0, 0, 0, :3] = [L + 0.5, L + 1.2, -0.7]      # channel 0: channel 1's levels 0 and 1; int(-0.7) = 0
    k[1, 1, 2, :2] = [-1.3, -2.0]                   # channel 1: channel 0's levels L - 1, L - 2
    k[1, 2, 0, 0], k[0, 0, 1, 0] = L + 3.0, -1.5    # outside the whole table (out of bounds there): clamped
    table = np.zeros(3 * L, F32)                    # decoder_quant_weight_kernel: flat, per channel
    for c in range(3):
        table[c * L] = raw[0, c, 0, 0]
        for i in range(1, L):
            table[c * L + i] = table[c * L + i - 1] + expf(raw[0, c, 0, i])
    v = np.zeros(shape, F32)                        # decoder_quant_forward_kernel: weight[tc L + int(x)]
    for i in np.ndindex(shape):
        v[i] = table[min(max(i[1] * L + int(k[i]), 0), 3 * L - 1)]
    mask = np.zeros(shape, F32)
    mask[:, :keep] = 1
    check_everywhere(model, {"k": k}, {"v": v, "m": mask, "s": v[:, :2]}, tmp_path)


@pytest.mark.parametrize("code", [True, False])
def test_nonlocal_pre_and_post(code, tmp_path):
    shape = (2, 3, 3, 4)
    n, c, h, w = shape
    hw = h * w
    r = rng(10)
    text = net('layer { name: "pre" type: "NolocalGemmV4Pre" bottom: "x" top: "d" }',
               'layer { name: "post" type: "NolocalGemmV4Post" bottom: "x" bottom: "d" top: "y" top: "wt" '
               f'nonlocal_param {{ groups: 3 code: {str(code).lower()} mean: 3 margin: 0.5 }} }}', inputs={"x": shape})
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
            # nonlocal4_constrain_forward: code zeroes diag(a) <= diag(b), else diag(a) < diag(b)
            kept = [a // w + a % w > e // w + e % w if code else a // w + a % w >= e // w + e % w for e in range(hw)]
            row = np.array([np.exp(d[b, ch, a, e]) if kept[e] else 0 for e in range(hw)], F32)
            s = row.sum(dtype=np.float64)
            p = row / F32(s) if s > 0 else row
            y[b, ch, a] = (p * v[b, ch]).sum()
            wt[b, ch, a] = (p * d[b, ch, a]).sum()
        y[b, ch, 0], wt[b, ch, 0] = 3, -0.25
    refs = {"d": d, "y": y.reshape(shape), "wt": wt.reshape(shape)}
    # the fork sums each row with cuBLAS gemv / batched gemm in an order of its own, and takes CUDA's expf:
    # a few float32 ulps on the sums
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
               'layer { name: "cv" type: "DecoderConv3" bottom: "c" top: "f" convolution_param { num_output: 6 '
               'kernel_size: 3 constrain: 5 group_in: 2 group_out: 3 } }',
               'layer { name: "out" type: "DecoderOutput" bottom: "p" top: "t" decoder_param { nchannels: 4 } }',
               'layer { name: "ex" type: "DecoderExtract" bottom: "p" top: "e" decoder_param { extract_label: true } }',
               inputs={"x": (2, 1, 3, 5), "p": (2, 32, 3, 5)})
    model = load_from_text(text, random_weights=True, outputs=["f", "t", "e"])
    # the Reshapes: (num, nchannel, h, w); (num, nout, h, w) with blobs (nout, ch, k, k), (nout);
    # (num h w + 1, 1, 1, ch / nchannel + 1); (num, 1, h, w)
    assert model.blob_shapes["c"] == (2, 4, 3, 5) and model.blob_shapes["f"] == (2, 6, 3, 5)
    assert [np.shape(b) for b in node_of(model, "cv").blobs] == [(6, 4, 3, 3), (6,)]
    assert model.blob_shapes["t"] == (31, 1, 1, 9) and model.blob_shapes["e"] == (2, 1, 3, 5)
    with pytest.raises(CaffeqError, match="sequential decoder step"):
        model.run({"x": np.zeros((2, 1, 3, 5), F32), "p": np.zeros((2, 32, 3, 5), F32)})
    with pytest.raises(LayerError, match="one channel"):                    # CHECK_EQ(channel_, 1)
        load_from_text(net('layer { name: "in" type: "DecoderInput" bottom: "x" top: "c" decoder_param { '
                           'nchannels: 4 } }', inputs={"x": (2, 2, 3, 5)}))


def test_bad_parameters_are_one_line_errors():
    with pytest.raises(LayerError, match="groups must equal the data's 3 channels"):
        load_from_text(net('layer { name: "d" type: "NolocalGemmV4Pre" bottom: "x" top: "d" }',
                           'layer { name: "p" type: "NolocalGemmV4Post" bottom: "x" bottom: "d" top: "y" top: "w" '
                           'nonlocal_param { groups: 2 } }', inputs={"x": (1, 3, 2, 3)}))
    with pytest.raises(LayerError, match="memory_data_param.channels 5 exceeds"):
        load_from_text(net('layer { name: "s" type: "SplitChannel" bottom: "x" top: "s" memory_data_param { channels: 5 } }',
                           inputs={"x": (1, 3, 2, 3)}))
