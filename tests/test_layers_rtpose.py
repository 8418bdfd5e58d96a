"""CMU-Perceptual-Computing-Lab/caffe_rtpose (a4778bb1): ImResize (src/caffe/cpm/layers/imresize_layer.cu),
Nms (nms_layer.cu) and Maximum (src/caffe/layers/maximum_layer.cu), as the realtime demo's GPU kernels
compute them.

The references are loops written here over the kernels' own indexing (float32 where the kernels
round); each layer is checked in torch, onnxruntime and the generated model.py.  No fork file is a
fixture (caffe_rtpose is licensed for non-commercial research only and forbids copies): the nets
below are written here with the layers and parameters of its model/coco and model/mpi deploy files.
"""
import numpy as np
import pytest
from conftest import assert_close, check_everywhere, model_py_outputs, net, onnx_outputs, rng

from caffeq.errors import CaffeqError, ExportError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

f32 = np.float32


def check(model, feeds, refs, tmp_path, atol=1e-5, rtol=1e-5):
    """refs against torch, onnxruntime (opsets 13 and the default) and model.py; NaN where the fork
    divides 0 by 0 must be NaN there too."""
    runs = {"torch": model.run(feeds), "onnx 13": onnx_outputs(model, feeds, tmp_path, 13),
            "onnx": onnx_outputs(model, feeds, tmp_path), "model.py": model_py_outputs(model, feeds, tmp_path)}
    for where, got in runs.items():
        for k, ref in refs.items():
            nan = np.isnan(ref)
            assert (np.isnan(got[k]) == nan).all(), f"{where} {k}: NaN at other places"
            assert_close(np.where(nan, 0, got[k]), np.where(nan, 0, ref), atol, rtol, f"{where} {k}")


# ---- ImResize --------------------------------------------------------------------------------

def cubic(v0, v1, v2, v3, d):
    """cubic_interpolation of imresize_layer.cu."""
    return ((-0.5 * v0 + 1.5 * v1 - 1.5 * v2 + 0.5 * v3) * d * d * d + (v0 - 2.5 * v1 + 2.0 * v2 - 0.5 * v3) * d * d
            + (-0.5 * v0 + 0.5 * v2) * d + v1)


def taps(pos_out, target, size, pad):
    """The kernel's four neighbours (with the pad added) and the offset along one axis."""
    crop = size - 2 * pad
    offset = f32(f32(f32(target) / f32(crop)) / f32(2) - f32(0.5))
    on = f32((f32(pos_out) - offset) * f32(f32(crop) / f32(target)))
    i1 = max(int(float(on) + 1e-5), 0)           # C's (int): toward zero, then clamped at 0
    i0 = (i1 if i1 - 1 < 0 else i1 - 1) + pad
    i2 = crop - 1 if i1 + 1 >= crop else i1 + 1
    i3 = (crop - 1 if i2 + 1 >= crop else i2 + 1) + pad
    d = f32(on - f32(i1))
    return (i0, i1 + pad, i2 + pad, i3), float(d)


