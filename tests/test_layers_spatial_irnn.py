"""sherylwang/spatial-IRNN's RNNUP / RNNDOWN / RNNLEFT / RNNRIGHT (caffeq/layers/spatial_irnn.py) against the
forks' Forward_cpu loop (rnn_*_layer.cpp at 8581318: the input copied into the top, gemm(W, previous slice)
added, ReLU per slice), written here in float64; in torch, onnxruntime and model.py, on maps of H != W."""
import numpy as np
import pytest
from conftest import check_everywhere, net, node_of, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32
BACKWARDS = {"RNNUP": True, "RNNDOWN": False, "RNNLEFT": True, "RNNRIGHT": False}


def irnn_ref(x, w, backwards):
    """The fork's loop over axis 0 of x, each slice a (C, rest) matrix: top = x; top[i] += W top[prev]; relu."""
    steps, c = x.shape[0], w.shape[0]
    top = x.astype(np.float64).reshape(steps, c, -1).copy()
    w = w.astype(np.float64)
    order = range(steps - 1, -1, -1) if backwards else range(steps)
    for k, i in enumerate(order):
        if k > 0:
            prev = i + 1 if backwards else i - 1
            top[i] = top[i] + w @ top[prev]
        top[i] = np.maximum(top[i], 0)
    return top.reshape(x.shape).astype(F)


def sweep_net(kind, shape, extra=""):
    return net(f'layer {{ name: "r" type: "{kind}" bottom: "x" top: "o" {extra} }}', inputs={"x": shape})


def set_weights(model, name, c, seed):
    w = rng(seed).uniform(-0.5, 0.5, (c, c)).astype(F) + np.eye(c, dtype=F)    # near the identity filler
    node_of(model, name).blobs[:] = [w]
    return w


@pytest.mark.parametrize("kind", sorted(BACKWARDS))
@pytest.mark.parametrize("shape", [(5, 3, 2, 7), (4, 2, 3)])
def test_each_sweep_follows_the_forks_loop(kind, shape, tmp_path):
    model = load_from_text(sweep_net(kind, shape), random_weights=True)
    assert node_of(model, "r").expected_param_shapes == [(shape[1], shape[1])]
    w = set_weights(model, "r", shape[1], 1)
    x = rng(2).standard_normal(shape).astype(F)
    want = irnn_ref(x, w, BACKWARDS[kind])
    assert (want == 0).any() and (want > 0).any()
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path, atol=1e-5, rtol=1e-5)


def test_the_four_directions_over_a_map_as_the_example_net_permutes_it(tmp_path):
    # the fork's models/example.prototxt: (N, C, H, W) permuted to (H, C, N, W) for up / down and (W, C, H, N)
    # for left / right, swept, permuted back and concatenated: each direction a recurrence along the map
    shape = (2, 3, 5, 7)
    layers = ['layer { name: "ver" type: "Permute" bottom: "x" top: "ver" permute_param { order: 2 order: 1 '
              'order: 0 order: 3 } }',
              'layer { name: "hor" type: "Permute" bottom: "x" top: "hor" permute_param { order: 3 order: 1 '
              'order: 2 order: 0 } }']
    for kind, src in (("RNNUP", "ver"), ("RNNDOWN", "ver"), ("RNNLEFT", "hor"), ("RNNRIGHT", "hor")):
        order = "order: 2 order: 1 order: 0 order: 3" if src == "ver" else "order: 3 order: 1 order: 2 order: 0"
        layers += [f'layer {{ name: "{kind}" type: "{kind}" bottom: "{src}" top: "{kind}_s" '
                   f'{kind.lower().replace("rnn", "rnn_")}_param {{ weight_filler {{ type: "identity" }} }} }}',
                   f'layer {{ name: "{kind}_p" type: "Permute" bottom: "{kind}_s" top: "{kind}_o" '
                   f'permute_param {{ {order} }} }}']
    model = load_from_text(net(*layers, inputs={"x": shape}), random_weights=True)
    x = rng(3).standard_normal(shape).astype(F)
    want = {}
    for i, kind in enumerate(sorted(BACKWARDS)):
        w = set_weights(model, kind, 3, 10 + i)
        h = np.zeros(shape)
        xd, wd = x.astype(np.float64), w.astype(np.float64)
        vertical = kind in ("RNNUP", "RNNDOWN")
        n_steps = shape[2] if vertical else shape[3]
        steps = range(n_steps - 1, -1, -1) if BACKWARDS[kind] else range(n_steps)
        prev = None
        for s in steps:      # up: from the bottom row upwards; left: from the last column leftwards
            sl = (slice(None), slice(None), s) if vertical else (slice(None), slice(None), slice(None), s)
            pre = xd[sl] if prev is None else xd[sl] + np.einsum("ck,nk...->nc...", wd, h[prev])
            h[sl] = np.maximum(pre, 0)
            prev = sl
        want[f"{kind}_o"] = h.astype(F)
    check_everywhere(model, {"x": x}, want, tmp_path, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["RNNUP", "RNNRIGHT"])
def test_one_slice_is_a_relu(kind, tmp_path):
    shape = (1, 4, 3, 2)
    model = load_from_text(sweep_net(kind, shape), random_weights=True)
    w = set_weights(model, "r", 4, 4)
    w[0, 1], w[2, 3] = np.inf, np.nan     # the fork adds no W h term for the first slice, not even a zero one
    node_of(model, "r").blobs[:] = [w]
    x = rng(5).standard_normal(shape).astype(F)
    check_everywhere(model, {"x": x}, {"o": np.maximum(x, 0)}, tmp_path)


def test_axis_is_read_and_noted_as_ignored():
    model = load_from_text(sweep_net("RNNLEFT", (3, 2, 2, 2), "rnn_left_param { axis: 2 }"), random_weights=True)
    assert any("rnn_left_param.axis 2 is read and ignored" in w for w in model.warnings)


@pytest.mark.parametrize("text, msg", [
    (sweep_net("RNNDOWN", (2, 2, 2, 2, 2)), r"at most 4 axes, got \[2, 2, 2, 2, 2\]"),
    (net('layer { name: "r" type: "RNNUP" bottom: "x" bottom: "y" top: "o" }', inputs={"x": (2, 2), "y": (2, 2)}),
     "RNNUP takes one bottom and one top, got 2 and 1"),
])
def test_refusals(text, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(text)
