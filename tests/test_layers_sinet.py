"""xw-hu/SINet 0ef178f: CAROIPooling, ROISplit and ROIFeatureSplit against loop-by-loop readings of the
fork's C++ (caroi_pooling_layer.cu CAROIPoolForward, roi_split_layer.cpp Forward_cpu at TEST,
roi_feature_split_layer.cu FeatureSplitForward) in float32, nvcc's contracted multiply-adds as fmaf;
torch, onnxruntime where the layer exports, and model.py."""
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from c_reference import c_round
from conftest import check_everywhere, model_py_outputs, net

from caffeq.errors import CaffeqError, ExportError
from caffeq.model import load, load_from_text

F = np.float32
FLT_MAX = float(np.finfo(np.float32).max)
CORPUS = Path("/work/corpus94a")
DEPLOYS = [CORPUS / f"xw-hu__SINet__examples__kitti_car__SINet-{k}-576-2-branch__SINet_deploy.prototxt"
           for k in ("pva", "vgg")]


def fmaf(a, b, c):
    """fmaf: the exact a b + c (fractions) rounded once to the nearest float32, ties to even."""
    if not all(math.isfinite(float(v)) for v in (a, b, c)):   # NaN / inf: no rounding to get right
        return F(float(a) * float(b) + float(c))
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    near = F(float(exact))
    best = None
    for cand in (np.nextafter(near, F(-np.inf)), near, np.nextafter(near, F(np.inf))):
        key = (abs(Fraction(float(cand)) - exact), int(np.array(cand).view(np.int32)) & 1)
        if best is None or key < best[0]:
            best = (key, cand)
    return F(best[1])


def cuda_floor(v):
    """(int)floor(v) on the device: NaN converts to 0."""
    return 0 if math.isnan(v) else math.floor(v)


