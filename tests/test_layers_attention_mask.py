"""The AttentionMask family (caffeq/layers/attention_mask.py, attention_mask_spx.py) against loops written here
from chwilms/AttentionMask's, harm-matthias-harms/AttentionBox's and chwilms/superpixelRefinement's C++ and CUDA,
in torch, onnxruntime (where emitted) and model.py; and the corpus nets."""
import numpy as np
import pytest
from conftest import REPO, check_everywhere, inspect_corpus_file, model_py_outputs, net, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

F32 = np.float32
CORPUS = REPO / "tests" / "fixtures" / "realworld"


# ---- references from the fork's loops ----------------------------------------------

def check_att_ref(a, b, always):
    a, b = a.copy(), b.copy()
    if always:
        a.flat[0], b.flat[0] = 1.0, 0.0
    elif not (a > b).sum():
        a.flat[0], b.flat[0] = 0.51, 0.49
    return a, b


def argmax_ref(x, k, axis, out_max_val):
    """argmax_layer_all.cpp's Forward_cpu: std::partial_sort of (value, index) pairs with greater<>."""
    if axis is None:
        dim, axis_dist = int(np.prod(x.shape[1:])), 1
    else:
        dim = x.shape[axis]
        axis_dist = int(np.prod(x.shape[axis:])) // dim
    num = x.size // dim
    flat = x.reshape(-1)
    if axis is None:
        shape = [1] * max(x.ndim, 3)
        shape[0], shape[2] = x.shape[0], k
        if out_max_val:
            shape[1] = 2
    else:
        shape = list(x.shape)
        shape[axis] = k
    top = np.zeros(int(np.prod(shape)), F32)
    for i in range(num):
        pairs = [(flat[(i // axis_dist * dim + j) * axis_dist + i % axis_dist], j) for j in range(dim)]
        pairs.sort(reverse=True)
        for j in range(k):
            if out_max_val and axis is None:
                top[2 * i * k + j] = pairs[j][1]
                top[2 * i * k + k + j] = pairs[j][0]
            else:
                top[(i // axis_dist * k + j) * axis_dist + i % axis_dist] = pairs[j][0 if out_max_val else 1]
    return top.reshape(shape)


def windows_ref(x, flags, wh, ww, outside):
    """sliding_window_index(_seg)_layer.cu: window index = running sum of the flags before it."""
    _, c, h, w = x.shape
    rows = max(int(np.abs(flags).sum()), 1)
    out = np.zeros((rows, c, wh, ww), F32)
    index = 0
    for n, f in enumerate(flags.reshape(-1)):
        if f > 0:
            oh, ow = divmod(n, w + 1)
            for i in range(wh):
                for j in range(ww):
                    r, q = oh - wh // 2 + i, ow - ww // 2 + j
                    out[index, :, i, j] = x[0, :, r, q] if 0 <= r < h and 0 <= q < w else outside
        index += int(f)
    return out


def top_k_old_ref(items, scores, k):
    n = items.shape[0]
    rows = scores.reshape(scores.shape[0], -1)
    score = rows[:, 0] if rows.shape[1] == 1 else np.maximum(rows[:, 1:].max(1), 0)
    order = sorted(range(n), key=lambda i: (-score[i], i))
    kept = min(k, n)
    ids = sorted(order[:kept]) + order[kept:]
    top = np.zeros((k,) + items.shape[1:], F32)
    top[:kept] = items[ids[:kept]]
    idx = np.zeros(k, F32)
    idx[:min(k, n)] = ids[:k]
    return top, idx.reshape(k, 1, 1, 1)


def cut_ref(x):
    n, c, h, w = x.shape
    flat = x.reshape(-1)
    out = np.zeros((n, c, h - 1, w - 1), F32)
    for b in range(n):
        for ch in range(c):
            for y in range(h - 1):
                for z in range(w - 1):
                    out[b, ch, y, z] = flat[b * h * w * c + ch * h * w + y * h + z]
    return out


def scale_flags_ref(flags, h, w, hs, ws, s):
    out = np.zeros((hs + 1) * (ws + 1), F32)
    for i, f in enumerate(flags.reshape(-1)):       # in index order: the last write stays
        out[min(hs, (i // (w + 1)) * s) * (ws + 1) + min(ws, (i % (w + 1)) * s)] = f
    return out.reshape(1, 1, 1, -1)


def spx_pool_ref(x, spx):
    """spx_pooling_layer.cu: SUM then AVG, float32, pixels in order."""
    _, c, hf, wf = x.shape
    hs, ws = spx.shape[2], spx.shape[3]
    ids = spx.reshape(-1)
    m = int(F32(max(ids.max(), 0)) + F32(1))
    f = F32(hf) / F32(hs)
    sums = np.zeros((m, c), F32)
    counts = np.zeros(m, F32)
    for n, v in enumerate(ids):
        hy, wx = F32(n // ws) * f, F32(n % ws) * f
        hy, wx = np.floor(hy + F32(0.5)), np.floor(wx + F32(0.5))     # round, x >= 0 (no x.5 - eps here)
        cell = int(min(hf - 1, max(hy, 0)) * wf + min(wf - 1, max(wx, 0)))
        s = int(v)
        counts[s] += 1
        for ch in range(c):
            sums[s, ch] = F32(sums[s, ch] + x[0, ch].reshape(-1)[cell])
    mean = np.where(counts[:, None] > 0, sums / np.maximum(counts, 1)[:, None], sums).astype(F32)
    return mean.reshape(1, 1, m, c), counts.reshape(1, 1, 1, m)


def att_spx_pool_ref(x, ids, largest):
    n = ids.shape[0]
    m = int(F32(max(largest.max(), 0)) + F32(1))
    flat = ids.reshape(-1)
    per = flat.size // n
    sums = np.full(n * m, -100, F32)
    counts = np.zeros(n * m, F32)
    for i, v in enumerate(flat):
        if v >= 0:
            slot = (i // per) * m + int(v)
            counts[slot] += 1
            sums[slot] = F32(sums[slot] + x.reshape(-1)[i])
    mean = np.where(counts > 0, (sums + F32(100)) / np.maximum(counts, 1), sums).astype(F32)
    return mean.reshape(n, 1, 1, m), counts.reshape(n, 1, 1, m)


# ---- tests ----------------------------------------------------------------------

@pytest.mark.parametrize("none_above", [False, True, "equal"])
def test_check_att_sets_first_values_only_where_nothing_is_above(tmp_path, none_above):
    r = rng(1)
    a = r.random((2, 3, 5, 4)).astype(F32)
    b = {False: r.random((2, 3, 5, 4)).astype(F32), True: (a + 0.5).astype(F32), "equal": a.copy()}[none_above]
    none_above = bool(none_above)
    model = load_from_text(net('layer { name: "c" type: "CheckAtt" bottom: "a" bottom: "b" top: "ta" top: "tb" }',
                               inputs={"a": a.shape, "b": b.shape}))
    ra, rb = check_att_ref(a, b, False)
    assert (ra.flat[0] == F32(0.51)) == none_above
    check_everywhere(model, {"a": a, "b": b}, {"ta": ra, "tb": rb}, tmp_path)


def test_check_att_in_a_superpixel_net_always_sets_one_and_zero(tmp_path):
    r = rng(2)
    a, b = r.random((1, 1, 1, 9)).astype(F32), r.random((1, 1, 1, 9)).astype(F32)
    x = r.standard_normal((1, 2, 3, 5)).astype(F32)
    spx = np.zeros((1, 1, 3, 5), F32)
    text = net('layer { name: "c" type: "CheckAtt" bottom: "a" bottom: "b" top: "ta" top: "tb" }',
               'layer { name: "p" type: "SpxPooling" bottom: "x" bottom: "s" top: "p" top: "n" '
               'superpixel_pooling_param { pool: AVE } }',
               inputs={"a": a.shape, "b": b.shape, "x": x.shape, "s": spx.shape})
    model = load_from_text(text)
    assert next(n for n in model.layers if n.name == "c").type == "CheckAttSpx"
    ra, rb = check_att_ref(a, b, True)
    got = model.run({"a": a, "b": b, "x": x, "s": spx})
    np.testing.assert_array_equal(got["ta"], ra)
    np.testing.assert_array_equal(got["tb"], rb)
    got = model_py_outputs(model, {"a": a, "b": b, "x": x, "s": spx}, tmp_path)
    np.testing.assert_array_equal(got["ta"], ra)


def argmax_net(kind, shape, params):
    return net(f'layer {{ name: "am" type: "{kind}" bottom: "x" bottom: "b" top: "o" argmax_param {{ {params} }} }}',
               inputs={"x": shape, "b": (1, 1, 1, shape[-1])})


def test_argmax_all_takes_at_least_1000_and_ranks_equal_values_higher_index_first(tmp_path):
    r = rng(3)
    x = np.round(r.random((1, 1, 1, 1203)) * 50).astype(F32)          # many equal values
    b = np.full((1, 1, 1, 1203), 5.0, F32)
    model = load_from_text(argmax_net("ArgMaxAll", x.shape, "top_k: 1000 axis: -1"))
    assert model.blob_shapes["o"] == (1, 1, 1, 1000)                   # set up over zeros
    k = max(int((x > b).sum()), 1000)
    assert k > 1000
    check_everywhere(model, {"x": x, "b": b}, {"o": argmax_ref(x, k, 3, False)}, tmp_path)
    b2 = np.full_like(b, 100.0)
    check_everywhere(model, {"x": x, "b": b2}, {"o": argmax_ref(x, 1000, 3, False)}, tmp_path)


@pytest.mark.parametrize("params,axis,out_max_val", [("top_k: 1", None, False), ("out_max_val: true", None, True),
                                                      ("axis: 2 out_max_val: true", 2, True), ("axis: 1", 1, False)])
def test_argmax_my_counts_k_from_the_values(tmp_path, params, axis, out_max_val):
    r = rng(4)
    x = np.round(r.random((2, 5, 3, 7)) * 9).astype(F32)
    b = (x.reshape(-1)[:7] + 1).reshape(1, 1, 1, 7)
    b.flat[[0, 3]] -= 2                                                     # two values above: k = 2
    k = 2
    model = load_from_text(argmax_net("ArgMaxMy", x.shape, params))
    check_everywhere(model, {"x": x, "b": b}, {"o": argmax_ref(x, k, axis, out_max_val)}, tmp_path)


def test_argmax_my_in_a_superpixel_net_takes_at_least_5(tmp_path):
    r = rng(12)
    x = np.round(r.random((2, 3, 2, 7)) * 9).astype(F32)
    b = (x.reshape(-1)[:7] + 1).reshape(1, 1, 1, 7)
    b.flat[[1, 4]] -= 2                                                     # two values above: k = max(2, 5)
    g = r.random((1, 1, 1, 12)).astype(F32)
    text = net('layer { name: "am" type: "ArgMaxMy" bottom: "x" bottom: "b" top: "o" argmax_param { axis: 3 } }',
               'layer { name: "sf" type: "ScaleFlags" bottom: "f" bottom: "seg" bottom: "g" top: "sg" }',
               inputs={"x": x.shape, "b": b.shape, "f": (1, 1, 2, 3), "seg": (1, 1, 2, 3), "g": g.shape})
    model = load_from_text(text)
    assert next(n for n in model.layers if n.name == "am").type == "ArgMaxMySpx"
    assert model.blob_shapes["o"] == (2, 3, 2, 5)                            # set up over zeros: k = 5
    feeds = {"x": x, "b": b, "f": np.zeros((1, 1, 2, 3), F32), "seg": np.zeros((1, 1, 2, 3), F32), "g": g}
    refs = {"o": argmax_ref(x, 5, 3, False), "sg": scale_flags_ref(g, 2, 3, 2, 3, 1)}
    check_everywhere(model, feeds, refs, tmp_path)


def test_argmax_top_k_and_counts_past_the_values_are_refused():
    with pytest.raises(CaffeqError, match="top_k 1201 is more than the 1200 values per item"):
        load_from_text(argmax_net("ArgMaxAll", (1, 2, 1, 600), "top_k: 1201"))
    model = load_from_text(net('layer { name: "am" type: "ArgMaxMy" bottom: "x" bottom: "b" top: "o" '
                               'argmax_param { axis: 3 } }', inputs={"x": (2, 1, 1, 6), "b": (1, 1, 1, 8)}))
    with pytest.raises(CaffeqError, match="8 values of the first bottom are above the second's, more than the 6"):
        model.run({"x": np.ones((2, 1, 1, 6), F32), "b": np.zeros((1, 1, 1, 8), F32)})


def test_argmax_all_below_1000_values_cannot_run():
    model = load_from_text(argmax_net("ArgMaxAll", (1, 1, 1, 505), "top_k: 1000 axis: -1"))
    with pytest.raises(CaffeqError, match="1000 best of 505"):
        model.run({"x": np.zeros((1, 1, 1, 505), F32), "b": np.zeros((1, 1, 1, 505), F32)})


def test_convert_flags_and_split_indices(tmp_path):
    r = rng(5)
    scores = r.random((1, 1, 1, 11)).astype(F32)
    idx = np.array([3, 7, 0, 7, 10], F32).reshape(1, 1, 1, 5) + F32(0.6)     # truncated
    parts = [(1, 1, 1, 4), (2, 3, 1, 2), (1, 1, 1, 5)]
    text = net('layer { name: "cv" type: "ConvertIndices" bottom: "i" bottom: "s" top: "flags" top: "picked" }',
               'layer { name: "fi" type: "FlagsToIndices" bottom: "flags" top: "where" }',
               'layer { name: "sp" type: "SplitIndices" bottom: "flags" bottom: "p0" bottom: "p1" bottom: "p2" '
               'top: "f0" top: "f1" top: "f2" }',
               inputs={"i": idx.shape, "s": scores.shape, "p0": parts[0], "p1": parts[1], "p2": parts[2]})
    model = load_from_text(text, outputs=["flags", "picked", "where", "f0", "f1", "f2"])
    assert model.blob_shapes["where"] == (0, 1, 1, 1)
    flags = np.zeros(11, F32)
    flags[[3, 7, 0, 10]] = 1
    at = np.array([3, 7, 0, 7, 10])
    refs = {"flags": flags.reshape(1, 1, 1, 11), "picked": scores.reshape(-1)[at].reshape(5, 1, 1, 1),
            "where": np.array([0, 3, 7, 10], F32).reshape(4, 1, 1, 1),
            "f0": flags[:4].reshape(1, 1, 1, 4), "f1": flags[4:6].reshape(1, 1, 1, 2),
            "f2": flags[6:].reshape(1, 1, 1, 5)}
    feeds = {"i": idx, "s": scores, **{f"p{i}": np.zeros(p, F32) for i, p in enumerate(parts)}}
    check_everywhere(model, feeds, refs, tmp_path)


def test_flags_to_indices_reads_the_first_shape3_values_equal_to_1(tmp_path):
    flags = np.array([1, 0.5, 2, 1, 0, 1, 1, 1, 0, 1, 1, 1], F32).reshape(2, 1, 1, 6)
    model = load_from_text(net('layer { name: "fi" type: "FlagsToIndices" bottom: "f" top: "o" }',
                               inputs={"f": flags.shape}))
    assert model.blob_shapes["o"] == (0, 1, 1, 1)                              # set up over zeros
    check_everywhere(model, {"f": flags}, {"o": np.array([0, 3, 5], F32).reshape(3, 1, 1, 1)}, tmp_path)


@pytest.mark.parametrize("kind,outside", [("SlidingWindowIndex", 0.0), ("SlidingWindowIndexSeg", -1.0)])
@pytest.mark.parametrize("flagged", [[0, 5, 6, 23, 29], []])
def test_sliding_window_index_takes_the_flagged_windows(tmp_path, kind, outside, flagged):
    x = rng(6).standard_normal((1, 3, 4, 5)).astype(F32)
    flags = np.zeros((1, 1, 1, 30), F32)
    flags.reshape(-1)[flagged] = 1
    model = load_from_text(net(f'layer {{ name: "w" type: "{kind}" bottom: "x" bottom: "f" top: "o" '
                               'sliding_window_param { window_h: 4 window_w: 2 stride_h: 3 } }',
                               inputs={"x": x.shape, "f": flags.shape}))
    assert model.blob_shapes["o"] == (1, 3, 4, 2)
    check_everywhere(model, {"x": x, "f": flags}, {"o": windows_ref(x, flags, 4, 2, outside)}, tmp_path)


@pytest.mark.parametrize("n,cols", [(7, 1), (3, 4)])
def test_top_k_old_keeps_the_best_in_order_then_zeros(tmp_path, n, cols):
    r = rng(7)
    items = r.standard_normal((n, 2, 3, 1)).astype(F32)
    scores = np.round(r.standard_normal((n, cols)) * 2).astype(F32)      # ties
    k = 5
    model = load_from_text(net('layer { name: "t" type: "TopKOld" bottom: "items" bottom: "s" bottom: "k" '
                               'top: "o" top: "ids" }',
                               inputs={"items": items.shape, "s": scores.shape, "k": (k, 1, 1, 1)}))
    top, ids = top_k_old_ref(items, scores, k)
    feeds = {"items": items, "s": scores, "k": np.zeros((k, 1, 1, 1), F32)}
    check_everywhere(model, feeds, {"o": top, "ids": ids}, tmp_path)


@pytest.mark.parametrize("scores,picked", [
    ([[1], [3], [2], [3], [2], [2], [0]], [1, 2, 3]),                  # a tie at the cut: the lower index
    ([[9, -1, -2], [9, -3, -4], [0, 2, 1], [0, -2, -5], [0, 1, 0], [0, -0.5, -1]], [0, 2, 4])])   # classes: >= 0
def test_top_k_old_ranks_ties_by_index_and_classes_from_0(tmp_path, scores, picked):
    scores = np.array(scores, F32)
    n = scores.shape[0]
    items = rng(14).standard_normal((n, 3, 1, 2)).astype(F32)
    model = load_from_text(net('layer { name: "t" type: "TopKOld" bottom: "items" bottom: "s" bottom: "k" '
                               'top: "o" top: "ids" }',
                               inputs={"items": items.shape, "s": scores.shape, "k": (3, 1, 1, 1)}))
    top, ids = top_k_old_ref(items, scores, 3)
    assert ids.reshape(-1).tolist() == picked
    feeds = {"items": items, "s": scores, "k": np.zeros((3, 1, 1, 1), F32)}
    check_everywhere(model, feeds, {"o": top, "ids": ids}, tmp_path)


@pytest.mark.parametrize("shape", [(2, 3, 5, 5), (2, 3, 4, 6), (2, 3, 5, 4)])
def test_cut_steps_rows_by_the_height(tmp_path, shape):
    x = rng(8).standard_normal(shape).astype(F32)
    model = load_from_text(net('layer { name: "cut" type: "Cut" bottom: "x" top: "o" }', inputs={"x": shape}))
    check_everywhere(model, {"x": x}, {"o": cut_ref(x)}, tmp_path)


@pytest.mark.parametrize("shape", [(1, 2, 5, 3), (1, 2, 4, 2)])      # (4, 2): the last read is value 8 of 8
def test_cut_with_two_rows_more_than_columns_is_refused(shape):
    model = load_from_text(net('layer { name: "cut" type: "Cut" bottom: "x" top: "o" }', inputs={"x": shape}))
    with pytest.raises(CaffeqError, match="read past the bottom"):
        model.run({"x": np.zeros(shape, F32)})


@pytest.mark.parametrize("s,seg", [(3, (1, 1, 9, 13)), (4, (1, 1, 7, 9))])
def test_scale_flags_places_the_flags_on_the_segmentation_grid(tmp_path, s, seg):
    flags = rng(9).random((1, 1, 1, 4 * 5)).astype(F32)
    model = load_from_text(net('layer { name: "sf" type: "ScaleFlags" bottom: "f" bottom: "seg" bottom: "g" top: "o" '
                               f'scale_flags_param {{ scalefactor: {s} }} }}',
                               inputs={"f": (1, 2, 3, 4), "seg": seg, "g": flags.shape}))
    feeds = {"f": np.zeros((1, 2, 3, 4), F32), "seg": np.zeros(seg, F32), "g": flags}
    check_everywhere(model, feeds, {"o": scale_flags_ref(flags, 3, 4, seg[2], seg[3], s)}, tmp_path)


def test_spx_pooling_averages_per_superpixel(tmp_path):
    r = rng(10)
    x = r.standard_normal((1, 3, 5, 7)).astype(F32)
    spx = r.integers(0, 6, (1, 1, 9, 12)).astype(F32)
    spx[0, 0, 0, 0] = 8                                                   # ids 6 and 7 empty
    model = load_from_text(net('layer { name: "p" type: "SpxPooling" bottom: "x" bottom: "s" top: "p" top: "n" '
                               'superpixel_pooling_param { pool: AVE weight: 1 } }',
                               inputs={"x": x.shape, "s": spx.shape}))
    assert model.blob_shapes["p"] == (1, 1, 1, 3)
    mean, counts = spx_pool_ref(x, spx)
    check_everywhere(model, {"x": x, "s": spx}, {"p": mean, "n": counts}, tmp_path, atol=1e-6, rtol=1e-6, opsets=())


def test_spx_pooling_rounds_half_coordinates_up(tmp_path):
    r = rng(13)
    x = r.standard_normal((1, 2, 3, 4)).astype(F32)
    spx = r.integers(0, 3, (1, 1, 6, 9)).astype(F32)                      # f = 3 / 6: half coordinates
    model = load_from_text(net('layer { name: "p" type: "SpxPooling" bottom: "x" bottom: "s" top: "p" top: "n" '
                               'superpixel_pooling_param { pool: AVE } }', inputs={"x": x.shape, "s": spx.shape}))
    mean, counts = spx_pool_ref(x, spx)
    check_everywhere(model, {"x": x, "s": spx}, {"p": mean, "n": counts}, tmp_path, atol=1e-6, rtol=1e-6, opsets=())


def test_att_spx_pooling_starts_from_minus_100(tmp_path):
    r = rng(11)
    x = r.random((2, 1, 5, 4)).astype(F32)
    ids = r.integers(-1, 4, (2, 1, 5, 4)).astype(F32)
    largest = np.zeros((1, 1, 3, 3), F32)
    largest[0, 0, 1, 2] = 5                                               # ids 4, 5 empty: -100
    model = load_from_text(net('layer { name: "ap" type: "AttSpxPooling" bottom: "x" bottom: "i" bottom: "m" '
                               'top: "a" top: "n" superpixel_pooling_param { pool: AVE } }',
                               inputs={"x": x.shape, "i": ids.shape, "m": largest.shape}))
    mean, counts = att_spx_pool_ref(x, ids, largest)
    assert (mean == -100).any()
    check_everywhere(model, {"x": x, "i": ids, "m": largest}, {"a": mean, "n": counts}, tmp_path, opsets=())


def test_spx_pooling_max_and_bad_counts_are_refused():
    with pytest.raises(CaffeqError, match="NOT_IMPLEMENTED"):
        load_from_text(net('layer { name: "p" type: "SpxPooling" bottom: "x" bottom: "s" top: "p" top: "n" }',
                           inputs={"x": (1, 2, 3, 3), "s": (1, 1, 3, 3)}))
    with pytest.raises(CaffeqError, match=r"12 flags .* \(3 \+ 1\)\(4 \+ 1\)"):
        load_from_text(net('layer { name: "w" type: "SlidingWindowIndex" bottom: "x" bottom: "f" top: "o" '
                           'sliding_window_param { window_h: 2 window_w: 2 } }',
                           inputs={"x": (1, 2, 3, 4), "f": (1, 1, 1, 12)}))


@pytest.mark.parametrize("name", ["chwilms__AttentionMask__models__attentionMask-16-192.test.prototxt",
                                  "chwilms__AttentionMask__models__attentionMask-8-128.test.prototxt",
                                  "harm-matthias-harms__AttentionBox__models__attentionBox-final.test.prototxt",
                                  "chwilms__superpixelRefinement__models__spxRefinedAttMask.test.prototxt"])
def test_corpus_nets_read(name):
    out = inspect_corpus_file(str(CORPUS / name))
    assert "total:" in out and "ArgMaxAll" in out
