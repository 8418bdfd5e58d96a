"""Shape layers (Concat, Slice, Flatten, Reshape, Crop, Tile, Im2col, BatchReindex, Filter).

Variants the reference cases do not cover, checked against numpy results
written independently of caffeq (hand-computed shapes, np.split/np.tile,
a loop im2col); any-batch behaviour; bad parameters; ONNX vs torch.
"""
import itertools

import numpy as np
import pytest
import torch
from conftest import FIXTURES, Case, inputs_text

from caffeq.errors import CaffeqError, ShapeError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

RNG = np.random.default_rng(7)


def net(shapes, layers):
    return 'name: "t"\n' + inputs_text(**shapes) + layers


def rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def run_layer(shapes, layer, feeds=None, **load_kw):
    model = load_from_text(net(shapes, layer), **load_kw)
    feeds = feeds or {n: rand(*s) for n, s in shapes.items()}
    return model, feeds, model.run(feeds, all_blobs=True)


# ---- Reshape --------------------------------------------------------------------

# (bottom shape, reshape_param body, expected top shape worked out by hand from reshape_layer.cpp)
RESHAPES = [
    ((2, 3, 4, 5), "shape { dim: 0 dim: -1 }", (2, 60)),
    ((2, 3, 4, 5), "shape { dim: -1 } axis: 1 num_axes: 2", (2, 12, 5)),
    ((2, 3, 4, 5), "shape { dim: 1 } axis: -1 num_axes: 0", (2, 3, 4, 5, 1)),   # append an axis
    ((2, 3, 4, 5), "shape { dim: 1 } axis: 0 num_axes: 0", (1, 2, 3, 4, 5)),    # prepend: batch moves
    ((2, 3, 4, 5), "shape { dim: 3 dim: 1 } axis: 1 num_axes: 1", (2, 3, 1, 4, 5)),
    ((2, 3, 4, 5), "shape { dim: 0 dim: 0 dim: -1 dim: 1 } axis: 1", (2, 3, 4, 5, 1)),
    ((2, 6, 4, 5), "shape { dim: -1 dim: 0 dim: 10 } axis: 1", (2, 3, 4, 10)),
    ((2, 6, 4, 5), "shape { dim: 2 dim: -1 } axis: -4 num_axes: 1", (2, 2, 3, 4, 5)),
    ((2, 6, 4, 5), "shape { dim: 2 dim: -1 } axis: -3 num_axes: 1", (2, 6, 2, 2, 5)),  # -3 -> axis 2
    ((2, 3, 4, 5), "shape { dim: -1 dim: 4 dim: 5 }", (6, 4, 5)),               # -1 absorbs the batch
    ((2, 6, 4, 5), "shape { dim: 0 dim: 3 dim: -1 } axis: 0 num_axes: 2", (2, 3, 2, 4, 5)),
]


@pytest.mark.parametrize("bottom,param,expected", RESHAPES)
def test_reshape_axis_num_axes_copy_and_infer(bottom, param, expected):
    model, feeds, out = run_layer({"x": bottom},
                                  f'layer {{ name: "r" type: "Reshape" bottom: "x" top: "r" reshape_param {{ {param} }} }}')
    assert model.blob_shapes["r"] == expected
    np.testing.assert_array_equal(out["r"], feeds["x"].reshape(expected))


def test_reshape_in_place_as_older_caffe_forks(tmp_path):
    # ECO's caffe_3d (before BVLC's in-place check): the blob takes the new shape and the net reads on
    layers = ('layer { name: "r" type: "Reshape" bottom: "x" top: "x" reshape_param { shape { dim: 0 dim: -1 } } }\n'
              'layer { name: "s" type: "Scale" bottom: "x" top: "y" scale_param { axis: 1 bias_term: false } }\n')
    model = load_from_text(net({"x": (2, 3, 4)}, layers), random_weights=True)
    assert model.blob_shapes["x"] == (2, 12) and model.blob_shapes["y"] == (2, 12)
    assert any("reshapes in place" in w for w in model.warnings)
    x = rand(2, 3, 4)
    w = model.params["s"][0]
    np.testing.assert_allclose(model.run({"x": x})["y"], x.reshape(2, 12) * w, rtol=1e-6)
    ours = model.run({"x": x})["y"]
    onnx_path = tmp_path / "m.onnx"
    model.export_onnx(onnx_path)
    import onnxruntime as ort
    got = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, ours, rtol=1e-6)


def test_reshape_follows_the_runtime_batch():
    # dim 0 copied with 0, and -1 absorbing the batch: both must follow a new batch size
    layers = ('layer { name: "a" type: "Reshape" bottom: "x" top: "a" reshape_param { shape { dim: 0 dim: -1 dim: 5 } } }\n'
              'layer { name: "b" type: "Reshape" bottom: "x" top: "b" reshape_param { shape { dim: -1 dim: 20 } } }\n')
    model = load_from_text(net({"x": (2, 3, 4, 5)}, layers))
    x = rand(7, 3, 4, 5)
    out = model.run(x, all_blobs=True)
    np.testing.assert_array_equal(out["a"], x.reshape(7, 12, 5))
    np.testing.assert_array_equal(out["b"], x.reshape(21, 20))


# ---- Slice ----------------------------------------------------------------------

