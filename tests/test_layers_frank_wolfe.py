"""sunke123/FW-Net's ConvConjugateNorm, HolderPool and SigScale (caffeq/layers/frank_wolfe.py) against the
fork's GPU formulas written here in float64 and the spec's worked example, in torch, onnxruntime and model.py;
and its Noise layer, which copies at inference."""
import math

import numpy as np
import pytest
from conftest import check_everywhere, net, node_of, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

F32 = np.float32
LAYERS = ('layer {{ name: "norm" type: "ConvConjugateNorm" bottom: "x" top: "n" param {{ name: "p" lr_mult: 0 }} '
          'conjugate_norm_param {{ filler {{ type: "constant" value: {p} }} channel_shared: true }} }}',
          'layer {{ name: "pool" type: "HolderPool" bottom: "n" top: "h" param {{ name: "p" lr_mult: 0 }} '
          'holder_pool_param {{ filler {{ type: "constant" value: {p} }} d: {d} }} }}',
          'layer {{ name: "scale" type: "SigScale" bottom: "h" top: "s" sig_scale_param {{ counterpart: {c} }} }}')


def fw_ref(x, p, d, t, counterpart):
    xd = x.astype(np.float64)
    q = p / (p - 1)
    n = xd / ((np.abs(xd) ** q).sum(1, keepdims=True) ** (1 / q) + 1e-10)
    h = -d * (np.abs(n) + 1e-10) ** (1 / (p - 1)) * n / np.sqrt(n * n + 1e-20)
    r = 1 / (1 + math.exp(-t))
    return n, h, h * (1 - r if counterpart else r)


def build(shape, p=1.5, d=1.0, t=math.log(2), counterpart=False):
    text = net(*(s.format(p=p, d=d, c=str(counterpart).lower()) for s in LAYERS), inputs={"x": shape})
    model = load_from_text(text, random_weights=True, outputs=["n", "h", "s"])
    for name, value in (("norm", p), ("pool", p), ("scale", t)):
        node_of(model, name).blobs = [np.array(value, F32)]
    model.clear_cache()
    return model


def test_the_worked_example_of_one_pixel():
    x = np.array([3, -4], F32).reshape(1, 2, 1, 1)
    out = build(x.shape).run({"x": x})
    np.testing.assert_allclose(out["n"].ravel(), [0.66697174, -0.8892957], rtol=1e-6)
    np.testing.assert_allclose(out["h"].ravel(), [-0.4448513, 0.7908468], rtol=1e-6)
    np.testing.assert_allclose(out["s"].ravel(), [-0.2965675, 0.5272312], rtol=1e-6)


@pytest.mark.parametrize("p, d, counterpart", [(1.5, 1.0, False), (2.5, 0.5, True)])
def test_frank_wolfe_layers_match_the_formulas(p, d, counterpart, tmp_path):
    x = rng(80).standard_normal((2, 6, 5, 4)).astype(F32)
    x[0, :, 0, 0] = 0                      # an all-zero pixel: 0, not NaN (the GPU's 1e-10)
    model = build(x.shape, p, d, 10.0, counterpart)
    n, h, s = fw_ref(x, float(F32(p)), d, 10.0, counterpart)
    check_everywhere(model, {"x": x}, {"n": n, "h": h, "s": s}, tmp_path, atol=1e-6, rtol=1e-5)


def test_the_blobs_are_scalars_and_other_forms_are_refused():
    model = build((1, 2, 3, 3))
    assert node_of(model, "norm").expected_param_shapes == [()]
    with pytest.raises(CaffeqError, match="one value shared by every channel"):
        load_from_text(net('layer { name: "s" type: "SigScale" bottom: "x" top: "y" sig_scale_param { '
                           'channel_shared: false } }', inputs={"x": (1, 2, 3, 3)}))


def test_fw_nets_noise_layer_copies_at_inference():
    x = rng(81).standard_normal((1, 1, 4, 4)).astype(F32)
    model = load_from_text(net('layer { name: "add_noise" type: "Noise" bottom: "label" top: "data" noise_param { '
                               'filler_param { type: "gaussian" mean: 0 } std: 0.19607843 } }', inputs={"label": x.shape}))
    assert any("FW-Net's Noise" in w for w in model.warnings)
    np.testing.assert_array_equal(model.run({"label": x})["data"], x)


def test_a_caffemodel_blob_without_any_shape_is_the_scalar(tmp_path):
    # FW-Net's shipped caffemodels store these blobs as `data` alone (no shape, no num/channels/...)
    from caffeq.io.schema import caffe_pb2
    from caffeq.model import load
    text = net('layer { name: "scale" type: "SigScale" bottom: "x" top: "s" }', inputs={"x": (1, 2, 2, 2)})
    (tmp_path / "n.prototxt").write_text(text)
    weights = caffe_pb2.NetParameter()
    layer = weights.layer.add(name="scale", type="SigScale")
    layer.blobs.add().data.append(0.0)       # sigmoid(0) = 1/2
    (tmp_path / "n.caffemodel").write_bytes(weights.SerializeToString())
    model = load(str(tmp_path / "n.prototxt"), weights=str(tmp_path / "n.caffemodel"))
    x = rng(82).standard_normal((1, 2, 2, 2)).astype(F32)
    np.testing.assert_array_equal(model.run({"x": x})["s"], x * F32(0.5))
