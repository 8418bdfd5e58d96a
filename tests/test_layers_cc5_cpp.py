"""dlunion/CC5.0's CPP layer with FWYsimon/CornerNet-Caffe's classes: references written as loops from
ReLU.cpp, Upsample.cpp (parseParamStr, the floor-index copy) and CornerPool.cpp (the in-place scans with their
> / >= comparisons), compared in torch, onnxruntime and the generated model.py."""

import numpy as np
import pytest
from conftest import REPO, check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.layers.cc5_cpp import parse_param_str
from caffeq.model import load, load_from_text

CORPUS = REPO / "tests" / "fixtures" / "realworld"


def cpp_layer(kind, shape, param_str=""):
    extra = f' param_str: "{param_str}"' if param_str else ""
    return load_from_text(net(f'layer {{ name: "c" type: "CPP" bottom: "x" top: "y" cpp_param {{ type: "{kind}"'
                              f'{extra} }} }}', inputs={"x": shape}))


def corner_pool_ref(x, kind):
    """CornerPool.cpp: copy, then per line a scan from its start: max = first; if (v > max) (>= for Left and
    Right) max = v, else v = max."""
    y = x.copy()
    n, c, h, w = x.shape
    axis_h = kind in ("TopCornerPoolLayer", "BottomCornerPoolLayer")
    backward = kind in ("TopCornerPoolLayer", "LeftCornerPoolLayer")
    ge = kind in ("LeftCornerPoolLayer", "RightCornerPoolLayer")
    for b in range(n):
        for ch in range(c):
            plane = y[b, ch]
            for line in range(w if axis_h else h):
                order = list(range((h if axis_h else w)))
                if backward:
                    order.reverse()
                best = np.float32(0)
                for k, j in enumerate(order):
                    at = (j, line) if axis_h else (line, j)
                    if k == 0:
                        best = plane[at]
                    if (plane[at] >= best) if ge else (plane[at] > best):
                        best = plane[at]
                    else:
                        plane[at] = best
    return y


@pytest.mark.parametrize("kind", ["TopCornerPoolLayer", "BottomCornerPoolLayer", "LeftCornerPoolLayer",
                                  "RightCornerPoolLayer"])
def test_corner_pools(kind, tmp_path):
    shape = (2, 3, 5, 7)
    model = cpp_layer(kind, shape)
    x = rng(51).standard_normal(shape).astype(np.float32)
    x[0, 0, 2, :] = np.nan                   # a NaN met mid-scan takes the running max ...
    x[1, 1, :, 0] = np.nan                   # ... and one met first makes its line NaN
    x[1, 2, 4, 6] = x[1, 2, 0, 0] = np.nan
    check_everywhere(model, {"x": x}, {"y": corner_pool_ref(x, kind)}, tmp_path)


def test_relu_zeroes_nan(tmp_path):
    model = cpp_layer("ReLU", (2, 3, 4))
    x = rng(52).standard_normal((2, 3, 4)).astype(np.float32)
    x.ravel()[:5] = [np.nan, -0.0, np.inf, -np.inf, 0.0]
    ref = np.array([0.0 if np.isnan(v) or not v > 0 else v for v in x.ravel()], np.float32).reshape(x.shape)
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path)


def test_upsample_reads_only_the_scale(tmp_path):
    model = cpp_layer("Upsample", (1, 2, 3, 4), "scale:3; upsample_h: 8; upsample_w: 8")
    x = rng(53).standard_normal((1, 2, 3, 4)).astype(np.float32)
    ref = np.empty((1, 2, 9, 12), np.float32)
    for r in range(9):
        for c in range(12):
            ref[:, :, r, c] = x[:, :, r // 3, c // 3]
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path)


def test_param_str_reads_as_the_class():
    assert parse_param_str("scale:2; upsample_h: 8; upsample_w: 8") == {"scale": 2, "upsample_h": 8, "upsample_w": 8}
    assert parse_param_str("scale:'1.5' other: x") == {"scale": 1, "other": 0}
    # a key runs to a space or a colon, so these read as the class reads them
    assert parse_param_str("scale 2") == {"scale": 2}
    assert parse_param_str("up-sample:4 scale:3") == {"up-sample": 4, "scale": 3}
    assert parse_param_str("scale") == {} and parse_param_str(":;") == {}


@pytest.mark.parametrize("kind, param_str, message", [
    ("MyLayer", "", "does not know"),
    ("Upsample", "upsample_h: 8", "scale 0"),
])
def test_refusals(kind, param_str, message):
    with pytest.raises(LayerError, match=message):
        cpp_layer(kind, (1, 1, 2, 2), param_str)


@pytest.mark.skipif(not CORPUS.exists(), reason="the corpus files are not on this machine")
def test_cornernet_deploy_reads():
    model = load(CORPUS / "FWYsimon__CornerNet-Caffe__cornernet.prototxt", random_weights=True)
    assert model.blob_shapes["upsample_blob5"] == (1, 256, 128, 128)
