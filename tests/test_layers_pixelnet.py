"""aayushbansal/PixelNet (227c48e): RandBI, the hypercolumn sampler (tools/caffe/src/caffe/layers/rand_bi_layer.cpp).

The reference below is a loop over the fork's Forward_cpu (the fork has no CUDA code): float32 positions,
its four cases, `v * (1. - r)` in double and `w * r` in float32, one rounding at the end; C's (int) of a
NaN or infinite float is x86's INT_MIN.  Each net runs in torch, onnxruntime and the generated model.py
and must match it bit for bit.  The two deploy files copied in tests/fixtures/realworld (MIT) give the
real layer's parameters.
"""
import math

import numpy as np
import pytest
from conftest import check_everywhere, model_py_outputs, net, onnx_outputs, rng

from caffeq.errors import CaffeqError, DataError
from caffeq.io.prototxt import read_prototxt
from caffeq.model import load, load_from_text

f32 = np.float32
REALWORLD = __import__("pathlib").Path(__file__).parent / "fixtures" / "realworld"
EDGES = REALWORLD / "aayushbansal__PixelNet__models__generalizability__edge_detection__deploy.prototxt"
SEGMENTATION = REALWORLD / "aayushbansal__PixelNet__models__scratch__semantic_segmentation__c123457__deploy.prototxt"


def c_int(v):
    """static_cast<int> of a float on x86: toward zero; NaN, infinities and overflow give INT_MIN."""
    v = float(v)
    return int(v) if math.isfinite(v) and -2.0 ** 31 < v < 2.0 ** 31 else -2 ** 31


def legacy(shape):
    return tuple(shape) + (1,) * (4 - len(shape))


def randbi_ref(maps, pixels, rates, pad):
    """RandBILayer::Forward_cpu; None where the fork's CHECKs abort."""
    out = []
    for row in pixels:
        n = c_int(row[0])
        if n < 0:
            return None
        y, x = f32(row[1]), f32(row[2])
        values = []
        for fmap, rate in zip(maps, rates):
            num, ch, h, w = legacy(fmap.shape)
            f = fmap.reshape(num, ch, h, w)
            p = f32((rate - 1.0) / 2) if pad else f32(0)
            tx = f32(f32(x - p) / f32(rate))
            ty = f32(f32(y - p) / f32(rate))
            tx1, tx2 = max(c_int(np.floor(tx)), 0), max(c_int(np.ceil(tx)), 0)
            ty1, ty2 = max(c_int(np.floor(ty)), 0), max(c_int(np.ceil(ty)), 0)
            if tx2 >= w or ty2 >= h or n >= num:
                return None
            for c in range(ch):
                if tx1 == tx2 and ty1 == ty2:
                    v = float(f[n, c, ty1, tx1])
                elif ty1 == ty2:
                    rx = f32(tx - f32(tx1))
                    v = float(f[n, c, ty1, tx1]) * (1.0 - float(rx)) + float(f32(f[n, c, ty1, tx1 + 1] * rx))
                elif tx1 == tx2:
                    ry = f32(ty - f32(ty1))
                    v = float(f[n, c, ty1, tx1]) * (1.0 - float(ry)) + float(f32(f[n, c, ty1 + 1, tx1] * ry))
                else:
                    rx, ry = f32(tx - f32(tx1)), f32(ty - f32(ty1))
                    col0 = float(f[n, c, ty1, tx1]) * (1.0 - float(ry)) + float(f32(f[n, c, ty1 + 1, tx1] * ry))
                    col1 = float(f[n, c, ty1, tx1 + 1]) * (1.0 - float(ry)) + float(f32(f[n, c, ty1 + 1, tx1 + 1] * ry))
                    v = col0 * (1.0 - float(rx)) + col1 * float(rx)
                values.append(f32(v))
        out.append(values)
    return np.array(out, np.float32)


def layer_text(rates, pad, bottoms, name="r"):
    params = " ".join(f"compression_rate: {r}" for r in rates) + (" pad: true" if pad else "")
    bottoms = " ".join(f'bottom: "{b}"' for b in bottoms)
    return f'layer {{ name: "{name}" type: "RandBI" {bottoms} bottom: "p" top: "o" rand_comp_param {{ {params} }} }}'


