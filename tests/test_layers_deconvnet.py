"""piergiaj/caffe-deconvnet's PoolingSwitches, SliceHalf and InvPooling (caffeq/layers/deconvnet.py) against the
fork's CPU loops (pooling_switches_layer.cpp, slice_half_layer.cpp, inv_pooling_layer.cpp at a71d409) written here
in numpy, on asymmetric shapes, in torch, onnxruntime and model.py."""
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.errors import CaffeqError
from caffeq.model import load, load_from_text

F = np.float32
FLT_MAX = np.finfo(F).max
REALWORLD = Path(__file__).parent / "fixtures" / "realworld"


def geometry(shape, kernel, stride, pad, global_pooling=False):
    """The fork's LayerSetUp / Reshape: kernel, stride, pad and the pooled size (float ceil, the pad rule)."""
    h, w = shape[2], shape[3]
    if global_pooling:
        kernel, stride, pad = (h, w), (1, 1), (0, 0)
    out = []
    for size, k, s, p in zip((h, w), kernel, stride, pad):
        out.append(int(math.ceil(F(size + 2 * p - k) / F(s))) + 1)
    if pad[0] or pad[1]:
        for i, size in enumerate((h, w)):
            if (out[i] - 1) * stride[i] >= size + pad[i]:
                out[i] -= 1
    return kernel, stride, pad, out


def ref_pool_switches(x, kernel, stride, pad, pool="MAX", global_pooling=False, mask_top=False):
    """PoolingSwitchesLayer::Forward_cpu with flat pointers as the C++ walks them."""
    n_, c_, h_, w_ = x.shape
    (kh, kw), (sh, sw), (ph_, pw_), (oh, ow) = geometry(x.shape, kernel, stride, pad, global_pooling)
    bottom = x.reshape(-1)
    count = 2 * n_ * c_ * oh * ow
    top = np.zeros(count, F)
    mask = np.full(count, -1, F)
    num_offset = n_ * c_ * oh * ow
    b = t = 0
    if pool == "MAX":
        top[:] = -FLT_MAX
        for _n in range(n_):
            for _c in range(c_):
                for ph in range(oh):
                    for pw in range(ow):
                        hs, ws = ph * sh - ph_, pw * sw - pw_
                        he, we = min(hs + kh, h_), min(ws + kw, w_)
                        hs, ws = max(hs, 0), max(ws, 0)
                        pi = ph * ow + pw
                        for hh in range(hs, he):
                            for ww in range(ws, we):
                                index = hh * w_ + ww
                                if bottom[b + index] > top[t + pi]:
                                    top[t + pi] = bottom[b + index]
                                    top[t + num_offset + pi] = index
                                    mask[t + pi] = mask[t + num_offset + pi] = index
                b += h_ * w_
                t += oh * ow
    else:   # AVE: the channel loop stops at C / 2
        for _n in range(n_):
            for _c in range(c_ // 2):
                for ph in range(oh):
                    for pw in range(ow):
                        hs, ws = ph * sh - ph_, pw * sw - pw_
                        he, we = min(hs + kh, h_ + ph_), min(ws + kw, w_ + pw_)
                        size = (he - hs) * (we - ws)
                        hs, ws, he, we = max(hs, 0), max(ws, 0), min(he, h_), min(we, w_)
                        acc = F(0)
                        for hh in range(hs, he):
                            for ww in range(ws, we):
                                acc = F(acc + bottom[b + hh * w_ + ww])
                        top[t + ph * ow + pw] = F(acc / F(size))
                b += h_ * w_
                t += oh * ow
    shape = (2 * n_, c_, oh, ow)
    return top.reshape(shape), mask.reshape(shape)


def ref_inv_pooling(x, kernel, stride, pad, global_pooling=False):
    """InvPoolingLayer::Forward_cpu: zeros, then top_data[int(switch)] = value plane by plane, in order."""
    n_, c_, h_, w_ = x.shape
    if global_pooling:
        kernel, stride, pad = (h_, w_), (1, 1), (0, 0)
    oh = h_ * stride[0] - stride[0] - 2 * pad[0] + kernel[0]
    ow = w_ * stride[1] - stride[1] - 2 * pad[1] + kernel[1]
    m = n_ // 2
    bottom = x.reshape(-1)
    top = np.zeros(m * c_ * oh * ow, F)
    num_offset = m * c_ * h_ * w_
    b = t = 0
    for _n in range(m):
        for _c in range(c_):
            for index in range(h_ * w_):
                top[t + int(bottom[b + index])] = bottom[b + num_offset + index]
            b += h_ * w_
            t += oh * ow
    return top.reshape(m, c_, oh, ow)


def layer(kind, bottom, tops, params):
    return (f'layer {{ name: "l" type: "{kind}" bottom: "{bottom}" '
            + " ".join(f'top: "{t}"' for t in tops) + f" {params} }}")


def ties_and_holes(shape, seed):
    """Small integers (many ties), a NaN, and a -inf block wide enough to fill a window."""
    x = rng(seed).integers(-2, 3, shape).astype(F)
    x[0, 0, 0, 0] = np.nan
    x[-1, -1, :3, :3] = -np.inf
    return x


@pytest.mark.parametrize("params, geom", [
    ("kernel_size: 3 stride: 2", ((3, 3), (2, 2), (0, 0), False)),
    ("kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 3 pad_h: 1 pad_w: 1", ((3, 2), (2, 3), (1, 1), False)),
    ("kernel_size: 2 stride: 3", ((2, 2), (3, 3), (0, 0), False)),
    ("global_pooling: true", (None, (1, 1), (0, 0), True)),
])
def test_pooling_switches_max_matches_the_forks_loop(params, geom, tmp_path):
    shape = (2, 3, 7, 6)
    x = ties_and_holes(shape, 1)
    kernel, stride, pad, glob = geom
    values_and_switches, mask = ref_pool_switches(x, kernel, stride, pad, "MAX", glob)
    if not glob:
        assert (values_and_switches[3, 2] == -FLT_MAX).any()   # an all -inf window: value and switch -FLT_MAX
    model = load_from_text(net(layer("PoolingSwitches", "x", ["y", "m"], f"pooling_param {{ pool: MAX {params} }}"),
                               inputs={"x": shape}))
    assert model.blob_shapes["y"] == values_and_switches.shape
    check_everywhere(model, {"x": x}, {"y": values_and_switches, "m": mask}, tmp_path)


def test_pooling_switches_max_one_top(tmp_path):
    shape = (3, 2, 9, 8)
    x = rng(2).standard_normal(shape).astype(F)
    ref, _ = ref_pool_switches(x, (3, 3), (2, 2), (0, 0))
    model = load_from_text(net(layer("PoolingSwitches", "x", ["y"], "pooling_param { kernel_size: 3 stride: 2 }"),
                               inputs={"x": shape}))
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path)


