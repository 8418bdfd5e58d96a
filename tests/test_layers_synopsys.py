"""synopsys-caffe (foss-for-synopsys-dwc-arc-processors/synopsys-caffe @977ba36a) fork fields.

References are numpy re-derivations of the fork's C++ written here:
- BatchNorm add_eps_before_sqrt: false (batch_norm_layer.cpp Forward_cpu): sqrt of the variance,
  then eps added, then (x - mean) divided by it; true is BVLC's sqrt(var + eps).
"""
import re

import numpy as np
import pytest
from conftest import assert_close, backend_outputs, inputs_text, model_py_outputs, rng

from caffeq.backends.pytorch_source import export_pytorch
from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

SHAPE = (2, 3, 5, 7)  # N, C, H, W all different


# ---- BatchNorm add_eps_before_sqrt ------------------------------------------------------------

def bn_net(param):
    return inputs_text(x=SHAPE) + (
        f'layer {{ name: "bn" type: "BatchNorm" bottom: "x" top: "o" batch_norm_param {{ {param} }} }}')


def bn_ref(x, mean, var, factor, eps, before):
    f = 0.0 if factor == 0 else 1.0 / factor
    m = (mean * f).reshape(1, -1, 1, 1).astype(np.float64)
    v = (var * f).reshape(1, -1, 1, 1).astype(np.float64)
    std = np.sqrt(v + eps) if before else np.sqrt(v) + eps
    return (x - m) / std


def bn_model(param):
    model = load_from_text(bn_net(param), random_weights=True)
    g = rng(3)
    c = SHAPE[1]
    # tiny variances so that where eps goes matters far above float32 rounding
    blobs = [g.uniform(-1, 1, c), g.uniform(1e-4, 3e-3, c), np.array([2.5])]
    model.graph.node("bn").blobs = [b.astype(np.float32) for b in blobs]
    return model, blobs


@pytest.mark.parametrize("before", [True, False])
def test_batchnorm_add_eps_before_sqrt(before, tmp_path):
    model, (mean, var, factor) = bn_model(f"eps: 0.01 add_eps_before_sqrt: {str(before).lower()}")
    x = rng(1).standard_normal(SHAPE).astype(np.float32)
    ref = bn_ref(x, mean, var, factor[0], 0.01, before)
    other = bn_ref(x, mean, var, factor[0], 0.01, not before)
    assert np.abs(ref - other).max() > 0.1  # the flag matters on these numbers
    outs = backend_outputs(model, {"x": x}, tmp_path)
    outs["exact"] = model.run({"x": x}, exact=True)["o"]  # model.run folds BatchNorm by default
    for name, out in outs.items():
        assert_close(out, ref, 1e-4, 1e-4, name)


def test_batchnorm_default_is_bvlc_bit_for_bit(tmp_path):
    plain, _ = bn_model("eps: 0.01")
    flagged, _ = bn_model("eps: 0.01 add_eps_before_sqrt: true")
    assert plain.graph.node("bn").attrs["eps_after_sqrt"] is False
    x = rng(2).standard_normal(SHAPE).astype(np.float32)
    for exact in (False, True):
        assert np.array_equal(plain.run({"x": x}, exact=exact)["o"], flagged.run({"x": x}, exact=exact)["o"])


def test_batchnorm_eps_after_sqrt_in_exact_model_py_and_batch_stats(tmp_path):
    model, _ = bn_model("eps: 0.01 add_eps_before_sqrt: false use_global_stats: false")
    x = rng(4).standard_normal(SHAPE).astype(np.float32) * 0.05
    mean = x.mean(axis=(0, 2, 3), keepdims=True, dtype=np.float64)
    var = ((x - mean) ** 2).mean(axis=(0, 2, 3), keepdims=True)
    ref = (x - mean) / (np.sqrt(var) + 0.01)
    for name, out in backend_outputs(model, {"x": x}, tmp_path).items():
        assert_close(out, ref, 1e-4, 1e-4, name)
    export_pytorch(model, tmp_path / "exact", exact_batchnorm=True)
    assert "eps_after_sqrt=True" in (tmp_path / "exact" / "model.py").read_text()


