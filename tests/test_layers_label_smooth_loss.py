"""Kevinduan23/caffe's softmax_param.label_smooth on SoftmaxWithLoss (softmax_loss_layer.cpp): each counted
position adds -sum_c coeff_c log(max(prob_c, FLT_MIN)), coeff 1 - f at the label and f / C elsewhere; its
backward gives prob - coeff.  The reference is that loop in numpy (float64)."""
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import cli_process, net, node_of, one_line_error, rng

from caffeq.model import load, load_from_text

REALWORLD = Path(__file__).parent / "fixtures" / "realworld"
FLT_MIN = 1.1754943508222875e-38


def softmax(scores):
    e = np.exp(scores - scores.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def smoothed_loss_ref(scores, labels, f, mode, ignore):
    """The fork's Forward_cpu: (loss, d loss / d scores from its Backward_cpu)."""
    prob = softmax(scores.astype(np.float64))
    n, c = scores.shape[:2]
    loss, count = 0.0, 0
    grad = prob.copy()
    for i, h, w in np.ndindex(n, *scores.shape[2:]):
        label = int(labels[i, 0, h, w])
        if label == ignore:
            grad[i, :, h, w] = 0
            continue
        coeff = np.full(c, np.float32(f) / np.float32(c), np.float64)
        coeff[label] = np.float32(1) - np.float32(f)
        loss -= (coeff * np.log(np.maximum(prob[i, :, h, w], FLT_MIN))).sum()
        grad[i, :, h, w] -= coeff
        count += 1
    norm = {"VALID": count, "BATCH_SIZE": n}[mode]
    return loss / max(norm, 1), grad / max(norm, 1)


def loss_net(shape, params):
    return net('layer { name: "loss" type: "SoftmaxWithLoss" bottom: "s" bottom: "l" top: "loss" top: "prob" '
               f'loss_param {{ ignore_label: 9 {params} }} softmax_param {{ label_smooth: true '
               'label_smooth_factor: 0.1 } }', inputs={"s": shape, "l": (shape[0], 1) + shape[2:]})


@pytest.mark.parametrize("mode", ["VALID", "BATCH_SIZE"])
def test_label_smoothed_loss_and_its_gradient(mode):
    shape = (3, 4, 2, 5)
    model = load_from_text(loss_net(shape, f"normalization: {mode}"))
    scores = (rng(1).standard_normal(shape) * 3).astype(np.float32)
    labels = rng(2).integers(0, 4, size=(3, 1, 2, 5)).astype(np.float32)
    labels[1, 0, 1, :3] = 9
    want, want_grad = smoothed_loss_ref(scores, labels, 0.1, mode, 9)
    out = model.run({"s": scores, "l": labels})
    np.testing.assert_allclose(out["loss"], want, rtol=1e-5)
    np.testing.assert_allclose(out["prob"], softmax(scores.astype(np.float64)), rtol=1e-5, atol=1e-7)
    node = node_of(model, "loss")
    s = torch.from_numpy(scores).requires_grad_()
    loss, _ = node.spec.forward(node.attrs, [], s, torch.from_numpy(labels))
    loss.backward()
    np.testing.assert_allclose(float(loss.detach()), want, rtol=1e-5)
    np.testing.assert_allclose(s.grad.numpy(), want_grad, rtol=1e-5, atol=1e-7)


def test_without_a_positive_factor_the_loss_is_bvlcs():
    shape = (2, 3, 1, 4)
    scores = rng(3).standard_normal(shape).astype(np.float32)
    labels = rng(4).integers(0, 3, size=(2, 1, 1, 4)).astype(np.float32)
    plain, _ = smoothed_loss_ref(scores, labels, 0.0, "VALID", None)
    for smooth in ("label_smooth: true label_smooth_factor: 0", "label_smooth: false label_smooth_factor: 0.2"):
        text = net('layer { name: "loss" type: "SoftmaxWithLoss" bottom: "s" bottom: "l" top: "loss" '
                   f'softmax_param {{ {smooth} }} }}', inputs={"s": shape, "l": (2, 1, 1, 4)})
        np.testing.assert_allclose(load_from_text(text).run({"s": scores, "l": labels})["loss"], plain, rtol=1e-5)


def test_a_negative_factor_gives_bvlcs_loss():
    # the fork smooths only where label_smooth_factor > 0
    shape = (3, 5, 2, 1)
    scores = rng(6).standard_normal(shape).astype(np.float32)
    labels = rng(7).integers(0, 5, size=(3, 1, 2, 1)).astype(np.float32)
    plain, _ = smoothed_loss_ref(scores, labels, 0.0, "VALID", None)
    text = net('layer { name: "loss" type: "SoftmaxWithLoss" bottom: "s" bottom: "l" top: "loss" '
               'softmax_param { label_smooth: true label_smooth_factor: -0.3 } }', inputs={"s": shape, "l": (3, 1, 2, 1)})
    np.testing.assert_allclose(load_from_text(text).run({"s": scores, "l": labels})["loss"], plain, rtol=1e-5)


def test_a_vanishing_probability_is_clamped_at_flt_min():
    # exp(-300) underflows float32: the fork's log(max(prob, FLT_MIN)) is log(FLT_MIN) for each such class
    shape = (2, 3, 1, 2)
    scores = np.zeros(shape, np.float32)
    scores[:, 2] = -300.0
    scores[1, 1, 0, 1] = 4.0
    labels = np.array([0, 1, 1, 0], np.float32).reshape(2, 1, 1, 2)
    want, _ = smoothed_loss_ref(scores, labels, 0.1, "VALID", 9)
    assert want < 0.1 / 3 * 300   # each position's class-2 term alone would be 0.1 / 3 * 300 unclamped
    got = load_from_text(loss_net(shape, "")).run({"s": scores, "l": labels})["loss"]
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("bottoms, tops, counts", [
    ('bottom: "s" bottom: "l" bottom: "w"', 'top: "loss"', "got 3 and 1"),
    ('bottom: "s" bottom: "l"', 'top: "loss" top: "prob" top: "each"', "got 2 and 3"),
])
def test_other_bottom_or_top_counts_with_label_smooth_are_refused_in_one_line(tmp_path, bottoms, tops, counts):
    path = tmp_path / "bad.prototxt"
    path.write_text(net(f'layer {{ name: "loss" type: "SoftmaxWithLoss" {bottoms} {tops} '
                        'softmax_param { label_smooth: true } }', inputs={"s": (2, 3), "l": (2,), "w": (2,)}))
    one_line_error(cli_process("inspect", str(path)), "layer 'loss'", "softmax_param.label_smooth",
                   "takes 2 bottoms", counts)


@pytest.mark.parametrize("name, layers", [
    ("Kevinduan23__caffe__examples__cifar10__cifar10_full_sigmoid_train_test_bn.prototxt", 16),
    ("Kevinduan23__caffe__examples__cifar10__cifar10_resnet.prototxt", 97),
])
def test_the_forks_cifar10_nets_read(name, layers):
    model = load(str(REALWORLD / name), input_shapes={"data": (2, 3, 32, 32)})
    assert len(model.layers) == layers
    loss = node_of(model, "loss")
    assert type(loss.spec).__name__ == "LabelSmoothSoftmaxWithLoss"
    assert loss.attrs["smooth"] == float(np.float32(0.001))
    scores = rng(5).standard_normal((2, 10)).astype(np.float32)
    labels = np.array([3, 7], np.float32)
    got = loss.spec.forward(loss.attrs, [], torch.from_numpy(scores), torch.from_numpy(labels))   # one top
    want, _ = smoothed_loss_ref(scores.reshape(2, 10, 1, 1), labels.reshape(2, 1, 1, 1), 0.001, "VALID", None)
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