def ref_caroi(x, rois, ph, pw, scale, pad_ratio):
    """CAROIPoolForward, one output element at a time."""
    n_img, c, h, w = x.shape
    out = np.zeros((len(rois), c, ph, pw), F)
    scale, pad_ratio = F(scale), F(pad_ratio)
    for n, roi in enumerate(rois.astype(F)):
        b = int(roi[0])
        size_w, size_h = F(F(roi[3] - roi[1]) + F(1)), F(F(roi[4] - roi[2]) + F(1))
        # roi[1] - pad_w with pad_w = size_w * pad_ratio: contracted by nvcc to fmaf(-size_w, pad_ratio, roi[1])
        sw = max(int(c_round(F(fmaf(-size_w, pad_ratio, roi[1]) * scale))), 0)
        sh = max(int(c_round(F(fmaf(-size_h, pad_ratio, roi[2]) * scale))), 0)
        ew = int(c_round(F(fmaf(size_w, pad_ratio, roi[3]) * scale)))
        eh = int(c_round(F(fmaf(size_h, pad_ratio, roi[4]) * scale)))
        ew, eh = min(int(c_round(F(F(w) / scale))) - 1, ew), min(int(c_round(F(F(h) / scale))) - 1, eh)
        rw, rh = max(ew - sw + 1, 1), max(eh - sh + 1, 1)
        bh, bw = F(F(rh) / F(ph)), F(F(rw) / F(pw))
        for ch in range(c):
            data = x[b, ch]

            def feat(iy, ix):
                return data[min(max(sh + iy, 0), h - 1), min(max(sw + ix, 0), w - 1)]

            for i in range(ph):
                for j in range(pw):
                    if bh < 1 or bw < 1:
                        if bh > 1 or bw > 1:
                            ew_, eh_ = (pw, rh) if bh > 1 else (rw, ph)
                            xr, yr = F(F(rw - 1) / F(ew_ - 1)), F(F(rh - 1) / F(eh_ - 1))
                            if bh > 1:
                                hs, he, ws, we = math.floor(F(i) * bh), math.ceil(F(i + 1) * bh), j, j + 1
                            else:
                                hs, he, ws, we = i, i + 1, math.floor(F(j) * bw), math.ceil(F(j + 1) * bw)
                            hs, he = min(max(hs, 0), h), min(max(he, 0), h)
                            ws, we = min(max(ws, 0), w), min(max(we, 0), w)
                            best = F(0) if (he <= hs or we <= ws) else F(-FLT_MAX)
                            for hi in range(hs, he):
                                for wi in range(ws, we):
                                    ix, iy = cuda_floor(F(xr * F(wi))), cuda_floor(F(yr * F(hi)))
                                    d00 = feat(iy, ix) if ix < rw and iy < rh else F(0)
                                    if bh > 1:
                                        a = fmaf(xr, wi, -ix)
                                        d10 = feat(iy, ix + 1) if ix + 1 < rw and iy < rh else F(0)
                                        v = fmaf(a, d10, fmaf(-d00, a, d00))
                                    else:
                                        bb = fmaf(yr, hi, -iy)
                                        d01 = feat(iy + 1, ix) if ix < rw and iy + 1 < rh else F(0)
                                        v = fmaf(bb, d01, fmaf(-d00, bb, d00))
                                    if v > best:
                                        best = v
                            out[n, ch, i, j] = best
                        else:
                            with np.errstate(invalid="ignore", divide="ignore"):   # 0 / 0 with a 1-wide grid
                                xr, yr = F(F(rw - 1) / F(pw - 1)), F(F(rh - 1) / F(ph - 1))
                            ix, iy = cuda_floor(F(xr * F(j))), cuda_floor(F(yr * F(i)))
                            a, bb = fmaf(xr, j, -ix), fmaf(yr, i, -iy)

                            def tap(dy, dx):
                                ok = ix + dx < rw and iy + dy < rh
                                return feat(iy + dy, ix + dx) if ok else F(0)

                            t1 = fmaf(a, tap(0, 1), fmaf(-tap(0, 0), a, tap(0, 0)))
                            t2 = fmaf(a, tap(1, 1), fmaf(-tap(1, 0), a, tap(1, 0)))
                            out[n, ch, i, j] = fmaf(bb, t2, fmaf(-t1, bb, t1))
                    else:
                        hs = min(max(math.floor(F(i) * bh) + sh, 0), h)
                        he = min(max(math.ceil(F(i + 1) * bh) + sh, 0), h)
                        ws = min(max(math.floor(F(j) * bw) + sw, 0), w)
                        we = min(max(math.ceil(F(j + 1) * bw) + sw, 0), w)
                        best = F(0) if (he <= hs or we <= ws) else F(-FLT_MAX)
                        for hh in range(hs, he):
                            for ww in range(ws, we):
                                if data[hh, ww] > best:
                                    best = data[hh, ww]
                        out[n, ch, i, j] = best
    return out


def ref_roi_split(rois, branch_num, a1, a2):
    counts, table = [0] * branch_num, []
    for roi in rois.reshape(len(rois), -1).astype(F):
        area = int(F(F(roi[4] - roi[2]) + F(1))) * int(F(F(roi[3] - roi[1]) + F(1)))
        if area < a1:
            k = 1
        elif branch_num == 3 and area <= a2:
            k = 2
        else:
            k = branch_num
        table.append([counts[k - 1], k])
        counts[k - 1] += 1
    return (np.array(counts, F).reshape(-1, 1, 1, 1), np.array(table, F).reshape(-1, 2, 1, 1))


def ref_feature_split(x, counts, table, branch_num):
    tops = [np.zeros((max(int(counts.reshape(-1)[k]), 1),) + x.shape[1:], F) for k in range(branch_num)]
    for n, (row, k) in enumerate(table.reshape(-1, 2)):
        if k in range(1, branch_num + 1):
            tops[int(k) - 1][max(int(row), 0)] = x[n]
    return tops


