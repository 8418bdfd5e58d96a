"""PiCANet's layers (nian-liu/PiCANet 9a08472, caffe/): AttPooling (and PwAttend, its earlier name
in the fork's mnist examples) and ReNetLSTM.

References are numpy loops written here from the fork's C++ (att_pooling_layer.cu Forward_gpu with
im2col; renet_lstm_layer.cpp Forward_cpu), run in torch, onnxruntime and the generated model.py on
shapes whose axes all differ.
"""

import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

# ---- AttPooling -------------------------------------------------------------------------------


def im2col_ref(x, kernel, pad, stride, dilation, out_h, out_w):
    """Caffe's im2col of one image (C, H, W): rows c * k * k + ki * k + kj, zeros off the map."""
    c, h, w = x.shape
    col = np.zeros((c, kernel * kernel, out_h, out_w), np.float64)
    for ch in range(c):
        for ki in range(kernel):
            for kj in range(kernel):
                for oh in range(out_h):
                    for ow in range(out_w):
                        y = oh * stride - pad + ki * dilation
                        xx = ow * stride - pad + kj * dilation
                        if 0 <= y < h and 0 <= xx < w:
                            col[ch, ki * kernel + kj, oh, ow] = x[ch, y, xx]
    return col


def att_pooling_ref(x, att, kernel, pad, stride, dilation, global_mode):
    """Forward_gpu: GLOBAL, the gemm col (C x K) . att (K x H1W1); LOCAL, per position p the sum over
    k of col[c * K + k, p] * att[k, p] (local_forward_kernel)."""
    n, c = x.shape[:2]
    kk, h1, w1 = att.shape[1:]
    top = np.zeros((n, c, h1, w1), np.float64)
    for i in range(n):
        if global_mode:
            col = im2col_ref(x[i], kernel, pad, stride, dilation, 1, 1).reshape(c, kk)
            top[i] = (col @ att[i].reshape(kk, h1 * w1).astype(np.float64)).reshape(c, h1, w1)
        else:
            col = im2col_ref(x[i], kernel, pad, stride, dilation, h1, w1)
            for ch in range(c):
                for k in range(kk):
                    top[i, ch] += col[ch, k] * att[i, k]
    return top


def att_net(x_shape, att_shape, params, kind="AttPooling", field="att_pooling_param"):
    layer = (f'layer {{ name: "ap" type: "{kind}" bottom: "x" bottom: "a" top: "o" '
             f'{field} {{ {params} }} }}')
    return net(layer, inputs={"x": x_shape, "a": att_shape})


ATT_CASES = [
    # (x shape, attention shape, params, kernel, pad, stride, dilation, global)
    ((2, 3, 7, 9), (2, 9, 7, 9), "att_mode: LOCAL kernel_size: 3 pad: 2 dilation: 2", 3, 2, 1, 2, False),
    ((2, 3, 7, 10), (2, 9, 4, 5), "kernel_size: 3 pad: 1 stride: 2", 3, 1, 2, 1, False),
    # a partial window: (4 - 5) / 3 is 0 in C++, one window reading zeros past the map
    ((3, 2, 4, 5), (3, 9, 1, 1), "kernel_size: 3 dilation: 2 stride: 3", 3, 0, 3, 2, False),
    ((2, 3, 7, 7), (2, 9, 4, 5), "att_mode: GLOBAL kernel_size: 3 dilation: 3", 3, 0, 1, 3, True),
    ((2, 4, 5, 5), (2, 25, 3, 4), "att_mode: GLOBAL", 5, 0, 1, 1, True),
    ((3, 2, 5, 5), (3, 16, 3, 6), "att_mode: GLOBAL kernel_size: 4 dilation: 2 pad: 1", 4, 1, 1, 2, True),
]


