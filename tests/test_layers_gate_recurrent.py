"""Sifei Liu's GateRecurrent (Liusifei/caffe-lowlevel b8abec0 gaterecurrent_layer.cpp Forward_cpu): the
reference follows that code step by step, its matlab-style permute with a flipped axis included, in
float64, on asymmetric shapes."""
import numpy as np
import pytest
from conftest import check_everywhere, net, node_of, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


def caffe_permute(data, order, flipdim):
    """caffe_cpu_permute: dataout = datain permuted by `order`, then the output axis flipdim reversed."""
    out = np.transpose(data, order)
    return np.flip(out, flipdim).copy() if flipdim >= 0 else out.copy()


def gate_recurrent_ref(x, gate, w_x, w_h, bias, horizontal, reverse, use_bias, use_wx, use_wh, restrict_g, restrict_w):
    order, recover = ((3, 0, 2, 1), (1, 3, 2, 0)) if horizontal else ((2, 0, 3, 1), (1, 3, 0, 2))
    flip_in, flip_out = (0, 3 if horizontal else 2) if reverse else (-1, -1)
    xs = caffe_permute(x.astype(np.float64), order, flip_in)
    gs = caffe_permute(gate.astype(np.float64), order, flip_in)
    if restrict_g < 1:
        gs = gs * restrict_g
    if restrict_w > 0:
        w_h = np.clip(w_h, -restrict_w, restrict_w)
    wx, wh, b = (a.astype(np.float64) for a in (w_x[0, 0], w_h[0, 0], bias.reshape(-1)))
    hs = np.zeros(gs.shape)
    for t in range(xs.shape[0]):
        level = np.broadcast_to(b, hs[t].shape).copy() if use_bias else np.zeros(hs[t].shape)
        level = level - (xs[t] @ wx if use_wx else xs[t])
        if t > 0:
            level = level + (hs[t - 1] @ wh.T if use_wh else hs[t - 1])
        hs[t] = gs[t] * level + restrict_g * (xs[t] @ wx if use_wx else xs[t])
    return caffe_permute(hs, recover, flip_out).astype(F)


def gr_net(params, x_shape, gate_shape):
    return net(f'layer {{ name: "g" type: "GateRecurrent" bottom: "x" bottom: "gate" top: "o" '
               f'gaterecurrent_param {{ {params} }} }}', inputs={"x": x_shape, "gate": gate_shape})


@pytest.mark.parametrize("horizontal", [True, False])
@pytest.mark.parametrize("reverse", [False, True])
def test_the_nets_blend_of_input_and_previous_step(horizontal, reverse, tmp_path):
    # the LRNN and deblur nets' setting: no weights used, h_t = (1 - g) x + g h_{t-1}
    params = (f"num_output: 3 horizontal: {str(horizontal).lower()} reverse: {str(reverse).lower()} "
              "use_bias: false use_wx: false use_wh: false restrict_g: 1.0 restrict_w: 0.5")
    shape = (2, 3, 4, 5)
    model = load_from_text(gr_net(params, shape, shape), random_weights=True)
    x = rng(1).standard_normal(shape).astype(F)
    g = rng(2).uniform(0, 1, shape).astype(F)
    blobs = node_of(model, "g").blobs
    want = gate_recurrent_ref(x, g, *blobs, horizontal, reverse, False, False, False, 1.0, 0.5)
    check_everywhere(model, {"x": x, "gate": g}, {"o": want}, tmp_path, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("horizontal, reverse", [(True, True), (False, False)])
def test_weights_bias_and_restrictions(horizontal, reverse, tmp_path):
    params = (f"num_output: 4 horizontal: {str(horizontal).lower()} reverse: {str(reverse).lower()} "
              "restrict_g: 0.75 restrict_w: 0.3")
    x_shape, gate_shape = (2, 3, 4, 5), (2, 4, 4, 5)
    model = load_from_text(gr_net(params, x_shape, gate_shape), random_weights=True)
    node = node_of(model, "g")
    assert node.expected_param_shapes == [(1, 1, 3, 4), (1, 1, 4, 4), (1, 1, 1, 4)]
    blobs = [rng(3).uniform(-0.6, 0.6, (1, 1, 3, 4)).astype(F), rng(4).uniform(-0.6, 0.6, (1, 1, 4, 4)).astype(F),
             rng(5).standard_normal((1, 1, 1, 4)).astype(F)]
    node.blobs[:] = blobs
    x = rng(6).standard_normal(x_shape).astype(F)
    g = rng(7).uniform(0, 1, gate_shape).astype(F)
    want = gate_recurrent_ref(x, g, *blobs, horizontal, reverse, True, True, True, 0.75, 0.3)
    assert np.abs(blobs[1]).max() > 0.3                      # restrict_w clamps some recurrent weights
    check_everywhere(model, {"x": x, "gate": g}, {"o": want}, tmp_path, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("params, shapes, msg", [
    ("num_output: 3 active: SIGMOID", ((1, 3, 2, 2), (1, 3, 2, 2)), "only LINEAR gives one answer"),
    ("num_output: 3", ((1, 3, 2, 2), (1, 2, 2, 2)), r"gate must be \[1, 3, 2, 2\]"),
    ("num_output: 4 use_wx: false", ((1, 3, 2, 2), (1, 4, 2, 2)), "needs x's 3 channels to equal num_output 4"),
])
def test_refusals(params, shapes, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(gr_net(params, *shapes))


def test_one_bottom_is_refused_as_its_fork_does():
    with pytest.raises(LayerError, match="not implement none gate rnn"):
        load_from_text(net('layer { name: "g" type: "GateRecurrent" bottom: "x" top: "o" '
                           'gaterecurrent_param { num_output: 2 } }', inputs={"x": (1, 2, 3, 3)}))