def mixed_rois(rng, n_img, img_h, img_w):
    """Rois of every kind for a 7 x 5 grid at scale 1/4: large, tall-narrow, wide-short, tiny, one cell,
    partly and wholly off the map, corners that are x.5 after scaling."""
    rows = [[0, 2, 3, 60, 40], [1, 5, 1, 13, 44], [0, 0, 30, 50, 36], [1, 9, 9, 15, 14], [0, 20, 20, 20, 20],
            [1, 70, 2, 90, 30], [0, 6, 10, 10, 42], [1, 1, 2, 50, 9], [0, 2.0, 6.0, 26.0, 14.0],
            [1, -10, -6, 30, 60], [0, 100, 90, 120, 110]]
    for _ in range(6):
        x1, y1 = rng.uniform(-4, img_w), rng.uniform(-4, img_h)
        rows.append([rng.integers(0, n_img), x1, y1, x1 + rng.uniform(0, 40), y1 + rng.uniform(0, 40)])
    return np.array(rows, F)


@pytest.mark.parametrize("ph, pw, scale, pad", [(5, 7, 0.25, 0.0), (4, 3, 0.5, 0.1), (1, 3, 0.25, 0.0)])
def test_caroi_pooling_matches_the_kernel(ph, pw, scale, pad, tmp_path):
    rng = np.random.default_rng(ph * 10 + pw)
    x = rng.normal(0, 1, (2, 3, 11, 17)).astype(F)
    rois = mixed_rois(rng, 2, 44, 68)
    text = net(f'layer {{ name: "p" type: "CAROIPooling" bottom: "x" bottom: "r" top: "o" caroi_pooling_param {{ '
               f'pooled_h: {ph} pooled_w: {pw} spatial_scale: {scale} pad_ratio: {pad} }} }}',
               inputs={"x": list(x.shape), "r": list(rois.shape)})
    model = load_from_text(text)
    feeds = {"x": x, "r": rois}
    ref = ref_caroi(x, rois, ph, pw, scale, pad)
    assert np.isnan(ref).any() == (ph == 1)   # a 1-cell roi on a 1-row grid: the kernel's 0 / 0
    for name, got in (("torch", model.run(feeds)), ("model.py", model_py_outputs(model, feeds, tmp_path))):
        np.testing.assert_array_equal(got["o"], ref, err_msg=name)
    with pytest.raises(ExportError, match="context-aware"):
        model.export_onnx(str(tmp_path / "m.onnx"))


def test_caroi_pooling_takes_every_branch():
    # the rois above reach all four branches of the kernel at 5 x 7, 1/4
    rois = mixed_rois(np.random.default_rng(0), 2, 44, 68)
    def edge(v):
        return int(c_round(F(v * F(0.25))))

    sizes = [(max(edge(r[4]) - max(edge(r[2]), 0) + 1, 1), max(edge(r[3]) - max(edge(r[1]), 0) + 1, 1)) for r in rois]
    kinds = {("large" if h >= 5 and w >= 7 else "tall" if h > 5 else "wide" if w > 7 else "small") for h, w in sizes}
    assert kinds == {"large", "tall", "wide", "small"}


def test_fma32_rounds_once():
    import torch

    from caffeq.layers.sinet import fma32
    # a b = 2^-24 + 2^-60: 1 + a b rounds up in float32, but its float64 sum is the midpoint 1 + 2^-24
    a, b, c = F(1 + 2.0 ** -12), F(2.0 ** -24 * (1 - 2.0 ** -12 + 2.0 ** -24)), F(1)
    assert F(float(a) * float(b) + float(c)) == F(1)           # rounding twice: wrong
    rng = np.random.default_rng(5)
    trio = np.concatenate([np.array([[a, b, c], [-a, b, -c], [a, b / F(2 ** 100), F(2.0 ** -126)]], F),
                           rng.normal(0, 1, (200, 3)).astype(F)])
    got = fma32(*(torch.from_numpy(trio[:, k].copy()) for k in range(3))).numpy()
    np.testing.assert_array_equal(got, [fmaf(*t) for t in trio])
    assert got[0] == F(1 + 2.0 ** -23)