def test_slice_along_batch_axis_with_points():
    model, feeds, out = run_layer(
        {"x": (6, 3, 4, 5)},
        'layer { name: "s" type: "Slice" bottom: "x" top: "a" top: "b" top: "c" '
        'slice_param { axis: 0 slice_point: 1 slice_point: 4 } }')
    for name, ref in zip("abc", np.split(feeds["x"], [1, 4], axis=0)):
        assert model.blob_shapes[name] == ref.shape
        np.testing.assert_array_equal(out[name], ref)


def test_slice_equal_along_last_axis():
    model, feeds, out = run_layer(
        {"x": (2, 3, 4, 6)},
        'layer { name: "s" type: "Slice" bottom: "x" top: "a" top: "b" top: "c" slice_param { axis: -1 } }')
    for name, ref in zip("abc", np.split(feeds["x"], 3, axis=-1)):
        assert model.blob_shapes[name] == (2, 3, 4, 2)
        np.testing.assert_array_equal(out[name], ref)


def test_slice_legacy_slice_dim():
    _, feeds, out = run_layer(
        {"x": (2, 3, 4, 5)},
        'layer { name: "s" type: "Slice" bottom: "x" top: "a" top: "b" slice_param { slice_dim: 2 slice_point: 3 } }')
    a, b = np.split(feeds["x"], [3], axis=2)
    np.testing.assert_array_equal(out["a"], a)
    np.testing.assert_array_equal(out["b"], b)


def test_slice_equal_along_batch_follows_runtime_batch():
    model = load_from_text(net({"x": (4, 3)}, 'layer { name: "s" type: "Slice" bottom: "x" top: "a" top: "b" '
                                             'slice_param { axis: 0 } }'))
    x = rand(10, 3)
    out = model.run(x, all_blobs=True)
    np.testing.assert_array_equal(out["a"], x[:5])
    np.testing.assert_array_equal(out["b"], x[5:])


# ---- Concat ---------------------------------------------------------------------

@pytest.mark.parametrize("param,axis", [("", 1), ("concat_param { axis: -1 }", 3),
                                        ("concat_param { concat_dim: 2 }", 2), ("concat_param { axis: 0 }", 0)])
def test_concat_three_inputs(param, axis):
    base = [2, 3, 4, 5]
    shapes = {}
    for name, extra in zip("abc", (1, 2, 3)):
        s = list(base)
        s[axis] = extra
        shapes[name] = tuple(s)
    model, feeds, out = run_layer(
        shapes, f'layer {{ name: "cat" type: "Concat" bottom: "a" bottom: "b" bottom: "c" top: "cat" {param} }}')
    ref = np.concatenate([feeds[n] for n in "abc"], axis=axis)
    assert model.blob_shapes["cat"] == ref.shape
    np.testing.assert_array_equal(out["cat"], ref)


# ---- Flatten --------------------------------------------------------------------

@pytest.mark.parametrize("param,expected", [
    ("axis: 1 end_axis: -2", (2, 12, 5)),
    ("axis: -3 end_axis: -2", (2, 12, 5)),
    ("axis: 0 end_axis: -3", (6, 4, 5)),
    ("axis: 2", (2, 3, 20)),
    ("", (2, 60)),
    ("axis: 1 end_axis: 0", (2, 1, 3, 4, 5)),  # Caffe's count(1, 1) = 1: a singleton axis
])
def test_flatten_axes(param, expected):
    model, feeds, out = run_layer(
        {"x": (2, 3, 4, 5)}, f'layer {{ name: "f" type: "Flatten" bottom: "x" top: "f" flatten_param {{ {param} }} }}')
    assert model.blob_shapes["f"] == expected
    np.testing.assert_array_equal(out["f"], feeds["x"].reshape(expected))


# ---- Crop -----------------------------------------------------------------------

def test_crop_one_offset_for_every_axis():
    _, feeds, out = run_layer(
        {"x": (2, 3, 11, 13), "ref": (2, 3, 7, 9)},
        'layer { name: "c" type: "Crop" bottom: "x" bottom: "ref" top: "c" crop_param { offset: 2 } }')
    np.testing.assert_array_equal(out["c"], feeds["x"][:, :, 2:9, 2:11])


def test_crop_per_axis_offsets_from_axis_1():
    model, feeds, out = run_layer(
        {"x": (2, 4, 11, 13), "ref": (2, 2, 5, 6)},
        'layer { name: "c" type: "Crop" bottom: "x" bottom: "ref" top: "c" '
        'crop_param { axis: 1 offset: 1 offset: 2 offset: 3 } }')
    assert model.blob_shapes["c"] == (2, 2, 5, 6)
    np.testing.assert_array_equal(out["c"], feeds["x"][:, 1:3, 2:7, 3:9])


def test_crop_default_offset_zero_and_negative_axis():
    _, feeds, out = run_layer(
        {"x": (2, 3, 11, 13), "ref": (1, 1, 1, 4)},
        'layer { name: "c" type: "Crop" bottom: "x" bottom: "ref" top: "c" crop_param { axis: -1 } }')
    np.testing.assert_array_equal(out["c"], feeds["x"][:, :, :, :4])


