"""MS-CNN's BoxOutput and Cascade R-CNN's BoxGroupOutput against plain readings of the forks' C++
(zhaoweicai/mscnn 534bcac box_output_layer.cpp, BoxIOU; zhaoweicai/cascade-rcnn 2252f46
box_group_output_layer.cpp, bbox_util.cpp), written here box by box in float32; torch and model.py
(ONNX refuses).  The ranking with tied scores: std_partial_sort_order against libstdc++ itself."""
import math
import shutil
import subprocess

import numpy as np
import pytest
from conftest import model_py_outputs

from caffeq.errors import CaffeqError, ExportError
from caffeq.layers.mscnn_proposals import std_partial_sort_order
from caffeq.model import load_from_text

F = np.float32


def clamp(v, lo, hi):
    v = v if lo < v else lo        # std::max(lo, v)
    return hi if hi < v else v     # std::min(hi, v)


def decode(d, means, stds, xyr, whr, fw, fh, col, row, stride):
    d = [F(v) for v in d]
    if stds is not None:
        d = [F(v * F(s)) + F(m) for v, s, m in zip(d, stds, means)]
    lo, hi = F(-1) / F(xyr), F(1) / F(xyr)
    wlo, whi = F(math.log(F(1) / F(whr))), F(math.log(F(whr)))
    x, y = clamp(d[0], lo, hi), clamp(d[1], lo, hi)
    w, h = clamp(d[2], wlo, whi), clamp(d[3], wlo, whi)
    x = F(x * F(fw)) + F((F(col) + F(0.5)) * F(stride))
    y = F(y * F(fh)) + F((F(row) + F(0.5)) * F(stride))
    w, h = F(float(F(fw)) * math.exp(w)), F(float(F(fh)) * math.exp(h))   # GCC 5: double exp and product
    return F(x - w / F(2)), F(y - h / F(2)), w, h


def greedy(boxes, thr, overlap):
    keep = [True] * len(boxes)
    for i in range(len(boxes)):
        if not keep[i]:
            continue
        for j in range(i + 1, len(boxes)):
            if keep[j] and overlap(boxes[i], boxes[j]) > F(thr):
                keep[j] = False
    return [b for b, k in zip(boxes, keep) if k]


def box_iou(a, b):   # MS-CNN's BoxIOU, (x, y, w, h), mode IOU
    if a[2] <= 0 or a[3] <= 0 or b[2] <= 0 or b[3] <= 0:
        return F(0)
    tlx, tly = max(a[0], b[0]), max(a[1], b[1])
    brx, bry = min(F(a[0] + a[2]), F(b[0] + b[2])), min(F(a[1] + a[3]), F(b[1] + b[3]))
    over = F(0) if tlx >= brx or tly >= bry else F(F(brx - tlx) * F(bry - tly))
    return F(over / F(F(F(a[2] * a[3]) + F(b[2] * b[3])) - over))


def jaccard(a, b):   # Cascade R-CNN's JaccardOverlap, inclusive pixels, mode IOU
    if a[2] < a[0] or a[3] < a[1] or b[2] < b[0] or b[3] < b[1]:
        return F(0)
    ix0, iy0, ix1, iy1 = max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3])
    inter = F(0) if ix0 > ix1 or iy0 >= iy1 else F(F(ix1 - ix0 + F(1)) * F(iy1 - iy0 + F(1)))
    sa = F(F(a[2] - a[0] + F(1)) * F(a[3] - a[1] + F(1)))
    sb = F(F(b[2] - b[0] + F(1)) * F(b[3] - b[1] + F(1)))
    union = F(F(sa + sb) - inter)
    return F(0) if union <= 0 else F(inter / union)


def ref_box_output(xs, p):
    rows = []
    for i in range(xs[0].shape[0]):
        boxes = []
        for j, x in enumerate(xs):
            classes, (height, width) = x.shape[1] - 4, x.shape[2:]
            img_w, img_h = int(F(width) * F(p["rates"][j])), int(F(height) * F(p["rates"][j]))
            for cell in range(height * width):
                r, c = divmod(cell, width)
                fg = F(-3.4028234663852886e38)
                for k in range(1, classes):
                    fg = max(fg, x[i, k, r, c])
                fg = F(fg - x[i, 0, r, c])
                if fg >= F(p["fg_thr"]):
                    bx, by, bw, bh = decode(x[i, classes:, r, c], p["means"], p["stds"], p["xyr"], p["whr"],
                                            p["fw"][j], p["fh"][j], c, r, p["rates"][j])
                    bx, by = max(bx, F(0)), max(by, F(0))
                    bw, bh = min(bw, F(F(img_w) - bx)), min(bh, F(F(img_h) - by))
                    if bw >= F(p["min_size"]) and bh >= F(p["min_size"]):
                        boxes.append((bx, by, bw, bh, fg, len(boxes)))
        boxes.sort(key=lambda b: (b[4], b[5]), reverse=True)
        if p["max_nms"]:
            boxes = boxes[:p["max_nms"]]
        kept = greedy(boxes, p["iou"], box_iou)
        if p["max_post"]:
            kept = kept[:p["max_post"]]
        rows += [[i, b[0], b[1], F(b[0] + b[2]), F(b[1] + b[3]), b[4]] for b in kept]
    return np.array(rows, F).reshape(-1, 6, 1, 1) if rows else None