def test_caroi_pooling_pads_with_fmaf(tmp_path):
    # x1 - pad with pad = (x2 - x1 + 1) 0.1: 17.5 after scaling when rounded twice, 17.499998 with fmaf
    x1, x2 = F(72.6473617553711), F(98.12101745605469)
    size = F(F(x2 - x1) + F(1))
    assert c_round(F(F(x1 - F(size * F(0.1))) * F(0.25))) == 18
    rois = np.array([[0, x1, 3, x2, 30]], F)
    x = np.broadcast_to(-np.arange(31, dtype=F), (1, 2, 11, 31)).copy()   # the max of a bin: its first column
    text = net('layer { name: "p" type: "CAROIPooling" bottom: "x" bottom: "r" top: "o" caroi_pooling_param { '
               'pooled_h: 3 pooled_w: 4 spatial_scale: 0.25 pad_ratio: 0.1 } }',
               inputs={"x": list(x.shape), "r": list(rois.shape)})
    got = load_from_text(text).run({"x": x, "r": rois})["o"]
    ref = ref_caroi(x, rois, 3, 4, 0.25, 0.1)
    np.testing.assert_array_equal(got, ref)
    assert (got[..., 0] == -17).all()


def test_caroi_pooling_skips_nan_in_resampled_bins(tmp_path):
    # tall and wide rois (max over resampled rows / columns): the kernel's v > maxval passes NaN by
    rng = np.random.default_rng(4)
    x = rng.normal(0, 1, (1, 2, 13, 15)).astype(F)
    x[0, 0, 2:9, 3] = np.nan
    x[0, 1, 4, 2:12] = np.nan
    rois = np.array([[0, 2, 1, 4, 11], [0, 1, 3, 13, 5], [0, 3, 2, 3, 12]], F)
    text = net('layer { name: "p" type: "CAROIPooling" bottom: "x" bottom: "r" top: "o" caroi_pooling_param { '
               'pooled_h: 4 pooled_w: 5 spatial_scale: 1 } }', inputs={"x": list(x.shape), "r": list(rois.shape)})
    model = load_from_text(text)
    ref = ref_caroi(x, rois, 4, 5, 1.0, 0.0)
    assert not np.isnan(ref).any() and (ref == -FLT_MAX).any()
    for name, got in (("torch", model.run({"x": x, "r": rois})),
                      ("model.py", model_py_outputs(model, {"x": x, "r": rois}, tmp_path))):
        np.testing.assert_array_equal(got["o"], ref, err_msg=name)


def test_caroi_pooling_chunks_change_nothing():
    import torch

    from caffeq.layers.sinet import caroi_pool
    rng = np.random.default_rng(9)
    x = torch.from_numpy(rng.normal(0, 1, (2, 3, 11, 17)).astype(F))
    rois = torch.from_numpy(mixed_rois(rng, 2, 44, 68))
    whole = caroi_pool(x, rois, 5, 7, 0.25, 0.0)
    np.testing.assert_array_equal(caroi_pool(x, rois, 5, 7, 0.25, 0.0, budget=1).numpy(), whole.numpy())
    np.testing.assert_array_equal(whole.numpy(), ref_caroi(x.numpy(), rois.numpy(), 5, 7, 0.25, 0.0))


@pytest.mark.parametrize("branch_num", [2, 3])
def test_roi_split_matches_the_fork(branch_num, tmp_path):
    rng = np.random.default_rng(branch_num)
    x1, y1 = rng.uniform(0, 300, 13), rng.uniform(0, 200, 13)
    rois = np.stack([rng.integers(0, 2, 13), x1, y1, x1 + rng.uniform(0, 90, 13), y1 + rng.uniform(0, 70, 13)],
                    1).astype(F).reshape(13, 5, 1, 1)
    a2 = " split_area2: 3000" if branch_num == 3 else ""
    text = net(f'layer {{ name: "s" type: "ROISplit" bottom: "r" top: "num" top: "hash" roi_split_param {{ '
               f'branch_num: {branch_num} split_area1: 1500{a2} fluctuation_range_large: 100 }} }}',
               inputs={"r": list(rois.shape)})
    model = load_from_text(text)
    counts, table = ref_roi_split(rois, branch_num, 1500, 3000)
    assert (counts > 0).all()
    check_everywhere(model, {"r": rois}, {"num": counts, "hash": table}, tmp_path)


