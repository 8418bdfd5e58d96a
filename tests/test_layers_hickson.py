"""StevenHickson/caffe a933dcb: Segmentation (segmentation_layer.cpp: FHGraphSegment, ExtractSegBoxes,
MostOccuringValue, Forward_cpu) and LabelData (label_data_layer.cpp), against a plain reading of the C++ written
here (libstdc++'s std::sort step by step, the fork's Universe with its ranks), against results of the fork's own
FH code and std::sort compiled with g++ 12, and on StevenHickson/SemanticLabelingDemo's two nets."""
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import model_py_outputs, net, rng

from caffeq.errors import ExportError
from caffeq.layers import LayerError
from caffeq.layers.hickson import hickson_fh_segment, hickson_sort_order
from caffeq.model import load, load_from_text

F = np.float32
REALWORLD = Path(__file__).parent / "fixtures" / "realworld"
DEMO = "StevenHickson__SemanticLabelingDemo__"


# ---- the reference: the fork's code read line by line ------------------------------------------------

class Edge:
    def __init__(self, w, a, b):
        self.w, self.a, self.b = w, a, b


def std_sort(v, lt):
    """libstdc++'s std::sort of the list v with the comparison lt, as stl_algo.h writes it."""
    def swap(i, j):
        v[i], v[j] = v[j], v[i]

    def median_to_first(result, a, b, c):
        if lt(v[a], v[b]):
            swap(result, b if lt(v[b], v[c]) else (c if lt(v[a], v[c]) else a))
        elif lt(v[a], v[c]):
            swap(result, a)
        else:
            swap(result, c if lt(v[b], v[c]) else b)

    def partition(first, last, pivot):
        while True:
            while lt(v[first], v[pivot]):
                first += 1
            last -= 1
            while lt(v[pivot], v[last]):
                last -= 1
            if not first < last:
                return first
            swap(first, last)
            first += 1

    def sift(first, hole, length, value):   # __adjust_heap + __push_heap
        top = child = hole
        while child < (length - 1) // 2:
            child = 2 * (child + 1)
            if lt(v[first + child], v[first + child - 1]):
                child -= 1
            v[first + hole] = v[first + child]
            hole = child
        if length % 2 == 0 and child == (length - 2) // 2:
            child = 2 * (child + 1)
            v[first + hole] = v[first + child - 1]
            hole = child - 1
        parent = (hole - 1) // 2
        while hole > top and lt(v[first + parent], value):
            v[first + hole] = v[first + parent]
            hole = parent
            parent = (hole - 1) // 2
        v[first + hole] = value

    def heap_sort(first, last):
        length = last - first
        for parent in range((length - 2) // 2, -1, -1):
            sift(first, parent, length, v[first + parent])
        while last - first > 1:
            last -= 1
            value = v[last]
            v[last] = v[first]
            sift(first, 0, last - first, value)

    def introsort(first, last, depth):
        while last - first > 16:
            if depth == 0:
                heap_sort(first, last)
                return
            depth -= 1
            median_to_first(first, first + 1, first + (last - first) // 2, last - 1)
            cut = partition(first + 1, last, first)
            introsort(cut, last, depth)
            last = cut

    def insert(i, lo):   # an insertion step: guarded at lo
        value = v[i]
        while i > lo and lt(value, v[i - 1]):
            v[i] = v[i - 1]
            i -= 1
        v[i] = value

    n = len(v)
    if n > 1:
        introsort(0, n, 2 * int(math.log2(n)))
        for i in range(1, n):
            insert(i, 0)


class Universe:
    def __init__(self, n):
        self.p, self.rank, self.size, self.num = list(range(n)), [0] * n, [1] * n, n

    def find(self, x):
        y = x
        while y != self.p[y]:
            y = self.p[y]
        self.p[x] = y
        return y

    def join(self, x, y):
        if self.rank[x] > self.rank[y]:
            self.p[y] = x
            self.size[x] += self.size[y]
        else:
            self.p[x] = y
            self.size[y] += self.size[x]
            if self.rank[x] == self.rank[y]:
                self.rank[y] += 1
        self.num -= 1


def ref_smooth(src, sigma):
    sigma = max(F(sigma), F(0.01))
    mask = [F(math.exp(-0.5 * float(F(F(i) / sigma) * F(F(i) / sigma))))
            for i in range(int(math.ceil(float(sigma) * 4.0)) + 1)]
    total = F(0)
    for m in mask[1:]:
        total = F(total + abs(m))
    total = F(F(2) * total + abs(mask[0]))
    mask = [F(m / total) for m in mask]
    h, w = src.shape
    for _ in range(2):   # convolve_even twice, its output not transposed
        out = np.zeros_like(src)
        for x in range(w):
            acc = mask[0] * src[:, x]
            for i in range(1, len(mask)):
                acc = acc + mask[i] * (src[:, max(x - i, 0)] + src[:, min(x + i, w - 1)])
            out[:, x] = acc
        src = out
    return src


def ref_fh(image, sigma, c, min_size):
    """FHGraphSegment -> (ids (H * W,), count)."""
    _, h, w = image.shape
    b, g, r = (ref_smooth(image[i].astype(F), sigma).reshape(-1) for i in range(3))

    def edge(a, bb):
        return Edge(F(np.sqrt(F(F(F((r[a] - r[bb]) ** 2) + F((g[a] - g[bb]) ** 2)) + F((b[a] - b[bb]) ** 2)))), a, bb)
    edges = []
    for y in range(h):
        for x in range(w):
            p = y * w + x
            if x < w - 1:
                edges.append(edge(p, p + 1))
            if y < h - 1:
                edges.append(edge(p, p + w))
            if x < w - 1 and y < h - 1:
                edges.append(edge(p, p + w + 1))
            if x < w - 1 and y > 0:
                edges.append(edge(p, p - w + 1))
    std_sort(edges, lambda e1, e2: e1.w < e2.w)
    u = Universe(h * w)
    c = F(c)
    threshold = [c] * (h * w)
    for e in edges:
        a, bb = u.find(e.a), u.find(e.b)
        if a != bb and e.w <= threshold[a] and e.w <= threshold[bb]:
            u.join(a, bb)
            a = u.find(a)
            threshold[a] = F(e.w + F(c / F(u.size[a])))
    for e in edges:
        a, bb = u.find(e.a), u.find(e.b)
        if a != bb and (u.size[a] < min_size or u.size[bb] < min_size):
            u.join(a, bb)
    ids, out = {}, []
    for p in range(h * w):
        out.append(ids.setdefault(u.find(p), len(ids)))
    assert len(ids) == u.num
    return np.array(out), u.num


def ref_most_occurring(label, x, y, x2, y2):
    width, height = x2 - x, y2 - y          # fixedBox.width -= x ...
    width = min(max(width, 1), width - 1)   # ... then the fork's clamp
    height = min(max(height, 1), height - 1)
    counts = [0] * 255
    for v in label[y:y + height, x:x + width].reshape(-1):
        counts[int(v)] += 1
    return int(np.argmax(counts))


def ref_segmentation(data, labels, sigma, k, min_size, ext):
    """Forward_cpu: boxes (R, 5, 1, 1), labels (R, 1, 1, 1) or None, map (N, 1, H, W)."""
    n, _, h, w = data.shape
    rows, seg_labels, maps, start = [], [], [], 0
    for i in range(n):
        ids, count = ref_fh(data[i, :3], sigma, k, min_size)
        seg = ids.reshape(h, w)
        for s in range(count):
            ys, xs = np.nonzero(seg == s)
            x, y = min(max(xs.min() - ext, 0), w - 2), min(max(ys.min() - ext, 0), h - 2)
            x2, y2 = min(max(xs.max() + ext, 1), w - 1), min(max(ys.max() + ext, 1), h - 1)
            rows.append([i, x, y, x2, y2])
            if labels is not None:
                seg_labels.append(ref_most_occurring(labels[i, 0], x, y, x2, y2))
        maps.append(seg + start)
        start += count
    boxes = np.array(rows, F).reshape(-1, 5, 1, 1)
    lab = None if labels is None else np.array(seg_labels, F).reshape(-1, 1, 1, 1)
    return boxes, lab, np.array(maps, F)[:, None]


# ---- std::sort and the FH segmentation ----------------------------------------------------------------

# std::sort of Edges keyed ((7 i) % 5) // 2, i < 40, by the fork's Edge::operator< (g++ 12, libstdc++)
GPP_SORT = [0, 23, 20, 25, 18, 28, 15, 13, 30, 10, 33, 8, 35, 5, 3, 38, 31, 34, 29, 26, 36, 24, 39, 11, 1, 4, 6, 9,
            14, 16, 19, 21, 12, 22, 32, 27, 7, 17, 37, 2]


def test_sort_order_is_libstdcxx_std_sort():
    keys = [float((i * 7) % 5 // 2) for i in range(40)]
    assert hickson_sort_order(keys) == GPP_SORT
    assert GPP_SORT != sorted(range(40), key=keys.__getitem__)   # equal keys: not a stable sort


@pytest.mark.parametrize("n, values", [(17, 2), (300, 3), (2000, 40), (5000, 5000), (1, 1), (0, 1)])
def test_sort_order_matches_the_reference(n, values):
    keys = [float(v) for v in rng(n).integers(0, values, n)]
    edges = [Edge(k, i, i) for i, k in enumerate(keys)]
    std_sort(edges, lambda a, b: a.w < b.w)
    assert hickson_sort_order(keys) == [e.a for e in edges]


def test_sort_order_heap_sort_fallback():
    """McIlroy's adversary against the reference std::sort: keys that exhaust introsort's depth."""
    n = 3000
    val, gas = [n] * n, n
    state = {"solid": 0, "candidate": 0}

    def lt(x, y):
        if val[x] == gas and val[y] == gas:
            val[x if x == state["candidate"] else y] = state["solid"]
            state["solid"] += 1
        if val[x] == gas:
            state["candidate"] = x
        elif val[y] == gas:
            state["candidate"] = y
        return val[x] < val[y]
    std_sort(list(range(n)), lt)
    for tie in (1, 4):
        keys = [float(v // tie) for v in val]
        edges = [Edge(k, i, i) for i, k in enumerate(keys)]
        std_sort(edges, lambda a, b: a.w < b.w)
        assert hickson_sort_order(keys) == [e.a for e in edges]


# FHGraphSegment compiled from the fork (g++ 12): ids of the 7 x 11 image ((x + 3 y + 3 c + x y) % 4) * 10,
# smoothing 0, k 5, min_size 4 (a stable sort of the edges gives other segments), and of the 7 x 10 image
# ((x^2 + 3 y^2 + 5 c x + 2 x y) % 23) * 2.5, smoothing 0.6, k 8, min_size 3
GPP_TIES = [0, 0, 1, 1, 0, 0, 2, 2, 2, 0, 0, 0, 0, 1, 0, 1, 0, 2, 2, 2, 0, 0, 0, 0, 0, 1, 1, 0, 0, 2, 2, 0, 0, 0, 0, 0,
            0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3, 3, 3, 0, 4, 4, 4, 0, 0, 0, 0, 3, 3, 3, 0, 4, 4, 4, 0, 0, 0, 0, 3, 3, 3, 0,
            4, 4, 4, 0, 0]
GPP_SMOOTHED = [0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 0, 0, 3, 1, 4, 5, 5, 5, 2, 2, 3, 3, 6, 4, 7, 7, 5, 5, 2, 2, 8, 6, 4, 4, 7,
                7, 7, 7, 7, 7, 8, 6, 4, 4, 4, 9, 9, 9, 10, 10, 8, 11, 11, 11, 11, 11, 11, 11, 10, 10, 12, 12, 12, 12, 13,
                13, 13, 13, 10, 10]


@pytest.mark.parametrize("shape, formula, settings, want", [
    ((3, 7, 11), lambda c, y, x: ((x + 3 * y + 3 * c + x * y) % 4) * 10.0, (0.0, 5.0, 4), GPP_TIES),
    ((3, 7, 10), lambda c, y, x: ((x * x + 3 * y * y + 5 * c * x + 2 * x * y) % 23) * 2.5, (0.6, 8.0, 3),
     GPP_SMOOTHED),
])
def test_fh_segment_matches_the_compiled_fork(shape, formula, settings, want):
    image = np.fromfunction(formula, shape).astype(F)
    ids, count = hickson_fh_segment(torch.from_numpy(image), *settings)
    assert ids.tolist() == want and count == max(want) + 1
    assert ref_fh(image, *settings)[0].tolist() == want


@pytest.mark.parametrize("seed", range(6))
def test_fh_segment_matches_the_reference(seed):
    r = rng(seed)
    h, w = int(r.integers(2, 14)), int(r.integers(2, 14))
    image = (r.integers(0, 3, (3, h, w)) * 9.0 if seed % 2 else r.standard_normal((3, h, w)) * 20).astype(F)
    settings = ((0.0, 0.5, 0.9)[seed % 3], (3.0, 40.0)[seed % 2], (1, 4, 7)[seed % 3])
    ids, count = hickson_fh_segment(torch.from_numpy(image), *settings)
    want, want_count = ref_fh(image, *settings)
    assert ids.tolist() == want.tolist() and count == want_count


# ---- the layer ---------------------------------------------------------------------------------------

def seg_net(shapes, tops, param, bottoms=("data", "label")):
    bottom = " ".join(f'bottom: "{b}"' for b in bottoms[:len(shapes)])
    top = " ".join(f'top: "{t}"' for t in tops)
    return net(f'layer {{ name: "seg" type: "Segmentation" {bottom} {top} seg_param {{ {param} }} }}',
               inputs=dict(zip(bottoms, shapes)))


def blocky_batch(n, c, h, w, seed):
    """Images of a few flat blocks with noise: a handful of segments each."""
    r = rng(seed)
    blocks = r.integers(0, 3, (n, 3, (h + 3) // 4, (w + 4) // 5)) * 60.0
    data = np.repeat(np.repeat(blocks, 4, 2), 5, 3)[:, :, :h, :w] + r.uniform(-2, 2, (n, 3, h, w))
    return np.concatenate([data, r.standard_normal((n, c - 3, h, w)) * 100], 1).astype(F)


def test_segmentation_with_labels_and_map(tmp_path):
    n, c, h, w = 2, 4, 13, 17
    data = blocky_batch(n, c, h, w, 3)
    labels = rng(4).integers(0, 6, (n, 2, h, w)).astype(F) + F(0.75)
    param = "k: 300 min_size: 6 bbox_extension: 2 smoothing: 0.7"
    model = load_from_text(seg_net([(n, c, h, w), (n, 2, h, w)], ["boxes", "seglabels", "map"], param))
    assert [model.blob_shapes[t] for t in ("boxes", "seglabels", "map")] == [(100, 5, 1, 1), (100, 1, 1, 1),
                                                                            (n, 1, h, w)]
    boxes, seg_labels, maps = ref_segmentation(data, labels, 0.7, 300.0, 6, 2)
    assert 4 < boxes.shape[0] <= 100 and set(boxes[:, 0, 0, 0]) == {0, 1}
    feeds = {"data": data, "label": labels}
    for got in (model.run(feeds), model_py_outputs(model, feeds, tmp_path)):
        np.testing.assert_array_equal(got["boxes"], boxes)
        np.testing.assert_array_equal(got["seglabels"], seg_labels)
        np.testing.assert_array_equal(got["map"], maps)
    with pytest.raises(ExportError, match="seg.*Felzenszwalb-Huttenlocher.*--outputs"):
        model.export_onnx(str(tmp_path / "m.onnx"))


@pytest.mark.parametrize("tops, ext, sigma", [(["boxes", "map"], 0, 0.5), (["boxes"], 5, 0.0)])
def test_segmentation_one_bottom(tops, ext, sigma, tmp_path):
    n, c, h, w = 1, 3, 11, 19
    data = blocky_batch(n, c, h, w, 7)
    model = load_from_text(seg_net([(n, c, h, w)], tops, f"k: 150 min_size: 4 bbox_extension: {ext} "
                                                         f"smoothing: {sigma}"))
    boxes, _, maps = ref_segmentation(data, None, sigma, 150.0, 4, ext)
    for got in (model.run({"data": data}), model_py_outputs(model, {"data": data}, tmp_path)):
        np.testing.assert_array_equal(got["boxes"], boxes)
        if "map" in tops:
            np.testing.assert_array_equal(got["map"], maps)


def test_segmentation_keeps_the_inputs_device():
    from cuda_emulation import run_on_emulated_cuda
    model = load_from_text(seg_net([(1, 3, 8, 9), (1, 1, 8, 9)], ["boxes", "seglabels", "map"], "k: 100"))
    feeds = {"data": blocky_batch(1, 3, 8, 9, 2), "label": np.ones((1, 1, 8, 9), F)}
    out, mixes = run_on_emulated_cuda(model, feeds)
    assert not mixes, mixes
    np.testing.assert_array_equal(out["boxes"], model.run(feeds)["boxes"])


def test_segmentation_refuses_batches_past_the_blobs_first_rows():
    """Two images of more than 100 segments together: the fork's blob grows between them, zeroing the first's."""
    data = rng(5).uniform(0, 255, (2, 3, 12, 12)).astype(F)
    model = load_from_text(seg_net([(2, 3, 12, 12)], ["boxes"], "k: 0 min_size: 1 smoothing: 0"))
    with pytest.raises(LayerError, match="'seg'.*image 1 brings the batch to .* past the 100 rows"):
        model.run({"data": data})
    assert model.run({"data": data[:1]})["boxes"].shape == (144, 5, 1, 1)   # one image: every pixel a segment


@pytest.mark.parametrize("labels, param, message", [
    (np.full((1, 1, 9, 10), 255, F), "k: 100", "labels must lie in 0..254"),
    (np.full((1, 1, 9, 10), -1, F), "k: 100", "labels must lie in 0..254"),
    (None, "k: 100 bbox_extension: 0", "OpenCV refuses the label crop"),
])
def test_segmentation_refuses_what_the_fork_cannot_count(labels, param, message):
    data = np.zeros((1, 3, 9, 10), F)
    data[0, :, :, 4] = 200   # a one-column segment in the middle
    if labels is None:
        labels = np.zeros((1, 1, 9, 10), F)
    model = load_from_text(seg_net([(1, 3, 9, 10), (1, 1, 9, 10)], ["boxes", "seglabels"], param + " min_size: 1"))
    with pytest.raises(LayerError, match=f"'seg' \\(Segmentation\\): {message}"):
        model.run({"data": data, "label": labels})


@pytest.mark.parametrize("shapes, tops, param, message", [
    ([(1, 3, 8, 8)], ["b"], "method: 2", "seg_param.method must be 0"),
    ([(1, 3, 8, 8)], ["b"], "k: -1", "seg_param.k must be >= 0"),
    ([(1, 3, 8, 8)], ["b"], "smoothing: -0.5", "seg_param.smoothing must be >= 0"),
    ([(1, 3, 8, 8)], ["b"], "min_size: 3000000000", "seg_param.min_size must be < 2"),
    ([(1, 3, 8, 8), (1, 1, 8, 8)], ["b"], "k: 1", "give 2 or 3 tops"),
    ([(1, 2, 8, 8)], ["b"], "k: 1", "first 3 channels"),
    ([(3, 8, 8)], ["b"], "k: 1", "4-axis data bottom"),
    ([(1, 3, 8, 8), (1, 1, 8, 7)], ["b", "l"], "k: 1", "labels \\(N >= 1, C, 8, 8\\)"),
])
def test_segmentation_bad_settings_are_one_line(shapes, tops, param, message):
    with pytest.raises(LayerError, match=message):
        load_from_text(seg_net(shapes, tops, param))


@pytest.mark.parametrize("shapes, tops, param, message", [
    ([(1, 3, 8, 8)], ["b"], "method: 1", "SLIC\\) is unfinished"),
    ([(1, 3, 8, 8)], ["b"], "max_k: 300 min_k: 100", "rand\\(\\) seeded by the clock"),
    ([(1, 3, 8, 8)], ["b", "l", "m"], "k: 1", "never writes its second top"),
])
def test_segmentation_refuses_to_run_what_the_fork_leaves_open(shapes, tops, param, message, tmp_path):
    model = load_from_text(seg_net(shapes, tops, param))
    assert model.blob_shapes["b"] == (100, 5, 1, 1)
    with pytest.raises(LayerError, match=f"'seg' \\(Segmentation\\): .*{message}"):
        model.run({"data": np.zeros((1, 3, 8, 8), F)})
    with pytest.raises(ExportError, match=message):
        model.export_pytorch(str(tmp_path / "py"))


# ---- LabelData and the real nets ---------------------------------------------------------------------

def test_label_data_is_image_data():
    text = ('layer { name: "d" type: "LabelData" top: "data" top: "label" image_data_param { source: "x.txt" '
            'batch_size: 3 new_height: 21 new_width: 34 is_color: false } label_data_param { batch_size: 9 } }')
    model = load_from_text(text)
    assert model.blob_shapes["data"] == (3, 1, 21, 34) and model.blob_shapes["label"] == (3,)
    assert any("label_data_param is not read" in note for note in model.warnings)
    with pytest.raises(LayerError, match="new_height and new_width must be set together"):
        load_from_text(text.replace("new_width: 34", ""))
    with pytest.raises(LayerError, match="LabelData \\(tops data, label\\) takes 0 bottoms and 2 tops"):
        load_from_text(text.replace(' top: "label"', ""))


def test_semantic_labeling_demo_deploy_reads():
    model = load(str(REALWORLD / (DEMO + "deploy.prototxt")), random_weights=True)
    shapes = model.blob_shapes
    assert shapes["bboxes"] == (100, 5, 1, 1) and shapes["segmentations"] == (1, 1, 227, 227)
    assert shapes["pool5"] == (100, 256, 3, 3) and shapes["prob"] == (100, 20)


def test_semantic_labeling_demo_train_val_reads():
    model = load(str(REALWORLD / (DEMO + "train_val.prototxt")))
    shapes = model.blob_shapes
    assert shapes["data"] == (2, 3, 227, 227) and shapes["label"] == (2, 1, 227, 227)
    assert shapes["bboxes"] == (100, 5, 1, 1) and shapes["segLabels"] == (100, 1, 1, 1)
    node = next(n for n in model.layers if n.name == "seg")
    assert node.attrs["k"] == 200 and node.attrs["min_size"] == 200 and node.attrs["extension"] == 3
    train = load(str(REALWORLD / (DEMO + "train_val.prototxt")), phase="TRAIN")
    assert next(n for n in train.layers if n.name == "label").type == "LabelData"
    assert train.blob_shapes["label"] == (2, 1, 227, 227)
