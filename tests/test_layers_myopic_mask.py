"""kaveena/myopic-oracle's masked layers (ecadb1a): a Convolution with convolution_mask_param.mask_term keeps
blobs [W, b, W mask, b mask] and convolves with W x W mask, adding b x b mask (base_conv_layer.cpp LayerSetUp,
conv_layer.cpp/.cu Forward); an InnerProduct with inner_product_param.mask_term keeps [W, b, W mask] and uses
W x W mask with the bias unmasked (inner_product_layer.cpp/.cu); a Deconvolution makes the masks and never
applies them (deconv_layer.cpp/.cu).  References are Caffe's convolution / inner product on the masked blobs,
in torch, onnxruntime and model.py, through a caffemodel holding the masks or one without them (net.cpp
CopyTrainedLayersFrom keeps the new masks of ones)."""
from pathlib import Path

import numpy as np
import pytest
from conftest import check_everywhere, conv_ref, net, node_of

from caffeq.errors import CaffeqError
from caffeq.io.caffemodel import BlobData
from caffeq.io.prototxt import parse_prototxt_text
from caffeq.io.writer import write_caffemodel
from caffeq.layers.myopic_mask import MyopicMaskedConvolution, _MyopicMasked
from caffeq.model import load, load_from_text

f32 = np.float32
REALWORLD = Path(__file__).parent / "fixtures" / "realworld"
MYOPIC = "kaveena__myopic-oracle__myopic-oracle__caffe-models__"


def dyadic(r, shape, scale=16):
    """Small multiples of 1/scale: their sums are exact in float32 whatever the order."""
    return (r.integers(-24, 25, size=shape) / scale).astype(f32)


def mask(r, shape):
    """0 / 1 mostly, a few halves (a mask is any float blob; the fork multiplies by it)."""
    return r.choice(np.array([0, 1, 1, 0.5], f32), size=shape)


def load_with_caffemodel(tmp_path, text, blobs):
    proto, weights = tmp_path / "m.prototxt", tmp_path / "m.caffemodel"
    proto.write_text(text)
    write_caffemodel(parse_prototxt_text(text), {k: [BlobData(b) for b in v] for k, v in blobs.items()}, weights)
    return load(str(proto), str(weights))


def conv_text(bias=True, mask_param="mask_term: true", type_name="Convolution"):
    return net(f'layer {{ name: "c" type: "{type_name}" bottom: "x" top: "y" convolution_mask_param {{ {mask_param} }} '
               f'convolution_param {{ num_output: 6 kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 1 pad_h: 0 pad_w: 1 group: 2 '
               f'{"" if bias else "bias_term: false"} }} }}', inputs={"x": (2, 4, 7, 5)})


@pytest.mark.parametrize("bias", [True, False])
def test_masked_convolution_masks_the_weights_and_the_bias(bias, tmp_path):
    r = np.random.default_rng(1)
    w, mw = dyadic(r, (6, 2, 3, 2)), mask(r, (6, 2, 3, 2))
    b, mb = dyadic(r, (6,)), mask(r, (6,))
    blobs = [w, b, mw, mb] if bias else [w, mw]
    model = load_with_caffemodel(tmp_path, conv_text(bias), {"c": blobs})
    node = node_of(model, "c")
    assert isinstance(node.spec, MyopicMaskedConvolution)
    assert node.spec.blob_names_for(node.attrs) == (("weight", "bias", "weight_mask", "bias_mask") if bias
                                                    else ("weight", "weight_mask"))
    x = r.standard_normal((2, 4, 7, 5)).astype(f32)
    ref = conv_ref(x, w * mw, b * mb if bias else None, (2, 1), (0, 1), 2).astype(f32)
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=2e-5)


def test_masked_inner_product_masks_only_the_weights(tmp_path):
    r = np.random.default_rng(2)
    text = net('layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" inner_product_param { num_output: 5 '
               'mask_term: true } inner_product_mask_param { default_init: true } }', inputs={"x": (3, 2, 4, 1)})
    w, b, mw = dyadic(r, (5, 8)), dyadic(r, (5,)), mask(r, (5, 8))
    model = load_with_caffemodel(tmp_path, text, {"ip": [w, b, mw]})
    x = r.standard_normal((3, 2, 4, 1)).astype(f32)
    ref = (x.reshape(3, 8).astype(np.float64) @ (w * mw).astype(np.float64).T + b).astype(f32)
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=2e-5)


