"""Sifei Liu's spatial propagation layers (Liusifei/caffe-spn a25d2af gaterecurrent2dnoind_layer.cu and
divide_layer.cu): references from the CUDA kernels, one output element at a time in numpy float32."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


def spn_ref(x, g1, g2, g3, horizontal, reverse):
    n, c, height, width = x.shape
    out = np.zeros_like(x)

    def data(t, nn, cc, r, w):
        return t[nn, cc, r, w] if 0 <= r < height and 0 <= w < width else F(0)

    def gate(g, nn, cc, r, w, r2, w2):   # get_gate_sf: read at (r, w), 0 when the neighbour is outside
        return g[nn, cc, r, w] if 0 <= r2 < height and 0 <= w2 < width else F(0)

    if horizontal:
        steps = range(width - 1, -1, -1) if reverse else range(width)
        d = 1 if reverse else -1                    # the previous column
        for w in steps:
            for nn in range(n):
                for cc in range(c):
                    for r in range(height):
                        nbrs = [(r - 1, w + d), (r, w + d), (r + 1, w + d)]
                        _cell(out, x, (g1, g2, g3), nbrs, nn, cc, r, w, data, gate)
    else:
        steps = range(height - 1, -1, -1) if reverse else range(height)
        d = 1 if reverse else -1                    # the previous row
        for r in steps:
            for nn in range(n):
                for cc in range(c):
                    for w in range(width):
                        nbrs = [(r + d, w - 1), (r + d, w), (r + d, w + 1)]
                        _cell(out, x, (g1, g2, g3), nbrs, nn, cc, r, w, data, gate)
    return out


def _cell(out, x, gates, nbrs, nn, cc, r, w, data, gate):
    gs = [gate(g, nn, cc, r, w, r2, w2) for g, (r2, w2) in zip(gates, nbrs)]
    hs = [F(gv * data(out, nn, cc, r2, w2)) for gv, (r2, w2) in zip(gs, nbrs)]
    h_hype = F(F(hs[0] + hs[1]) + hs[2])
    x_hype = F(F(F(F(F(1) - gs[0]) - gs[1]) - gs[2]) * x[nn, cc, r, w])
    out[nn, cc, r, w] = F(x_hype + h_hype)


@pytest.mark.parametrize("horizontal", [True, False])
@pytest.mark.parametrize("reverse", [False, True])
def test_three_way_propagation_in_each_direction(horizontal, reverse, tmp_path):
    shape = (2, 3, 4, 5)
    text = net(f'layer {{ name: "p" type: "GateRecurrent2dnoind" bottom: "x" bottom: "g1" bottom: "g2" bottom: "g3" '
               f'top: "o" gaterecurrent2dnoind_param {{ horizontal: {str(horizontal).lower()} '
               f'reverse: {str(reverse).lower()} }} }}', inputs={k: shape for k in ("x", "g1", "g2", "g3")})
    x = rng(1).standard_normal(shape).astype(F)
    gates = [rng(i).uniform(-0.4, 0.4, shape).astype(F) for i in (2, 3, 4)]
    want = spn_ref(x, *gates, horizontal, reverse)
    feeds = {"x": x, "g1": gates[0], "g2": gates[1], "g3": gates[2]}
    check_everywhere(load_from_text(text), feeds, {"o": want}, tmp_path, atol=1e-6, rtol=1e-5)


def test_propagation_refusals():
    with pytest.raises(LayerError, match=r"gate 2 must be shaped as x \[1, 2, 3, 3\]"):
        load_from_text(net('layer { name: "p" type: "GateRecurrent2dnoind" bottom: "x" bottom: "g1" bottom: "g2" '
                           'bottom: "g3" top: "o" }', inputs={"x": (1, 2, 3, 3), "g1": (1, 2, 3, 3),
                                                                "g2": (1, 2, 3, 4), "g3": (1, 2, 3, 3)}))
    tanh = load_from_text(net('layer { name: "p" type: "GateRecurrent2dnoind" bottom: "x" bottom: "x" bottom: "x" '
                              'bottom: "x" top: "o" gaterecurrent2dnoind_param { active: TANH } }',
                              inputs={"x": (1, 2, 3, 3)}))
    assert any("active TANH is not read" in w for w in tanh.warnings)


def test_divide_clamps_small_values_in_its_bottom(tmp_path):
    # DividForward sets |x| < 1e-6 to 1e-6 in the bottom blob itself, then writes 1 / x; a later
    # reader of the bottom (here the Eltwise) sees the clamped values
    text = net('layer { name: "d" type: "Divide" bottom: "x" top: "inv" }',
               'layer { name: "e" type: "Eltwise" bottom: "x" bottom: "inv" top: "prod" eltwise_param { operation: PROD } }',
               inputs={"x": (2, 5)})
    x = np.array([[0, 5e-7, -5e-7, 1e-6, -2.0], [4.0, 1e-5, -1e-6, 3.0, 0.25]], F)
    wide = x.astype(np.float64)            # the kernel compares in double against 1e-6
    clamped = np.where((wide < 1e-6) & (wide > -1e-6), F(1e-6), x)
    assert clamped[1, 2] == F(1e-6)        # -float32(1e-6) lies above -1e-6: it becomes +1e-6
    inv = (F(1) / clamped).astype(F)
    model = load_from_text(text, outputs=["inv", "prod"])
    check_everywhere(model, {"x": x}, {"inv": inv, "prod": (clamped * inv).astype(F)}, tmp_path)
