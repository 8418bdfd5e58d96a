"""Layers of optical_flow.py, each as its fork computes it: lmb-freiburg/flownet2 correlation_layer.cu,
correlation_layer1d.cu, channel_norm_layer.cu, downsample_layer.cu (and the augmentation layers' Reshape),
NVlabs/PWC-Net Caffe/warping_code/warp_layer.cu, twhui/LiteFlowNet warp_layer.cu, grid_layer.cpp,
negsquare_layer.cu and expmax_layer.cu.

References are numpy loops written here over the forks' own indexing (float64 sums of float32 inputs);
each running layer is checked in torch, onnxruntime and the generated model.py.  No fork file is a
fixture (FlowNet 2, PWC-Net and LiteFlowNet are licensed for non-commercial use only): the nets below are
written here with the same layers.
"""
import math

import numpy as np
import pytest
from conftest import assert_close, check_everywhere, model_py_outputs, net, node_of, onnx_outputs, rng

from caffeq.errors import CaffeqError, ExportError
from caffeq.layers import LayerError
from caffeq.model import load_from_text


def check_backends(model, feeds, tmp_path, refs, atol=1e-5, rtol=1e-5):
    check_everywhere(model, feeds, refs, tmp_path, atol, rtol)


# ---- Correlation ---------------------------------------------------------------------------