def randbi_net(shapes, pixels, rates, pad):
    names = [f"f{i}" for i in range(len(shapes))]
    inputs = dict(zip(names, shapes)) | {"p": pixels}
    return load_from_text(net(layer_text(rates, pad, names), inputs=inputs)), names


def feeds_for(names, shapes, pixels, seed=0):
    g = rng(seed)
    feeds = {n: g.standard_normal(s).astype(f32) for n, s in zip(names, shapes)}
    feeds["p"] = np.asarray(pixels, f32)
    return feeds


def random_pixels(count, images, y_range, x_range, seed=1):
    """Pixels inside the ranges: a third integers, a third halves, a third any float32."""
    g = rng(seed)
    ids = g.integers(0, images, count).astype(f32)
    y = g.uniform(*y_range, count)
    x = g.uniform(*x_range, count)
    third = count // 3
    y[:third], x[:third] = np.floor(y[:third]), np.floor(x[:third])
    y[third:2 * third], x[third:2 * third] = np.floor(2 * y[third:2 * third]) / 2, np.floor(2 * x[third:2 * third]) / 2
    return np.stack([ids, y, x], 1).astype(f32)


def check(shapes, pixels, rates, pad, tmp_path, seed=0):
    model, names = randbi_net(shapes, pixels.shape, rates, pad)
    feeds = feeds_for(names, shapes, pixels, seed)
    ref = randbi_ref([feeds[n] for n in names], pixels, rates, pad)
    assert ref is not None, "the test's pixels must be ones the fork reads"
    assert model.graph.tensors[model.outputs[0]].shape == ref.shape
    check_everywhere(model, feeds, {"o": ref}, tmp_path)      # bit for bit
    return model, feeds, ref


def test_padded_rates_on_non_square_maps_of_two_images(tmp_path):
    # maps of a 7 x 10 image at strides 1, 2 and 4 (pad: (r - 1) / 2): every case of the fork, the
    # last row and column each map reaches, negative positions (read at 0), float ids (truncated)
    shapes = [(2, 3, 7, 10), (2, 4, 4, 5), (2, 2, 2, 3)]
    edges = np.array([[0, 0, 0], [1, 5.5, 8.5], [1, 5, 8], [0, -3, -0.25], [1, 0.5, 2.5], [0, 1.5, 1.5],
                      [1, 2.25, 7.75], [1.9, 4.5, 0.5], [-0.5, 0.5, 5], [1, 5.5, 0], [0, 0, 8.5]], f32)
    pixels = np.concatenate([edges, random_pixels(60, 2, (-2, 5.5), (-2, 8.5))])
    _, feeds, ref = check(shapes, pixels, [1, 2, 4], True, tmp_path)
    # pixel (0, 0, 0) reads each map's corner: 3 + 4 + 2 channels, maps in the bottoms' order
    corner = np.concatenate([feeds[f"f{i}"][0, :, 0, 0] for i in range(3)])
    np.testing.assert_array_equal(ref[0], corner)


def test_unpadded_rate_three_rounds_as_the_fork(tmp_path):
    # (x - 0) / 3 is inexact in float32; the double mixes make the last bit differ from a float32 blend
    shapes = [(3, 2, 6, 9), (3, 5, 2, 3)]
    pixels = np.concatenate([np.array([[2, 3, 6], [0, 0, 0], [1, 1, 1], [2, 2, 5]], f32),
                             random_pixels(80, 3, (-1, 3), (-1, 6), seed=4)])
    _, feeds, ref = check(shapes, pixels, [1, 3], False, tmp_path, seed=3)
    blend32 = []    # the same positions mixed in float32 only
    for row in pixels:
        n, y, x = int(row[0]), f32(row[1]), f32(row[2])
        f = feeds["f1"]
        ty, tx = max(f32(y / f32(3)), f32(0)), max(f32(x / f32(3)), f32(0))
        y0, x0 = int(np.floor(ty)), int(np.floor(tx))
        y1, x1 = min(y0 + 1, 1), min(x0 + 1, 2)
        ry, rx = f32(ty - f32(y0)), f32(tx - f32(x0))
        top = f[n, :, y0, x0] * (f32(1) - ry) + f[n, :, y1, x0] * ry
        bottom = f[n, :, y0, x1] * (f32(1) - ry) + f[n, :, y1, x1] * ry
        blend32.append(top * (f32(1) - rx) + bottom * rx)
    assert not np.array_equal(ref[:, 2:], np.array(blend32, f32))