def test_a_caffemodel_without_masks_loads_with_masks_of_ones(tmp_path):
    """myopic-oracle's original.caffemodel files hold [W, b] per layer: the fork's loader copies those and keeps
    the new masks (default_init: ones), so the net is the unmasked one."""
    r = np.random.default_rng(3)
    w, b = dyadic(r, (6, 2, 3, 2)), dyadic(r, (6,))
    model = load_with_caffemodel(tmp_path, conv_text(), {"c": [w, b]})
    blobs = node_of(model, "c").blobs
    assert [a.shape for a in blobs] == [(6, 2, 3, 2), (6,), (6, 2, 3, 2), (6,)]
    assert np.all(blobs[2] == 1) and np.all(blobs[3] == 1)
    assert any("layer 'c': the weights file has 0 of its 2 mask blob(s): the fork's loader keeps new ones for the "
               "rest (ones)" in n for n in model.warnings)
    x = r.standard_normal((2, 4, 7, 5)).astype(f32)
    ref = conv_ref(x, w, b, (2, 1), (0, 1), 2).astype(f32)
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=2e-5)


def test_the_loader_keeps_new_masks_for_missing_or_misshapen_ones_and_skips_extra_blobs(tmp_path):
    """net.cpp CopyTrainedLayersFrom copies blob j only where the file has it and the shapes agree, and never
    looks past the net's blobs (the fork's saliency blobs of a net without them)."""
    r = np.random.default_rng(7)
    w, b, mw = dyadic(r, (6, 2, 3, 2)), dyadic(r, (6,)), mask(r, (6, 2, 3, 2))
    x = r.standard_normal((2, 4, 7, 5)).astype(f32)
    ref = conv_ref(x, w * mw, b, (2, 1), (0, 1), 2).astype(f32)
    cases = {"short": [w, b, mw], "misshapen": [w, b, mw, np.zeros(5, f32)],
             "extra": [w, b, mw, np.ones(6, f32), np.zeros((1, 6), f32), np.zeros((1, 2), f32)]}
    notes = {"short": "has 1 of its 2 mask blob(s): the fork's loader keeps new ones for the rest (ones)",
             "misshapen": "blob 3 (a mask) has shape [5], not its blob's [6]: the fork's loader keeps its new one",
             "extra": "blobs 4 to 5 of the weights file are not this net's: skipped"}
    for case, blobs in cases.items():
        model = load_with_caffemodel(tmp_path, conv_text(), {"c": blobs})
        assert any(notes[case] in n for n in model.warnings), (case, model.warnings)
        assert [a.shape for a in node_of(model, "c").blobs] == [(6, 2, 3, 2), (6,), (6, 2, 3, 2), (6,)]
        np.testing.assert_allclose(model.run({"x": x}, exact=True)["y"], ref, atol=2e-5, err_msg=case)


def test_random_masks_follow_default_init_and_mask_filler():
    ones = load_from_text(conv_text(), random_weights=True)
    assert all(np.all(m == 1) for m in node_of(ones, "c").blobs[2:])
    half = load_from_text(conv_text(mask_param='mask_term: true default_init: false mask_filler { type: "constant" '
                                    'value: 0.5 }'), random_weights=True)
    assert all(np.all(m == f32(0.5)) for m in node_of(half, "c").blobs[2:])
    # without default_init and a filler, Caffe's constant filler: zeros, so every output is 0
    zeros = load_from_text(conv_text(mask_param="mask_term: true default_init: false"), random_weights=True)
    x = np.random.default_rng(4).standard_normal((2, 4, 7, 5)).astype(f32)
    assert np.all(zeros.run({"x": x})["y"] == 0)
    drawn = load_from_text(conv_text(mask_param='mask_term: true default_init: false mask_filler { type: "uniform" '
                                     'min: 2 max: 3 }'), random_weights=True)
    assert all(((m >= 2) & (m <= 3)).all() and m.std() > 0 for m in node_of(drawn, "c").blobs[2:])


