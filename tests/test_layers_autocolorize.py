"""gustavla/autocolorize's layers (caffeq/layers/autocolorize.py) against float32 numpy loops written here from
the fork's C++ (79d4ce1, caffe/src/caffe/layers/*_layer.cpp), in torch, onnxruntime and model.py; the data
layer's shapes; and the fork's two nets in the corpus."""
import math

import numpy as np
import pytest
from conftest import REPO, check_everywhere, cli_process, net, ok, one_line_error, repeated, rng

from caffeq.errors import CaffeqError, DataError
from caffeq.model import load_from_text

F = np.float32
CORPUS = REPO / "tests" / "fixtures" / "realworld"


def layer(name, kind, bottoms, tops, params=""):
    return (f'layer {{ name: "{name}" type: "{kind}" ' + "".join(f'bottom: "{b}" ' for b in bottoms)
            + "".join(f'top: "{t}" ' for t in tops) + params + " }")


# ---- BgrToMunsell ------------------------------------------------------------------------------------------

def munsell_ref(bgr):
    """Forward_cpu for one (B, G, R) pixel, float32 as Dtype, the hue's arithmetic in double."""
    b, g, r = (F(v) for v in bgr)
    v = max(r, max(g, b))
    delta = F(v - min(r, min(g, b)))
    s = F(0) if v == 0 else F(delta / v)
    with np.errstate(all="ignore"):
        if r == v:
            out0 = F((g - b) / delta)
        elif g == v:
            out0 = F(2.0 + float(F((b - r) / delta)))
        else:
            out0 = F(4.0 + float(F((r - g) / delta)))
    h = F(math.fmod(float(out0) / 6.0 + 10.0, 1.0)) if delta != 0 else F(0)
    return h, F(s * v), v


def test_bgr_to_munsell_matches_the_fork_pixel_by_pixel(tmp_path):
    x = rng(1).uniform(0, 1, (2, 3, 3, 5)).astype(F)
    x[0, :, 0, 0] = [0.5, 0.5, 0.5]            # grey: delta 0, hue 0
    x[0, :, 0, 1] = [0, 0, 0]                  # black: v 0, s 0
    x[1, :, 2, 4] = [0.2, 0.7, 0.7]            # r and g tie at the max: the r branch
    x[1, :, 1, 3] = [0.9, 0.1, 0.4]            # blue largest: hue past 0.5
    x[1, :, 0, 2] = [0.1, 0.6, 0.3]            # green largest
    x[1, :, 0, 0] = [-0.3, 0.2, -0.1]          # negative values: chroma from s * v
    ref = np.empty(x.shape, F)
    for n, i, j in np.ndindex(2, 3, 5):
        ref[n, :, i, j] = munsell_ref(x[n, :, i, j])
    model = load_from_text(net(layer("hcv", "BgrToMunsell", ["bgr"], ["hcv"]), inputs={"bgr": x.shape}))
    check_everywhere(model, {"bgr": x}, {"hcv": ref}, tmp_path)


# ---- StripDecimals -----------------------------------------------------------------------------------------

def test_strip_decimals_truncates_toward_zero_and_saturates_as_the_cuda_kernel(tmp_path):
    x = rng(2).uniform(-300, 300, (2, 3, 5)).astype(F)
    x[0, 0, :5] = [-0.7, 0.7, -2.5, 3e9, -3e9]
    x[1, 2, :3] = [np.nan, np.inf, -np.inf]
    ref = np.where(np.isnan(x), 0, np.clip(np.trunc(x), -2.0 ** 31, 2.0 ** 31)).astype(F)
    model = load_from_text(net(layer("s", "StripDecimals", ["x"], ["y"]), inputs={"x": x.shape}))
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path)
    assert not np.signbit(model.run({"x": x})["y"][0, 0, 0])     # (float)(int)-0.7 is +0


# ---- UniformToHistogram ------------------------------------------------------------------------------------