def test_maps_of_fewer_axes_are_read_as_caffe_legacy_shapes(tmp_path):
    # a 2-axis (N, C) map is N x C x 1 x 1 to num()/channels()/height()/width(): pixels at or left of 0
    shapes = [(3, 4), (3, 2, 3, 5)]
    pixels = np.array([[0, 0, 0], [2, -1, 0.5], [1, 0.5, -3], [2, 0.25, 0.5], [1, -0.5, 0.5]], f32)
    check(shapes, pixels, [2, 1], True, tmp_path)


def test_non_finite_coordinates_read_row_and_column_0(tmp_path):
    # the fork's (int) of floor(NaN) or of an infinity is INT_MIN, raised to 0: the first row or column
    shapes = [(2, 3, 4, 6), (2, 2, 2, 3)]
    pixels = np.array([[0, np.nan, 2], [1, 2, np.inf], [1, -np.inf, 4.5], [0, np.nan, np.nan], [1, 1, 1]], f32)
    check(shapes, pixels, [1, 2], True, tmp_path)


@pytest.mark.parametrize("pixel, words", [
    ([0, 0, 9], "pixel 1 (id 0, y 0, x 9) maps to row 0, column 5 of bottom[1] (4 x 5, compression_rate 2)"),
    ([0, 6.5, 0], "pixel 1 (id 0, y 6.5, x 0) maps to row 7, column 0 of bottom[0] (7 x 10, compression_rate 1)"),
    ([2, 1, 1], "image id 2 is outside [0, 2) of bottom[0]"),
    ([-1, 1, 1], "image id -1 is outside [0, 2)"),
    ([np.nan, 1, 1], "image id nan is outside [0, 2)"),
])
def test_pixels_where_the_fork_aborts_are_one_line_in_torch_and_clamped_in_exports(tmp_path, pixel, words):
    shapes = [(2, 3, 7, 10), (2, 4, 4, 5)]
    pixels = np.array([[1, 2, 3], pixel], f32)
    model, names = randbi_net(shapes, pixels.shape, [1, 2], True)
    feeds = feeds_for(names, shapes, pixels)
    assert randbi_ref([feeds[n] for n in names], pixels, [1, 2], True) is None
    with pytest.raises(DataError) as e:
        model.run(feeds)
    msg = str(e.value)
    assert msg.startswith("layer 'r' (RandBI): ") and words in msg and "\n" not in msg, msg
    # ONNX and model.py cannot stop a run: they read the nearest row, column or image instead
    got = onnx_outputs(model, feeds, tmp_path)["o"]
    np.testing.assert_array_equal(got, model_py_outputs(model, feeds, tmp_path)["o"])
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[:1], randbi_ref([feeds[n] for n in names], pixels[:1], [1, 2], True))


@pytest.mark.parametrize("layer, inputs, words", [
    (layer_text([1], True, ["a", "b"]), {"a": (1, 2, 3, 3), "b": (1, 2, 3, 3)},
     "rand_comp_param.compression_rate is given 1 times; RandBI needs one per feature-map bottom (2)"),
    (layer_text([1, 0], True, ["a", "b"]), {"a": (1, 2, 3, 3), "b": (1, 2, 3, 3)},
     "rand_comp_param.compression_rate[1] must be >= 1, got 0"),
    ('layer { name: "r" type: "RandBI" bottom: "p" top: "o" }', {},
     "RandBI takes at least 2 bottoms (feature maps..., pixels)"),
    (layer_text([1], False, ["a"]), {"a": (1, 2, 3, 3), "p": (4, 2)}, "the last bottom (pixels) must be P x 3"),
    (layer_text([1], False, ["a"]), {"a": (1, 2, 3, 3), "p": (4, 3, 1)}, "got [4, 3, 1]"),
    (layer_text([1], False, ["a"]), {"a": (1, 2, 3, 3, 2), "p": (4, 3)}, "need at most 4 axes"),
])
def test_bad_layers_are_one_line(layer, inputs, words):
    inputs = {"p": (5, 3)} | inputs
    with pytest.raises(CaffeqError) as e:
        load_from_text(net(layer, inputs=inputs))
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


# ---- the real files ---------------------------------------------------------------------------

