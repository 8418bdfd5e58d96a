"""ZhiwenShao's JAANet (0b8e87e) and ARL (512c226) layers against numpy loops written from the forks'
C++ (division_layer.cpp, combination_layer.cpp, au_mask_based_land_layer.cpp), in torch, onnxruntime
and model.py.  MultiStageMeanfieldAU3 runs CRF-RNN's inference: test_layers_crf_rnn.py."""
import numpy as np
import pytest
from c_reference import c_round
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

f32 = np.float32


def division_ref(x, ys, xs, height, width):
    """Forward_cpu: top n's row h - v from bottom row h, columns w .. w + width (flat indices)."""
    n, c, hb, wb = x.shape
    flat = x.reshape(-1)
    tops = []
    for v, w in zip(ys, xs):
        top = np.zeros((n, c, height, width), np.float32).reshape(-1)
        for b in range(n):
            for ch in range(c):
                for h in range(v, v + height):
                    ib = b * c * hb * wb + ch * hb * wb + h * wb + w
                    it = b * c * height * width + ch * height * width + (h - v) * width
                    for i in range(width):
                        top[it + i] = flat[ib + i]
        tops.append(top.reshape(n, c, height, width))
    return tops


def combination_ref(parts, ys, xs):
    """Forward_cpu: a zero-allocated top, bottom k written at (ycoord[k], xcoord[k]) in order."""
    n, c = parts[0].shape[:2]
    height, width = ys[-1] + parts[-1].shape[2], xs[-1] + parts[-1].shape[3]
    top = np.zeros(n * c * height * width, np.float32)
    for part, v, w in zip(parts, ys, xs):
        hb, wb = part.shape[2:]
        flat = part.reshape(-1)
        for b in range(n):
            for ch in range(c):
                for h in range(v, v + hb):
                    ib = b * c * hb * wb + ch * hb * wb + (h - v) * wb
                    it = b * c * height * width + ch * height * width + h * width + w
                    for i in range(wb):
                        top[it + i] = flat[ib + i]
    return top.reshape(n, c, height, width)


CENTRES = {0: (4, -2), 1: (5, -2), 2: (1, -3), 3: (8, -3), 4: (2, 3), 5: (7, 3), 6: (24, 1), 7: (29, 1),
           8: (21, 0), 9: (26, 0), 10: (43, 0), 11: (45, 0), 12: (31, 0), 13: (37, 0), 14: (31, 0), 15: (37, 0),
           16: (31, 0), 17: (37, 0), 18: (39, 2), 19: (41, 2), 20: (34, 0), 21: (40, 0), 22: (34, 0), 23: (40, 0)}