@pytest.mark.parametrize("case", ATT_CASES, ids=[c[2] for c in ATT_CASES])
def test_att_pooling_matches_the_fork(case, tmp_path):
    x_shape, a_shape, params, kernel, pad, stride, dil, glob = case
    model = load_from_text(att_net(x_shape, a_shape, params))
    assert model.graph.tensors["o"].shape == (x_shape[0], x_shape[1], a_shape[2], a_shape[3])
    x = rng(1).standard_normal(x_shape).astype(np.float32)
    a = rng(2).standard_normal(a_shape).astype(np.float32)
    ref = att_pooling_ref(x, a, kernel, pad, stride, dil, glob)
    check_everywhere(model, {"x": x, "a": a}, {"o": ref}, tmp_path, atol=1e-5, rtol=1e-5)


def test_pw_attend_reads_as_att_pooling(tmp_path):
    """The fork's mnist example: PwAttend with pw_attend_param (AttPooling's fields)."""
    x_shape, a_shape = (2, 3, 6, 8), (2, 25, 6, 8)
    model = load_from_text(att_net(x_shape, a_shape, "att_mode: LOCAL kernel_size: 5 pad: 2",
                                   kind="PwAttend", field="pw_attend_param"))
    x = rng(3).standard_normal(x_shape).astype(np.float32)
    a = rng(4).standard_normal(a_shape).astype(np.float32)
    ref = att_pooling_ref(x, a, 5, 2, 1, 1, False)
    check_everywhere(model, {"x": x, "a": a}, {"o": ref}, tmp_path, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("x_shape, a_shape, params, needle", [
    ((1, 2, 5, 5), (1, 8, 5, 5), "kernel_size: 3 pad: 1", "kernel_size^2 = 9 channels"),
    ((1, 2, 5, 5), (1, 9, 4, 5), "kernel_size: 3 pad: 1", "the attention map is 4 x 5"),
    ((1, 2, 5, 5), (1, 9, 5, 5), "pad: 1", "kernel_size must be given for local attention"),
    ((1, 2, 5, 6), (1, 30, 2, 2), "att_mode: GLOBAL", "square feature map"),
    ((1, 2, 5, 5), (1, 9, 2, 2), "att_mode: GLOBAL kernel_size: 3", "must cover the map once"),
    ((1, 2, 5, 5), (1, 25, 2, 2), "att_mode: GLOBAL stride: 2", "stride must be 1"),
    ((1, 2, 5, 5), (1, 25, 2, 2), "att_mode: GLOBAL dilation: 2", "dilation must be 1"),
    ((2, 2, 5, 5), (1, 25, 2, 2), "att_mode: GLOBAL", "same batch size"),
    ((1, 2, 33, 33), (1, 33 * 33, 2, 2), "att_mode: GLOBAL", "over the fork's limit of 1024"),
])
def test_att_pooling_refuses_what_the_fork_refuses(x_shape, a_shape, params, needle):
    with pytest.raises(LayerError, match=None) as err:
        load_from_text(att_net(x_shape, a_shape, params))
    assert needle in str(err.value)


# ---- ReNetLSTM --------------------------------------------------------------------------------


def sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def renet_ref(x, blobs, y_dir, ph, pw, peephole):
    """renet_lstm_layer.cpp Forward_cpu: per sweep and step, Fill_X_H_Data_cpu then
    ComputeCellData_cpu, written as loops over (RNN, n)."""
    n, c, h, w = x.shape
    ny, nx = h // ph, w // pw
    hd = blobs[0].shape[0]
    num_rnn, num_steps = (nx, ny) if y_dir else (ny, nx)
    top = np.zeros((n, 2 * hd, ny, nx), np.float64)
    for sweep in range(2):
        w_i, w_c, w_o, w_f, w_ic, w_oc, w_fc, b_i, b_c, b_o, b_f = (b.astype(np.float64) for b in
                                                                   blobs[11 * sweep:11 * sweep + 11])
        start = 0 if sweep == 0 else num_steps - 1
        step = 1 if sweep == 0 else -1
        hidden = {}
        cstate = {}
        t = start
        while 0 <= t < num_steps:
            not_start = t != start
            for rnn in range(num_rnn):
                y, xx = (t, rnn) if y_dir else (rnn, t)
                for i in range(n):
                    xh = []
                    for ch in range(c):
                        for py in range(ph):
                            for px in range(pw):
                                xh.append(x[i, ch, y * ph + py, xx * pw + px])
                    xh += list(hidden[rnn, i]) if not_start else [0.0] * hd
                    xh = np.array(xh, np.float64)
                    gi = w_i @ xh + b_i
                    gc = w_c @ xh + b_c
                    go = w_o @ xh + b_o
                    gf = w_f @ xh + b_f
                    if not_start and peephole:
                        gi += w_ic @ cstate[rnn, i]
                        gf += w_fc @ cstate[rnn, i]
                    gi, gc, gf = sigmoid(gi), np.tanh(gc), sigmoid(gf)
                    s = gc * gi + (gf * cstate[rnn, i] if not_start else 0.0)
                    if peephole:
                        go += w_oc @ s
                    hnew = sigmoid(go) * np.tanh(s)
                    cstate[rnn, i] = s
                    hidden[rnn, i] = hnew
                    top[i, sweep * hd:(sweep + 1) * hd, y, xx] = hnew
            t += step
    return top


def renet_model(x_shape, params, seed):
    layer = f'layer {{ name: "renet" type: "ReNetLSTM" bottom: "x" top: "o" renet_lstm_param {{ {params} }} }}'
    model = load_from_text(net(layer, inputs={"x": x_shape}), random_weights=True)
    node = next(nd for nd in model.layers if nd.name == "renet")
    node.blobs = [rng(seed + i).standard_normal(b.shape).astype(np.float32) * 0.4
                  for i, b in enumerate(node.blobs)]
    return model, node


RENET_CASES = [
    # (x shape, params, y_dir, patch_h, patch_w, peephole)
    ((2, 3, 6, 6), "direction: X_DIR num_output: 4 patch_height: 2 patch_width: 3", False, 2, 3, True),
    ((2, 3, 6, 6), "direction: Y_DIR num_output: 4 patch_height: 2 patch_width: 3", True, 2, 3, True),
    ((3, 2, 5, 4), "direction: Y_DIR num_output: 5 peephole: false", True, 1, 1, False),
    ((3, 2, 5, 4), "num_output: 3 peephole: false", False, 1, 1, False),
    ((2, 2, 1, 4), "direction: Y_DIR num_output: 3", True, 1, 1, True),   # one step per sweep
]


@pytest.mark.parametrize("case", RENET_CASES, ids=[c[1] for c in RENET_CASES])
def test_renet_lstm_matches_the_fork(case, tmp_path):
    x_shape, params, y_dir, ph, pw, peephole = case
    model, node = renet_model(x_shape, params, 30)
    hd = node.attrs["num_output"]
    p = x_shape[1] * ph * pw
    assert [tuple(b.shape) for b in node.blobs] == ([(hd, p + hd)] * 4 + [(hd, hd)] * 3 + [(hd,)] * 4) * 2
    assert model.graph.tensors["o"].shape == (x_shape[0], 2 * hd, x_shape[2] // ph, x_shape[3] // pw)
    x = rng(5).standard_normal(x_shape).astype(np.float32)
    ref = renet_ref(x, node.blobs, y_dir, ph, pw, peephole)
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("x_shape, params, needle", [
    ((1, 2, 5, 4), "num_output: 3 patch_height: 2", "whole number of 2 x 1 patches"),
    ((1, 2, 4, 4), "patch_width: 2", "num_output must be >= 1"),
    ((1, 2, 4, 4), "num_output: 2 patch_width: 0", "patch_width must be >= 1"),
    ((2, 4, 4), "num_output: 2", "4-axis"),
])
def test_renet_lstm_refuses_what_the_fork_refuses(x_shape, params, needle):
    layer = f'layer {{ name: "renet" type: "ReNetLSTM" bottom: "x" top: "o" renet_lstm_param {{ {params} }} }}'
    with pytest.raises(LayerError) as err:
        load_from_text(net(layer, inputs={"x": x_shape}))
    assert needle in str(err.value)