def test_a_deconvolution_keeps_its_masks_without_applying_them(tmp_path):
    r = np.random.default_rng(5)
    text = net('layer { name: "d" type: "Deconvolution" bottom: "x" top: "y" convolution_mask_param { mask_term: true } '
               'convolution_param { num_output: 3 kernel_size: 2 stride: 2 } }', inputs={"x": (2, 4, 3, 5)})
    w, b = dyadic(r, (4, 3, 2, 2)), dyadic(r, (3,))
    model = load_with_caffemodel(tmp_path, text, {"d": [w, b, np.zeros((4, 3, 2, 2), f32), np.zeros(3, f32)]})
    x = dyadic(r, (2, 4, 3, 5))
    ref = np.einsum("nchw,cokl->nohkwl", x.astype(np.float64), w).reshape(2, 3, 6, 10) + b[:, None, None]
    check_everywhere(model, {"x": x}, {"y": ref.astype(f32)}, tmp_path, atol=1e-6)


def test_a_mask_filler_caffeq_cannot_draw_is_one_error_naming_layer_and_field():
    text = conv_text(mask_param='mask_term: true default_init: false mask_filler { type: "bilinear" }')
    with pytest.raises(CaffeqError, match=r"layer 'c': convolution_mask_param.mask_filler type 'bilinear' cannot "
                                          r"fill a new mask"):
        load_from_text(text, random_weights=True)
    load_from_text(text)   # reading it needs no mask


@pytest.mark.parametrize("name", ["CIFAR10-CIFAR10", "LeNet-5-CIFAR10", "NIN-CIFAR10", "ResNet-20-CIFAR10"])
def test_the_forks_masked_nets_read_with_four_blobs_per_convolution(name):
    model = load(REALWORLD / f"{MYOPIC}{name}__masked.prototxt", random_weights=True,
                 input_shapes={"data": (2, 3, 32, 32), "label": (2,)})
    convs = [n for n in model.layers if n.type == "Convolution"]
    assert convs and all(isinstance(n.spec, MyopicMaskedConvolution) for n in convs)
    for n in convs:
        w_shape = n.blobs[0].shape
        expected = [w_shape, (w_shape[0],)] if n.attrs["bias_term"] else [w_shape]
        assert [b.shape for b in n.blobs] == expected * 2
        assert all(np.all(m == 1) for m in n.blobs[len(expected):])


def test_the_lenet_file_runs_as_the_unmasked_net_until_a_mask_prunes(tmp_path):
    """myopic-oracle's LeNet-5 with its new masks (ones) computes the plain net; zeroing conv2's masks for one
    output channel zeroes that channel before the pooling (its bias masked too)."""
    path = REALWORLD / f"{MYOPIC}LeNet-5-CIFAR10__masked.prototxt"
    shapes = {"data": (2, 3, 32, 32), "label": (2,)}
    masked = load(path, random_weights=True, input_shapes=shapes, outputs=["conv2", "ip2"])
    plain_text = path.read_text().replace("convolution_mask_param {\n    mask_term: true\n  }", "")
    assert "convolution_mask_param" not in plain_text
    plain = load_from_text(plain_text, input_shapes=shapes, outputs=["conv2", "ip2"], random_weights=True)
    for n in masked.layers:
        if n.blobs:
            node_of(plain, n.name).blobs = n.blobs[:2]
    x = np.random.default_rng(6).standard_normal((2, 3, 32, 32)).astype(f32)
    feeds = {"data": x, "label": np.zeros(2, f32)}
    ref = plain.run(feeds, exact=True)
    check_everywhere(masked, feeds, ref, tmp_path, atol=1e-5, rtol=1e-5, opsets=(None,))
    conv2 = node_of(masked, "conv2")
    conv2.blobs[2][7] = 0
    conv2.blobs[3][7] = 0
    masked.clear_cache()
    out = masked.run(feeds, exact=True)["conv2"]
    assert np.all(out[:, 7] == 0) and np.array_equal(np.delete(out, 7, axis=1), np.delete(ref["conv2"], 7, axis=1))