@pytest.mark.parametrize("path", [EDGES, SEGMENTATION])
def test_real_deploy_files_size_the_hypercolumns(path):
    channels = 64 + 128 + 256 + 512 + 512 + 4096      # conv1_2 ... conv5_3 and the 4096 of fc7
    model = load(str(path))
    node = next(n for n in model.layers if n.type == "RandBI")
    assert node.attrs["rates"] == [1, 2, 4, 8, 16, 32] and node.attrs["pad"]
    assert model.graph.tensors[node.outputs[0]].shape == (1000, channels)


def test_real_layer_on_small_maps(tmp_path):
    # the edge detector's RandBI as the file writes it, fed the maps of a 40 x 48 crop with few channels
    lp = next(lp for lp in read_prototxt(str(EDGES)).layer if lp.type == "RandBI")
    from google.protobuf import text_format
    text = "layer {\n" + text_format.MessageToString(lp) + "}\n"
    sizes = [(40, 48), (20, 24), (10, 12), (5, 6), (3, 3), (2, 2)]
    shapes = [(1, c, h, w) for c, (h, w) in zip((3, 2, 4, 2, 3, 5), sizes)]
    grid = np.array([[0, y, x] for y in np.arange(-1, 40, 1.5) for x in np.arange(-1, 48, 1.75)], f32)
    names = list(lp.bottom[:-1])
    g = rng(5)
    maps = [g.standard_normal(s).astype(f32) for s in shapes]
    keep = [row for row in grid if randbi_ref(maps, row[None], [1, 2, 4, 8, 16, 32], True) is not None]
    pixels = np.array(keep, f32)
    assert len(pixels) > 50
    model = load_from_text(net(text, inputs=dict(zip(names, shapes)) | {"pixels": pixels.shape}))
    feeds = dict(zip(names, maps)) | {"pixels": pixels}
    ref = randbi_ref(maps, pixels, [1, 2, 4, 8, 16, 32], True)
    check_everywhere(model, feeds, {"fc5": ref}, tmp_path)


def test_the_surface_normal_nets_normalize_reads_fix_scale(tmp_path):
    # the fork's NormalizeParameter adds fix_scale (4 there, 10004 here: SSD's eps is 4); it only
    # freezes the scale in training, and the layer is SSD's Normalize, here on a P x 3 blob
    text = net('layer { name: "n" type: "Normalize" bottom: "x" top: "o" norm_param { scale_filler { type: "constant" '
               'value: 1 } across_spatial: false channel_shared: false fix_scale: true } }', inputs={"x": (7, 3)})
    model = load_from_text(text, random_weights=True)
    node = next(n for n in model.layers if n.type == "Normalize")
    scale = np.asarray(node.blobs[0], f32)
    x = rng(2).standard_normal((7, 3)).astype(f32)
    norm = np.sqrt((x.astype(np.float64) ** 2).sum(1, keepdims=True) + 1e-10)
    check_everywhere(model, {"x": x}, {"o": x / norm * scale}, tmp_path, atol=1e-6, rtol=1e-6)


# ---- RandCatConv (aayushbansal/caffe, MarrRevisited's surface normals) ----------------------------

def rand_cat_conv_text(rates, pad_factor, maps, random=False):
    factors = " ".join(f"pooling_factor: {r}" for r in rates)
    bottoms = " ".join(f'bottom: "{b}"' for b in maps)
    return (f'layer {{ name: "rc" type: "RandCatConv" {bottoms} bottom: "mask" bottom: "sn" top: "fc5" top: "pixel_sn" '
            f'rand_cat_conv_param {{ rand_selection: {str(random).lower()} num_output: 7 {factors} '
            f'pad_factor: {pad_factor} }} }}')


def marked_pixels(mask, num, rows):
    """The fork's list: image 0's mask cells whose value truncates to 1, raster order, once per image."""
    h, w = mask.shape[-2:]
    cells = [(y, x) for y in range(h) for x in range(w) if c_int(mask.reshape(-1)[y * w + x]) == 1]
    return np.array([(i, y, x) for i in range(num) for y, x in cells], f32)[:rows * num]