def au_mask_ref(land, img_size, ratio, scale, coeff=0.075, fill=0.0, manhattan=True):
    """Forward_cpu of AUMaskBasedLand, float32 where the fork computes in float, double where it does."""
    ratio, scale, coeff, fill = f32(ratio), f32(scale), f32(coeff), f32(fill)
    size = int(c_round(f32(f32(img_size) * scale)))
    half = f32((img_size - 1) / 2.0 * float(ratio))
    factor = 100.0 / float(f32(f32(img_size) * scale))
    num = land.shape[0]
    pts = land.reshape(num, -1)
    tops = np.full((13, num, 1, size, size), fill, np.float32)
    for i in range(num):
        ruler = f32(abs(pts[i, 44] - pts[i, 50]))
        for j in range(24):
            mark, shift = CENTRES[j]
            cx, cy = pts[i, 2 * mark], pts[i, 2 * mark + 1]
            if shift < 0:
                cy = f32(cy - f32(ruler / f32(-shift)))
            elif shift > 0:
                cy = f32(cy + f32(ruler / f32(shift)))
            sw, sh = int(c_round(f32(f32(cx - half) * scale))), int(c_round(f32(f32(cy - half) * scale)))
            ew, eh = int(c_round(f32(f32(cx + half) * scale))), int(c_round(f32(f32(cy + half) * scale)))
            sh, sw, eh, ew = (min(max(v, 0), size - 1) for v in (sh, sw, eh, ew))
            acx, acy = f32(cx * scale), f32(cy * scale)
            for h in range(sh, eh + 1):
                for w in range(sw, ew + 1):
                    if manhattan:
                        d = f32(f32(abs(f32(h) - acy)) + f32(abs(f32(w) - acx)))
                        value = f32(max(1 - float(f32(d * coeff)) * factor, float(fill)))
                        tops[j // 2, i, 0, h, w] = value
                        tops[12, i, 0, h, w] = max(tops[12, i, 0, h, w], value)
    return list(tops)


def division_layer(tops, param):
    names = "".join(f' top: "t{k}"' for k in range(tops))
    return f'layer {{ name: "d" type: "Division" bottom: "x"{names} division_param {{ {param} }} }}'


def combination_layer(bottoms, param):
    names = "".join(f' bottom: "b{k}"' for k in range(bottoms))
    return f'layer {{ name: "c" type: "Combination"{names} top: "o" combination_param {{ {param} }} }}'


def coords(ys, xs):
    return " ".join(f"xcoord: {x}" for x in xs) + " " + " ".join(f"ycoord: {y}" for y in ys)


@pytest.mark.parametrize("ys, xs, height, width", [
    ([0, 4, 1, 3], [0, 5, 2, 3], 3, 4),        # corners and overlapping crops
    ([2, 0], [1, 6], 5, 3),                     # the full height, the last columns
])
def test_division_follows_the_fork(ys, xs, height, width, tmp_path):
    x = rng(1).standard_normal((2, 3, 7, 9)).astype(np.float32)
    model = load_from_text(net(division_layer(len(ys), f"width: {width} height: {height} {coords(ys, xs)}"),
                               inputs={"x": x.shape}))
    refs = {f"t{k}": r for k, r in enumerate(division_ref(x, ys, xs, height, width))}
    check_everywhere(model, {"x": x}, refs, tmp_path)


@pytest.mark.parametrize("shapes, ys, xs", [
    ([(2, 3, 4, 5), (2, 3, 3, 6), (2, 3, 5, 2)], [0, 2, 1], [0, 3, 7]),     # overlaps, uncovered corners
    ([(2, 3, 3, 4), (2, 3, 3, 4)], [0, 2], [0, 5]),                          # apart: gaps stay zero
])
def test_combination_follows_the_fork(shapes, ys, xs, tmp_path):
    parts = [rng(k + 3).standard_normal(s).astype(np.float32) for k, s in enumerate(shapes)]
    model = load_from_text(net(combination_layer(len(shapes), coords(ys, xs)),
                               inputs={f"b{k}": s for k, s in enumerate(shapes)}))
    want = combination_ref(parts, ys, xs)
    assert (want == 0).any()
    check_everywhere(model, {f"b{k}": p for k, p in enumerate(parts)}, {"o": want}, tmp_path)


def test_division_then_combination_round_trip(tmp_path):
    x = rng(2).standard_normal((2, 4, 6, 8)).astype(np.float32)
    text = net(division_layer(2, "width: 4 height: 6 xcoord: 0 xcoord: 4 ycoord: 0 ycoord: 0"),
               'layer { name: "c" type: "Combination" bottom: "t0" bottom: "t1" top: "o" '
               "combination_param { xcoord: 0 xcoord: 4 ycoord: 0 ycoord: 0 } }", inputs={"x": x.shape})
    check_everywhere(load_from_text(text), {"x": x}, {"o": x}, tmp_path)


AU_TOPS = "".join(f' top: "m{k}"' for k in range(13))


@pytest.mark.parametrize("param, kw", [
    ("img_size: 41 spatial_ratio: 0.25 spatial_scale: 0.5", {}),      # 20.5 -> 21 pixels, half = 5 exactly
    ("img_size: 41 spatial_ratio: 0.14 spatial_scale: 0.295454545 fill_coeff: 0.04 fill_value: 0.1",
     {"coeff": 0.04, "fill": 0.1}),
    ('img_size: 40 spatial_ratio: 0.3 spatial_scale: 0.5 fill_type: "none" fill_value: 0.25',
     {"fill": 0.25, "manhattan": False}),
])
def test_au_mask_based_land_follows_the_fork(param, kw, tmp_path):
    img = int(param.split()[1])
    ratio, scale = float(param.split()[3]), float(param.split()[5])
    land = rng(5).uniform(-6, img + 6, (2, 98)).astype(np.float32)
    land[1, 2 * 31:2 * 31 + 2] = 18.0   # in the first case (18 -+ 5) * 0.5 = 6.5, 11.5: C rounds halves up
    model = load_from_text(net(f'layer {{ name: "a" type: "AUMaskBasedLand" bottom: "l"{AU_TOPS} '
                               f"au_mask_based_land_param {{ {param} }} }}", inputs={"l": land.shape}))
    want = au_mask_ref(land, img, ratio, scale, **kw)
    size = int(c_round(f32(f32(img) * f32(scale))))
    assert len(want) == 13 and all(w.shape == (2, 1, size, size) for w in want)
    check_everywhere(model, {"l": land}, {f"m{k}": w for k, w in enumerate(want)}, tmp_path)


MEANFIELD = ('layer {{ name: "crf" type: "MultiStageMeanfieldAU3" bottom: "u" bottom: "q" bottom: "f" top: "o" '
             "multi_stage_meanfield_au3_param {{ num_iterations: {it} theta_alpha: 160 theta_beta: 3 "
             "theta_gamma: 3 }} }}")


@pytest.mark.parametrize("text, inputs, msg", [
    (division_layer(2, "width: 4 height: 3 xcoord: 0 xcoord: 6 ycoord: 0 ycoord: 0"), {"x": (2, 3, 7, 9)},
     "crop 1 .*leaves the 7 x 9 bottom"),
    (division_layer(2, "width: 4 height: 3 xcoord: 0 ycoord: 0"), {"x": (2, 3, 7, 9)}, "one xcoord and one ycoord"),
    (division_layer(1, "width: 0 height: 3 xcoord: 0 ycoord: 0"), {"x": (2, 3, 7, 9)}, "width and height >= 1"),
    (combination_layer(2, "xcoord: 0 xcoord: 1 ycoord: 0"), {"b0": (2, 3, 4, 5), "b1": (2, 3, 4, 5)},
     "one xcoord and one ycoord per bottom"),
    (combination_layer(2, "xcoord: 0 xcoord: 2 ycoord: 0 ycoord: 0"), {"b0": (2, 3, 4, 9), "b1": (2, 3, 4, 5)},
     "bottom 0 .*leaves the 4 x 7 top"),
    (combination_layer(2, "xcoord: 0 xcoord: 5 ycoord: 0 ycoord: 0"), {"b0": (2, 3, 4, 5), "b1": (2, 2, 4, 5)},
     "bottom 1 .*N and C"),
    (f'layer {{ name: "a" type: "AUMaskBasedLand" bottom: "l"{AU_TOPS} au_mask_based_land_param {{ img_size: 40 '
     "spatial_ratio: 0.3 spatial_scale: 0.5 } }", {"l": (2, 90)}, "up to value 91"),
    ('layer { name: "a" type: "AUMaskBasedLand" bottom: "l" top: "m" au_mask_based_land_param { img_size: 40 '
     "spatial_ratio: 0.3 spatial_scale: 0.5 } }", {"l": (2, 98)}, "13 tops"),
    (f'layer {{ name: "a" type: "AUMaskBasedLand" bottom: "l"{AU_TOPS} au_mask_based_land_param {{ img_size: 1 '
     "spatial_ratio: 0.3 spatial_scale: 0.2 } }", {"l": (2, 98)}, "= 0 pixels"),
    (MEANFIELD.format(it=1), {"u": (2, 1, 5, 7), "q": (2, 1, 5, 7), "f": (2, 3, 5, 7)}, "must be > 1"),
    (MEANFIELD.format(it=5), {"u": (2, 1, 5, 7), "q": (2, 1, 5, 7), "f": (2, 3, 5, 6)}, "N, H and W"),
])
def test_bad_parameters_are_one_clear_line(text, inputs, msg):
    with pytest.raises(LayerError, match=msg) as err:
        load_from_text(net(text, inputs=inputs))
    assert "\n" not in str(err.value)


# ---- AlignDataTransform ---------------------------------------------------------------------------

def align_ref(land, para, pairs):
    """align_data_transform_layer.cpp Forward_cpu, item by item."""
    n, dim = land.shape[0], land[0].size
    out = land.reshape(n, dim).astype(np.float32).copy()
    for i in range(n):
        rec = para.reshape(n, -1)[i]
        for j in range(0, dim, 2):
            out[i, j] = land.reshape(n, dim)[i, j] - rec[3]
            out[i, j + 1] = land.reshape(n, dim)[i, j + 1] - rec[2]
            if rec[0]:
                out[i, j] = rec[1] - 1 - out[i, j]
        if rec[0]:
            swap = out[i].copy()
            for j in range(0, dim, 2):
                k = int(pairs.reshape(-1)[j // 2])
                swap[j], swap[j + 1] = out[i, 2 * k - 2], out[i, 2 * k - 1]
            out[i] = swap
    return out


def test_align_data_transform_moves_landmarks_into_the_mirrored_crop(tmp_path):
    r = rng(31)
    land = r.uniform(0, 200, (3, 10, 1, 1)).astype(np.float32)       # 5 (x, y) landmarks, as a Data blob
    para = np.array([[1, 176, 7, 11], [0, 176, 3, 2], [1, 150, 0, 5]], np.float32).reshape(3, 4, 1, 1)
    pairs = np.array([[2, 1, 3, 5, 4]], np.float32).reshape(1, 5, 1, 1)      # 1-based mirror partners
    model = load_from_text(net('layer { name: "a" type: "AlignDataTransform" bottom: "land" bottom: "para" '
                               'bottom: "pairs" top: "aligned" }',
                               inputs={"land": land.shape, "para": para.shape, "pairs": pairs.shape}))
    assert model.blob_shapes["aligned"] == (3, 10, 1, 1)
    check_everywhere(model, {"land": land, "para": para, "pairs": pairs},
                     {"aligned": align_ref(land, para, pairs).reshape(3, 10, 1, 1)}, tmp_path)


def test_jaanet_data_layer_gives_the_mirror_crop_record():
    # JAANet data_layer.cpp: with get_mirror_crop, top[1] is (batch_size, 4, 1, 1)
    model = load_from_text('layer { name: "data" type: "Data" top: "data" top: "mirror_crop_para" '
                           'transform_param { crop_size: 176 mean_value: 128 } '
                           'data_param { source: "missing_ldb" batch_size: 8 get_mirror_crop: true } }',
                           input_shapes={"data": (8, 3, 176, 176)})
    assert model.blob_shapes["mirror_crop_para"] == (8, 4, 1, 1)
