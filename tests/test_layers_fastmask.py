"""FastMask's SlidingWindow, TileProduct and TopK (caffeq/layers/fastmask.py) against loops written here from
voidrank/caffe-fm's CUDA kernels, in torch, onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

F32 = np.float32


def windows_ref(x, wh, ww):
    """sliding_window_layer.cu: window n at (n // (W+1), n % (W+1)), cell (i, j) from (oh - wh/2 + i, ow - ww/2 + j)."""
    _, c, h, w = x.shape
    out = np.zeros(((h + 1) * (w + 1), c, wh, ww), F32)
    for n in range(out.shape[0]):
        oh, ow = divmod(n, w + 1)
        for i in range(wh):
            for j in range(ww):
                r, q = oh - wh // 2 + i, ow - ww // 2 + j
                if 0 <= r < h and 0 <= q < w:
                    out[n, :, i, j] = x[0, :, r, q]
    return out


def test_sliding_window_worked_example():
    x = np.array([[1, 2], [3, 4]], F32).reshape(1, 1, 2, 2)
    model = load_from_text(net('layer { name: "extractor" type: "SlidingWindow" bottom: "x" top: "w" '
                               'sliding_window_param { window_h: 2 window_w: 2 } }', inputs={"x": x.shape}))
    got = model.run({"x": x})["w"][:, 0]
    np.testing.assert_array_equal(got[0], [[0, 0], [0, 1]])
    np.testing.assert_array_equal(got[4], [[1, 2], [3, 4]])
    np.testing.assert_array_equal(got[8], [[4, 0], [0, 0]])


def test_sliding_windows_of_two_layers_with_one_name_match_the_kernel(tmp_path):
    # the nets name every SlidingWindow "extractor"; the stride fields are read and ignored
    a = rng(1).standard_normal((1, 3, 5, 7)).astype(F32)
    b = rng(2).standard_normal((1, 3, 3, 2)).astype(F32)
    text = net('layer { name: "extractor" type: "SlidingWindow" bottom: "a" top: "wa" '
               'sliding_window_param { window_h: 4 window_w: 2 stride_h: 3 } }',
               'layer { name: "extractor" type: "SlidingWindow" bottom: "b" top: "wb" '
               'sliding_window_param { window_h: 4 window_w: 2 } }',
               'layer { name: "cat" type: "Concat" bottom: "wa" bottom: "wb" top: "all" concat_param { axis: 0 } }',
               inputs={"a": a.shape, "b": b.shape})
    model = load_from_text(text)
    ref = np.concatenate([windows_ref(a, 4, 2), windows_ref(b, 4, 2)])
    assert model.blob_shapes["all"] == (6 * 8 + 4 * 3, 3, 4, 2)
    check_everywhere(model, {"a": a, "b": b}, {"all": ref}, tmp_path)


def test_tile_product_multiplies_every_channel_by_the_map(tmp_path):
    x = rng(3).standard_normal((3, 4, 5, 5)).astype(F32)
    m = rng(4).standard_normal((3, 1, 5, 5)).astype(F32)
    model = load_from_text(net('layer { name: "att_filt" type: "TileProduct" bottom: "x" bottom: "m" top: "y" }',
                               inputs={"x": x.shape, "m": m.shape}))
    check_everywhere(model, {"x": x, "m": m}, {"y": x * m}, tmp_path)


TOPK = ('layer {{ name: "batch_filter" type: "TopK" bottom: "items" bottom: "scores" bottom: "k" top: "kept" '
        '{ids} }}')


@pytest.mark.parametrize("columns", [1, 3])
def test_top_k_keeps_the_best_scores_in_their_own_order(columns, tmp_path):
    n, k = 23, 9
    items = rng(5).standard_normal((n, 2, 3)).astype(F32)
    scores = rng(6).standard_normal((n, columns)).astype(F32)
    scores[[4, 11, 17], -1] = 5.0        # a tie at the top; and column 0 (background) is never read
    if columns > 1:
        scores[2, 0] = 100.0
        scores[8, 1:] = -1.0             # negative classes: the running maximum from 0
    model = load_from_text(net(TOPK.format(ids='top: "ids"'),
                               inputs={"items": items.shape, "scores": scores.shape, "k": (k, 1, 1, 1)}))
    per_item = scores[:, 0] if columns == 1 else np.maximum(scores[:, 1:].max(1), 0)
    best = sorted(range(n), key=lambda i: (-per_item[i], i))[:k]       # ties: the lower index
    kept = sorted(best)
    feeds = {"items": items, "scores": scores, "k": np.zeros((k, 1, 1, 1), F32)}
    check_everywhere(model, feeds, {"kept": items[kept], "ids": np.array(kept, F32).reshape(k, 1, 1, 1)}, tmp_path)


def test_top_k_past_its_items_and_odd_windows_are_refused():
    with pytest.raises(CaffeqError, match="keeps k = 8 .* of 5 items"):
        load_from_text(net(TOPK.format(ids=""), inputs={"items": (5, 2), "scores": (5, 1), "k": (8, 1, 1, 1)}))
    with pytest.raises(CaffeqError, match="window_h must be a positive even number"):
        load_from_text(net('layer { name: "e" type: "SlidingWindow" bottom: "x" top: "w" '
                           'sliding_window_param { window_h: 3 window_w: 2 } }', inputs={"x": (1, 1, 4, 4)}))
    with pytest.raises(CaffeqError, match="batch of 1"):
        load_from_text(net('layer { name: "e" type: "SlidingWindow" bottom: "x" top: "w" '
                           'sliding_window_param { window_h: 2 window_w: 2 } }', inputs={"x": (2, 1, 4, 4)}))