def test_rand_cat_conv_worked_example():
    # spec: A 4x4 at factor 1, B 2x2 = [[0, 1], [2, 3]] at factor 2, pad_factor 1, the mask's centre 2x2
    a = np.arange(16, dtype=f32).reshape(1, 1, 4, 4)
    b = np.array([[0, 1], [2, 3]], f32).reshape(1, 1, 2, 2)
    mask = np.zeros((1, 1, 4, 4), f32)
    mask[0, 0, 1:3, 1:3] = 1
    model = load_from_text(net(rand_cat_conv_text([1, 2], 1, ["a", "b"]),
                               inputs={"a": a.shape, "b": b.shape, "mask": mask.shape, "sn": (1, 3, 4, 4)}))
    sn = np.arange(48, dtype=f32).reshape(1, 3, 4, 4)
    out = model.run({"a": a, "b": b, "mask": mask, "sn": sn})
    np.testing.assert_array_equal(out["fc5"], [[5, 0.75], [6, 1.25], [9, 1.75], [10, 2.25]])
    np.testing.assert_array_equal(out["pixel_sn"], [[5, 21, 37], [6, 22, 38], [9, 25, 41], [10, 26, 42]])


def test_rand_cat_conv_matches_the_forks_loop(tmp_path):
    # two images read image 0's mask; values from 1 to < 2 mark a pixel; bottom 0 is 12 x 12, pad_factor 3
    shapes = [(2, 3, 12, 12), (2, 4, 6, 6), (2, 2, 3, 3)]
    rates = [1, 2, 4]
    g = rng(21)
    feeds = {f"f{i}": g.standard_normal(s).astype(f32) for i, s in enumerate(shapes)}
    mask = np.zeros((2, 1, 12, 12), f32)
    mask[0, 0, 3:9, 3:9] = 1.5
    mask[0, 0, 4, 4] = 2.0           # truncates to 2: not marked, so the list runs on past the square
    mask[0, 0, 8, 2] = 1.0
    mask[1] = 0                      # image 1's own mask is never read
    feeds |= {"mask": mask, "sn": g.standard_normal((2, 3, 12, 12)).astype(f32)}
    names = [f"f{i}" for i in range(3)]
    model = load_from_text(net(rand_cat_conv_text(rates, 3, names),
                               inputs={n: s for n, s in zip(names, shapes)} | {"mask": mask.shape, "sn": (2, 3, 12, 12)}))
    rows = 36
    assert model.blob_shapes["fc5"] == (72, 9) and model.blob_shapes["pixel_sn"] == (72, 3)
    pixels = marked_pixels(mask[0], 2, rows)
    ref = randbi_ref([feeds[n] for n in names], pixels, rates, True)
    sn = feeds["sn"].reshape(-1)
    targets = np.array([[sn[int(i) * 3 * 144 + c * 144 + int(y) * 12 + int(x)] for c in range(3)]
                        for i, y, x in pixels], f32)
    check_everywhere(model, feeds, {"fc5": ref, "pixel_sn": targets}, tmp_path)


def test_rand_cat_conv_refuses_a_mask_of_too_few_pixels_and_random_selection():
    shapes = {"a": (1, 1, 6, 6), "mask": (1, 1, 6, 6), "sn": (1, 3, 6, 6)}
    model = load_from_text(net(rand_cat_conv_text([1], 1, ["a"]), inputs=shapes))
    mask = np.zeros((1, 1, 6, 6), f32)
    mask[0, 0, 1:5, 1:4] = 1
    with pytest.raises(CaffeqError, match="the mask marks 12 pixels .* takes 16 per image"):
        model.run({"a": np.zeros((1, 1, 6, 6), f32), "mask": mask, "sn": np.zeros((1, 3, 6, 6), f32)})
    random = load_from_text(net(rand_cat_conv_text([1], 1, ["a"], random=True), inputs=shapes))
    assert random.blob_shapes["fc5"] == (7, 1)
    with pytest.raises(CaffeqError, match="rand_selection: true"):
        random.run({"a": np.zeros((1, 1, 6, 6), f32), "mask": mask, "sn": np.zeros((1, 3, 6, 6), f32)})


# ---- RandCat (aayushbansal/caffe 3222608, rand_cat_layer.cpp) ----------------------------------------

def rand_cat_text(maps, random=False, extra=""):
    bottoms = " ".join(f'bottom: "{b}"' for b in maps)
    return (f'layer {{ name: "rc" type: "RandCat" {bottoms} bottom: "valid" bottom: "sn" top: "fc5" top: "pixel_sn" '
            f'rand_cat_param {{ rand_selection: {str(random).lower()} num_output: 5 {extra} }} }}')


