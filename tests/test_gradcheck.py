"""float64 gradient checks of every op whose backward is not the derivative of its forward.

torch.autograd.gradcheck compares autograd's Jacobian with finite differences of the forward
pass.  A straight-through path has, by design, a backward that differs from its own forward's
derivative: it is the derivative of a *surrogate* function.  Each test here builds that surrogate
from its formula, gives it the op's backward (surrogate(x).detach() + op(x) - op(x).detach()
has the surrogate's value and the op's gradient) and lets gradcheck compare the two, at points
where the surrogate is smooth.  The ops: SignSTE and binarize_ste (fine-tuning's binary
weights), and the loss layers whose log clamps pass the unclamped gradient (SoftmaxWithLoss,
InfogainLoss).
"""
import math

import numpy as np
import pytest
import torch

from caffeq.finetune import SignSTE, binarize_ste
from caffeq.model import load_from_text

RNG = np.random.default_rng(2024)


def _away_from(values, points, margin=0.05):
    """values moved so that none lies within `margin` of any of `points` (kinks of the surrogate)."""
    v = np.asarray(values, np.float64).copy()
    for p in points:
        near = np.abs(v - p) < margin
        v[near] = p + np.where(v[near] >= p, margin, -margin) * 2
    return v


def _with_backward_of(surrogate_value, op_value):
    return surrogate_value.detach() + (op_value - op_value.detach())


def test_sign_ste_backward_is_the_derivative_of_hardtanh():
    clip = 0.8
    w = torch.tensor(_away_from(RNG.uniform(-2, 2, size=(3, 4, 5)), (-clip, 0.0, clip)), requires_grad=True)

    def f(x):
        surrogate = torch.clamp(x, -clip, clip)        # d/dx = 1 where |x| < clip, else 0
        return _with_backward_of(surrogate, SignSTE.apply(x, clip))

    assert torch.autograd.gradcheck(f, (w,), eps=1e-6, atol=1e-8)
    # and the forward is sign with sign(0) = +1
    z = torch.tensor([-0.5, 0.0, 0.5], dtype=torch.float64)
    assert SignSTE.apply(z, clip).tolist() == [-1.0, 1.0, 1.0]


@pytest.mark.parametrize("shape,axis,groups", [((5, 3, 2, 2), 0, 1),      # Convolution: channels on 0
                                               ((4, 3), None, 1),         # one alpha for the blob
                                               ((4, 3, 2, 2), 1, 1),      # Deconvolution, group 1
                                               ((4, 3, 2, 2), 1, 2)])     # grouped Deconvolution