def ref_box_group_output(xs, p):
    rows = []
    groups = [len(g[0]) for g in p["groups"]]
    for i in range(xs[0].shape[0] // groups[0]):
        boxes = []
        for j, (fws, fhs, stride) in enumerate(p["groups"]):
            prob, delta = xs[2 * j], xs[2 * j + 1]
            height, width = prob.shape[2:]
            for k in range(groups[j]):
                g = i * groups[j] + k
                for cell in range(height * width):
                    r, c = divmod(cell, width)
                    fg = F(F(1) - prob[g, 0, r, c])
                    if fg >= F(p["fg_thr"]):
                        x, y, w, h = decode(delta[g, :, r, c], p["means"], p["stds"], p["xyr"], p["whr"],
                                            fws[k], fhs[k], c, r, stride)
                        x2, y2 = F(F(x + w) - F(1)), F(F(y + h) - F(1))
                        b = (max(F(0), x), max(F(0), y), min(F(width * stride), x2), min(F(height * stride), y2))
                        if F(b[2] - b[0] + F(1)) >= F(p["min_size"]) and F(b[3] - b[1] + F(1)) >= F(p["min_size"]):
                            boxes.append(b + (fg,))
        boxes.sort(key=lambda b: b[4], reverse=True)   # no tied scores in these tests
        if p["max_nms"]:
            boxes = boxes[:p["max_nms"]]
        kept = greedy(boxes, p["iou"], jaccard)
        if p["max_post"]:
            kept = kept[:p["max_post"]]
        rows += [[i, *b] for b in kept]
    return np.array(rows, F).reshape(-1, 6, 1, 1) if rows else None


def settings_text(p):
    norm = (f'bbox_reg_param {{ {" ".join(f"bbox_mean: {v}" for v in p["means"])} '
            f'{" ".join(f"bbox_std: {v}" for v in p["stds"])} }}') if p["stds"] else ""
    return (f'fg_thr: {p["fg_thr"]} iou_thr: {p["iou"]} field_whr: {p["whr"]} field_xyr: {p["xyr"]} '
            f'max_nms_num: {p["max_nms"]} max_post_nms_num: {p["max_post"]} min_size: {p["min_size"]}'), norm


def distinct_scores(rng, shape):
    """Scores without ties, so a plain sort is the reference ranking."""
    return (rng.permutation(int(np.prod(shape))).reshape(shape).astype(F) / np.prod(shape)).astype(F)


BOX_OUTPUT_CASES = [
    dict(fg_thr=-0.2, iou=0.5, whr=2, xyr=2, max_nms=0, max_post=0, min_size=4, means=None, stds=None),
    dict(fg_thr=0.1, iou=0.3, whr=3, xyr=1.5, max_nms=20, max_post=9, min_size=2,
         means=[0.1, -0.1, 0.0, 0.2], stds=[0.5, 0.5, 0.3, 0.3]),
]


@pytest.mark.parametrize("p", BOX_OUTPUT_CASES)
def test_box_output_matches_the_fork(p, tmp_path):
    rng = np.random.default_rng(int(p["fg_thr"] * 10) + 3)
    p = dict(p, fw=[10, 22], fh=[14, 30], rates=[4, 8])
    shapes = [(2, 3 + 4, 5, 7), (2, 3 + 4, 3, 4)]
    xs = []
    for s in shapes:
        x = rng.normal(0, 0.6, s).astype(F)
        x[:, :3] = distinct_scores(rng, (s[0], 3) + s[2:]) * 2 - 1
        xs.append(x)
    main, norm = settings_text(p)
    fields = " ".join(f"field_w: {w} field_h: {h} downsample_rate: {r}" for w, h, r in zip(p["fw"], p["fh"], p["rates"]))
    text = ('layer { name: "in" type: "Input" top: "a" top: "b" input_param { '
            + " ".join("shape { " + " ".join(f"dim: {d}" for d in s) + " }" for s in shapes) + " } }\n"
            f'layer {{ name: "out" type: "BoxOutput" bottom: "a" bottom: "b" top: "rois" top: "scored" '
            f'box_output_param {{ {main} {fields} }} {norm} }}\n')
    model = load_from_text(text)
    feeds = {"a": xs[0], "b": xs[1]}
    ref = ref_box_output(xs, p)
    assert ref is not None and ref.shape[0] > 3
    for name, got in (("torch", model.run(feeds)), ("model.py", model_py_outputs(model, feeds, tmp_path))):
        np.testing.assert_array_equal(got["scored"], ref, err_msg=name)
        np.testing.assert_array_equal(got["rois"], ref[:, :5], err_msg=name)
    with pytest.raises(ExportError, match="no ONNX form"):
        model.export_onnx(str(tmp_path / "m.onnx"))


GROUP_CASES = [
    dict(fg_thr=0.3, iou=0.5, whr=2, xyr=2, max_nms=0, max_post=0, min_size=3, means=None, stds=None),
    dict(fg_thr=0.5, iou=0.4, whr=2.5, xyr=1, max_nms=15, max_post=6, min_size=2,
         means=[0.0, 0.1, -0.1, 0.0], stds=[0.2, 0.2, 0.4, 0.4]),
]


@pytest.mark.parametrize("p", GROUP_CASES)
def test_box_group_output_matches_the_fork(p, tmp_path):
    rng = np.random.default_rng(int(p["fg_thr"] * 10))
    p = dict(p, groups=[[[12, 20], [16, 28], 4], [[40], [36], 8]])
    shapes = [(2 * 2, 3, 5, 7), (2 * 2, 4, 5, 7), (2 * 1, 3, 3, 4), (2 * 1, 4, 3, 4)]
    xs = [distinct_scores(rng, s) if s[1] == 3 else rng.normal(0, 0.7, s).astype(F) for s in shapes]
    main, norm = settings_text(p)
    groups = " ".join("box_group_param { " + " ".join(f"field_w: {w} field_h: {h}" for w, h in zip(fw, fh))
                      + f" stride: {st} }}" for fw, fh, st in p["groups"])
    text = ('layer { name: "in" type: "Input" top: "s0" top: "b0" top: "s1" top: "b1" input_param { '
            + " ".join("shape { " + " ".join(f"dim: {d}" for d in s) + " }" for s in shapes) + " } }\n"
            f'layer {{ name: "out" type: "BoxGroupOutput" bottom: "s0" bottom: "b0" bottom: "s1" bottom: "b1" '
            f'top: "rois" top: "scored" box_group_output_param {{ {main} {groups} }} {norm} }}\n')
    model = load_from_text(text)
    feeds = dict(zip(["s0", "b0", "s1", "b1"], xs))
    ref = ref_box_group_output(xs, p)
    assert ref is not None and ref.shape[0] > 3 and set(ref[:, 0, 0, 0]) == {0, 1}
    for name, got in (("torch", model.run(feeds)), ("model.py", model_py_outputs(model, feeds, tmp_path))):
        np.testing.assert_array_equal(got["scored"], ref, err_msg=name)
        np.testing.assert_array_equal(got["rois"], ref[:, :5], err_msg=name)


def test_no_box_gives_the_forks_placeholder_rows():
    text = ('layer { name: "in" type: "Input" top: "s" top: "b" input_param { shape { dim: 1 dim: 2 dim: 3 dim: 3 } '
            'shape { dim: 1 dim: 4 dim: 3 dim: 3 } } }\n'
            'layer { name: "out" type: "BoxGroupOutput" bottom: "s" bottom: "b" top: "rois" top: "scored" '
            'box_group_output_param { fg_thr: 0.5 box_group_param { field_w: 8 field_h: 8 stride: 4 } } }\n')
    got = load_from_text(text).run({"s": np.ones((1, 2, 3, 3), F), "b": np.zeros((1, 4, 3, 3), F)})
    np.testing.assert_array_equal(got["rois"].reshape(-1), [0, 1, 1, 10, 10])
    np.testing.assert_array_equal(got["scored"].reshape(-1), np.zeros(6))


def test_partial_sort_with_ties_is_libstdcxx():
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no g++ to run std::partial_sort")
    source = ("#include <algorithm>\n#include <cstdio>\n#include <vector>\n"
              "struct B { float s; int i; };\n"
              "int main() { int n, k; while (scanf(\"%d %d\", &n, &k) == 2) { std::vector<B> v(n);"
              " for (int i = 0; i < n; i++) { scanf(\"%f\", &v[i].s); v[i].i = i; }"
              " std::partial_sort(v.begin(), v.begin() + k, v.end(),"
              " [](const B& a, const B& b) { return a.s > b.s; });"
              " for (int i = 0; i < k; i++) printf(\"%d \", v[i].i); printf(\"\\n\"); } }\n")
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/ps.cpp", "w") as f:
            f.write(source)
        subprocess.run([cxx, "-O2", "-o", f"{tmp}/ps", f"{tmp}/ps.cpp"], check=True)
        rng = np.random.default_rng(5)
        cases = []
        for _ in range(400):
            n = int(rng.integers(1, 50))
            cases.append(((rng.integers(0, 4, n) / 2).tolist(), int(rng.integers(1, n + 1))))
        text = "\n".join(f"{len(s)} {k} " + " ".join(map(str, s)) for s, k in cases) + "\n"
        out = subprocess.run([f"{tmp}/ps"], input=text, capture_output=True, text=True, check=True).stdout
    for (scores, k), line in zip(cases, out.splitlines()):
        assert std_partial_sort_order(scores, k) == [int(v) for v in line.split()]


@pytest.mark.parametrize("layer, message", [
    ('type: "BoxOutput" bottom: "a" top: "r" box_output_param { field_w: 8 }', "one field_h, field_w"),
    ('type: "BoxOutput" bottom: "a" top: "r" box_output_param { field_w: 8 field_h: 8 downsample_rate: 4 '
     'field_whr: 0 }', "field_whr and field_xyr must be > 0"),
    ('type: "BoxGroupOutput" bottom: "a" top: "r" box_group_output_param { }', "bottom pairs"),
])
def test_bad_proposal_settings_are_one_line(layer, message):
    text = ('layer { name: "in" type: "Input" top: "a" input_param { shape { dim: 1 dim: 6 dim: 3 dim: 3 } } }\n'
            f'layer {{ name: "out" {layer} }}\n')
    with pytest.raises(CaffeqError, match=message):
        load_from_text(text)


def test_only_box_group_output_checks_the_stds():
    # MS-CNN's BoxOutput multiplies by bbox_std whatever it is; Cascade R-CNN's LayerSetUp CHECKs > 0
    norm = "bbox_reg_param { bbox_mean: 0 bbox_mean: 0 bbox_mean: 0 bbox_mean: 0 bbox_std: 0 bbox_std: 1 bbox_std: 1 bbox_std: 1 }"
    box = ('layer { name: "in" type: "Input" top: "a" input_param { shape { dim: 1 dim: 6 dim: 3 dim: 3 } } }\n'
           'layer { name: "out" type: "BoxOutput" bottom: "a" top: "r" box_output_param { field_w: 8 field_h: 8 '
           f'downsample_rate: 4 }} {norm} }}\n')
    assert load_from_text(box).blob_shapes["r"] == (1, 5, 1, 1)
    group = ('layer { name: "in" type: "Input" top: "s" top: "b" input_param { shape { dim: 1 dim: 2 dim: 3 dim: 3 } '
             'shape { dim: 1 dim: 4 dim: 3 dim: 3 } } }\n'
             'layer { name: "out" type: "BoxGroupOutput" bottom: "s" bottom: "b" top: "r" box_group_output_param { '
             f'box_group_param {{ field_w: 8 field_h: 8 stride: 4 }} }} {norm} }}\n')
    with pytest.raises(CaffeqError, match="bbox_std must all be > 0"):
        load_from_text(group)


def test_one_net_with_both_proposal_layers_writes_one_model_py(tmp_path):
    """BoxOutput and BoxGroupOutput share helpers (f32_max, greedy_nms...): model.py writes each once and runs
    both as the torch path does."""
    rng = np.random.default_rng(5)
    p = BOX_OUTPUT_CASES[0]
    main, _ = settings_text(p)
    a = rng.normal(0, 0.6, (1, 7, 5, 7)).astype(F)
    a[:, :3] = distinct_scores(rng, (1, 3, 5, 7)) * 2 - 1
    s, b = distinct_scores(rng, (1, 3, 5, 7)), rng.normal(0, 0.7, (1, 4, 5, 7)).astype(F)
    text = ('layer { name: "in" type: "Input" top: "a" top: "s" top: "b" input_param { shape { dim: 1 dim: 7 dim: 5 '
            'dim: 7 } shape { dim: 1 dim: 3 dim: 5 dim: 7 } shape { dim: 1 dim: 4 dim: 5 dim: 7 } } }\n'
            f'layer {{ name: "one" type: "BoxOutput" bottom: "a" top: "rois1" box_output_param {{ {main} '
            'field_w: 10 field_h: 14 downsample_rate: 4 } }\n'
            f'layer {{ name: "two" type: "BoxGroupOutput" bottom: "s" bottom: "b" top: "rois2" '
            f'box_group_output_param {{ {main} box_group_param {{ field_w: 12 field_h: 16 stride: 4 }} }} }}\n')
    model = load_from_text(text)
    feeds = {"a": a, "s": s, "b": b}
    want, got = model.run(feeds), model_py_outputs(model, feeds, tmp_path)
    assert want["rois1"].shape[0] > 1 and want["rois2"].shape[0] > 1
    for name in ("rois1", "rois2"):
        np.testing.assert_array_equal(got[name], want[name])