def correlation_ref(a, b, pad, k, md, s1, s2, subtract=False):
    """correlation_layer.cu: zero-padded bottoms; CorrelateData (MULTIPLY) and CorrelateDataSubtract."""
    n_, c_, h, w = a.shape
    pa = np.zeros((n_, c_, h + 2 * pad, w + 2 * pad))
    pb = np.zeros_like(pa)
    pa[:, :, pad:pad + h, pad:pad + w] = a
    pb[:, :, pad:pad + h, pad:pad + w] = b
    r = (k - 1) // 2
    border = md + r
    tw = math.ceil((w + 2 * pad - 2 * border) / s1)
    th = math.ceil((h + 2 * pad - 2 * border) / s1)
    g = md // s2
    gw = 2 * g + 1
    out = np.zeros((n_, gw * gw, th, tw))
    for item in range(n_):
        for tc in range(gw * gw):
            s2o = (tc % gw - g) * s2
            s2p = (tc // gw - g) * s2
            for y in range(th):
                for x in range(tw):
                    total = 0.0
                    if subtract:      # kernel centre, j and i over -r..r
                        x1, y1 = x * s1 + r + md, y * s1 + r + md
                        for j in range(-r, r + 1):
                            for i in range(-r, r + 1):
                                for ch in range(c_):
                                    total += abs(pa[item, ch, y1 + j, x1 + i] - pb[item, ch, y1 + s2p + j, x1 + s2o + i])
                    else:             # kernel upper-left corner, j and i over 0..k-1
                        x1, y1 = x * s1 + md, y * s1 + md
                        for j in range(k):
                            for i in range(k):
                                for ch in range(c_):
                                    total += pa[item, ch, y1 + j, x1 + i] * pb[item, ch, y1 + s2p + j, x1 + s2o + i]
                    out[item, tc, y, x] = total / (k * k * c_)
    return out


def correlation1d_ref(a, b, pad, k, md, s1, s2, direction=0):
    """correlation_layer1d.cu CorrelateData: padding along W only, displacements along x only."""
    n_, c_, h, w = a.shape
    pa = np.zeros((n_, c_, h, w + 2 * pad))
    pb = np.zeros_like(pa)
    pa[:, :, :, pad:pad + w] = a
    pb[:, :, :, pad:pad + w] = b
    r = (k - 1) // 2
    tw = math.ceil((w + 2 * pad - 2 * (md + r)) / s1)
    th = math.ceil((h - 2 * r) / s1)
    g = md // s2
    gw = g + 1 if direction else 2 * g + 1
    x_shift = {0: -g, 1: 0, -1: -gw}[direction]
    out = np.zeros((n_, gw, th, tw))
    for item in range(n_):
        for tc in range(gw):
            s2o = (tc % gw + x_shift) * s2
            for y in range(th):
                for x in range(tw):
                    x1, y1 = x * s1 + md, y * s1
                    total = 0.0
                    for j in range(k):
                        for i in range(k):
                            for ch in range(c_):
                                total += pa[item, ch, y1 + j, x1 + i] * pb[item, ch, y1 + j, x1 + s2o + i]
                    out[item, tc, y, x] = total / (k * k * c_)
    return out


def corr_net(kind, shape, **fields):
    body = " ".join(f"{k}: {v}" for k, v in fields.items())
    return load_from_text(net(f'layer {{ name: "corr" type: "{kind}" bottom: "a" bottom: "b" top: "o" '
                              f'correlation_param {{ {body} }} }}', inputs={"a": shape, "b": shape}))


def pair(shape, seed):
    g = rng(seed)
    return g.standard_normal(shape).astype(np.float32), g.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("pad, k, md, s1, s2", [(2, 3, 2, 2, 1), (3, 1, 3, 1, 2), (0, 3, 1, 1, 1), (1, 1, 4, 3, 2)])
def test_correlation_multiply_follows_the_kernels_indexing(tmp_path, pad, k, md, s1, s2):
    shape = (2, 3, 7, 9)
    a, b = pair(shape, pad + 10 * k + 100 * md)
    model = corr_net("Correlation", shape, pad=pad, kernel_size=k, max_displacement=md, stride_1=s1, stride_2=s2)
    ref = correlation_ref(a, b, pad, k, md, s1, s2)
    assert model.graph.tensors["o"].shape == ref.shape
    check_backends(model, {"a": a, "b": b}, tmp_path, {"o": ref})


def test_correlation_subtract(tmp_path):
    shape = (2, 2, 8, 5)
    a, b = pair(shape, 3)
    model = corr_net("Correlation", shape, pad=2, kernel_size=3, max_displacement=2, stride_1=1, stride_2=2,
                     correlation_type="SUBTRACT")
    check_backends(model, {"a": a, "b": b}, tmp_path, {"o": correlation_ref(a, b, 2, 3, 2, 1, 2, subtract=True)})


def test_correlation_pwc_net_sizes():
    # PWC-Net / LiteFlowNet: pad 4, kernel 1, max_displacement 4 -> 81 channels at the bottom's size
    model = corr_net("Correlation", (1, 196, 5, 7), pad=4, kernel_size=1, max_displacement=4)
    assert model.graph.tensors["o"].shape == (1, 81, 5, 7)
    # FlowNetC: pad 20, kernel 1, max_displacement 20, stride_2 2 -> 21 x 21 displacements
    model = corr_net("Correlation", (1, 256, 48, 64), pad=20, kernel_size=1, max_displacement=20, stride_2=2)
    assert model.graph.tensors["o"].shape == (1, 441, 48, 64)


@pytest.mark.parametrize("direction", [0, 1])
def test_correlation1d(tmp_path, direction):
    shape = (2, 3, 6, 11)
    a, b = pair(shape, 20 + direction)
    model = corr_net("Correlation1D", shape, pad=3, kernel_size=3, max_displacement=3, stride_1=2, stride_2=1,
                     single_direction=direction)
    ref = correlation1d_ref(a, b, 3, 3, 3, 2, 1, direction)
    assert model.graph.tensors["o"].shape == ref.shape
    check_backends(model, {"a": a, "b": b}, tmp_path, {"o": ref})


def test_correlation1d_to_the_left_is_sized_but_not_run(tmp_path):
    shape = (1, 2, 5, 9)
    model = corr_net("Correlation1D", shape, pad=2, kernel_size=1, max_displacement=2, single_direction=-1)
    assert model.graph.tensors["o"].shape == (1, 3, 5, 9)
    with pytest.raises(CaffeqError, match="single_direction -1"):
        model.run({"a": np.zeros(shape, np.float32), "b": np.zeros(shape, np.float32)})
    with pytest.raises(ExportError, match="single_direction -1"):
        model.export_onnx(str(tmp_path / "m.onnx"))


@pytest.mark.parametrize("fields, msg", [(dict(kernel_size=2, max_displacement=1), "odd"),
                                         (dict(kernel_size=1), "max_displacement"),
                                         (dict(kernel_size=1, max_displacement=5), "do not fit"),
                                         (dict(kernel_size=1, max_displacement=1, stride_2=0), "stride")])
def test_correlation_refuses_what_the_fork_checks(fields, msg):
    with pytest.raises(LayerError, match=msg):
        corr_net("Correlation", (1, 2, 4, 6), **fields)


# ---- ChannelNorm ---------------------------------------------------------------------------

def test_channel_norm(tmp_path):
    x = rng(4).standard_normal((2, 3, 5, 7)).astype(np.float32)
    model = load_from_text(net('layer { name: "n" type: "ChannelNorm" bottom: "x" top: "o" }', inputs={"x": x.shape}))
    ref = np.zeros((2, 1, 5, 7))
    for n in range(2):
        for y in range(5):
            for xx in range(7):
                ref[n, 0, y, xx] = math.sqrt(sum(float(x[n, c, y, xx]) ** 2 for c in range(3)))
    check_backends(model, {"x": x}, tmp_path, {"o": ref})


@pytest.mark.parametrize("writer", ["FLOWriter", "FloatWriter", "ImgWriter", "PFMWriter"])
def test_a_writer_saves_nothing_and_adds_no_output(tmp_path, writer):
    # PWC-Net's test nets end in FLOWriter { folder: "./tmp" ... }: the flow stays the output
    x = rng(5).standard_normal((2, 3, 5, 7)).astype(np.float32)
    model = load_from_text(net('layer { name: "n" type: "ChannelNorm" bottom: "x" top: "o" }\n'
                               f'layer {{ name: "w" type: "{writer}" bottom: "o" writer_param {{ folder: '
                               f'"{tmp_path}/out" prefix: "flow-" suffix: "" scale: 1.0 }} }}', inputs={"x": x.shape}))
    assert model.outputs == ["o"]
    ref = np.sqrt((x.astype(np.float64) ** 2).sum(axis=1, keepdims=True))
    check_backends(model, {"x": x}, tmp_path, {"o": ref})
    assert not (tmp_path / "out").exists()


# ---- Downsample ----------------------------------------------------------------------------

def downsample_ref(x, th, tw):
    """downsample_layer.cu DownsampleFeatures, positions and weights in float32 as the kernel."""
    n_, c_, bh, bw = x.shape
    if (bh, bw) == (th, tw):
        return x.astype(np.float64)
    f = np.float32
    ws, hs = f(bw - 1) / f(tw - 1), f(bh - 1) / f(th - 1)
    wr, hr = math.ceil(ws), math.ceil(hs)
    out = np.zeros((n_, c_, th, tw))
    for n in range(n_):
        for c in range(c_):
            for dy in range(th):
                for dx in range(tw):
                    bx = f(dx) / f(tw - 1) * f(bw - 1)
                    by = f(dy) / f(th - 1) * f(bh - 1)
                    ibx, iby = math.floor(bx + 0.5), math.floor(by + 0.5)   # round(), halves up (>= 0)
                    value = weight = nan = 0.0
                    for yo in range(-hr, hr + 1):
                        for xo in range(-wr, wr + 1):
                            sx, sy = ibx + xo, iby + yo
                            if 0 <= sx < bw and 0 <= sy < bh:
                                wgt = (max(0.0, 1 - abs(float(f(sx) - bx)) / float(ws))
                                       * max(0.0, 1 - abs(float(f(sy) - by)) / float(hs)))
                                sample = float(x[n, c, sy, sx])
                                if math.isnan(sample):
                                    nan += wgt
                                    continue
                                value += sample * wgt
                                weight += wgt
                    out[n, c, dy, dx] = np.nan if (nan / weight if weight else np.inf) > 0.5 else value / weight
    return out


def check_nan_aware(model, feeds, ref, tmp_path):
    outs = {"torch": model.run(feeds)["o"], "onnx": onnx_outputs(model, feeds, tmp_path)["o"],
            "model.py": model_py_outputs(model, feeds, tmp_path)["o"]}
    for backend, got in outs.items():
        assert np.array_equal(np.isnan(got), np.isnan(ref)), backend
        assert_close(np.nan_to_num(got), np.nan_to_num(ref), 1e-5, 1e-5, backend)


@pytest.mark.parametrize("src, dst", [((9, 13), (4, 5)), ((8, 5), (3, 4)), ((4, 5), (6, 8)), ((6, 7), (6, 3)),
                                      ((4, 3), (7, 9))])
def test_downsample_to_a_second_bottoms_size(tmp_path, src, dst):
    x = rng(sum(src)).standard_normal((2, 3) + src).astype(np.float32)
    model = load_from_text(net('layer { name: "d" type: "Downsample" bottom: "x" bottom: "like" top: "o" }',
                               inputs={"x": x.shape, "like": (2, 1) + dst}))
    feeds = {"x": x, "like": np.zeros((2, 1) + dst, np.float32)}
    ref = downsample_ref(x, *dst)
    # upsampling 3 -> 9 columns (scale 0.25): some top pixels get no weight, 0 / 0 = NaN in the fork too
    assert np.isnan(ref).any() == (src == (4, 3))
    check_nan_aware(model, feeds, ref, tmp_path)


def test_downsample_nan_samples(tmp_path):
    x = rng(5).standard_normal((1, 2, 9, 11)).astype(np.float32)
    x[0, 0, :3, :4] = np.nan
    x[0, 1, 4, 5] = np.nan
    model = load_from_text(net('layer { name: "d" type: "Downsample" bottom: "x" top: "o" '
                               'downsample_param { top_height: 4 top_width: 5 } }', inputs={"x": x.shape}))
    ref = downsample_ref(x, 4, 5)
    assert np.isnan(ref).any() and not np.isnan(ref).all()
    check_nan_aware(model, {"x": x}, ref, tmp_path)


def test_downsample_to_the_same_size_is_the_bottom(tmp_path):
    x = rng(6).standard_normal((1, 2, 4, 6)).astype(np.float32)
    model = load_from_text(net('layer { name: "d" type: "Downsample" bottom: "x" top: "o" '
                               'downsample_param { top_height: 4 top_width: 6 } }', inputs={"x": x.shape}))
    check_backends(model, {"x": x}, tmp_path, {"o": x})


@pytest.mark.parametrize("param, msg", [("", "> 0"), ("top_height: 1 top_width: 3", "divides by")])
def test_downsample_refuses_sizes_the_fork_cannot_compute(param, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net(f'layer {{ name: "d" type: "Downsample" bottom: "x" top: "o" downsample_param {{ {param} }} }}',
                           inputs={"x": (1, 1, 5, 5)}))


# ---- Warp (PWC-Net) -------------------------------------------------------------------------

def pwc_warp_ref(image, flow):
    """PWC-Net warp_layer.cu WarpForwardGPU: in [0, W-1] x [0, H-1], floor / ceil neighbours, else 0."""
    n_, c_, h, w = image.shape
    out = np.zeros(image.shape)
    for n in range(n_):
        for c in range(c_):
            for s in range(h):
                for t in range(w):
                    x = np.float32(t) + flow[n, 0, s, t]
                    y = np.float32(s) + flow[n, 1, s, t]
                    if not (x >= 0 and x <= w - 1 and y >= 0 and y <= h - 1):
                        continue
                    fx, fy, cx, cy = math.floor(x), math.floor(y), math.ceil(x), math.ceil(y)
                    ax, ay = float(x - fx), float(y - fy)
                    out[n, c, s, t] = ((1 - ax) * (1 - ay) * image[n, c, fy, fx] + ax * (1 - ay) * image[n, c, fy, cx]
                                       + (1 - ax) * ay * image[n, c, cy, fx] + ax * ay * image[n, c, cy, cx])
    return out


def warp_inputs(seed, h=5, w=7):
    g = rng(seed)
    image = g.standard_normal((2, 3, h, w)).astype(np.float32)
    flow = g.uniform(-3, 3, (2, 2, h, w)).astype(np.float32)
    flow[0, 0, 0, :4] = [0.0, 5.0, 5.5, 6.0]      # on, past, and exactly at the last column
    flow[0, 1, 1, :3] = [3.0, 3.25, 2.0]          # the last row exactly, past it, an integer row
    flow[1, :, 2, 2] = [-2.0, -2.0]               # exactly the corner (0, 0)
    flow[1, :, 3, 3] = [-3.5, 0.0]                # half a pixel left of the image
    return image, flow


def test_pwc_warp_samples_inside_the_last_pixel_centres(tmp_path):
    image, flow = warp_inputs(7)
    model = load_from_text(net('layer { name: "w" type: "Warp" bottom: "img" bottom: "flow" top: "o" }',
                               inputs={"img": image.shape, "flow": flow.shape}))
    assert node_of(model, "w").attrs["coords"] is False
    ref = pwc_warp_ref(image, flow)
    assert 0 < np.count_nonzero(ref == 0) < ref.size
    check_backends(model, {"img": image, "flow": flow}, tmp_path, {"o": ref})


def test_warp_checks_the_second_bottom():
    with pytest.raises(LayerError, match="flow must be"):
        load_from_text(net('layer { name: "w" type: "Warp" bottom: "img" bottom: "flow" top: "o" }',
                           inputs={"img": (1, 3, 5, 7), "flow": (1, 2, 5, 6)}))


# ---- Warp (LiteFlowNet), Grid ----------------------------------------------------------------

def coords_warp_ref(image, coords):
    """LiteFlowNet warp_layer.cpp Forward_cpu: four neighbours, each 0 outside the image."""
    n_, c_, h, w = image.shape
    out = np.zeros(image.shape)

    def value(n, c, x, y):
        return 0.0 if (x < 0 or x > w - 1 or y < 0 or y > h - 1) else float(image[n, c, y, x])

    for n in range(n_):
        for hh in range(h):
            for ww in range(w):
                x, y = coords[n, 0, hh, ww], coords[n, 1, hh, ww]
                x0, y0 = math.floor(x), math.floor(y)
                wx, wy = float(x - x0), float(y - y0)
                for c in range(c_):
                    out[n, c, hh, ww] = ((1 - wx) * (1 - wy) * value(n, c, x0, y0) + (1 - wx) * wy * value(n, c, x0, y0 + 1)
                                         + wx * (1 - wy) * value(n, c, x0 + 1, y0) + wx * wy * value(n, c, x0 + 1, y0 + 1))
    return out


LITEFLOWNET_WARP = """
layer { name: "grid" type: "Grid" bottom: "flow" top: "gxy" }
layer { name: "coords" type: "Eltwise" bottom: "flow" bottom: "gxy" top: "coords" eltwise_param { coeff: 1 coeff: 1 } }
layer { name: "w" type: "Warp" bottom: "img" bottom: "coords" top: "o" }
"""


def test_liteflownet_warp_reads_grid_coordinates(tmp_path):
    image, flow = warp_inputs(8, h=6, w=5)
    model = load_from_text(net(LITEFLOWNET_WARP, inputs={"img": image.shape, "flow": flow.shape}))
    assert node_of(model, "w").attrs["coords"] is True
    gy, gx = np.meshgrid(np.arange(6, dtype=np.float32), np.arange(5, dtype=np.float32), indexing="ij")
    coords = flow + np.stack([gx, gy])[None]
    ref = coords_warp_ref(image, coords)
    check_backends(model, {"img": image, "flow": flow}, tmp_path, {"o": ref})


def test_grid_holds_x_then_y(tmp_path):
    x = np.zeros((3, 4, 5, 7), np.float32)
    model = load_from_text(net('layer { name: "g" type: "Grid" bottom: "x" top: "o" }', inputs={"x": x.shape}))
    ref = np.zeros((3, 2, 5, 7))
    for n in range(3):
        for h in range(5):
            for w in range(7):
                ref[n, 0, h, w], ref[n, 1, h, w] = w, h
    check_backends(model, {"x": x}, tmp_path, {"o": ref})


def test_warp_absolute_coords_can_be_written(tmp_path):
    image, _ = warp_inputs(9)
    coords = rng(9).uniform(-1.5, 8, (2, 2, 5, 7)).astype(np.float32)
    coords[0, :, 0, 0] = [6.0, 4.0]    # exactly the last pixel
    coords[0, :, 0, 1] = [-1.0, -1.0]  # exactly one pixel outside
    model = load_from_text(net('layer { name: "w" type: "Warp" bottom: "img" bottom: "c" top: "o" '
                               'warp_param { absolute_coords: true } }', inputs={"img": image.shape, "c": coords.shape}))
    check_backends(model, {"img": image, "c": coords}, tmp_path, {"o": coords_warp_ref(image, coords)})


# ---- NegSquare, ExpMax ------------------------------------------------------------------------

def test_neg_square(tmp_path):
    x = rng(10).standard_normal((2, 3, 4, 5)).astype(np.float32)
    model = load_from_text(net('layer { name: "s" type: "NegSquare" bottom: "x" top: "o" }', inputs={"x": x.shape}))
    check_backends(model, {"x": x}, tmp_path, {"o": -(x.astype(np.float64) ** 2)})


def expmax_ref(x, base, scale, shift):
    """expmax_layer.cu: the channel max of item 0 only (outer_num_ = 1); later items subtract the zeros of
    the never-written scale_ buffer; then exp(inner (x - m)) outer."""
    inner = (1.0 if base == -1 else math.log(base)) * scale
    outer = 1.0 if shift == 0 else (base ** shift if base != -1 else math.exp(shift))
    m = np.zeros((x.shape[0], 1) + x.shape[2:])
    m[0] = x[0].max(axis=0)
    return np.exp(inner * (x.astype(np.float64) - m)) * outer


@pytest.mark.parametrize("param, base, scale, shift", [("", -1, 1, 0), ("expmax_param { base: 2 scale: 0.5 shift: 1 }", 2, 0.5, 1),
                                                      ("expmax_param { scale: -0.25 shift: -0.5 }", -1, -0.25, -0.5)])
def test_expmax(tmp_path, param, base, scale, shift):
    x = rng(11).uniform(-3, 3, (3, 4, 3, 5)).astype(np.float32)
    model = load_from_text(net(f'layer {{ name: "e" type: "ExpMax" bottom: "x" top: "o" {param} }}', inputs={"x": x.shape}))
    check_backends(model, {"x": x}, tmp_path, {"o": expmax_ref(x, base, scale, shift)})


# ---- single-bottom Eltwise (flownet2, LiteFlowNet) ---------------------------------------------

def test_single_bottom_eltwise_sum_scales(tmp_path):
    x = rng(12).standard_normal((1, 2, 3, 4)).astype(np.float32)
    model = load_from_text(net('layer { name: "s" type: "Eltwise" bottom: "x" top: "o" '
                               'eltwise_param { operation: SUM coeff: 0.625 } }', inputs={"x": x.shape}))
    check_backends(model, {"x": x}, tmp_path, {"o": x * np.float32(0.625)})
    with pytest.raises(LayerError, match="takes at least 2 bottoms, got 1"):
        load_from_text(net('layer { name: "s" type: "Eltwise" bottom: "x" top: "o" eltwise_param { operation: PROD } }',
                           inputs={"x": x.shape}))


# ---- read-only: augmentation, Resample ---------------------------------------------------------

AUGMENTATION = """
layer { name: "img0_aug" type: "DataAugmentation" bottom: "img0" top: "img0_aug" top: "img0_aug_params"
  augmentation_param { max_multiplier: 1 recompute_mean: 1000 mean_per_pixel: false crop_width: 7 crop_height: 5
    translate { rand_type: "uniform_bernoulli" exp: false mean: 0 spread: 0.4 prob: 1.0 } } }
layer { name: "gen" type: "GenerateAugmentationParameters" bottom: "img0_aug_params" bottom: "img0" bottom: "img0_aug"
  top: "gen" coeff_schedule_param { half_life: 50000 initial_coeff: 0.5 final_coeff: 1 }
  augmentation_param { augment_during_test: false zoom { rand_type: "uniform_bernoulli" exp: true mean: 0.2 spread: 0.4 } } }
layer { name: "img1_aug" type: "DataAugmentation" bottom: "img1" bottom: "gen" top: "img1_aug"
  augmentation_param { crop_width: 7 crop_height: 5 } }
layer { name: "flow_aug" type: "FlowAugmentation" bottom: "flow" bottom: "img0_aug_params" bottom: "gen" top: "flow_aug"
  augmentation_param { crop_width: 7 crop_height: 5 } }
layer { name: "rs" type: "Resample" bottom: "img1_aug" top: "rs" resample_param { width: 4 height: 3 type: LINEAR } }
"""


def test_augmentation_layers_are_sized_as_their_reshape_and_refuse_to_run(tmp_path):
    shapes = {"img0": (2, 3, 8, 9), "img1": (2, 3, 8, 9), "flow": (2, 2, 8, 9)}
    model = load_from_text(net(AUGMENTATION, inputs=shapes), random_weights=True)
    t = model.graph.tensors
    assert t["img0_aug"].shape == (2, 3, 5, 7) and t["img0_aug_params"].shape == (2, 42, 1, 1)
    assert t["gen"].shape == (2, 42, 1, 1) and t["img1_aug"].shape == (2, 3, 5, 7)
    assert t["flow_aug"].shape == (2, 2, 5, 7) and t["rs"].shape == (2, 3, 3, 4)
    # the iteration counter, and with recompute_mean the per-pixel and per-channel means
    assert [tuple(b.shape) for b in node_of(model, "img0_aug").blobs] == [(1, 1, 1, 1), (1, 3, 5, 7), (1, 3, 1, 1)]
    assert [tuple(b.shape) for b in node_of(model, "img1_aug").blobs] == [(1, 1, 1, 1)]
    feeds = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    with pytest.raises(CaffeqError, match="'img0_aug' .DataAugmentation.*random"):
        model.run(feeds)
    with pytest.raises(ExportError, match="DataAugmentation"):
        model.export_onnx(str(tmp_path / "m.onnx"))


def test_data_augmentation_crop_larger_than_the_image():
    with pytest.raises(LayerError, match="larger than"):
        load_from_text(net('layer { name: "a" type: "DataAugmentation" bottom: "x" top: "o" '
                           'augmentation_param { crop_width: 10 crop_height: 2 } }', inputs={"x": (1, 3, 4, 9)}))


def test_resample_refuses_to_run():
    model = load_from_text(net('layer { name: "rs" type: "Resample" bottom: "x" bottom: "like" top: "o" }',
                               inputs={"x": (1, 3, 4, 6), "like": (1, 1, 8, 5)}))
    assert model.graph.tensors["o"].shape == (1, 3, 8, 5)
    with pytest.raises(CaffeqError, match="'rs' .Resample, LINEAR.*not reproduced"):
        model.run({"x": np.zeros((1, 3, 4, 6), np.float32), "like": np.zeros((1, 1, 8, 5), np.float32)})


# ---- a small PWC-Net-like pyramid step ---------------------------------------------------------

PWC_STEP = """
layer { name: "corr" type: "Correlation" bottom: "f0" bottom: "f1" top: "corr"
  correlation_param { pad: 2 kernel_size: 1 max_displacement: 2 stride_1: 1 stride_2: 1 } }
layer { name: "relu" type: "ReLU" bottom: "corr" top: "corr" relu_param { negative_slope: 0.1 } }
layer { name: "flow" type: "Convolution" bottom: "corr" top: "flow" convolution_param { num_output: 2 kernel_size: 3 pad: 1 } }
layer { name: "scale" type: "Eltwise" bottom: "flow" top: "scaled" eltwise_param { operation: SUM coeff: 0.625 } }
layer { name: "warp" type: "Warp" bottom: "f1" bottom: "scaled" top: "warped" }
layer { name: "corr2" type: "Correlation" bottom: "f0" bottom: "warped" top: "corr2"
  correlation_param { pad: 2 kernel_size: 1 max_displacement: 2 } }
layer { name: "norm" type: "ChannelNorm" bottom: "corr2" top: "norm" }
layer { name: "down" type: "Downsample" bottom: "norm" top: "o" downsample_param { top_height: 3 top_width: 4 } }
"""


def test_a_pwc_net_step_runs_everywhere(tmp_path):
    shape = (1, 4, 6, 9)
    a, b = pair(shape, 13)
    model = load_from_text(net(PWC_STEP, inputs={"f0": shape, "f1": shape}), random_weights=True)
    ours = model.run({"f0": a, "f1": b})
    assert ours["o"].shape == (1, 1, 3, 4)
    check_backends(model, {"f0": a, "f1": b}, tmp_path, {"o": ours["o"]}, atol=1e-4, rtol=1e-4)