def rand_cat_ref(maps, sn, num, h, w):
    """RandCatLayer::Forward_cpu with rand_selection false: the rows (n, j) for j < H W of bottom 0, map b's
    values at n C_b W H + c W H + j, the targets at n 3 W H + c W W + j (the fork's W W)."""
    rows, targets = [], []
    flat_sn = sn.reshape(-1)
    for n in range(num):
        for j in range(h * w):
            row = []
            for m in maps:
                flat, c = m.reshape(-1), m.shape[1]
                row += [flat[n * c * w * h + k * w * h + j] for k in range(c)]
            rows.append(row)
            targets.append([flat_sn[n * 3 * w * h + k * w * w + j] for k in range(3)])
    return np.array(rows, f32), np.array(targets, f32)


def test_rand_cat_every_pixel_matches_the_forks_loop(tmp_path):
    # bottom 0 is 4 x 3 (the targets' W W reads differ from W H); map 1 is larger and read in bottom 0's layout
    shapes = {"f0": (2, 3, 4, 3), "f1": (2, 2, 5, 3), "valid": (2, 1, 4, 3), "sn": (2, 3, 4, 3)}
    g = rng(31)
    feeds = {k: g.standard_normal(s).astype(f32) for k, s in shapes.items()}
    model = load_from_text(net(rand_cat_text(["f0", "f1"], extra="num_blobs: 2 start_id: 0 end_id: 1"),
                               inputs=shapes))
    assert model.blob_shapes["fc5"] == (24, 5) and model.blob_shapes["pixel_sn"] == (24, 3)
    assert any("rand_cat_param.num_blobs, start_id, end_id read as the fork's layer reads them" in n
               for n in model.warnings), model.warnings
    rows, targets = rand_cat_ref([feeds["f0"], feeds["f1"]], feeds["sn"], 2, 4, 3)
    check_everywhere(model, feeds, {"fc5": rows, "pixel_sn": targets}, tmp_path)


def test_rand_cat_worked_example():
    a = np.arange(4, dtype=f32).reshape(1, 1, 2, 2)
    sn = np.arange(12, dtype=f32).reshape(1, 3, 2, 2) + 100
    model = load_from_text(net(rand_cat_text(["a"]), inputs={"a": a.shape, "valid": (1, 1, 2, 2), "sn": sn.shape}))
    out = model.run({"a": a, "valid": np.zeros((1, 1, 2, 2), f32), "sn": sn})
    np.testing.assert_array_equal(out["fc5"], [[0], [1], [2], [3]])
    np.testing.assert_array_equal(out["pixel_sn"], [[100, 104, 108], [101, 105, 109], [102, 106, 110],
                                                    [103, 107, 111]])


def test_rand_cat_refuses_random_selection_and_reads_past_a_blob():
    shapes = {"a": (1, 2, 3, 4), "valid": (1, 1, 3, 4), "sn": (1, 3, 3, 4)}
    random = load_from_text(net(rand_cat_text(["a"], random=True), inputs=shapes))
    assert random.blob_shapes["fc5"] == (5, 2) and random.blob_shapes["pixel_sn"] == (5, 3)
    with pytest.raises(CaffeqError, match="rand_selection: true draws the pixels"):
        random.run({k: np.zeros(s, f32) for k, s in shapes.items()})
    # W > H: the last image's targets reach 2 W W + H W = 44 values, past the 36 the blob holds
    wide = load_from_text(net(rand_cat_text(["a"]), inputs=shapes))
    with pytest.raises(CaffeqError, match="the targets .* hold fewer than the 44 values"):
        wide.run({k: np.zeros(s, f32) for k, s in shapes.items()})
    small = load_from_text(net(rand_cat_text(["a", "b"]), inputs=dict(shapes, b=(1, 2, 2, 2), sn=(1, 3, 4, 4))))
    with pytest.raises(CaffeqError, match=r"bottom 1 \[1, 2, 2, 2\] is smaller than bottom 0's 1 x 3 x 4 grid"):
        small.run({"a": np.zeros((1, 2, 3, 4), f32), "b": np.zeros((1, 2, 2, 2), f32),
                   "valid": np.zeros((1, 1, 3, 4), f32), "sn": np.zeros((1, 3, 4, 4), f32)})