def histogram_ref(x, bins):
    n, _, h, w = x.shape
    top = np.zeros((n, bins, h, w), F)
    for i in range(x.size):
        img, s = divmod(i, h * w)
        idx = int(F(x.flat[i]) * F(bins))
        top[img, min(idx, bins - 1), s // w, s % w] = 1
    return top


def test_uniform_to_histogram_is_one_hot_on_the_truncated_bin(tmp_path):
    x = rng(3).uniform(0, 1, (2, 1, 3, 4)).astype(F)
    x[0, 0, 0, :4] = [0.0, 1.0, 1.7, -0.1]     # first bin, past the last bin twice, a product in (-1, 0)
    x[1, 0, 2, 3] = F(0.4)                     # 0.4 * 5 rounds to 2.0 in float32
    model = load_from_text(net(layer("h", "UniformToHistogram", ["u"], ["hist"],
                                     "uniform_to_histogram_param { bins: 5 }"), inputs={"u": x.shape}))
    check_everywhere(model, {"u": x}, {"hist": histogram_ref(x, 5)}, tmp_path)


def test_uniform_to_histogram_refuses_what_the_fork_writes_elsewhere():
    text = net(layer("h", "UniformToHistogram", ["u"], ["hist"]), inputs={"u": (1, 1, 2, 2)})
    model = load_from_text(text)
    with pytest.raises(DataError, match="outside the pixel's histogram"):
        model.run({"u": np.array([0.1, 0.2, -0.5, 0.3], F).reshape(1, 1, 2, 2)})
    with pytest.raises(CaffeqError, match="reads 1 channel a pixel"):
        load_from_text(net(layer("h", "UniformToHistogram", ["u"], ["hist"]), inputs={"u": (1, 2, 2, 2)}))


# ---- SparseHistogramExtractor ------------------------------------------------------------------------------

def sparse_histogram_ref(locations, hist, size):
    n, bins, h, w = hist.shape
    integral = hist.astype(F).copy()
    for y in range(1, h):                      # down each column, then along each row, in float32
        integral[:, :, y] = integral[:, :, y - 1] + integral[:, :, y]
    for x in range(1, w):
        integral[:, :, :, x] = integral[:, :, :, x - 1] + integral[:, :, :, x]
    p = locations.shape[1]
    out = np.zeros((n * p, bins), F)
    for i in range(n):
        for j in range(p):
            y, x = int(locations[i, j, 0]), int(locations[i, j, 1])
            y0 = y - size // 2 - 1
            x0 = x - size // 2 - 1
            y1, x1 = min(y0 + size, h - 1), min(x0 + size, w - 1)
            y0, x0 = min(y0, h - 1), min(x0, w - 1)

            def at(yy, xx, i=i):
                return integral[i, :, yy, xx] if yy >= 0 and xx >= 0 else np.zeros(bins, F)

            row = ((at(y1, x1) - at(y0, x1)) - at(y1, x0)) + at(y0, x0)
            total = F(0)
            for c in range(bins):
                total = F(total + row[c])
            out[i * p + j] = row / total if total > 0 else F(1.0 / bins)
    return out


@pytest.mark.parametrize("trailing", [(), (1,)])   # (N, P, 2, 1) locations read as (N, P, 2)
def test_sparse_histograms_of_two_window_sizes(tmp_path, trailing):
    hist = rng(4).uniform(0, 1, (2, 4, 5, 7)).astype(F)
    hist[1, :, :3, :3] = 0                    # an empty window: the uniform histogram
    rows = np.array([[[2, 3], [0, 0], [4, 6], [9, 2]],
                     [[1, 1], [3, -5], [-1, 4], [2.9, 5.5]]], F)
    locations = rows.reshape(rows.shape + trailing)
    text = net(layer("sparse", "SparseHistogramExtractor", ["loc", "hist"], ["w3", "w4"],
                     "sparse_histogram_extractor_param { size: 3 size: 4 }"),
               inputs={"loc": locations.shape, "hist": hist.shape})
    model = load_from_text(text)
    refs = {"w3": sparse_histogram_ref(rows, hist, 3), "w4": sparse_histogram_ref(rows, hist, 4)}
    assert np.allclose(refs["w4"][4], 0.25)   # image 1, location (1, 1), size 4: rows and columns 0..2 (from -1)
    check_everywhere(model, {"loc": locations, "hist": hist}, refs, tmp_path)


def test_sparse_histogram_sizes_must_match_the_tops():
    text = net(layer("sparse", "SparseHistogramExtractor", ["loc", "hist"], ["w3"],
                     "sparse_histogram_extractor_param { size: 3 size: 5 }"),
               inputs={"loc": (1, 2, 2), "hist": (1, 4, 5, 5)})
    with pytest.raises(CaffeqError, match="one top per sparse_histogram_extractor_param.size"):
        load_from_text(text)


# ---- SparseHypercolumnExtractor ----------------------------------------------------------------------------

def hypercolumn_ref(locations, maps, scales, offsets_h, offsets_w, mults):
    n, p = locations.shape[:2]
    out = []
    for i in range(n):
        for j in range(p):
            y, x = locations[i, j]
            row = []
            for f, scale, oh, ow, mult in zip(maps, scales, offsets_h, offsets_w, mults):
                h, w = f.shape[2:]
                ly = F(F(y - F(oh)) / F(scale))
                lx = F(F(x - F(ow)) / F(scale))
                ly = min(max(ly, F(0)), F(F(h) - F(1.0001)))
                lx = min(max(lx, F(0)), F(F(w) - F(1.0001)))
                ylo, xlo = int(ly), int(lx)
                fyhi, fylo = F(ly - F(ylo)), F(F(ylo + 1) - ly)
                fxhi, fxlo = F(lx - F(xlo)), F(F(xlo + 1) - lx)
                a, b = f[i, :, ylo, xlo], f[i, :, ylo, xlo + 1]
                c, d = f[i, :, ylo + 1, xlo], f[i, :, ylo + 1, xlo + 1]
                top = (fxlo * a).astype(F) + (fxhi * b).astype(F)
                bottom = (fxlo * c).astype(F) + (fxhi * d).astype(F)
                row.append(F(mult) * ((fylo * top).astype(F) + (fyhi * bottom).astype(F)))
            out.append(np.concatenate(row))
    return np.array(out, F)


@pytest.mark.parametrize("trailing", [(), (1,)])   # mix-and-match's deploy feeds (N, P, 2, 1)
def test_sparse_hypercolumns_bilinear_per_map(tmp_path, trailing):
    g = rng(5)
    maps = [g.standard_normal((2, 3, 5, 6)).astype(F), g.standard_normal((2, 2, 3, 4)).astype(F)]
    locations = g.uniform(-2, 9, (2, 4, 2)).astype(F)
    locations[0, 0] = [4.0, 5.0]             # on the last row and column of map 1: clamped to 3.9999
    locations[1, 1] = [2.0, 3.0]             # on grid points
    ref = hypercolumn_ref(locations, maps, [1, 2], [0, 0.5], [0, 0.5], [0.3, 1.0])
    locations = locations.reshape(locations.shape + trailing)
    params = ("sparse_hypercolumn_extractor_param { scale: 1 scale: 2 offset_height: 0 offset_height: 0.5 "
              "offset_width: 0 offset_width: 0.5 activation_mult: 0.3 }")
    text = net(layer("cols", "SparseHypercolumnExtractor", ["loc", "f1", "f2"], ["cols"], params),
               inputs={"loc": locations.shape, "f1": maps[0].shape, "f2": maps[1].shape})
    model = load_from_text(text)
    assert ref.shape == (8, 5)
    check_everywhere(model, {"loc": locations, "f1": maps[0], "f2": maps[1]}, {"cols": ref}, tmp_path)


def test_sparse_hypercolumn_offsets_are_one_per_map():
    # the corpus net's "columns" layer gives 16 scales and no offsets: the fork's CHECK_EQ fails there
    params = f"sparse_hypercolumn_extractor_param {{ {repeated('scale', [1, 2])} }}"
    text = net(layer("cols", "SparseHypercolumnExtractor", ["loc", "f1", "f2"], ["cols"], params),
               inputs={"loc": (1, 2, 2), "f1": (1, 2, 4, 4), "f2": (1, 2, 2, 2)})
    with pytest.raises(CaffeqError, match="offset_height is given 0 times; the fork needs one per feature-map"):
        load_from_text(text)


# ---- ExtendedImageData -------------------------------------------------------------------------------------

def data_layer(extended, transform, tops=("img",), image="batch_size: 8 source: \"/nowhere/list.txt\""):
    return ('layer { name: "d" type: "ExtendedImageData" ' + "".join(f'top: "{t}" ' for t in tops)
            + f"image_data_param {{ {image} }} extended_image_data_param {{ {extended} }} "
            + f"transform_param {{ {transform} }} }}\n"
            + 'layer { name: "p" type: "Power" bottom: "img" top: "out" }')


def shapes_of(text):
    model = load_from_text(text, phase="TRAIN")
    return {k: tuple(model.graph.tensors[k].shape) for k in model.inputs}


def test_extended_image_data_shapes_from_its_params():
    assert shapes_of(data_layer("image_type: PIXEL shortest_side: 352", "crop_size: 352",
                                tops=("img", "label"))) == {"img": (8, 3, 352, 352), "label": (8,)}
    assert shapes_of(data_layer("image_type: MAT ucm2: true", "crop_size: 10")) == {"img": (8, 1, 21, 21)}
    assert shapes_of(data_layer("image_type: COCO_JSON", "crop_size: 6")) == {"img": (8, 80, 6, 6)}
    gray = 'batch_size: 2 is_color: false new_height: 5 new_width: 7 source: "x"'
    assert shapes_of(data_layer("image_type: PIXEL", "", image=gray)) == {"img": (2, 1, 5, 7)}
    with pytest.raises(CaffeqError, match="--input-shape img="):
        shapes_of(data_layer("image_type: PIXEL shortest_side: 300", ""))
    with pytest.raises(CaffeqError, match="does not support transform_param.mean_file"):
        shapes_of(data_layer("image_type: PIXEL", 'crop_size: 4 mean_file: "m.binaryproto"'))


# ---- the fork's nets ----------------------------------------------------------------------------------------

TRAIN = CORPUS / "gustavla__autocolorize__train__train_vgg16.prototxt"
DEPLOY = CORPUS / "gustavla__autocolorize__autocolorize__res__autocolorize.prototxt"


def test_the_train_net_reads_every_layer_up_to_its_own_shape_mismatch():
    # every type reads now; the file's DummyData gives 896 = 7 x 128 rows where its 8 x 128 locations make
    # 1024, which BVLC's Eltwise refuses in the fork's Caffe as well
    one_line_error(cli_process("inspect", TRAIN, "--phase", "TRAIN"), "'sr_x_minus_one' (Eltwise)", "[896, 1]", "[1024, 1]")


def test_the_deploy_net_fits_the_sizes_the_fork_feeds():
    # 514 does not fit (pool2's ceil gives 129, conv4's 2x deconvolution 130); the fork's script fills the
    # template with multiples of 32 (512 by default)
    one_line_error(cli_process("inspect", DEPLOY), "--input-shape data=1,1,512,512")
    out = ok(cli_process("inspect", DEPLOY, "--input-shape", "data=1,1,512,512"))
    assert "dense_hypercolumn" in out and "1x12417x128x128" in out.replace(" ", "")
