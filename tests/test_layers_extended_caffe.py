"""xiamenwcy/extended-caffe (29c5454): pooling_param.output_size adds a last 1 x 1 x H x W top of zeros
(pooling_layer.cpp Reshape / Forward_cpu), and a three-bottom Upsample unpools to the height and width of its
third bottom (upsample_layer.cpp Reshape / Forward_cpu).  The references follow those loops in numpy."""
import math

import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

F = np.float32


def pool_ref(x, k, s, ave=False):
    """Caffe's pooling without pad: ceil size; MAX keeps the first largest (strict >) and its index h * W + w,
    AVE divides by the window clipped to the input (no pad, so the clipped size)."""
    n, c, h, w = x.shape
    oh, ow = math.ceil((h - k) / s) + 1, math.ceil((w - k) / s) + 1
    top = np.zeros((n, c, oh, ow), F)
    mask = np.full((n, c, oh, ow), -1, F)
    for b in range(n):
        for ch in range(c):
            for i in range(oh):
                for j in range(ow):
                    hs, ws = i * s, j * s
                    he, we = min(hs + k, h), min(ws + k, w)
                    if ave:
                        top[b, ch, i, j] = x[b, ch, hs:he, ws:we].astype(np.float64).sum() / ((he - hs) * (we - ws))
                        continue
                    best = -np.inf
                    for y in range(hs, he):
                        for z in range(ws, we):
                            if x[b, ch, y, z] > best:
                                best, mask[b, ch, i, j] = x[b, ch, y, z], y * w + z
                    top[b, ch, i, j] = best
    return top, mask


def unpool_ref(x, mask, oh, ow):
    """Upsample's loop: top[int(mask[i])] = bottom[i] per plane, zeros elsewhere."""
    n, c = x.shape[:2]
    top = np.zeros((n, c, oh * ow), F)
    for b in range(n):
        for ch in range(c):
            for v, m in zip(x[b, ch].ravel(), mask[b, ch].ravel()):
                top[b, ch, int(m)] = v
    return top.reshape(n, c, oh, ow)


def pool_layer(pool, tops, extra=""):
    top = "".join(f' top: "{t}"' for t in tops)
    return (f'layer {{ name: "p" type: "Pooling" bottom: "x"{top} pooling_param {{ pool: {pool} kernel_size: 2 '
            f'stride: 2 output_size: true {extra} }} }}')


def test_max_pooling_with_output_size_gives_values_mask_and_size(tmp_path):
    shape = (2, 3, 7, 10)
    model = load_from_text(net(pool_layer("MAX", ["v", "m", "size"]), inputs={"x": shape}))
    x = rng(1).standard_normal(shape).astype(F)
    v, m = pool_ref(x, 2, 2)
    want = {"v": v, "m": m, "size": np.zeros((1, 1, 7, 10), F)}
    got = model.run({"x": x})
    assert got["size"].shape == (1, 1, 7, 10) and got["v"].shape == (2, 3, 4, 5)
    check_everywhere(model, {"x": x}, want, tmp_path)


def test_output_size_with_two_tops_gives_values_and_size(tmp_path):
    # MaxTopBlobs: output_size makes a second top the size blob, not the mask (MAX and AVE alike)
    shape = (2, 2, 5, 8)
    x = rng(2).standard_normal(shape).astype(F)
    for pool, ave in (("MAX", False), ("AVE", True)):
        model = load_from_text(net(pool_layer(pool, ["v", "size"]), inputs={"x": shape}))
        want = {"v": pool_ref(x, 2, 2, ave)[0], "size": np.zeros((1, 1, 5, 8), F)}
        check_everywhere(model, {"x": x}, want, tmp_path / pool, atol=1e-6, rtol=1e-6)


def test_three_bottom_upsample_unpools_to_the_size_blobs_height_and_width(tmp_path):
    # IrisSegBenchmark's SegNet: pool (values, mask, size) -> Upsample(values, mask, size); the odd input
    # (9 x 7) comes back at its own size where scale 2 would give 10 x 8
    shape = (2, 3, 9, 7)
    text = net(pool_layer("MAX", ["v", "m", "size"]),
               'layer { name: "up" type: "Upsample" bottom: "v" bottom: "m" bottom: "size" top: "o" }',
               inputs={"x": shape})
    model = load_from_text(text)
    x = rng(3).standard_normal(shape).astype(F)
    v, m = pool_ref(x, 2, 2)
    want = unpool_ref(v, m, 9, 7)
    assert model.run({"x": x})["o"].shape == (2, 3, 9, 7)
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path)


def test_the_size_bottom_wins_over_upsample_h_and_w(tmp_path):
    shape = (1, 2, 6, 5)
    text = net(pool_layer("MAX", ["v", "m", "size"]),
               'layer { name: "up" type: "Upsample" bottom: "v" bottom: "m" bottom: "size" top: "o" '
               'upsample_param { upsample_h: 8 upsample_w: 8 } }', inputs={"x": shape})
    model = load_from_text(text)
    x = rng(4).standard_normal(shape).astype(F)
    v, m = pool_ref(x, 2, 2)
    check_everywhere(model, {"x": x}, {"o": unpool_ref(v, m, 6, 5)}, tmp_path)


def test_ave_pooling_with_three_tops_is_refused_in_one_line():
    with pytest.raises(CaffeqError, match=r"layer 'p' \(Pooling\): pooling_param.output_size: AVE and STOCHASTIC "
                                          r"pooling takes 1 or 2 tops \(values, size\), got 3"):
        load_from_text(net(pool_layer("AVE", ["v", "m", "size"]), inputs={"x": (1, 1, 4, 4)}))


def test_a_size_bottom_of_height_one_is_refused():
    text = net('layer { name: "up" type: "Upsample" bottom: "x" bottom: "m" bottom: "s" top: "o" }',
               inputs={"x": (1, 2, 3, 3), "m": (1, 2, 3, 3), "s": (1, 1, 1, 6)})
    with pytest.raises(CaffeqError, match=r"layer 'up' \(Upsample\): Upsample's size bottom \[1, 1, 1, 6\] must have "
                                          r"height and width > 1"):
        load_from_text(text)