# ---- UpsampleDarknet ------------------------------------------------------------------------

def upsample_darknet_ref(x, stride):
    n, c, h, w = x.shape
    out = np.empty((n, c, h * stride, w * stride), x.dtype)
    for i in range(h * stride):
        for j in range(w * stride):
            out[:, :, i, j] = x[:, :, i // stride, j // stride]
    return out


@pytest.mark.parametrize("stride", [1, 2, 3])
def test_upsample_darknet(stride, tmp_path):
    text = inputs_text(x=SHAPE) + (
        f'layer {{ name: "up" type: "UpsampleDarknet" bottom: "x" top: "o" '
        f'upsample_darknet_param {{ stride: {stride} }} }}')
    model = load_from_text(text)
    x = rng(5).standard_normal(SHAPE).astype(np.float32)
    ref = upsample_darknet_ref(x, stride)
    for name, out in backend_outputs(model, {"x": x}, tmp_path).items():
        assert out.shape == ref.shape, name
        assert np.array_equal(out, ref), name


@pytest.mark.parametrize("param, msg", [("stride: 0", "stride must be >= 1"), ("stride: -2", "stride")])
def test_upsample_darknet_bad_stride(param, msg):
    text = inputs_text(x=SHAPE) + (
        f'layer {{ name: "up" type: "UpsampleDarknet" bottom: "x" top: "o" upsample_darknet_param {{ {param} }} }}')
    with pytest.raises(CaffeqError, match=msg):
        load_from_text(text)


# ---- BN icnet: picks PSPNet's BN (true) or SegNet's (false) in bn_layer.cpp --------------------

def bn_icnet_model(param):
    text = inputs_text(x=SHAPE) + f'layer {{ name: "bn" type: "BN" bottom: "x" top: "o" bn_param {{ {param} }} }}'
    return load_from_text(text, random_weights=True)


def test_bn_icnet_true_is_pspnets_bn(tmp_path):
    # only a SegNet field besides icnet: the fork still runs PSPNet's branch
    model = bn_icnet_model("icnet: true eps: 0.001 bn_mode: INFERENCE")
    node = model.graph.node("bn")
    g, c = rng(6), SHAPE[1]
    slope, bias, mean = (g.uniform(-1, 1, (1, c, 1, 1)) for _ in range(3))
    var = g.uniform(0.01, 1, (1, c, 1, 1))
    node.blobs = [b.astype(np.float32) for b in (slope, bias, mean, var)]
    x = rng(7).standard_normal(SHAPE).astype(np.float32)
    ref = (x - mean) * (var + 0.001) ** -0.5 * slope + bias
    for name, out in backend_outputs(model, {"x": x}, tmp_path).items():
        assert_close(out, ref, 1e-5, 1e-5, name)


def test_bn_icnet_false_is_segnets_bn(tmp_path):
    # PSPNet's eps is unread in the fork's SegNet branch
    model = bn_icnet_model("icnet: false eps: 0.5 bn_mode: INFERENCE")
    assert model.graph.node("bn").attrs["variant"] == "segnet"
    node = model.graph.node("bn")
    g, c = rng(8), SHAPE[1]
    scale, shift = g.uniform(-1, 1, (1, c, 1, 1)), g.uniform(-1, 1, (1, c, 1, 1))
    node.blobs = [scale.astype(np.float32), shift.astype(np.float32)]
    x = rng(9).standard_normal(SHAPE).astype(np.float32)
    for name, out in backend_outputs(model, {"x": x}, tmp_path).items():
        assert_close(out, x * scale + shift, 1e-5, 1e-5, name)


# ---- Convolution pad_type / pad_l/r/t/b (im2col.cpp) ------------------------------------------

def conv_ref(x, w, stride, dil, top, left, oh, ow):
    """The fork's im2col read: output (i, j) takes input (i * s - top + ki * d, j * s - left + kj * d),
    zero outside the image."""
    n, _, h, wd = x.shape
    o, _, kh, kw = w.shape
    out = np.zeros((n, o, oh, ow))
    for i in range(oh):
        for j in range(ow):
            for ki in range(kh):
                for kj in range(kw):
                    r, q = i * stride[0] - top + ki * dil[0], j * stride[1] - left + kj * dil[1]
                    if 0 <= r < h and 0 <= q < wd:
                        out[:, :, i, j] += x[:, :, r, q] @ w[:, :, ki, kj].T
    return out


def fork_same_geometry(size, k, s):
    out = -(-size // s)
    along = max(k - (s if size % s == 0 else size % s), 0)
    return out, along // 2


CONV_CASES = [
    # (param text, stride, dilation, kernel (h, w))
    ("pad_t: 1 pad_b: 0 pad_l: 2 pad_r: 1 stride: 2", (2, 2), (1, 1), (3, 3)),
    ("pad_t: 0 pad_b: 2 pad_l: 1 pad_r: 0", (1, 1), (1, 1), (3, 2)),
    ("pad_t: -1 pad_l: 1 pad_r: 1", (1, 1), (1, 1), (2, 3)),
    ("pad_type: 1 stride: 2", (2, 2), (1, 1), (3, 3)),
    ("pad_type: 1 stride_h: 3 stride_w: 2", (3, 2), (1, 1), (2, 3)),
    ("pad_type: 1 dilation: 2", (1, 1), (2, 2), (3, 3)),
]


def conv_case_geometry(param, stride, dil, kernel, hw):
    """(top, left, out_h, out_w) from the fork's formulas."""
    if "pad_type" in param:
        (oh, top), (ow, left) = (fork_same_geometry(n, k, s) for n, k, s in zip(hw, kernel, stride))
        return top, left, oh, ow
    vals = dict(re.findall(r"(\w+): (-?\d+)", param))
    t, b, l, r = (int(vals.get(f, 0)) for f in ("pad_t", "pad_b", "pad_l", "pad_r"))
    ext = [d * (k - 1) + 1 for d, k in zip(dil, kernel)]
    return t, l, (hw[0] + t + b - ext[0]) // stride[0] + 1, (hw[1] + l + r - ext[1]) // stride[1] + 1


@pytest.mark.parametrize("param, stride, dil, kernel", CONV_CASES)
def test_conv_fork_edge_pads(param, stride, dil, kernel, tmp_path):
    kp = f"kernel_h: {kernel[0]} kernel_w: {kernel[1]}"
    text = inputs_text(x=SHAPE) + (
        f'layer {{ name: "c" type: "Convolution" bottom: "x" top: "o" convolution_param {{ num_output: 4 '
        f'{kp} {param} }} }}')
    model = load_from_text(text, random_weights=True)
    w, bias = (np.asarray(b, np.float64) for b in model.graph.node("c").blobs)
    x = rng(10).standard_normal(SHAPE).astype(np.float32)
    top, left, oh, ow = conv_case_geometry(param, stride, dil, kernel, SHAPE[2:])
    ref = conv_ref(x.astype(np.float64), w, stride, dil, top, left, oh, ow) + bias.reshape(1, -1, 1, 1)
    if "-" in param:  # a crop: torch and model.py (ONNX refuses negative pads)
        outs = {"torch": model.run({"x": x})["o"], "model.py": model_py_outputs(model, {"x": x}, tmp_path)["o"]}
        with pytest.raises(CaffeqError, match="negative"):
            model.export_onnx(str(tmp_path / "m.onnx"), optimize=False)
    else:
        outs = backend_outputs(model, {"x": x}, tmp_path)
    for name, out in outs.items():
        assert out.shape == ref.shape, name
        assert_close(out, ref, 1e-4, 1e-4, name)


def test_conv_default_pads_unchanged():
    text = inputs_text(x=SHAPE) + (
        'layer { name: "c" type: "Convolution" bottom: "x" top: "o" convolution_param { num_output: 4 '
        'kernel_size: 3 pad: 1 stride: 2 } }')
    model = load_from_text(text, random_weights=True)
    assert model.graph.node("c").attrs["edge_pads"] is None


@pytest.mark.parametrize("param, msg", [
    ("pad: 1 pad_l: 1", "not both"), ("pad_type: 1 pad_t: 1", "not both"), ("pad_type: 2", "pad_type"),
    ("pad_h: 1 pad_w: 1 pad_type: 1", "not both")])
def test_conv_fork_edge_pads_bad(param, msg):
    text = inputs_text(x=SHAPE) + (
        f'layer {{ name: "c" type: "Convolution" bottom: "x" top: "o" convolution_param {{ num_output: 4 '
        f'kernel_size: 3 {param} }} }}')
    with pytest.raises(CaffeqError, match=msg):
        load_from_text(text, random_weights=True)


# ---- Pooling pad_type / pad_l/r/t/b / AVE_EXC_PAD (pooling_layer.cpp) -------------------------------

def fork_pool_ref(x, pool, kernel, stride, edges, same, ceil):
    """The fork's Reshape and Forward_cpu loops: edges (t, b, l, r); float64 sums."""
    n, c, h, w = x.shape
    sizes, out, pads = (h, w), [0, 0], [0, 0, 0, 0]
    for i in range(2):
        if same:
            out[i] = int(np.ceil(sizes[i] / stride[i]))
            rem = sizes[i] % stride[i]
            along = max(kernel[i] - (stride[i] if rem == 0 else rem), 0)
            pads[2 * i], pads[2 * i + 1] = along // 2, along - along // 2
        else:
            pads[2 * i], pads[2 * i + 1] = edges[2 * i], edges[2 * i + 1]
            span = (sizes[i] + edges[2 * i] + edges[2 * i + 1] - kernel[i]) / stride[i]
            out[i] = int(np.ceil(span) if ceil else np.floor(span)) + 1
    if not same and any(edges):
        for i in range(2):
            if (out[i] - 1) * stride[i] >= sizes[i] + pads[2 * i]:
                out[i] -= 1
    t, b, l, r = pads
    y = np.zeros((n, c, out[0], out[1]))
    for ph in range(out[0]):
        for pw in range(out[1]):
            hs, ws = ph * stride[0] - t, pw * stride[1] - l
            if pool == "MAX":
                he, we = min(hs + kernel[0], h), min(ws + kernel[1], w)
                hs, ws = max(hs, 0), max(ws, 0)
                y[:, :, ph, pw] = x[:, :, hs:he, ws:we].max(axis=(2, 3))
                continue
            he, we = min(hs + kernel[0], h + b), min(ws + kernel[1], w + r)
            size = (he - hs) * (we - ws)
            hs, ws, he, we = max(hs, 0), max(ws, 0), min(he, h), min(we, w)
            if pool == "AVE_EXC_PAD":
                size = (he - hs) * (we - ws)
            y[:, :, ph, pw] = x[:, :, hs:he, ws:we].sum(axis=(2, 3)) / size
    return y


POOL_CASES = [
    # (param text, kernel (h, w), stride (h, w), edges (t, b, l, r), same)
    ("pool: MAX pad_t: 1 pad_b: 0 pad_l: 0 pad_r: 2 stride_h: 2 stride_w: 1", (3, 2), (2, 1), (1, 0, 0, 2), False),
    ("pool: AVE pad_t: 0 pad_b: 2 pad_l: 1 pad_r: 0 stride_h: 2 stride_w: 3", (3, 3), (2, 3), (0, 2, 1, 0), False),
    ("pool: AVE_EXC_PAD pad_t: 2 pad_l: 1 pad_r: 1", (3, 2), (1, 1), (2, 0, 1, 1), False),
    ("pool: MAX pad_type: 1 stride: 2", (2, 3), (2, 2), None, True),
    ("pool: AVE pad_type: 1 stride_h: 3 stride_w: 2", (3, 2), (3, 2), None, True),
    ("pool: AVE_TF pad_type: 1 stride: 2", (3, 3), (2, 2), None, True),
    ("pool: AVE_EXC_PAD pad_h: 1 pad_w: 2 stride: 2", (3, 3), (2, 2), (1, 1, 2, 2), False),
    ("pool: MAX pad_b: 1 pad_r: 1 round_mode: FLOOR stride: 2", (2, 2), (2, 2), (0, 1, 0, 1), False),
    ("pool: AVE pad_t: 1 pad_r: 1 stride: 3", (2, 2), (3, 3), (1, 0, 0, 1), False),
]


@pytest.mark.parametrize("param, kernel, stride, edges, same", POOL_CASES)
def test_pooling_fork_edge_pads(param, kernel, stride, edges, same, tmp_path):
    text = inputs_text(x=SHAPE) + (
        f'layer {{ name: "p" type: "Pooling" bottom: "x" top: "o" pooling_param {{ '
        f'kernel_h: {kernel[0]} kernel_w: {kernel[1]} {param} }} }}')
    model = load_from_text(text)
    x = rng(11).standard_normal(SHAPE).astype(np.float32)
    pool = re.search(r"pool: (\w+)", param).group(1).replace("AVE_TF", "AVE_EXC_PAD")
    ref = fork_pool_ref(x.astype(np.float64), pool, kernel, stride, edges, same, "FLOOR" not in param)
    outs = backend_outputs(model, {"x": x}, tmp_path)
    for name, out in outs.items():
        assert out.shape == ref.shape, name
        assert_close(out, ref, 1e-5, 1e-5, name)


def test_pooling_exc_pad_differs_from_ave():
    x = rng(12).standard_normal(SHAPE).astype(np.float32)
    outs = []
    for pool in ("AVE", "AVE_EXC_PAD"):
        text = inputs_text(x=SHAPE) + (
            f'layer {{ name: "p" type: "Pooling" bottom: "x" top: "o" pooling_param {{ '
            f'kernel_size: 3 pad: 1 pool: {pool} }} }}')
        outs.append(load_from_text(text).run({"x": x})["o"])
    assert np.abs(outs[0] - outs[1]).max() > 0.05
    assert np.array_equal(outs[0][:, :, 1:-1, 1:-1], outs[1][:, :, 1:-1, 1:-1])


def test_pooling_default_geometry_unchanged():
    text = inputs_text(x=SHAPE) + (
        'layer { name: "p" type: "Pooling" bottom: "x" top: "o" pooling_param { kernel_size: 3 pad: 1 '
        'stride: 2 pool: AVE } }')
    model = load_from_text(text)
    assert model.graph.node("p").attrs["edge"] is None


@pytest.mark.parametrize("param, msg", [
    ("pad: 1 pad_l: 1", "not both"), ("pad_type: 1 pad_t: 1", "not both"), ("pad_type: 2", "pad_type"),
    ("pool: STOCHASTIC pad_l: 1", "STOCHASTIC"), ("global_pooling: true pad_type: 1", "global")])
def test_pooling_fork_edge_pads_bad(param, msg):
    kernel = "" if "global" in param else "kernel_size: 2 "
    text = inputs_text(x=SHAPE) + (
        f'layer {{ name: "p" type: "Pooling" bottom: "x" top: "o" pooling_param {{ {kernel}{param} }} }}')
    with pytest.raises(CaffeqError, match=msg):
        load_from_text(text)


def relu_ref(x, slope, relu6, maximum, minimum):
    """relu_layer.cpp (synopsys-caffe): the slope, then relu6, maximum > 0 and minimum != 0 in order."""
    y = np.maximum(x, 0) + np.float32(slope) * np.minimum(x, 0)
    if relu6:
        y = np.minimum(y, np.float32(6))
    if maximum > 0:
        y = np.minimum(y, np.float32(maximum))
    if minimum != 0:
        y = np.maximum(y, np.float32(minimum))
    return y.astype(np.float32)


@pytest.mark.parametrize("param, slope, relu6, maximum, minimum", [
    ("relu6: true", 0, True, 0, 0),
    ("negative_slope: 0.1 relu6: true", 0.1, True, 0, 0),
    ("maximum: 2.5", 0, False, 2.5, 0),
    ("relu6: true maximum: 8 minimum: -0.2 negative_slope: 0.3", 0.3, True, 8, -0.2),
    ("", 0, False, 0, 0),
])
def test_relu_bounds_match_the_fork(param, slope, relu6, maximum, minimum, tmp_path):
    text = inputs_text(x=(2, 3, 4, 5)) + f'layer {{ name: "o" type: "ReLU" bottom: "x" top: "o" relu_param {{ {param} }} }}'
    model = load_from_text(text)
    x = (rng(7).standard_normal((2, 3, 4, 5)) * 6).astype(np.float32)
    ref = relu_ref(x, slope, relu6, maximum, minimum)
    for backend, got in backend_outputs(model, {"x": x}, tmp_path).items():
        assert_close(got, ref, 0, 0, backend)
    # the fast module must not fuse a bounded ReLU into the convolution before it
    conv = inputs_text(x=(2, 3, 4, 5)) + ('layer { name: "c" type: "Convolution" bottom: "x" top: "c" '
                                          'convolution_param { num_output: 4 kernel_size: 1 } }\n'
                                          f'layer {{ name: "o" type: "ReLU" bottom: "c" top: "r" relu_param {{ {param} }} }}')
    m = load_from_text(conv, random_weights=True)
    pre = m.run({"x": x}, exact=True, all_blobs=True)["c"]
    assert_close(m.run({"x": x})["r"], relu_ref(pre, slope, relu6, maximum, minimum), 1e-5, 1e-5, "optimized")


# ---- Reshape pixelshuffler (reshape_layer.cpp Forward_cpu) -------------------------------------

def pixel_shuffle_ref(x, r):
    """The fork's loop: bottom (n, c, h, w) goes to top (n, c // r^2, h*r + (c // r) % r, w*r + c % r)."""
    n, c, h, w = x.shape
    y = np.zeros((n, c // (r * r), h * r, w * r), x.dtype)
    for ci in range(c):
        for hi in range(h):
            for wi in range(w):
                y[:, ci // (r * r), hi * r + (ci // r) % r, wi * r + ci % r] = x[:, ci, hi, wi]
    return y


@pytest.mark.parametrize("r, shape", [(2, (2, 12, 3, 5)), (3, (3, 18, 4, 2))])
def test_reshape_pixelshuffler(r, shape, tmp_path):
    text = inputs_text(x=shape) + (
        f'layer {{ name: "ps" type: "Reshape" bottom: "x" top: "o" reshape_param {{ pixelshuffler: {r} }} }}')
    model = load_from_text(text)
    x = rng(13).standard_normal(shape).astype(np.float32)
    ref = pixel_shuffle_ref(x, r)
    for name, out in backend_outputs(model, {"x": x}, tmp_path).items():
        assert out.shape == ref.shape, name
        assert np.array_equal(out, ref), name


@pytest.mark.parametrize("param, shape, msg", [
    ("pixelshuffler: 0", (2, 12, 3, 5), "pixelshuffler"), ("pixelshuffler: 2", (2, 6, 3, 5), "multiple of 4"),
    ("pixelshuffler: 2", (2, 12, 15), "4-axis")])
def test_reshape_pixelshuffler_bad(param, shape, msg):
    text = inputs_text(x=shape) + (
        f'layer {{ name: "ps" type: "Reshape" bottom: "x" top: "o" reshape_param {{ {param} }} }}')
    with pytest.raises(CaffeqError, match=msg):
        load_from_text(text)


# ---- PriorBox tf / yx_order (prior_box_layer.cpp Forward_cpu) -----------------------------------

def fork_prior_ref(feat_hw, img_hw, min_size, max_size, ratios, tf, yx, variance):
    """The fork's loops: per cell the min box (inset 0.05 when tf and min_size is 60), the
    sqrt(min*max) box before (not tf) or after (tf) the flipped aspect-ratio boxes."""
    lh, lw = feat_hw
    ih, iw = img_hw
    sh, sw = np.float32(ih) / np.float32(lh), np.float32(iw) / np.float32(lw)
    ars = [1.0]
    for ar in ratios:
        ars += [ar, 1.0 / np.float32(ar)]
    coords = []
    for h in range(lh):
        for w in range(lw):
            cx, cy = float((np.float32(w) + np.float32(0.5)) * sw), float((np.float32(h) + np.float32(0.5)) * sh)
            boxes = [(float(min_size), float(min_size), 0.05 if tf and min_size == 60 else 0.0)]
            big = float(np.float32(np.sqrt(min_size * max_size))) if max_size else None
            if big and not tf:
                boxes.append((big, big, 0.0))
            for ar in ars[1:]:
                r = np.sqrt(float(np.float32(ar)))
                boxes.append((float(np.float32(min_size * r)), float(np.float32(min_size / r)), 0.0))
            if big and tf:
                boxes.append((big, big, 0.0))
            for bw, bh, d in boxes:
                x0, y0 = (cx - bw / 2) / iw + d, (cy - bh / 2) / ih + d
                x1, y1 = (cx + bw / 2) / iw - d, (cy + bh / 2) / ih - d
                coords += [y0, x0, y1, x1] if yx else [x0, y0, x1, y1]
    coords = np.asarray(coords, np.float32)
    return np.stack([coords, np.tile(np.asarray(variance, np.float32), len(coords) // 4)])[None]


@pytest.mark.parametrize("min_size, max_size, tf, yx", [
    (60, 0, True, True), (60, 90, True, False), (45, 70, True, True), (60, 90, False, True), (45, 70, False, False)])
def test_priorbox_tf_yx_order(min_size, max_size, tf, yx, tmp_path):
    variance = [0.1, 0.1, 0.2, 0.2]
    extra = f"max_size: {max_size} " if max_size else ""
    text = inputs_text(f=(2, 3, 3, 5), img=(2, 3, 70, 110)) + (
        f'layer {{ name: "pb" type: "PriorBox" bottom: "f" bottom: "img" top: "o" prior_box_param {{ '
        f'min_size: {min_size} {extra}aspect_ratio: 2 aspect_ratio: 3 flip: true clip: false '
        f'tf: {str(tf).lower()} yx_order: {str(yx).lower()} '
        + " ".join(f"variance: {v}" for v in variance) + ' } }')
    model = load_from_text(text)
    ref = fork_prior_ref((3, 5), (70, 110), min_size, max_size, [2.0, 3.0], tf, yx, variance)
    feeds = {"f": rng(14).standard_normal((2, 3, 3, 5)).astype(np.float32),
             "img": rng(15).standard_normal((2, 3, 70, 110)).astype(np.float32)}
    for name, out in backend_outputs(model, feeds, tmp_path).items():
        assert out.shape == ref.shape, name
        assert_close(out, ref, 0, 1e-6, name)


def test_priorbox_tf_with_denser_refused():
    text = inputs_text(f=(1, 3, 3, 5), img=(1, 3, 70, 110)) + (
        'layer { name: "pb" type: "PriorBox" bottom: "f" bottom: "img" top: "o" prior_box_param { '
        'min_size: 30 tf: true denser_prior_boxes: true } }')
    with pytest.raises(CaffeqError, match="tf"):
        load_from_text(text)


# ---- ResizeBilinear (resize_bilinear_layer.cpp 90349ee) ----------------------------------------

def resize_weights_ref(n_in, n_out, mode):
    """compute_interpolation_weights, in float32 as the fork: [(lower, upper, lerp)] per output index."""
    f = np.float32
    if mode == "align_corners" and n_out > 1:
        scale = f(n_in - 1) / f(n_out - 1)
    else:
        scale = f(n_in) / f(n_out)
    taps = []
    for i in range(n_out):
        if mode in ("align_corners", "asymmetric"):
            src = f(i) * scale
        elif mode == "pytorch_half_pixel" and n_out == 1:
            src = f(-0.5)
        else:
            src = (f(i) + f(0.5)) * scale - f(0.5)
        lo = np.floor(src)
        taps.append((max(int(lo), 0), min(int(np.ceil(src)), n_in - 1), f(src - lo)))
    return taps


def resize_bilinear_ref(x, ho, wo, mode, nhwc=False, quant=False, sat=None):
    """The fork's NCHW / NHWC loops: top + (bottom - top) * y_lerp of top = tl + (tr - tl) * x_lerp."""
    xc = x.transpose(0, 3, 1, 2) if nhwc else x
    n, c, h, w = xc.shape
    ys, xs = resize_weights_ref(h, ho, mode), resize_weights_ref(w, wo, mode)
    out = np.empty((n, c, ho, wo), np.float32)
    for i, (y0, y1, ly) in enumerate(ys):
        for j, (x0, x1, lx) in enumerate(xs):
            top = xc[:, :, y0, x0] + (xc[:, :, y0, x1] - xc[:, :, y0, x0]) * lx
            bottom = xc[:, :, y1, x0] + (xc[:, :, y1, x1] - xc[:, :, y1, x0]) * lx
            v = top + (bottom - top) * ly
            if quant:  # std::round: half away from zero
                v = np.sign(v) * np.floor(np.abs(v) + 0.5)
            out[:, :, i, j] = v
    if sat is not None:
        out = np.clip(out, *sat)
    return out.transpose(0, 2, 3, 1) if nhwc else out


def resize_model(shape, param):
    return load_from_text(inputs_text(x=shape) + (
        f'layer {{ name: "rs" type: "ResizeBilinear" bottom: "x" top: "o" resize_bilinear_param {{ {param} }} }}'))


RESIZE_FLAGS = {"asymmetric": "", "align_corners": "align_corners: true",
                "half_pixel": "half_pixel_centers: true", "pytorch_half_pixel": "pytorch_half_pixel: true"}


@pytest.mark.parametrize("mode", list(RESIZE_FLAGS))
@pytest.mark.parametrize("fmt, size, hw", [
    ("NCHW", "output_height: 8 output_width: 4", (8, 4)),       # up in H, down in W
    ("NHWC", "output_height: 3 output_width: 11", (3, 11)),     # the fork's default layout
    ("NCHW", "scale_height: 1.5 scale_width: 0.3", (7, 2)),     # floor(5 * 1.5), floor(7 * 0.3)
    ("NCHW", "output_height: 1 scale_width: 2.0", (1, 14)),     # one axis set, the other scaled
])
def test_resize_bilinear_matches_the_fork(mode, fmt, size, hw, tmp_path):
    shape = SHAPE if fmt == "NCHW" else (2, 5, 7, 3)   # N, H, W, C
    model = resize_model(shape, f'{RESIZE_FLAGS[mode]} {size} data_format: "{fmt}"')
    x = rng(11).standard_normal(shape).astype(np.float32)
    ref = resize_bilinear_ref(x, *hw, mode, nhwc=fmt == "NHWC")
    expect = (2, 3) + hw if fmt == "NCHW" else (2,) + hw + (3,)
    assert model.graph.shape("o") == expect
    for name, out in backend_outputs(model, {"x": x}, tmp_path).items():
        assert out.shape == expect, name
        assert_close(out, ref, 1e-5, 1e-5, f"{mode} {name}")


def test_resize_bilinear_default_layout_is_nhwc():
    assert resize_model((1, 4, 6, 3), "output_height: 8 output_width: 9").graph.shape("o") == (1, 8, 9, 3)


def test_resize_bilinear_quantized_output_rounds_then_saturates(tmp_path):
    param = 'output_height: 9 output_width: 4 data_format: "NCHW" output_zero_point: 3 saturate: Signed_8bit'
    model = resize_model(SHAPE, param)
    x = (rng(12).standard_normal(SHAPE) * 90).astype(np.float32)
    ref = resize_bilinear_ref(x, 9, 4, "asymmetric", quant=True, sat=(-128, 127))
    assert ref.max() == 127 and ref.min() == -128
    for name, out in backend_outputs(model, {"x": x}, tmp_path).items():
        assert_close(out, ref, 0, 0, name)


@pytest.mark.parametrize("param, msg", [
    ('data_format: "NCHWD" output_height: 2 output_width: 2', "3-D"),
    ("align_corners: true half_pixel_centers: true output_height: 2", "exclude each other"),
    ("output_height: 0 output_width: 3", "output_height must be positive"),
    ('data_format: "NCHW" scale_height: 0.1 output_width: 3', "must be positive"),
])
def test_resize_bilinear_bad(param, msg):
    with pytest.raises(CaffeqError, match=msg):
        resize_model(SHAPE, param)