def test_glads_one_bottom_crop_to_a_fixed_height_and_weight(tmp_path):
    # southatsouth/GLAD's crop_layer.cpp: axis 2 becomes `height`, the other cropped axes `weight`
    from conftest import check_everywhere
    model = load_from_text('name: "t"\n' + inputs_text(x=(2, 3, 11, 13)) +
                           'layer { name: "c" type: "Crop" bottom: "x" top: "c" '
                           'crop_param { axis: 2 height: 5 weight: 7 offset: 4 offset: 1 } }\n')
    assert model.blob_shapes["c"] == (2, 3, 5, 7)
    x = np.random.default_rng(5).standard_normal((2, 3, 11, 13)).astype(np.float32)
    check_everywhere(model, {"x": x}, {"c": x[:, :, 4:9, 1:8]}, tmp_path)
    with pytest.raises(LayerError, match="out of bounds"):
        load_from_text('name: "t"\n' + inputs_text(x=(2, 3, 11, 13)) + 'layer { name: "c" type: "Crop" '
                       'bottom: "x" top: "c" crop_param { height: 5 weight: 7 offset: 8 } }\n')
    with pytest.raises(LayerError, match="needs height and weight >= 1"):
        load_from_text('name: "t"\n' + inputs_text(x=(2, 3, 11, 13)) + 'layer { name: "c" type: "Crop" '
                       'bottom: "x" top: "c" crop_param { height: 5 } }\n')


# ---- Tile -----------------------------------------------------------------------

@pytest.mark.parametrize("axis,tiles", [(1, 3), (-1, 2), (0, 2), (2, 4)])
def test_tile_is_numpy_tile(axis, tiles):
    _, feeds, out = run_layer(
        {"x": (2, 3, 4, 5)}, f'layer {{ name: "t" type: "Tile" bottom: "x" top: "t" tile_param {{ axis: {axis} tiles: {tiles} }} }}')
    reps = [1, 1, 1, 1]
    reps[axis] = tiles
    np.testing.assert_array_equal(out["t"], np.tile(feeds["x"], reps))


@pytest.mark.parametrize("axis", [2, 0, -1])
def test_two_bottom_tile_tiles_by_the_second_bottoms_first_axis(axis, tmp_path):
    """PPR-FCN's ms_caffe Tile (tile_layer.cpp Forward_cpu): with a second bottom, tiles = its first axis, whatever
    tile_param.tiles says; checked in torch, onnxruntime and model.py, and with another count at run time."""
    from conftest import check_everywhere
    text = net({"x": (2, 3, 1, 5), "labels": (4, 1)},
               f'layer {{ name: "t" type: "Tile" bottom: "x" bottom: "labels" top: "t" '
               f'tile_param {{ axis: {axis} tiles: 1 }} }}')
    model = load_from_text(text)
    reps = [1, 1, 1, 1]
    reps[axis] = 4
    assert model.blob_shapes["t"] == tuple(np.array([2, 3, 1, 5]) * reps)
    x, labels = rand(2, 3, 1, 5), rand(4, 1)
    check_everywhere(model, {"x": x, "labels": labels}, {"t": np.tile(x, reps)}, tmp_path)


def test_tile_refuses_a_third_bottom():
    with pytest.raises(CaffeqError, match="bottom"):
        load_from_text(net({"x": (2, 3), "a": (2, 1), "b": (2, 1)},
                           'layer { name: "t" type: "Tile" bottom: "x" bottom: "a" bottom: "b" top: "t" '
                           'tile_param { tiles: 2 } }'))


# ---- Im2col ---------------------------------------------------------------------