@pytest.mark.parametrize("branch_num", [2, 3])
def test_roi_feature_split_matches_the_kernel(branch_num, tmp_path):
    rng = np.random.default_rng(7 + branch_num)
    x = rng.normal(0, 1, (9, 3, 5, 4)).astype(F)
    branch = np.array([1, 2, 1, 1, 2, 2, 1, 2, 1]) if branch_num == 2 else np.array([1, 3, 1, 3, 3, 1, 1, 3, 3])
    table = np.zeros((9, 2), F)
    counts = np.zeros(branch_num, F)
    for n, k in enumerate(branch):
        table[n] = [counts[k - 1], k]
        counts[k - 1] += 1
    tops = " ".join(f'top: "t{k}"' for k in range(branch_num))
    text = net(f'layer {{ name: "f" type: "ROIFeatureSplit" bottom: "x" bottom: "num" bottom: "hash" {tops} '
               f'roi_feature_split_param {{ branch_num: {branch_num} }} }}',
               inputs={"x": [9, 3, 5, 4], "num": [branch_num, 1, 1, 1], "hash": [9, 2, 1, 1]})
    model = load_from_text(text)
    feeds = {"x": x, "num": counts.reshape(-1, 1, 1, 1), "hash": table.reshape(9, 2, 1, 1)}
    refs = ref_feature_split(x, counts, table, branch_num)
    if branch_num == 3:
        assert refs[1].shape[0] == 1 and not refs[1].any()   # the empty middle branch: one zero row
    for name, got in (("torch", model.run(feeds)), ("model.py", model_py_outputs(model, feeds, tmp_path))):
        for k, ref in enumerate(refs):
            np.testing.assert_array_equal(got[f"t{k}"], ref, err_msg=f"{name} t{k}")
    with pytest.raises(ExportError, match="counts bottom"):
        model.export_onnx(str(tmp_path / "m.onnx"))


SMALL_SINET = """
layer { name: "in" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 36 dim: 52 } } }
layer { name: "c1" type: "Convolution" bottom: "data" top: "c1" convolution_param { num_output: 4 pad: 1 kernel_size: 3 } }
layer { name: "p1" type: "Pooling" bottom: "c1" top: "p1" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "c2" type: "Convolution" bottom: "p1" top: "c2" convolution_param { num_output: 5 pad: 1 kernel_size: 3 } }
layer { name: "l1" type: "Convolution" bottom: "c2" top: "l1" convolution_param { num_output: 7 pad: 1 kernel_size: 3 } }
layer { name: "proposals" type: "BoxOutput" bottom: "l1" top: "proposals" top: "proposals_score"
  box_output_param { fg_thr: -1 iou_thr: 0.65 nms_type: "IOU" field_w: 12 field_h: 16 downsample_rate: 2
  field_whr: 2 field_xyr: 2 max_nms_num: 40 min_size: 2 } }
layer { name: "ROISplit" type: "ROISplit" bottom: "proposals" top: "roi_num" top: "hash_table"
  roi_split_param { branch_num: 2 split_area1: 150 fluctuation_range_large: 10 fluctuation_range_small: 10 } }
layer { name: "roi_pool_1" type: "CAROIPooling" bottom: "c1" bottom: "proposals" top: "roi_pool_1"
  caroi_pooling_param { pooled_w: 5 pooled_h: 4 spatial_scale: 1 } }
layer { name: "roi_pool_2" type: "CAROIPooling" bottom: "c2" bottom: "proposals" top: "roi_pool_2"
  caroi_pooling_param { pooled_w: 5 pooled_h: 4 spatial_scale: 0.5 } }
layer { name: "roi_split" type: "ROIFeatureSplit" bottom: "roi_pool_1" bottom: "roi_num" bottom: "hash_table"
  top: "small_1" top: "large_1" roi_feature_split_param { branch_num: 2 } }
layer { name: "roi_split" type: "ROIFeatureSplit" bottom: "roi_pool_2" bottom: "roi_num" bottom: "hash_table"
  top: "small_2" top: "large_2" roi_feature_split_param { branch_num: 2 } }
layer { name: "cs" type: "Concat" bottom: "small_1" bottom: "small_2" top: "cs" concat_param { axis: 1 } }
layer { name: "cl" type: "Concat" bottom: "large_1" bottom: "large_2" top: "cl" concat_param { axis: 1 } }
layer { name: "fs" type: "InnerProduct" bottom: "cs" top: "fs" inner_product_param { num_output: 6 } }
layer { name: "fl" type: "InnerProduct" bottom: "cl" top: "fl" inner_product_param { num_output: 6 } }
"""