def crop_pad(n, size, start, gap):
    """floor(size / 2 * (1 - start_scale + n * scale_gap)): float32, n * gap + (1 - start) fused."""
    ratio = f32(n * float(f32(gap)) + float(f32(1) - f32(start)))
    return int(np.floor(f32(size // 2) * ratio))


def imresize_ref(x, th, tw, start=1.0, gap=0.1):
    n_, c_, h, w = x.shape
    out = np.zeros((1, c_, th, tw))
    for c in range(c_):
        for y in range(th):
            for xo in range(tw):
                total = 0.0
                for n in range(n_):
                    xs, dx = taps(xo, tw, w, crop_pad(n, w, start, gap))
                    ys, dy = taps(y, th, h, crop_pad(n, h, start, gap))
                    rows = [cubic(*(float(x[n, c, yy, xx]) for xx in xs), dx) for yy in ys]
                    total += cubic(*rows, dy)
                out[0, c, y, xo] = total / n_
    return out


def imresize_net(shape, params, extra=""):
    return load_from_text(net(f'layer {{ name: "r" type: "ImResize" bottom: "x" top: "o" imresize_param {{ {params} }} }}'
                              + extra, inputs={"x": shape}))


def test_imresize_factor_averages_the_batch_of_centre_crops(tmp_path):
    # three scales: pads 0, (4 * 0.15) = 0 / (6 * 0.15) = 0, then 1 row and 1 column, as the demo's batch
    shape = (3, 2, 9, 13)
    x = rng(1).standard_normal(shape).astype(np.float32)
    model = imresize_net(shape, "factor: 2.5 start_scale: 1 scale_gap: 0.15")
    ref = imresize_ref(x, 22, 32, 1.0, 0.15)        # (int)(9 * 2.5), (int)(13 * 2.5)
    assert model.graph.tensors["o"].shape == (1, 2, 22, 32)
    check(model, {"x": x}, {"o": ref}, tmp_path)


def test_imresize_target_size_down_and_up_with_a_start_scale(tmp_path):
    shape = (2, 3, 9, 13)
    x = rng(2).standard_normal(shape).astype(np.float32)
    model = imresize_net(shape, "target_spatial_width: 20 target_spatial_height: 5 start_scale: 0.8 scale_gap: 0.1")
    assert [crop_pad(n, 13, 0.8, 0.1) for n in range(2)] == [1, 1] and crop_pad(1, 9, 0.8, 0.1) == 1
    check(model, {"x": x}, {"o": imresize_ref(x, 5, 20, 0.8, 0.1)}, tmp_path)


def onnx_cubic_resize(x, size):
    """onnxruntime's Resize: cubic, a = -0.5, half-pixel positions, taps clamped to the map."""
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    h = onnx.helper
    node = h.make_node("Resize", ["x", "", "", "sizes"], ["y"], mode="cubic", cubic_coeff_a=-0.5,
                       coordinate_transformation_mode="half_pixel", exclude_outside=0)
    graph = h.make_graph([node], "g", [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x.shape)],
                         [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
                         [onnx.numpy_helper.from_array(np.array(size, np.int64), "sizes")])
    opsets = [h.make_opsetid("", 13)]
    m = h.make_model(graph, opset_imports=opsets, ir_version=h.find_min_ir_version_for(opsets))   # older runtimes load it
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def test_imresize_left_edge_is_the_kernels_extrapolated_cubic_not_onnx_resize(tmp_path):
    """Left of (above) the first pixel the kernel evaluates the cubic through pixels 0, 0, 1, 2 at a
    negative offset; ONNX's half-pixel cubic Resize agrees everywhere else but not there."""
    shape = (1, 1, 5, 6)
    x = rng(3).standard_normal(shape).astype(np.float32)
    model = imresize_net(shape, "factor: 4")
    ref = imresize_ref(x, 20, 24)
    check(model, {"x": x}, {"o": ref}, tmp_path)
    resize = onnx_cubic_resize(x, [1, 1, 20, 24])
    assert np.abs(resize - ref)[..., 2:, 2:].max() < 1e-5
    assert np.abs(resize - ref)[..., :2, :].max() > 1e-3 and np.abs(resize - ref)[..., :, :2].max() > 1e-3


def test_imresize_runs_another_batch_in_onnx_and_torch(tmp_path):
    shape = (3, 2, 9, 13)
    model = imresize_net(shape, "factor: 2 scale_gap: 0.3")
    x = rng(4).standard_normal((2, 2, 9, 13)).astype(np.float32)
    ref = imresize_ref(x, 18, 26, 1.0, 0.3)
    assert_close(model.run({"x": x})["o"], ref, 1e-5, 1e-5, "torch, batch 2")
    assert_close(onnx_outputs(model, {"x": x}, tmp_path)["o"], ref, 1e-5, 1e-5, "onnx, batch 2")
    assert_close(model_py_outputs(model, {"x": x}, tmp_path)["o"], ref, 1e-5, 1e-5, "model.py, batch 2")


@pytest.mark.parametrize("params, shape, words", [
    ("factor: -2", (1, 1, 4, 4), "imresize_param.factor must be >= 0"),
    ("factor: 0 target_spatial_width: 0", (1, 1, 4, 4), "imresize_param.target_spatial_width (factor 0) must be >= 1"),
    ("factor: 0.1", (1, 1, 4, 12), "makes the 4 x 12 bottom 0 x 1"),
])
def test_imresize_bad_values_are_one_line(params, shape, words):
    with pytest.raises(LayerError) as e:
        imresize_net(shape, params)
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("params, shape, words", [
    ("factor: 2 start_scale: 1.2", (1, 1, 8, 10), "crop image 0 of the batch by -1 on each side of its height 8"),
    ("factor: 2 scale_gap: 0.5", (4, 1, 8, 9), "crop image 2 of the batch by 4 on each side of its height 8"),
])
def test_imresize_crops_outside_the_map_are_refused_everywhere(tmp_path, params, shape, words):
    model = imresize_net(shape, params)        # Caffe loads it; its kernel reads outside the map
    x = np.zeros(shape, np.float32)
    with pytest.raises(CaffeqError, match="layer 'r' \\(ImResize\\)") as e:
        model.run({"x": x})
    assert words in str(e.value)
    with pytest.raises(ExportError, match="reads outside the map"):
        model.export_onnx(str(tmp_path / "m.onnx"))
    with pytest.raises(ExportError, match="reads outside the map"):
        model_py_outputs(model, {"x": x}, tmp_path)


# ---- Nms -------------------------------------------------------------------------------------

def nms_ref(x, threshold, parts, peaks):
    """nms_register_kernel, the exclusive scan and writeResultKernel over the flat blob."""
    n_, c_, h, w = x.shape
    mem = x.reshape(-1)
    thr = f32(threshold)
    out = np.zeros((n_, parts, peaks + 1, 3))

    def at(i):                        # past the blob: caffeq reads zeros there
        return mem[i] if i < mem.size else f32(0)

    for n in range(n_):
        for c in range(parts):
            base = (n * parts + c) * h * w
            flags = np.zeros(h * w, np.int64)
            for y in range(1, h - 1):
                for xx in range(1, w - 1):
                    v = at(base + y * w + xx)
                    if v > thr and all(v > at(base + (y + dy) * w + xx + dx)
                                       for dy in (-1, 0, 1) for dx in (-1, 0, 1) if dy or dx):
                        flags[y * w + xx] = 1
            scan = np.concatenate([[0], np.cumsum(flags)[:-1]])
            for i in range(h * w - 1):
                if scan[i] != scan[i + 1] and scan[i] < peaks:
                    py, px = i // w, i % w
                    xa = ya = sa = f32(0)
                    for dy in range(-3, 4):
                        if 0 < py + dy < w:            # the kernel bounds rows by the width
                            for dx in range(-3, 4):
                                if 0 < px + dx < w:
                                    s = at(base + (py + dy) * w + px + dx)
                                    if s > 0:
                                        xa = f32(xa + f32(px + dx) * s)
                                        ya = f32(ya + f32(py + dy) * s)
                                        sa = f32(sa + s)
                    with np.errstate(invalid="ignore"):     # no positive value in the window: 0 / 0
                        out[n, c, scan[i] + 1] = [xa / sa, ya / sa, at(base + i)]
            out[n, c, 0, 0] = scan[h * w - 1]
    return out


def nms_net(shape, params):
    return load_from_text(net(f'layer {{ name: "nms" type: "Nms" bottom: "x" top: "o" nms_param {{ {params} }} }}',
                              inputs={"x": shape}))


def planted(shape, seed, spots):
    """Low noise with bumps: spots are (n, c, y, x, height)."""
    g = rng(seed)
    x = (g.random(shape) * 0.05).astype(np.float32)
    for n, c, y, xx, v in spots:
        x[n, c, y, xx] = v
        for dy in (-1, 0, 1):
            for dx in (-1, 0, 1):
                if (dy or dx) and 0 <= y + dy < shape[2] and 0 <= xx + dx < shape[3]:
                    x[n, c, y + dy, xx + dx] = max(x[n, c, y + dy, xx + dx], v * f32(0.5))
    return x


def test_nms_peaks_counts_and_windows(tmp_path):
    shape = (2, 5, 9, 13)         # num_parts 3 < 5 channels: image 1 reads flat maps 3..5
    spots = [(0, 0, 2, 3, 0.9), (0, 0, 5, 9, 0.8), (0, 0, 7, 6, 0.7), (0, 0, 4, 1, 0.95),  # 4 peaks, max_peaks 3
             (0, 0, 0, 7, 0.9),                            # the border row: never a peak
             (0, 1, 7, 11, 0.6),                          # a peak at the last interior row and column
             (0, 2, 7, 4, 0.5), (0, 3, 0, 4, 0.9), (0, 3, 1, 5, 0.7),  # below map 2 come map 3's rows 0, 1
             (0, 4, 4, 4, 0.3), (1, 0, 3, 3, 0.4)]
    x = planted(shape, 5, spots)
    x[0, 1, 3, 3] = x[0, 1, 3, 4] = 0.7                   # a tie: neither is a peak (strict)
    x[0, 1, 5, 8] = 0.2                                   # == threshold: not a peak
    model = nms_net(shape, "threshold: 0.2 max_peaks: 3 num_parts: 3")
    ref = nms_ref(x, 0.2, 3, 3)
    assert ref[0, 0, 0, 0] == 4 and ref[0, 1, 0, 0] == 1
    assert ref[0, 2, 1, 1] > 7.05                         # map 3's first rows pull its mean row lower
    check(model, {"x": x}, {"o": ref}, tmp_path)


def test_nms_rows_past_the_width_are_left_out_of_the_window(tmp_path):
    shape = (1, 2, 14, 6)          # H > W: the kernel keeps rows 1 .. W - 1 only
    x = planted(shape, 6, [(0, 0, 4, 2, 0.9), (0, 0, 9, 3, 0.8), (0, 1, 12, 4, 0.7)])
    model = nms_net(shape, "threshold: 0.1 max_peaks: 4 num_parts: 2")
    ref = nms_ref(x, 0.1, 2, 4)
    assert ref[0, 0, 0, 0] == 2 and 0 < ref[0, 0, 1, 1] < 4    # rows 1 .. 5 of the window at row 4
    assert np.isnan(ref[0, 0, 2, :2]).all() and np.isnan(ref[0, 1, 1, :2]).all()   # no row in the window: 0 / 0
    check(model, {"x": x}, {"o": ref}, tmp_path)


def test_nms_last_map_reads_zeros_past_the_blob_and_more_rows_than_pixels(tmp_path):
    shape = (1, 2, 3, 8)           # num_parts = channels; 3 x 8 has 8 pixels fewer than max_peaks rows
    x = planted(shape, 7, [(0, 0, 1, 2, 0.9), (0, 1, 1, 5, 0.9), (0, 1, 1, 2, 0.4)])
    model = nms_net(shape, "threshold: 0.05 max_peaks: 30 num_parts: 2")
    check(model, {"x": x}, {"o": nms_ref(x, 0.05, 2, 30)}, tmp_path)


def test_nms_without_interior_pixels_and_without_peak_rows(tmp_path):
    x = rng(8).random((2, 3, 2, 7)).astype(np.float32)
    check(nms_net(x.shape, "num_parts: 3"), {"x": x}, {"o": np.zeros((2, 3, 21, 3))}, tmp_path)
    y = planted((1, 1, 5, 6), 9, [(0, 0, 2, 3, 0.9)])
    model = nms_net(y.shape, "num_parts: 1 max_peaks: 0")
    assert model.graph.tensors["o"].shape == (1, 1, 1, 3)
    check(model, {"x": y}, {"o": nms_ref(y, 0.5, 1, 0)}, tmp_path)


def test_nms_defaults_and_more_parts_than_channels(tmp_path):
    model = nms_net((1, 20, 8, 8), "threshold: 0.3")
    assert model.graph.tensors["o"].shape == (1, 15, 21, 3)     # num_parts 15, max_peaks 20
    model = nms_net((1, 4, 8, 8), "num_parts: 6")
    x = np.zeros((1, 4, 8, 8), np.float32)
    with pytest.raises(CaffeqError, match="num_parts 6 is more than the bottom's 4 channels"):
        model.run({"x": x})
    with pytest.raises(ExportError, match="reads part maps past the end of the blob"):
        model.export_onnx(str(tmp_path / "m.onnx"))
    with pytest.raises(LayerError, match="nms_param.num_parts must be >= 1"):
        nms_net((1, 4, 8, 8), "num_parts: 0")


# ---- Maximum ---------------------------------------------------------------------------------

def lanes(values, count):
    """A 32-lane maximum as the kernels: each lane from float(-1e10), moving on >, then the tree
    that keeps the lower lane unless the higher one is larger -> (value, index)."""
    val, arg = [f32(-1e10)] * 32, [0] * 32
    for lane in range(32):
        for i in range(lane, count, 32):
            if values[i] > val[lane]:
                val[lane], arg[lane] = values[i], i
    for step in (1, 2, 4, 8, 16):
        for lane in range(0, 32, 2 * step):
            if val[lane] < val[lane + step]:
                val[lane], arg[lane] = val[lane + step], arg[lane + step]
    return val[0], arg[0]


def maximum_ref(x):
    n_, c_, h, w = x.shape
    maps = n_ * c_
    out = np.zeros((n_, c_, 1, 3))
    row_v = np.zeros((maps, h), np.float32)      # rowReduce: a fresh blob of zeros
    row_x = np.zeros((maps, h), np.int64)
    for t in range(maps):
        for r in range(h):
            if t * h + r < maps * w:             # rowReduceMax_kernel's bound
                row_v[t, r], row_x[t, r] = lanes(x.reshape(maps, h, w)[t, r], w)
        v, y = lanes(row_v[t], h)
        out.reshape(maps, 3)[t] = [row_x[t, y], y, v]
    return out


def maximum_net(shape):
    return load_from_text(net('layer { name: "m" type: "Maximum" bottom: "x" top: "o" }', inputs={"x": shape}))


def test_maximum_ties_go_to_the_lowest_lane(tmp_path):
    shape = (2, 3, 36, 40)
    x = rng(10).standard_normal(shape).astype(np.float32)
    x[0, 0, 7, 3] = x[0, 0, 7, 33] = 9      # lanes 3 and 1: column 33
    x[0, 1, 5, 10] = x[0, 1, 33, 2] = 9      # rows in lanes 5 and 1: row 33
    x[0, 2, 2, 4] = x[0, 2, 34, 36] = 9      # rows 2 and 34 share lane 2: the first, row 2
    x[1, 0] = -3e10                          # nothing above float(-1e10): (0, 0, -1e10)
    x[1, 1, 4, 5] = np.nan                   # NaN never wins
    ref = maximum_ref(x)
    assert list(ref[0, 0, 0, :2]) == [33, 7] and list(ref[0, 1, 0, :2]) == [2, 33]
    assert list(ref[0, 2, 0, :2]) == [4, 2] and list(ref[1, 0, 0]) == [0, 0, f32(-1e10)]
    model = maximum_net(shape)
    assert model.graph.tensors["o"].shape == (2, 3, 1, 3)
    check(model, {"x": x}, {"o": ref}, tmp_path, atol=0, rtol=0)


def test_maximum_narrow_maps_skip_rows_as_the_row_kernel(tmp_path):
    shape = (2, 3, 12, 5)          # W < H: rows with (n * C + c) * H + h >= N * C * W = 30 are zeros
    x = rng(11).standard_normal(shape).astype(np.float32) - 5
    x[0, 2, 9, 1] = 5              # flat row 33: skipped, its map's maximum stays in rows 0 .. 5
    x[0, 1, 3, 4] = 5              # flat row 15: read
    ref = maximum_ref(x)
    assert ref[0, 2, 0, 2] == 0 and ref[0, 1, 0, 2] == 5
    check(maximum_net(shape), {"x": x}, {"o": ref}, tmp_path, atol=0, rtol=0)


def test_maximum_needs_four_axes():
    with pytest.raises(LayerError, match="Maximum needs a 4-axis bottom"):
        maximum_net((2, 3, 4))


# ---- the demo's heads: resize, then peaks or maxima --------------------------------------------

POSE_TAIL = """
layer { name: "concat_stage7" type: "Concat" bottom: "paf" bottom: "heat" top: "concat_stage7" concat_param { axis: 1 } }
layer { name: "resize" type: "ImResize" bottom: "concat_stage7" top: "resized_map"
  imresize_param { factor: 8 scale_gap: 0.3 start_scale: 1.0 } }
layer { name: "nms" type: "Nms" bottom: "resized_map" top: "joints" propagate_down: false
  nms_param { threshold: 0.05 max_peaks: 64 num_parts: 18 } }
"""


def test_the_coco_demo_head_resize_then_peaks(tmp_path):
    """model/coco/pose_deploy_linevec.prototxt's last layers, on a small map: 2 PAF channels before the 19
    heat maps (the deploy file has 38), so Nms reads 18 maps that start in the PAFs as the fork would."""
    g = rng(12)
    paf = g.standard_normal((1, 2, 5, 9)).astype(np.float32)
    heat = (g.random((1, 19, 5, 9)) ** 4).astype(np.float32)
    model = load_from_text(net(POSE_TAIL, inputs={"paf": (1, 2, 5, 9), "heat": (1, 19, 5, 9)}))
    assert model.graph.tensors["joints"].shape == (1, 18, 65, 3)
    resized = imresize_ref(np.concatenate([paf, heat], 1), 40, 72, 1.0, 0.3).astype(np.float32)
    ran = model.run({"paf": paf, "heat": heat}, all_blobs=True)
    assert_close(ran["joints"][..., 0, 0], nms_ref(resized, 0.05, 18, 64)[..., 0, 0], 0, 0, "peak counts")
    ref = nms_ref(ran["resized_map"], 0.05, 18, 64)
    assert ref[..., 0, 0].sum() > 18
    check(model, {"paf": paf, "heat": heat}, {"joints": ref}, tmp_path, atol=1e-4, rtol=1e-5)


def test_the_mpi_resize_head_resize_then_maxima(tmp_path):
    """model/mpi/pose_deploy_resize.prototxt's last layers: ImResize factor 8, then Maximum."""
    shape = (1, 4, 6, 5)
    x = rng(13).standard_normal(shape).astype(np.float32)
    model = load_from_text(net('layer { name: "resize" type: "ImResize" bottom: "x" top: "resized_heatmap" '
                               'imresize_param { factor: 8 } }\n'
                               'layer { name: "maximum" type: "Maximum" bottom: "resized_heatmap" top: "joints" }',
                               inputs={"x": shape}))
    resized = model.run({"x": x}, all_blobs=True)["resized_heatmap"]
    assert_close(resized, imresize_ref(x, 48, 40), 1e-5, 1e-5, "resize")
    check(model, {"x": x}, {"joints": maximum_ref(resized)}, tmp_path, atol=1e-5, rtol=1e-6)


# ---- Switch (caffe_rtpose 182633d, switch_layer.cpp): the last bottom's values in bottom 0's shape -------

def switch_text(bottoms):
    names = " ".join(f'bottom: "{b}"' for b in bottoms)
    return f'layer {{ name: "sw" type: "Switch" {names} top: "o" }}'


def test_switch_copies_the_last_bottom_into_bottom_0s_shape(tmp_path):
    # a stage selector: the demo's default is the last stage; a larger last bottom gives its first values
    shapes = {"s1": (1, 3, 4, 5), "s2": (1, 3, 4, 5), "s3": (1, 2, 6, 7)}
    feeds = {k: rng(50 + i).standard_normal(s).astype(np.float32) for i, (k, s) in enumerate(shapes.items())}
    model = load_from_text(net(switch_text(list(shapes)), inputs=shapes))
    assert model.blob_shapes["o"] == (1, 3, 4, 5)
    ref = feeds["s3"].reshape(-1)[:60].reshape(1, 3, 4, 5)
    check_everywhere(model, feeds, {"o": ref}, tmp_path)
    same = {"s1": (1, 3, 4, 5), "s2": (1, 3, 4, 5)}
    model = load_from_text(net(switch_text(list(same)), inputs=same))
    check_everywhere(model, {k: feeds[k] for k in same}, {"o": feeds["s2"]}, tmp_path)


def test_switch_refuses_a_smaller_last_bottom_and_other_axes():
    shapes = {"s1": (1, 3, 4, 5), "s2": (1, 3, 4, 4)}
    model = load_from_text(net(switch_text(list(shapes)), inputs=shapes))
    with pytest.raises(CaffeqError, match=r"the selected \(last\) bottom \[1, 3, 4, 4\] holds fewer values"):
        model.run({k: np.zeros(s, np.float32) for k, s in shapes.items()})
    with pytest.raises(CaffeqError, match="all bottoms must have the same number of axes"):
        load_from_text(net(switch_text(["a", "b"]), inputs={"a": (1, 3, 4, 5), "b": (60,)}))


def test_maximum_on_the_mpi_nets_heatmaps_exports(tmp_path):
    # the MPI deploy file's 15 heatmaps resized to 368 x 368: the row kernel's index tables outgrow the .onnx
    # file's inline size; ONNX shape inference still reads them (data propagation into Gather)
    shape = (1, 15, 368, 368)
    x = rng(12).standard_normal(shape).astype(np.float32)
    check(maximum_net(shape), {"x": x}, {"o": maximum_ref(x)}, tmp_path, atol=0, rtol=0)