def im2col_reference(x, kernel, stride, pad, dilation):
    """Caffe's im2col for one item (C, *spatial) written as plain loops."""
    c, spatial = x.shape[0], x.shape[1:]
    out = [(n + 2 * p - (d * (k - 1) + 1)) // s + 1 for n, k, s, p, d in zip(spatial, kernel, stride, pad, dilation)]
    cols = np.zeros((c * int(np.prod(kernel)),) + tuple(out), np.float32)
    row = 0
    for ch in range(c):
        for koff in itertools.product(*[range(k) for k in kernel]):
            for opos in itertools.product(*[range(o) for o in out]):
                src = [o * s - p + k * d for o, s, p, k, d in zip(opos, stride, pad, koff, dilation)]
                if all(0 <= v < n for v, n in zip(src, spatial)):
                    cols[(row,) + opos] = x[(ch,) + tuple(src)]
            row += 1
    return cols


@pytest.mark.parametrize("shape,param,kernel,stride,pad,dilation", [
    ((2, 3, 9, 10), "kernel_h: 2 kernel_w: 3 stride_h: 2 stride_w: 1 pad_h: 1 pad_w: 0", (2, 3), (2, 1), (1, 0), (1, 1)),
    ((2, 2, 9, 11), "kernel_size: 3 dilation: 2 pad: 2 stride: 3", (3, 3), (3, 3), (2, 2), (2, 2)),
    ((2, 2, 8, 7), "kernel_size: 2 kernel_size: 3 dilation: 1 dilation: 2", (2, 3), (1, 1), (0, 0), (1, 2)),
    ((3, 2, 10), "kernel_size: 3 stride: 2 pad: 1", (3,), (2,), (1,), (1,)),          # 1-D
    ((2, 2, 4, 5, 6), "kernel_size: 2 stride: 1 stride: 2 stride: 2 pad: 1", (2, 2, 2), (1, 2, 2), (1, 1, 1), (1, 1, 1)),
])
def test_im2col_variants(shape, param, kernel, stride, pad, dilation):
    model, feeds, out = run_layer(
        {"x": shape}, f'layer {{ name: "i" type: "Im2col" bottom: "x" top: "i" convolution_param {{ {param} }} }}')
    ref = np.stack([im2col_reference(item, kernel, stride, pad, dilation) for item in feeds["x"]])
    assert model.blob_shapes["i"] == ref.shape
    np.testing.assert_array_equal(out["i"], ref)


def test_im2col_axis_2_merges_leading_axes():
    _, feeds, out = run_layer(
        {"x": (2, 3, 2, 6, 5)},
        'layer { name: "i" type: "Im2col" bottom: "x" top: "i" convolution_param { kernel_size: 2 axis: 2 } }')
    x = feeds["x"]
    ref = np.stack([np.stack([im2col_reference(x[a, b], (2, 2), (1, 1), (0, 0), (1, 1)) for b in range(3)])
                    for a in range(2)])
    np.testing.assert_array_equal(out["i"], ref)


# ---- BatchReindex and Filter -----------------------------------------------------

def test_batch_reindex_repeats_and_permutes():
    idx = np.array([3, 0, 0, 2, 1.0], np.float32)
    x = rand(4, 3, 2)
    _, _, out = run_layer({"x": (4, 3, 2), "idx": (5,)},
                              'layer { name: "b" type: "BatchReindex" bottom: "x" bottom: "idx" top: "b" }',
                              feeds={"x": x, "idx": idx})
    np.testing.assert_array_equal(out["b"], x[[3, 0, 0, 2, 1]])


def test_batch_reindex_index_out_of_range_is_an_error():
    model = load_from_text(net({"x": (4, 3), "idx": (2,)},
                               'layer { name: "b" type: "BatchReindex" bottom: "x" bottom: "idx" top: "b" }'))
    with pytest.raises(CaffeqError, match="outside"):
        model.run({"x": rand(4, 3), "idx": np.array([1, 4], np.float32)})


def test_filter_two_bottoms_with_singleton_selector_axes():
    x, y = rand(5, 3, 2), rand(5, 4)
    sel = np.array([0, 2.5, 0, -1, 1], np.float32).reshape(5, 1, 1)
    model, _, out = run_layer(
        {"x": (5, 3, 2), "y": (5, 4), "sel": (5, 1, 1)},
        'layer { name: "f" type: "Filter" bottom: "x" bottom: "y" bottom: "sel" top: "fx" top: "fy" }',
        feeds={"x": x, "y": y, "sel": sel})
    keep = [1, 3, 4]
    np.testing.assert_array_equal(out["fx"], x[keep])
    np.testing.assert_array_equal(out["fy"], y[keep])
    # the static shape is Caffe's setup-time one (full batch); the run gives the real count
    assert model.blob_shapes["fx"] == (5, 3, 2)


def test_filter_keeps_nothing_when_selector_is_zero():
    _, _, out = run_layer({"x": (3, 2), "sel": (3,)},
                              'layer { name: "f" type: "Filter" bottom: "x" bottom: "sel" top: "f" }',
                              feeds={"x": rand(3, 2), "sel": np.zeros(3, np.float32)})
    assert out["f"].shape == (0, 2)


# ---- any batch size -------------------------------------------------------------

BATCH_NET = """
layer { name: "conv" type: "Convolution" bottom: "x" top: "conv" convolution_param { num_output: 4 kernel_size: 3 } }
layer { name: "crop" type: "Crop" bottom: "x" bottom: "conv" top: "crop" crop_param { offset: 1 } }
layer { name: "cat" type: "Concat" bottom: "crop" bottom: "conv" top: "cat" }
layer { name: "sl" type: "Slice" bottom: "cat" top: "s1" top: "s2" slice_param { slice_point: 2 } }
layer { name: "tile" type: "Tile" bottom: "s1" top: "tile" tile_param { axis: -1 tiles: 2 } }
layer { name: "r" type: "Reshape" bottom: "tile" top: "r" reshape_param { shape { dim: 0 dim: -1 dim: 2 } } }
layer { name: "fl" type: "Flatten" bottom: "s2" top: "fl" flatten_param { axis: 1 end_axis: 2 } }
layer { name: "i2c" type: "Im2col" bottom: "x" top: "i2c" convolution_param { kernel_size: 2 stride: 2 } }
"""


def batch_net_reference(x, w, b):
    n = x.shape[0]
    # convolution 3x3, no pad, through the loop im2col (independent of torch)
    cols = np.stack([im2col_reference(item, (3, 3), (1, 1), (0, 0), (1, 1)) for item in x])
    conv = np.einsum("ok,nkhw->nohw", w.reshape(4, -1), cols) + b[None, :, None, None]
    crop = x[:, :, 1:1 + conv.shape[2], 1:1 + conv.shape[3]]
    cat = np.concatenate([crop, conv], axis=1)
    s1, s2 = cat[:, :2], cat[:, 2:]
    tile = np.tile(s1, (1, 1, 1, 2))
    i2c = np.stack([im2col_reference(item, (2, 2), (2, 2), (0, 0), (1, 1)) for item in x])
    return {"r": tile.reshape(n, -1, 2), "fl": s2.reshape(n, -1, s2.shape[-1]), "i2c": i2c}


@pytest.mark.parametrize("how", ["load_batch", "run_other_batch", "reshaped"])
def test_shape_layers_work_at_any_batch(how):
    text = net({"x": (2, 3, 8, 9)}, BATCH_NET)
    x = rand(5, 3, 8, 9)
    if how == "load_batch":
        model = load_from_text(text, random_weights=True, batch=5)
        assert model.blob_shapes["r"][0] == 5
    elif how == "reshaped":
        model = load_from_text(text, random_weights=True).reshaped(5)
    else:
        model = load_from_text(text, random_weights=True)
    w, b = model.params["conv"]
    out = model.run(x, all_blobs=True)
    for name, ref in batch_net_reference(x, w, b).items():
        np.testing.assert_allclose(out[name], ref, rtol=1e-5, atol=1e-5, err_msg=name)


def test_forward_is_differentiable():
    model = load_from_text(net({"x": (2, 3, 8, 9)}, BATCH_NET), random_weights=True)
    module = model.to_torch(all_blobs=True)
    x = torch.from_numpy(rand(2, 3, 8, 9)).requires_grad_()
    out = module(x)
    (out["r"].sum() + out["fl"].square().sum() + out["i2c"].sum()).backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


# ---- bad parameters ---------------------------------------------------------------

BAD = [
    ({"x": (2, 6, 4)}, ('layer { name: "bad" type: "Slice" bottom: "x" top: "a" top: "b" top: "c" '
                       'slice_param { slice_point: 4 slice_point: 2 } }'), "slice_point"),
    ({"x": (2, 6, 4)}, ('layer { name: "bad" type: "Slice" bottom: "x" top: "a" top: "b" '
                       'slice_param { slice_point: 7 } }'), "slice"),
    ({"x": (2, 6, 4)}, ('layer { name: "bad" type: "Slice" bottom: "x" top: "a" top: "b" top: "c" '
                       'slice_param { slice_point: 2 } }'), "slice_point"),
    ({"x": (2, 5, 4)}, 'layer { name: "bad" type: "Slice" bottom: "x" top: "a" top: "b" }', "divide"),
    ({"x": (2, 6, 4)}, ('layer { name: "bad" type: "Reshape" bottom: "x" top: "r" '
                       'reshape_param { shape { dim: 0 dim: 5 dim: 5 } } }'), "48"),
    ({"x": (2, 6, 4)}, ('layer { name: "bad" type: "Reshape" bottom: "x" top: "r" '
                       'reshape_param { shape { dim: 0 dim: -1 dim: 5 } } }'), "divisible"),
    ({"x": (2, 6, 4)}, ('layer { name: "bad" type: "Reshape" bottom: "x" top: "r" '
                       'reshape_param { shape { dim: -1 dim: -1 } } }'), "-1"),
    ({"x": (2, 6, 4)}, ('layer { name: "bad" type: "Reshape" bottom: "x" top: "r" '
                       'reshape_param { shape { dim: 0 dim: 0 } axis: 2 } }'), "copy"),
    ({"x": (2, 6, 4)}, ('layer { name: "bad" type: "Reshape" bottom: "x" top: "r" '
                       'reshape_param { shape { dim: -1 } axis: 1 num_axes: 3 } }'), "num_axes"),
    ({"x": (2, 3, 5, 5), "ref": (2, 3, 6, 4)},
     'layer { name: "bad" type: "Crop" bottom: "x" bottom: "ref" top: "c" }', "out of bounds"),
    ({"x": (2, 3, 8, 8), "ref": (2, 3, 6, 6)},
     'layer { name: "bad" type: "Crop" bottom: "x" bottom: "ref" top: "c" crop_param { offset: 3 } }', "offset 3"),
    ({"x": (2, 3, 8, 8), "ref": (2, 3, 6, 6)},
     'layer { name: "bad" type: "Crop" bottom: "x" bottom: "ref" top: "c" crop_param { offset: 1 offset: 1 offset: 1 } }',
     "offsets"),
    ({"a": (2, 3, 4), "b": (2, 3, 5)}, 'layer { name: "bad" type: "Concat" bottom: "a" bottom: "b" top: "c" }',
     "except along axis 1"),
    ({"a": (2, 3, 4), "b": (2, 3, 5)},
     'layer { name: "bad" type: "Concat" bottom: "a" bottom: "b" top: "c" concat_param { axis: 1 concat_dim: 2 } }',
     "concat_dim"),
    ({"x": (2, 3)}, 'layer { name: "bad" type: "Tile" bottom: "x" top: "t" }', "tiles"),
    ({"x": (2, 3)}, 'layer { name: "bad" type: "Flatten" bottom: "x" top: "f" flatten_param { axis: 1 end_axis: 3 } }',
     "end_axis"),
    ({"x": (2, 3, 4, 5)}, ('layer { name: "bad" type: "Flatten" bottom: "x" top: "f" '
                          'flatten_param { axis: 3 end_axis: 1 } }'), "end_axis"),
    ({"x": (2, 3, 5, 5)}, 'layer { name: "bad" type: "Im2col" bottom: "x" top: "i" convolution_param { stride: 2 } }',
     "kernel_size"),
    ({"x": (2, 3, 5, 5)}, ('layer { name: "bad" type: "Im2col" bottom: "x" top: "i" '
                          'convolution_param { kernel_size: 7 } }'), "empty"),
    ({"x": (2, 3), "sel": (3,)}, 'layer { name: "bad" type: "Filter" bottom: "x" bottom: "sel" top: "f" }', "selector"),
    ({"x": (2, 3), "sel": (2, 2)}, 'layer { name: "bad" type: "Filter" bottom: "x" bottom: "sel" top: "f" }', "1"),
    ({"x": (2, 3), "idx": (2, 1)}, 'layer { name: "bad" type: "BatchReindex" bottom: "x" bottom: "idx" top: "b" }',
     "1-D"),
]


@pytest.mark.parametrize("shapes,layer,needle", BAD, ids=[f"{i}-{b[1].split()[5]}" for i, b in enumerate(BAD)])
def test_bad_parameters_raise_one_clear_error(shapes, layer, needle):
    with pytest.raises((LayerError, ShapeError)) as info:
        load_from_text(net(shapes, layer))
    msg = str(info.value)
    assert "layer 'bad'" in msg and needle in msg, msg
    assert "\n" not in msg


def test_in_place_reshape_is_refused():
    with pytest.raises(LayerError, match="in-place"):
        load_from_text(net({"x": (2, 6)}, 'layer { name: "r" type: "Flatten" bottom: "x" top: "x" }'))


# ---- ONNX (needs caffeq.backends.onnx_backend) ------------------------------------

ONNX_NETS = {
    "batch_net": ({"x": (2, 3, 8, 9)}, BATCH_NET),
    "reshape_prepend": ({"x": (2, 3, 4, 5)}, ('layer { name: "r" type: "Reshape" bottom: "x" top: "r" '
                                             'reshape_param { shape { dim: 1 } axis: 0 num_axes: 0 } }')),
    "reshape_prepend_infer": ({"x": (2, 3, 4, 5)}, ('layer { name: "r" type: "Reshape" bottom: "x" top: "r" '
                                                   'reshape_param { shape { dim: 1 dim: -1 } axis: 0 num_axes: 0 } }')),
    "reshape_swap": ({"x": (2, 6, 4, 5)}, ('layer { name: "r" type: "Reshape" bottom: "x" top: "r" '
                                          'reshape_param { shape { dim: 0 dim: 3 dim: -1 } axis: 0 num_axes: 2 } }')),
    "reshape_absorb": ({"x": (2, 3, 4, 5)}, ('layer { name: "r" type: "Reshape" bottom: "x" top: "r" '
                                            'reshape_param { shape { dim: -1 dim: 4 dim: 5 } } }')),
    "flatten_all": ({"x": (2, 3, 4, 5)}, ('layer { name: "f" type: "Flatten" bottom: "x" top: "f" '
                                         'flatten_param { axis: 0 end_axis: 1 } }')),
    "flatten_insert": ({"x": (2, 3, 4, 5)}, ('layer { name: "f" type: "Flatten" bottom: "x" top: "f" '
                                            'flatten_param { axis: 2 end_axis: 1 } }')),
    "slice_batch_points": ({"x": (6, 3)}, ('layer { name: "s" type: "Slice" bottom: "x" top: "a" top: "b" '
                                          'slice_param { axis: 0 slice_point: 1 } }')),
    "slice_batch_equal": ({"x": (6, 3)}, ('layer { name: "s" type: "Slice" bottom: "x" top: "a" top: "b" '
                                         'slice_param { axis: 0 } }')),
    "slice_last": ({"x": (2, 3, 6)}, ('layer { name: "s" type: "Slice" bottom: "x" top: "a" top: "b" '
                                     'slice_param { axis: -1 slice_point: 4 } }')),
    "crop_axis0": ({"x": (4, 3, 6), "ref": (4, 2, 3)}, ('layer { name: "c" type: "Crop" bottom: "x" bottom: "ref" '
                                                      'top: "c" crop_param { axis: 0 offset: 0 offset: 1 offset: 2 } }')),
    "tile_batch": ({"x": (2, 3)}, 'layer { name: "t" type: "Tile" bottom: "x" top: "t" tile_param { axis: 0 tiles: 3 } }'),
    "im2col_axis2": ({"x": (2, 3, 2, 6, 5)}, ('layer { name: "i" type: "Im2col" bottom: "x" top: "i" '
                                             'convolution_param { kernel_size: 2 axis: 2 } }')),
    "im2col_1d": ({"x": (3, 2, 10)}, ('layer { name: "i" type: "Im2col" bottom: "x" top: "i" '
                                     'convolution_param { kernel_size: 3 stride: 2 pad: 1 } }')),
    "concat_3": ({"a": (2, 1, 4), "b": (2, 2, 4), "c": (2, 3, 4)},
                 'layer { name: "cat" type: "Concat" bottom: "a" bottom: "b" bottom: "c" top: "cat" }'),
}


def _onnx_backend():
    try:
        from caffeq.backends import onnx_backend
    except ImportError:
        pytest.skip("ONNX backend not available")
    return onnx_backend


def _ort_run(path, feeds):
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, {k: v.astype(np.float32) for k, v in feeds.items()})))