def test_a_small_sinet_runs_end_to_end(tmp_path):
    model = load_from_text(SMALL_SINET, random_weights=True, seed=3)
    x = np.random.default_rng(1).normal(0, 1, (2, 3, 36, 52)).astype(F)
    got = model.run({"data": x})
    py = model_py_outputs(model, {"data": x}, tmp_path)
    for k in ("fs", "fl"):
        np.testing.assert_allclose(py[k], got[k], rtol=1e-5, atol=1e-5, err_msg=k)
    # the split's pieces, from the blobs the net computed
    parts = load_from_text(SMALL_SINET, random_weights=True, seed=3,
                  outputs=["proposals", "roi_num", "hash_table", "c1", "c2", "small_1", "large_1", "small_2",
                           "large_2"]).run({"data": x})
    rois = parts["proposals"].reshape(-1, 5)
    assert rois.shape[0] > 4 and set(rois[:, 0]) == {0, 1}
    counts, table = ref_roi_split(parts["proposals"], 2, 150, 150)
    assert (counts > 0).all()
    np.testing.assert_array_equal(parts["roi_num"], counts)
    np.testing.assert_array_equal(parts["hash_table"], table)
    for level, (fmap, scale) in enumerate(((parts["c1"], 1.0), (parts["c2"], 0.5)), 1):
        pooled = ref_caroi(fmap, rois, 4, 5, scale, 0.0)
        small, large = ref_feature_split(pooled, counts, table, 2)
        np.testing.assert_array_equal(parts[f"small_{level}"], small)
        np.testing.assert_array_equal(parts[f"large_{level}"], large)
    assert got["fs"].shape == (int(counts[0, 0, 0, 0]), 6) and got["fl"].shape == (int(counts[1, 0, 0, 0]), 6)


@pytest.mark.parametrize("layer, message", [
    ('type: "CAROIPooling" bottom: "x" bottom: "r" top: "o" caroi_pooling_param { pooled_h: 0 pooled_w: 7 }',
     "pooled_h and pooled_w must be > 0"),
    ('type: "CAROIPooling" bottom: "x" bottom: "r" top: "o" caroi_pooling_param { pooled_h: 7 pooled_w: 7 '
     'spatial_scale: 0 }', "spatial_scale must be a number > 0"),
    ('type: "ROISplit" bottom: "r" top: "n" top: "t" roi_split_param { branch_num: 4 }', "branch_num must be 2 or 3"),
    ('type: "ROIFeatureSplit" bottom: "x" bottom: "r" bottom: "r" top: "a" roi_feature_split_param { branch_num: 2 }',
     "ROIFeatureSplit takes 3 bottoms"),
])
def test_bad_parameters_are_one_line(layer, message):
    text = net(f'layer {{ name: "l" {layer} }}', inputs={"x": [1, 2, 8, 8], "r": [3, 5]})
    with pytest.raises(CaffeqError, match=message):
        load_from_text(text)


@pytest.mark.parametrize("path", DEPLOYS, ids=["pva", "vgg"])
def test_the_sinet_deploys_read(path):
    if not path.exists():
        pytest.skip("not shipped: licence (xw-hu/SINet's LICENSE is non-commercial)")
    model = load(str(path))
    types = {n.type for n in model.layers}
    assert {"BoxOutput", "ROISplit", "CAROIPooling", "ROIFeatureSplit"} <= types
