"""CesarCadena/caffe-segnet's EltwiseScalarComparison and RemapLabels (caffeq/layers/label_maps.py) against
their Forward_cpu loops, and HRSOD's OutputDecay (caffeq/layers/regularizers.py): the identity forward, and
the backward's decay term, in torch, onnxruntime and model.py."""
import numpy as np
import pytest
import torch
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F32 = np.float32


def remap_ref(x, old, new):
    """The fork's loop: 0, then new[j] for every j whose old[j] equals the value (the last one wins)."""
    out = np.zeros_like(x)
    for i, v in enumerate(x.reshape(-1)):
        for o, n in zip(old, new):
            if v == F32(o):
                out.reshape(-1)[i] = F32(n)
    return out


def test_label_maps(tmp_path):
    """The fork's own test net: one-hot maps of label sets, and labels 3, 4 -> 2 and 2 -> 3 (others -> 0)."""
    x = rng(81).integers(0, 7, (1, 1, 6, 5)).astype(F32)
    layers = ('layer { name: "label1" type: "EltwiseScalarComparison" bottom: "data" top: "label1" '
              'eltwise_scalarcomparison_param { value: 1 } }\n'
              'layer { name: "label25" type: "EltwiseScalarComparison" bottom: "data" top: "label25" '
              'eltwise_scalarcomparison_param { value: 2 value: 5 } }\n'
              'layer { name: "remap" type: "RemapLabels" bottom: "data" top: "remap" remap_labels_param { '
              'oldlabel: 3 newlabel: 2 oldlabel: 4 newlabel: 2 oldlabel: 2 newlabel: 3 oldlabel: 3 newlabel: 6 } }')
    model = load_from_text(net(layers, inputs={"data": x.shape}))
    refs = {"label1": remap_ref(x, [1], [1]), "label25": remap_ref(x, [2, 5], [1, 1]),
            "remap": remap_ref(x, [3, 4, 2, 3], [2, 2, 3, 6])}
    assert set(np.unique(refs["remap"])) <= {0, 2, 3, 6} and (refs["remap"][x == 3] == 6).all()
    check_everywhere(model, {"data": x}, refs, tmp_path)
    with pytest.raises(LayerError, match="one newlabel per oldlabel"):
        load_from_text(net('layer { name: "r" type: "RemapLabels" bottom: "data" top: "r" remap_labels_param { '
                           'oldlabel: 1 oldlabel: 2 newlabel: 3 } }', inputs={"data": (1, 1, 2, 2)}))


@pytest.mark.parametrize("in_place", [False, True])
def test_label_maps_in_place_and_unmatched_non_finite_values(tmp_path, in_place):
    """Unmatched inf and NaN give 0; in place the fork compares the zero it just wrote: the map of 0."""
    x = np.array([[3, np.inf, np.nan, -np.inf, 0, 4]], F32)
    top = "x" if in_place else "y"
    text = net(f'layer {{ name: "r" type: "RemapLabels" bottom: "x" top: "{top}" remap_labels_param {{ oldlabel: 3 '
               f'newlabel: 2 oldlabel: 0 newlabel: 7 }} }}', inputs={"x": x.shape})
    if in_place:
        text += '\nlayer { name: "copy" type: "Power" bottom: "x" top: "y" }'
    model = load_from_text(text)
    want = np.full_like(x, 7) if in_place else remap_ref(x, [3, 0], [2, 7])
    assert want.tolist() == ([[7] * 6] if in_place else [[2, 0, 0, 0, 7, 0]])
    check_everywhere(model, {"x": x}, {"y": want}, tmp_path)


@pytest.mark.parametrize("kind, decay", [("L1", 0.5), ("L2", 0.25)])
def test_output_decay(tmp_path, kind, decay):
    layers = (f'layer {{ name: "d" type: "OutputDecay" bottom: "x" top: "x" output_decay_param {{ '
              f'regularization_type: "{kind}" output_decay: {decay} }} }}\n'
              'layer { name: "s" type: "Power" bottom: "x" top: "o" power_param { scale: 3 } }')
    model = load_from_text(net(layers, inputs={"x": (2, 3, 4)}))
    x = rng(82).standard_normal((2, 3, 4)).astype(F32)
    check_everywhere(model, {"x": x}, {"o": 3 * x}, tmp_path)
    xt = torch.from_numpy(x).requires_grad_(True)
    out = model.to_torch()(xt)
    (out["o"] if isinstance(out, dict) else out).sum().backward()
    term = np.sign(x) if kind == "L1" else x
    torch.testing.assert_close(xt.grad, torch.from_numpy((3 + F32(decay) * term).astype(F32)))
    with pytest.raises(LayerError, match="in place only"):
        load_from_text(net('layer { name: "d" type: "OutputDecay" bottom: "x" top: "y" }', inputs={"x": (1, 2)}))