def _batch_feeds(shapes, n):
    return {k: rand(n, *s[1:]) for k, s in shapes.items()}


@pytest.mark.parametrize("name", sorted(ONNX_NETS))
def test_onnx_matches_torch_at_several_batches(name, tmp_path):
    _onnx_backend()
    shapes, layers = ONNX_NETS[name]
    model = load_from_text(net(shapes, layers), random_weights=True)
    path = tmp_path / "m.onnx"
    model.export_onnx(str(path))
    # slicing the batch axis in two needs an even batch of at least 2 (Caffe's rule too)
    batches = (2, 4, 6) if name.startswith("slice_batch") else (1, next(iter(shapes.values()))[0], 5)
    for n in sorted(set(batches)):
        feeds = _batch_feeds(shapes, n)
        ref = model.run(feeds)
        got = _ort_run(path, feeds)
        for k, v in ref.items():
            assert got[k].shape == v.shape, (name, n, k, got[k].shape, v.shape)
            np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-5, err_msg=f"{name} batch {n} {k}")


REF_CASES = ["concat_axis2", "concat_channels", "slice_equal", "slice_points", "flatten_axes", "reshape_dims",
             "crop_offsets", "tile", "im2col", "batch_reindex", "filter"]


@pytest.mark.parametrize("name", REF_CASES)
def test_onnx_reference_cases(name, tmp_path):
    _onnx_backend()
    case = Case(FIXTURES / name)
    model = case.load()
    path = tmp_path / "m.onnx"
    model.export_onnx(str(path))
    inputs, outputs = case.inputs, case.outputs
    got = _ort_run(path, inputs)
    atol, rtol = case.tolerance
    for k in model.outputs:
        ref = outputs[k]
        assert got[k].shape == ref.shape
        assert np.abs(got[k] - ref).max() <= atol + rtol * np.abs(ref).max()
    if name not in ("batch_reindex", "filter"):  # items independent along axis 0
        one = {k: v[:1] for k, v in inputs.items()}
        got1 = _ort_run(path, one)
        ref1 = model.run(one)
        for k, v in ref1.items():
            np.testing.assert_allclose(got1[k], v, rtol=1e-5, atol=1e-5)