def test_a_batchnorm_after_a_masked_convolution_runs_in_the_optimized_path():
    text = net('layer { name: "c" type: "Convolution" bottom: "x" top: "c" convolution_mask_param { mask_term: true } '
               'convolution_param { num_output: 3 kernel_size: 3 bias_term: false } }\n'
               'layer { name: "bn" type: "BatchNorm" bottom: "c" top: "y" }', inputs={"x": (2, 4, 6, 5)})
    model = load_from_text(text, random_weights=True)
    r = np.random.default_rng(9)
    w = r.standard_normal((3, 4, 3, 3)).astype(f32)
    m = (r.random((3, 4, 3, 3)) < 0.5).astype(f32)
    node_of(model, "c").blobs = [w, m]
    model.clear_cache()
    x = r.standard_normal((2, 4, 6, 5)).astype(f32)
    ref = conv_ref(x, w * m, None, (1, 1), (0, 0)) / np.sqrt(1 + 1e-5)
    np.testing.assert_allclose(model.run({"x": x})["y"], ref, rtol=1e-5, atol=1e-5)


def drawn_masks(filler, bias=True):
    """The new masks (weight (40, 10, 3, 2), bias (40,)) a 40-output convolution draws with `filler`."""
    text = net('layer { name: "c" type: "Convolution" bottom: "x" top: "y" convolution_mask_param { mask_term: true '
               f'default_init: false mask_filler {{ {filler} }} }} convolution_param {{ num_output: 40 kernel_h: 3 '
               f'kernel_w: 2 {"" if bias else "bias_term: false"} }} }}', inputs={"x": (2, 10, 7, 5)})
    return node_of(load_from_text(text, random_weights=True), "c").blobs[2 if bias else 1:]


@pytest.mark.parametrize("norm, fan_w, fan_b", [("FAN_IN", 60, 1), ("FAN_OUT", 240, 40), ("AVERAGE", 150, 20.5)])
def test_a_xavier_mask_filler_draws_within_caffes_bound(norm, fan_w, fan_b):
    """filler.hpp XavierFiller: uniform in +-sqrt(3 / n), n = count / num (fan in), count / channels (fan out; a
    1-axis blob's count) or their mean; the weight mask's fans are 60 and 240, the bias mask's 1 and 40."""
    weight_mask, bias_mask = drawn_masks(f'type: "xavier" variance_norm: {norm}')
    for m, fan, near in ((weight_mask, fan_w, 0.9), (bias_mask, fan_b, 0.7)):
        bound = np.sqrt(3.0 / fan)
        assert near * bound < np.abs(m).max() <= bound * (1 + 1e-6), (norm, m.shape)


def test_msra_and_gaussian_mask_fillers_draw_caffes_distributions():
    (weight_mask,) = drawn_masks('type: "msra" variance_norm: FAN_OUT', bias=False)
    assert abs(weight_mask.std() / np.sqrt(2.0 / 240) - 1) < 0.05 and abs(weight_mask.mean()) < 0.01
    (weight_mask,) = drawn_masks('type: "gaussian" mean: 5 std: 0.25', bias=False)
    assert abs(weight_mask.mean() - 5) < 0.02 and abs(weight_mask.std() / 0.25 - 1) < 0.05


@pytest.mark.parametrize("filler, message", [
    ('type: "gaussian" sparse: 0', "a sparse gaussian cannot fill a new mask here"),
    ('type: "positive_unitball"', "type 'positive_unitball' cannot fill a new mask here"),
])
def test_a_filler_caffeq_does_not_draw_refuses_only_when_a_mask_is_new(filler, message):
    """GaussianFiller's sparse >= 0 (0 included: every value dropped) is not drawn here."""
    with pytest.raises(CaffeqError, match=f"layer 'c': convolution_mask_param.mask_filler {message}"):
        drawn_masks(filler)