def test_binarize_ste_backward_is_the_surrogate_derivative(shape, axis, groups):
    """binarize_ste(w) = alpha(w) * sign(w), alpha = mean |w| per output channel.  Its backward is
    that of G(w) = alpha(w) * s0 + alpha0 * hardtanh(w), with s0 = sign(w0) and alpha0 = alpha(w0)
    held at the point w0: the exact alpha gradient plus the straight-through sign gradient."""
    clip = 1.0
    w0 = torch.tensor(_away_from(RNG.uniform(-1.6, 1.6, size=shape), (-clip, 0.0, clip)), requires_grad=True)
    s0 = torch.where(w0 >= 0, 1.0, -1.0).to(torch.float64).detach()

    def alpha(w):
        """mean |w| over each output channel's elements, written out per layout, broadcast to w."""
        a = w.abs()
        if axis is None:
            return a.mean().expand_as(w)
        if groups > 1:
            cin, cpg = w.shape[0], w.shape[1]
            v = a.reshape(groups, cin // groups, cpg, -1)
            return v.mean(dim=(1, 3), keepdim=True).expand_as(v).reshape(w.shape)
        dims = [d for d in range(w.dim()) if d != axis]
        return a.mean(dim=dims, keepdim=True).expand_as(w)

    alpha0 = alpha(w0).detach()

    def f(w):
        surrogate = alpha(w) * s0 + alpha0 * torch.clamp(w, -clip, clip)
        return _with_backward_of(surrogate, binarize_ste(w, axis, groups, clip))

    assert torch.autograd.gradcheck(f, (w0,), eps=1e-6, atol=1e-8)
    # the forward is alpha * sign(w) (equal to the surrogate at w0)
    np.testing.assert_allclose(binarize_ste(w0, axis, groups, clip).detach().numpy(),
                               (alpha0 * s0).numpy(), rtol=1e-12)


# ---- loss layers: log(max(p, floor)) forward, the unclamped gradient backward ----------------

def _loss_module(layer, inputs):
    lines = ['name: "t"']
    for name, shape in inputs:
        dims = " ".join(f"dim: {d}" for d in shape)
        lines.append(f'layer {{ name: "{name}" type: "Input" top: "{name}" input_param {{ shape {{ {dims} }} }} }}')
    lines.append(layer)
    return load_from_text("\n".join(lines) + "\n").to_torch(dtype=torch.float64)


def _log_softmax(x):
    """log softmax over axis 1, written out (max-shifted log-sum-exp)."""
    m = x.max(dim=1, keepdim=True).values
    return x - m - torch.log(torch.exp(x - m).sum(dim=1, keepdim=True))


def test_softmax_loss_gradient_past_the_flt_min_clamp():
    n, c = 3, 5
    x = torch.tensor(RNG.normal(size=(n, c)), requires_grad=True)
    labels = torch.tensor([2.0, 0.0, 4.0], dtype=torch.float64)
    with torch.no_grad():
        x[1, 0] -= 120.0       # item 1: log p(label) ~ -120 < log(FLT_MIN) ~ -87.3: the clamp is active
    gm = _loss_module('layer { name: "loss" type: "SoftmaxWithLoss" bottom: "s" bottom: "l" top: "loss" }',
                      [("s", (n, c)), ("l", (n,))])
    lab = labels.long()

    def unclamped(s):
        return -_log_softmax(s)[torch.arange(n), lab].sum() / n

    logp = _log_softmax(x.detach())[torch.arange(n), lab].numpy()
    assert logp[1] < math.log(1.1754943508222875e-38) < logp[[0, 2]].min()
    # forward: Caffe's -log(max(p, FLT_MIN)), normalized by the valid count
    expected = -np.maximum(logp, math.log(1.1754943508222875e-38)).sum() / n
    np.testing.assert_allclose(float(gm(x, labels).detach()), expected, rtol=1e-12)
    # backward: the gradient of the unclamped loss, as Caffe's backward computes it
    assert torch.autograd.gradcheck(lambda s: _with_backward_of(unclamped(s), gm(s, labels)), (x,),
                                    eps=1e-6, atol=1e-8)


def test_infogain_loss_gradient_past_the_log_threshold_clamp():
    n, c = 4, 3
    x = torch.tensor(RNG.normal(size=(n, c)), requires_grad=True)
    labels = torch.tensor([0.0, 2.0, 1.0, 2.0], dtype=torch.float64)
    h = torch.tensor(RNG.uniform(0.1, 1.0, size=(c, c)))
    with torch.no_grad():
        x[2, 1] -= 70.0        # item 2: log p_1 ~ -70 < log(1e-20) ~ -46.1: the clamp is active
    gm = _loss_module('layer { name: "loss" type: "InfogainLoss" bottom: "s" bottom: "l" bottom: "h" top: "loss" }',
                      [("s", (n, c)), ("l", (n,)), ("h", (1, 1, c, c))])
    lab = labels.long()
    h4 = h.reshape(1, 1, c, c)

    def unclamped(s):
        return -(h[lab] * _log_softmax(s)).sum() / n

    logp = _log_softmax(x.detach()).numpy()
    assert logp.min() < math.log(1e-20)
    expected = -(h[lab].numpy() * np.maximum(logp, math.log(1e-20))).sum() / n
    np.testing.assert_allclose(float(gm(x, labels, h4).detach()), expected, rtol=1e-12)
    assert torch.autograd.gradcheck(lambda s: _with_backward_of(unclamped(s), gm(s, labels, h4)), (x,),
                                    eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("scale", [-0.1, 0.0, 2.5])
def test_scaled_gradient_backward_is_the_derivative_of_scale_times_x(scale):
    """affordanceNet_DA's GradientScaler: identity forward, backward scale * grad (the surrogate
    scale * x has that derivative)."""
    from caffeq.layers.affordance import ScaledGradient
    x = torch.tensor(RNG.standard_normal((2, 3, 4)), requires_grad=True)
    assert torch.equal(ScaledGradient.apply(x, scale), x)
    assert torch.autograd.gradcheck(lambda t: _with_backward_of(scale * t, ScaledGradient.apply(t, scale)), (x,))