# ---- Tiling (the highway-driving fork, asyncbridge/tsinghua-tencent-100k code/caffe) --------------

def ref_tiling(x, t):
    """tiling_layer.cpp Forward_cpu's loop: output channel c's t x t tile at input pixel (iy, ix) reads
    input channels c*t^2 .. c*t^2 + t^2 - 1 in row-major tile order."""
    n, c, h, w = x.shape
    out = np.zeros((n, c // (t * t), h * t, w * t), x.dtype)
    for b in range(n):
        for oc in range(c // (t * t)):
            for iy in range(h):
                for ix in range(w):
                    for ty in range(t):
                        for tx in range(t):
                            out[b, oc, iy * t + ty, ix * t + tx] = x[b, oc * t * t + ty * t + tx, iy, ix]
    return out


@pytest.mark.parametrize("t, shape", [(2, (2, 12, 3, 5)), (3, (1, 18, 4, 2)), (1, (2, 3, 2, 3))])
def test_tiling_matches_the_forks_loop(t, shape, tmp_path):
    from conftest import check_everywhere
    x = rand(*shape)
    model = load_from_text(net({"x": shape}, f'layer {{ name: "tile" type: "Tiling" bottom: "x" top: "o" '
                                             f'tiling_param {{ tile_dim: {t} }} }}'))
    ref = ref_tiling(x, t)
    assert model.blob_shapes["o"] == ref.shape
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path)


@pytest.mark.parametrize("params, shape, msg", [("tile_dim: 2", (1, 6, 3, 3), "not a multiple of 4"),
                                                ("", (1, 4, 3, 3), "tile_dim must be positive"),
                                                ("tile_dim: 2", (4, 8), "needs a 4-axis bottom")])
def test_tiling_bad_input(params, shape, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net({"x": shape}, f'layer {{ name: "tile" type: "Tiling" bottom: "x" top: "o" '
                                         f'tiling_param {{ {params} }} }}'))


def ref_pixel_shuffle(x, r):
    """ChaoFan's PixelShuffleForward: each bottom (n, c, h, w) goes to top channel c // r^2 at
    (h*r + (c - c // r^2 * r^2) // r, w*r + c % r)."""
    n, c, h, w = x.shape
    out = np.zeros((n, c // (r * r), h * r, w * r), x.dtype)
    for b, ch, y, z in np.ndindex(x.shape):
        tc = ch // (r * r)
        out[b, tc, y * r + (ch - tc * r * r) // r, z * r + ch % r] = x[b, ch, y, z]
    return out


@pytest.mark.parametrize("r, shape", [(2, (2, 12, 3, 5)), (3, (1, 18, 4, 2))])
def test_gait_extractors_pixel_shuffle_matches_the_forks_loop(r, shape, tmp_path):
    # wj1tr0y/gait_extractor's segmentation net (a PyTorch conversion): PixelShuffle with pixel_shuffle_param
    from conftest import check_everywhere
    x = rand(*shape)
    model = load_from_text(net({"x": shape}, f'layer {{ name: "ps" type: "PixelShuffle" bottom: "x" top: "o" '
                                             f'pixel_shuffle_param {{ upscale_factor: {r} }} }}'))
    check_everywhere(model, {"x": x}, {"o": ref_pixel_shuffle(x, r)}, tmp_path)
    with pytest.raises(LayerError, match="pixel_shuffle_param.upscale_factor must be > 1, got 1"):
        load_from_text(net({"x": shape}, 'layer { name: "ps" type: "PixelShuffle" bottom: "x" top: "o" '
                                         'pixel_shuffle_param { upscale_factor: 1 } }'))


def ref_rearrange(x, depth):
    """caffe-videoSR's RearrangeLayer::Forward_cpu: top (n, d, h*s + i, w*s + j) = bottom (n, (d*s + i)*s + j, h, w)."""
    n, c, h, w = x.shape
    s = int(round((c // depth) ** 0.5))
    out = np.zeros((n, depth, h * s, w * s), x.dtype)
    for b, d, y, z, i, j in np.ndindex(n, depth, h, w, s, s):
        out[b, d, y * s + i, z * s + j] = x[b, (d * s + i) * s + j, y, z]
    return out


@pytest.mark.parametrize("depth, shape", [(1, (2, 9, 3, 5)), (2, (1, 8, 4, 3)), (3, (1, 3, 2, 5))])
def test_video_sr_rearrange_matches_the_forks_loop(depth, shape, tmp_path):
    # Ding-Liu/caffe-videoSR's ESPCN nets: Rearrange with rearrange_param.depth output channels
    from conftest import check_everywhere
    x = rand(*shape)
    model = load_from_text(net({"x": shape}, f'layer {{ name: "r" type: "Rearrange" bottom: "x" top: "o" '
                                             f'rearrange_param {{ depth: {depth} }} }}'))
    check_everywhere(model, {"x": x}, {"o": ref_rearrange(x, depth)}, tmp_path)


@pytest.mark.parametrize("depth, channels", [(2, 9), (1, 8), (0, 4)])
def test_rearrange_refusals(depth, channels):
    with pytest.raises(LayerError, match="perfect square|depth must be >= 1"):
        load_from_text(net({"x": (1, channels, 2, 2)}, f'layer {{ name: "r" type: "Rearrange" bottom: "x" top: "o" '
                                                       f'rearrange_param {{ depth: {depth} }} }}'))


def test_zero_rows_in_torch_and_onnx(tmp_path):
    """A proposal layer may give zero rois: a Reshape whose -1 sits beside a copied 0 fails in onnxruntime and
    in torch, so the layers that merge an item's axes take their size from the shape (AnnikaLindh's
    bottom-up attention test net: Embed of the predicted classes, then Flatten)."""
    ort = pytest.importorskip("onnxruntime")
    text = net({"x": (3, 1, 4), "y": (3, 2, 3, 2)},
               'layer { name: "f" type: "Flatten" bottom: "x" top: "f" }\n'
               'layer { name: "f2" type: "Flatten" bottom: "y" top: "f2" flatten_param { axis: 2 } }\n'
               'layer { name: "ip" type: "InnerProduct" bottom: "y" top: "ip" '
               'inner_product_param { num_output: 5 axis: 2 } }\n'
               'layer { name: "am" type: "ArgMax" bottom: "y" top: "am" }\n'
               'layer { name: "rd" type: "Reduction" bottom: "y" top: "rd" reduction_param { axis: 2 operation: SUMSQ } }\n'
               'layer { name: "rp" type: "Repeat" bottom: "x" top: "rp" repeat_param { num_repeats: 2 } }\n'
               'layer { name: "apl" type: "APL" bottom: "y" top: "apl" apl_param { sums: 2 } }\n')
    model = load_from_text(text, random_weights=True)
    path = tmp_path / "m.onnx"
    model.export_onnx(str(path))
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    shapes = {"f": (4,), "f2": (2, 6), "ip": (2, 5), "am": (1, 1, 1), "rd": (2,), "rp": (2, 1, 4), "apl": (2, 3, 2)}
    for rows in (0, 2):
        feeds = {"x": rand(rows, 1, 4), "y": rand(rows, 2, 3, 2)}
        got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
        want = model.run(feeds)
        for top, tail in shapes.items():
            assert got[top].shape == want[top].shape == (rows,) + tail, top   # BVLC's ArgMax keeps 4 axes
            np.testing.assert_allclose(got[top], want[top], rtol=1e-5, atol=1e-5, err_msg=top)


def test_merged_axes_follow_a_batch_that_a_permute_moved(tmp_path):
    """After a Permute that moves the batch off axis 0, Flatten and ArgMax merge axes that hold it: the exported
    ONNX takes their size at run time, so it runs at another batch too."""
    ort = pytest.importorskip("onnxruntime")
    permute = 'layer { name: "p" type: "Permute" bottom: "x" top: "p" permute_param { order: 1 order: 0 order: 2 order: 3 } }\n'
    model = load_from_text(net({"x": (2, 3, 2, 2)}, permute + 'layer { name: "f" type: "Flatten" bottom: "p" top: "f" }\n'
                               'layer { name: "am" type: "ArgMax" bottom: "p" top: "am" }\n'))
    model.export_onnx(str(tmp_path / "m.onnx"))
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    for batch in (2, 3):
        x = rand(batch, 3, 2, 2)
        got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"x": x})))
        want = model.reshaped(batch).run({"x": x})
        assert got["f"].shape == (3, 4 * batch)
        np.testing.assert_array_equal(got["f"], want["f"])
        np.testing.assert_array_equal(got["am"], want["am"])


def test_argmax_of_a_one_axis_bottom():
    # argmax_layer.cpp Reshape: at least 3 top axes, count(1) = 1 value per item, so index 0 and shape (N, 1, 1)
    model = load_from_text(net({"x": (3,)}, 'layer { name: "a" type: "ArgMax" bottom: "x" top: "o" }'))
    assert model.blob_shapes["o"] == (3, 1, 1)
    np.testing.assert_array_equal(model.run({"x": np.array([1, 5, 2], np.float32)})["o"], np.zeros((3, 1, 1)))