@pytest.mark.parametrize("filler, message", [
    ('type: "ones"', r"mask_filler type 'ones' is not a Caffe filler"),
    ('type: "constant" value: 1 sparse: 3', r"mask_filler.sparse 3: Caffe's 'constant' filler CHECKs sparse == -1"),
    ('type: "gaussian" sparse: -2', r"mask_filler.sparse -2: Caffe's 'gaussian' filler CHECKs sparse >= -1"),
    ('type: "uniform" min: 2', r"mask_filler min 2 > max 1: Caffe's uniform filler CHECKs min <= max"),
])
def test_a_mask_filler_the_forks_setup_refuses_is_one_error_even_with_masks_at_hand(filler, message, tmp_path):
    """The fork fills new masks in LayerSetUp, before CopyTrainedLayersFrom: filler.hpp's CHECKs (GetFiller's
    names, sparse == -1 outside gaussian) stop it whatever the weights file holds."""
    text = conv_text(mask_param=f"mask_term: true default_init: false mask_filler {{ {filler} }}")
    blobs = [np.ones((6, 2, 3, 2), f32), np.ones(6, f32)] * 2
    with pytest.raises(CaffeqError, match=r"layer 'c' \(Convolution\): convolution_mask_param\." + message):
        load_with_caffemodel(tmp_path, text, {"c": blobs})


def test_a_caffemodel_without_masks_takes_them_from_mask_filler(tmp_path):
    """default_init: false: the masks CopyTrainedLayersFrom leaves are mask_filler's (a constant 0.25 here)."""
    r = np.random.default_rng(11)
    w, b = dyadic(r, (6, 2, 3, 2)), dyadic(r, (6,))
    text = conv_text(mask_param='mask_term: true default_init: false mask_filler { type: "constant" value: 0.25 }')
    model = load_with_caffemodel(tmp_path, text, {"c": [w, b]})
    assert all(np.all(m == f32(0.25)) for m in node_of(model, "c").blobs[2:])
    assert any("0 of its 2 mask blob(s): the fork's loader keeps new ones for the rest (drawn by "
               "convolution_mask_param.mask_filler)" in n for n in model.warnings)
    x = r.standard_normal((2, 4, 7, 5)).astype(f32)
    check_everywhere(model, {"x": x}, {"y": conv_ref(x, w * 0.25, b * 0.25, (2, 1), (0, 1), 2).astype(f32)}, tmp_path,
                     atol=2e-5)


def test_the_inner_product_fills_its_mask_by_inner_product_mask_param(tmp_path):
    """inner_product_layer.cpp reads default_init and mask_filler from inner_product_mask_param, never from
    convolution_mask_param; the bias stays unmasked."""
    text = net('layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y" inner_product_param { num_output: 5 '
               'mask_term: true } inner_product_mask_param { default_init: false mask_filler { type: "constant" '
               'value: 0.5 } } convolution_mask_param { default_init: true } }', inputs={"x": (3, 2, 4, 1)})
    r = np.random.default_rng(12)
    w, b = dyadic(r, (5, 8)), dyadic(r, (5,))
    model = load_with_caffemodel(tmp_path, text, {"ip": [w, b]})
    assert np.all(node_of(model, "ip").blobs[2] == f32(0.5))
    x = r.standard_normal((3, 2, 4, 1)).astype(f32)
    ref = (x.reshape(3, 8).astype(np.float64) @ (w * 0.5).astype(np.float64).T + b).astype(f32)
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=2e-5)


def test_mask_parameters_without_mask_term_leave_the_plain_layers():
    """base_conv_layer.cpp and inner_product_layer.cpp make masks only with mask_term: the other mask fields alone
    leave [W, b] and the unmasked forward."""
    text = net('layer { name: "c" type: "Convolution" bottom: "x" top: "c" convolution_mask_param { mask_term: false '
               'default_init: false } convolution_param { num_output: 3 kernel_size: 2 } }\n'
               'layer { name: "ip" type: "InnerProduct" bottom: "c" top: "y" inner_product_param { num_output: 4 } '
               'inner_product_mask_param { default_init: false } }', inputs={"x": (2, 5, 4, 6)})
    model = load_from_text(text, random_weights=True)
    for name in ("c", "ip"):
        node = node_of(model, name)
        assert not isinstance(node.spec, _MyopicMasked) and node.spec.blob_names_for(node.attrs) == ("weight", "bias")
        assert len(node.blobs) == 2