@pytest.mark.parametrize("shape, params, geom", [
    ((2, 5, 7, 6), "kernel_size: 3 stride: 2 pad: 1", ((3, 3), (2, 2), (1, 1))),
    ((3, 4, 6, 9), "kernel_h: 2 kernel_w: 3 stride_h: 1 stride_w: 2", ((2, 3), (1, 2), (0, 0))),
])
def test_pooling_switches_ave_averages_only_the_first_half_of_the_planes(shape, params, geom, tmp_path):
    x = rng(3).standard_normal(shape).astype(F)
    ref, _ = ref_pool_switches(x, *geom, pool="AVE")
    n, c = shape[:2]
    flat = ref.reshape(2 * n * c, -1)
    assert (flat[n * (c // 2):] == 0).all() and (flat[: n * (c // 2)] != 0).any()
    model = load_from_text(net(layer("PoolingSwitches", "x", ["y"], f"pooling_param {{ pool: AVE {params} }}"),
                               inputs={"x": shape}))
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("shape, params, axis", [
    ((3, 4, 5, 2), "slice_param { axis: 0 }", 0),
    ((4, 5, 3, 2), "", 1),                                   # BVLC's default axis 1, cut at num / 2 = 2
    ((2, 3, 5, 4), "slice_param { slice_dim: 2 }", 2),
    ((6, 2, 3, 7), "slice_param { axis: -1 slice_point: 1 }", 3),   # slice_point is not read
])
def test_slice_half_cuts_at_half_the_num(shape, params, axis, tmp_path):
    x = rng(4).standard_normal(shape).astype(F)
    point = shape[0] // 2
    a, b = np.split(x, [point], axis=axis)
    model = load_from_text(net(layer("SliceHalf", "x", ["a", "b"], params), inputs={"x": shape}))
    assert model.blob_shapes["a"] == a.shape and model.blob_shapes["b"] == b.shape
    check_everywhere(model, {"x": x}, {"a": a, "b": b}, tmp_path)


@pytest.mark.parametrize("shape, params, geom", [
    ((4, 3, 4, 5), "kernel_size: 3 stride: 2", ((3, 3), (2, 2), (0, 0), False)),
    ((5, 2, 3, 4), "kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 3 pad_h: 1 pad_w: 1", ((3, 2), (2, 3), (1, 1), False)),
    ((2, 3, 3, 2), "global_pooling: true", (None, (1, 1), (0, 0), True)),
])
def test_inv_pooling_writes_each_value_at_its_switch_last_write_wins(shape, params, geom, tmp_path):
    kernel, stride, pad, glob = geom
    n, c, h, w = shape
    k = (h, w) if glob else kernel
    oh, ow = (h - 1) * stride[0] + k[0] - 2 * pad[0], (w - 1) * stride[1] + k[1] - 2 * pad[1]
    r = rng(5)
    x = r.standard_normal(shape).astype(F)
    m = n // 2
    # switches with many repeats (overlapping windows) and fractions (truncated)
    x[:m] = r.integers(0, min(oh * ow, 2 * h * w), (m, c, h, w)) + r.choice([0.0, 0.25, 0.75], (m, c, h, w))
    ref = ref_inv_pooling(x, kernel, stride, pad, glob)
    assert ref.shape == (m, c, oh, ow)
    model = load_from_text(net(layer("InvPooling", "x", ["y"], f"pooling_param {{ pool: MAX {params} }}"),
                               inputs={"x": shape}))
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path)


def test_switches_through_slice_half_concat_and_inv_pooling(tmp_path):
    """The demo's chain: PoolingSwitches, SliceHalf, Concat(switches, data) on axis 0, InvPooling."""
    shape = (2, 3, 9, 7)
    x = ties_and_holes(shape, 6)
    x[-1, -1, :3, :3] = 0.5
    layers = [
        layer("PoolingSwitches", "x", ["ps"], "pooling_param { pool: MAX kernel_size: 3 stride: 2 }"),
        'layer { name: "s" type: "SliceHalf" bottom: "ps" top: "p" top: "sw" slice_param { axis: 0 } }',
        'layer { name: "c" type: "Concat" bottom: "sw" bottom: "p" top: "cat" concat_param { axis: 0 } }',
        'layer { name: "i" type: "InvPooling" bottom: "cat" top: "y" pooling_param { pool: MAX kernel_size: 3 '
        'stride: 2 } }',
    ]
    pooled, _ = ref_pool_switches(x, (3, 3), (2, 2), (0, 0))
    ref = ref_inv_pooling(np.concatenate([pooled[2:], pooled[:2]]), (3, 3), (2, 2), (0, 0))
    assert ref.shape == shape
    model = load_from_text(net(*layers, inputs={"x": shape}))
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path)


@pytest.mark.parametrize("text, message", [
    (layer("InvPooling", "x", ["y"], "pooling_param { pool: AVE kernel_size: 2 }"),
     "pooling_param.pool AVE: piergiaj/caffe-deconvnet's InvPooling implements MAX only"),
    (layer("PoolingSwitches", "x", ["y"], "pooling_param { pool: STOCHASTIC kernel_size: 2 }"),
     "pooling_param.pool STOCHASTIC: .*PoolingSwitches implements MAX and AVE only"),
    (layer("PoolingSwitches", "x", ["y", "m"], "pooling_param { pool: AVE kernel_size: 2 }"),
     r"PoolingSwitches takes one bottom \(data\) and one top, got 1 and 2"),
    (layer("PoolingSwitches", "x", ["y"], "pooling_param { kernel_size: 2 round_mode: FLOOR }"),
     "reads BVLC's kernel, stride, pad and global_pooling only"),
    (layer("InvPooling", "x", ["y", "z"], "pooling_param { kernel_size: 2 }"), "InvPooling's second top"),
    (layer("SliceHalf", "x", ["a", "b", "c"], ""), "SliceHalf takes one bottom and 2 tops, got 1 and 3"),
    (layer("SliceHalf", "x", ["a", "b"], "slice_param { axis: 3 }"),
     r"slices axis 3 at num / 2 = 3, which leaves nothing"),
    (layer("InvPooling", "x", ["y"], "pooling_param { kernel_size: 2 pad: 2 }"), "pad .* must be smaller"),
])
def test_refusals(text, message):
    with pytest.raises(CaffeqError, match=message):
        load_from_text(net(text, inputs={"x": (6, 2, 4, 3)}))


def test_inv_pooling_refuses_a_switch_outside_its_plane():
    shape = (2, 1, 2, 2)   # top 3 x 3 with kernel 3 stride 1... here kernel 2 stride 1: 3 x 3
    x = np.zeros(shape, F)
    x[0, 0, 1, 1] = 9      # plane holds 0..8
    model = load_from_text(net(layer("InvPooling", "x", ["y"], "pooling_param { kernel_size: 2 }"),
                               inputs={"x": shape}))
    with pytest.raises(CaffeqError, match=r"InvPooling switch 9.0 lies outside its 3x3 top plane"):
        model.run({"x": x})


def test_the_forks_demo_nets_run_end_to_end():
    deploy = load(REALWORLD / "piergiaj__caffe-deconvnet__python-demo__deploy.prototxt", batch=1, random_weights=True,
                  outputs=["pool5", "switches1", "switches2", "switches5"])
    inv = load(REALWORLD / "piergiaj__caffe-deconvnet__python-demo__invdeploy.prototxt", batch=1, random_weights=True)
    assert inv.blob_shapes["conv1"] == (1, 3, 227, 227)
    x = rng(7).standard_normal((1, 3, 227, 227)).astype(F)
    got = deploy.run({"data": x})
    assert got["switches5"].shape == (1, 256, 6, 6) and got["switches1"].shape == (1, 96, 27, 27)
    feeds = {"switches5": got["switches5"], "switches2": got["switches2"], "switches1": got["switches1"],
             "pooled": got["pool5"]}
    out = inv.run(feeds)["conv1"]
    assert out.shape == (1, 3, 227, 227) and np.isfinite(out).all()
