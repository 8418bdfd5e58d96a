"""Small fork layers of corpus 109b against numpy loops written from each fork's C++, in torch, onnxruntime
and model.py: ZJULearning/SplitNet's CornerCrop, aleksispi/pose-drl's Cos, busyboxs/roi_roi's Conadd,
jialinwu17/segawareatt's ChannelReduce; cswaynecool/DRT's Wtf* are read and sized, never run."""
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import check_everywhere, model_py_outputs, net, rng

from caffeq.errors import CaffeqError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

f32 = np.float32
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "tests", "fixtures", "realworld")


# ---- CornerCrop (corner_crop_layer.cpp) -------------------------------------------------------------

def corner_crop_ref(x, ch, cw, positions):
    """The fork's loop: every bottom element (h, w) inside a window at (y, x) goes to (h - y, w - x)."""
    n, c, h, w = x.shape
    oh, ow = (h - ch) // 2, (w - cw) // 2
    corner = {"center": (oh, ow), "upperleft": (0, 0), "upperright": (0, 2 * ow), "lowerleft": (2 * oh, 0),
              "lowerright": (2 * oh, 2 * ow)}
    tops = []
    for pos in positions:
        y0, x0 = corner[pos]
        top = np.full((n, c, ch, cw), np.nan, f32)
        for i in range(n):
            for k in range(c):
                for yy in range(h):
                    for xx in range(w):
                        if y0 <= yy < y0 + ch and x0 <= xx < x0 + cw:
                            top[i, k, yy - y0, xx - x0] = x[i, k, yy, xx]
        tops.append(top)
    return tops


@pytest.mark.parametrize("crop, side, positions, shape", [
    ("crop_h: 3 crop_w: 4", (3, 4), ["upperleft", "upperright", "lowerleft", "lowerright", "center"], (2, 3, 7, 10)),
    ("crop_size: 5", (5, 5), ["lowerright", "center"], (2, 3, 9, 7)),
    # crop_size wins over crop_h / crop_w (LayerSetUp's has_crop_size)
    ("crop_size: 3 crop_h: 5 crop_w: 1", (3, 3), ["lowerleft", "upperright", "lowerleft"], (2, 2, 7, 11)),
])
def test_corner_crop(tmp_path, crop, side, positions, shape):
    x = rng(1).standard_normal(shape).astype(f32)
    tops = " ".join(f'top: "t{i}"' for i in range(len(positions)))
    pos = " ".join(f'position: "{p}"' for p in positions)
    m = load_from_text(net(f'layer {{ name: "cc" type: "CornerCrop" bottom: "x" {tops} '
                           f'corner_crop_param {{ {crop} {pos} }} }}', inputs={"x": x.shape}))
    ch, cw = side
    refs = corner_crop_ref(x, ch, cw, positions)
    check_everywhere(m, {"x": x}, {f"t{i}": r for i, r in enumerate(refs)}, tmp_path)


@pytest.mark.parametrize("param, msg", [
    ('crop_size: 4 position: "upperleft"', "even number"),          # 7 - 4 is odd
    ('crop_size: 3 position: "middle"', "position 'middle'"),
    ('crop_h: 7 crop_w: 3 position: "center"', "smaller"),          # CHECK_GT(height, crop_h): 7 == 7
])
def test_corner_crop_refuses(param, msg):
    with pytest.raises(CaffeqError, match=msg):
        load_from_text(net(f'layer {{ name: "cc" type: "CornerCrop" bottom: "x" top: "t" corner_crop_param {{ {param} }} }}',
                           inputs={"x": (1, 2, 7, 9)}))


def test_corner_crop_one_position_per_top():
    with pytest.raises(CaffeqError, match="one position per top"):
        load_from_text(net('layer { name: "cc" type: "CornerCrop" bottom: "x" top: "a" top: "b" top: "c" top: "d" '
                           'top: "e" corner_crop_param { crop_size: 3 } }', inputs={"x": (1, 2, 7, 9)}))


# ---- Cos (cos_layer.cpp) -----------------------------------------------------------------------------

def test_cos(tmp_path):
    x = (rng(2).standard_normal((2, 3, 5, 4)) * 4).astype(f32)
    m = load_from_text(net('layer { name: "c" type: "Cos" bottom: "x" top: "y" }', inputs={"x": x.shape}))
    ref = np.cos(x.astype(np.float64)).astype(f32)
    check_everywhere(m, {"x": x}, {"y": ref}, tmp_path, atol=1e-6)


# ---- Conadd (conadd_layer.cu) ------------------------------------------------------------------------

def conadd_ref(*bottoms):
    """The fork: zero the top, then add each bottom's leading count(bottom 0) elements, in order."""
    first = bottoms[0]
    top = np.zeros(first.size, f32)
    for b in bottoms:
        flat = b.reshape(-1)
        for m in range(first.size):
            top[m] = f32(top[m] + flat[m])
    return top.reshape(first.shape)


def test_conadd_equal_and_larger_bottoms(tmp_path):
    r = rng(3)
    a = r.standard_normal((2, 3, 5, 4)).astype(f32)
    b = r.standard_normal((2, 3, 5, 4)).astype(f32)
    c = r.standard_normal((2, 3, 7, 6)).astype(f32)      # more elements: its leading ones are read
    m = load_from_text(net('layer { name: "s" type: "Conadd" bottom: "a" bottom: "b" bottom: "c" top: "y" '
                           'conadd_param { } }', inputs={"a": a.shape, "b": b.shape, "c": c.shape}))
    check_everywhere(m, {"a": a, "b": b, "c": c}, {"y": conadd_ref(a, b, c)}, tmp_path)


def test_conadd_one_bottom_is_a_copy(tmp_path):
    a = rng(4).standard_normal((2, 3, 5, 4)).astype(f32)
    m = load_from_text(net('layer { name: "s" type: "Conadd" bottom: "a" top: "y" }', inputs={"a": a.shape}))
    check_everywhere(m, {"a": a}, {"y": a}, tmp_path)


def test_conadd_refuses_a_smaller_bottom():
    with pytest.raises(CaffeqError, match="fewer elements"):
        load_from_text(net('layer { name: "s" type: "Conadd" bottom: "a" bottom: "b" top: "y" }',
                           inputs={"a": (2, 3, 5, 4), "b": (2, 3, 4, 4)}))


# ---- ChannelReduce (channel_reduce_layer.cpp) --------------------------------------------------------

def channel_reduce_ref(x, groups, op):
    n, c, h, w = x.shape
    per = c // groups
    lowest = -np.finfo(f32).max
    top = np.full((n, groups, h, w), lowest if op == "MAX" else 0, f32)
    for i in range(n):
        for ch in range(c):
            g = ch // per
            for y in range(h):
                for z in range(w):
                    v = x[i, ch, y, z]
                    if op == "SUM":
                        top[i, g, y, z] = f32(top[i, g, y, z] + v)
                    elif v > top[i, g, y, z]:
                        top[i, g, y, z] = v
    return top


@pytest.mark.parametrize("op, groups", [("SUM", 3), ("MAX", 2), ("SUM", 1), ("MAX", 3)])
def test_channel_reduce(tmp_path, op, groups):
    x = rng(5).standard_normal((2, 6, 5, 3)).astype(f32)
    x[0, 1, 2, 1] = np.nan          # MAX: NaN never replaces the running value
    x[1, :, 0, 0] = -np.inf         # MAX: an all -inf group stays at -FLT_MAX
    if op == "SUM":
        x = np.nan_to_num(x, nan=0.5, neginf=-3.0)
    m = load_from_text(net(f'layer {{ name: "r" type: "ChannelReduce" bottom: "x" top: "y" '
                           f'channel_reduce_param {{ num_channels: {groups} operation: {op} }} }}',
                           inputs={"x": x.shape}))
    check_everywhere(m, {"x": x}, {"y": channel_reduce_ref(x, groups, op)}, tmp_path)


def test_channel_reduce_max_keeps_the_first_of_equal_values(tmp_path):
    """MAX replaces only where a channel is larger (>): of +0 and -0 the first one seen stays.  Torch and
    model.py only: onnxruntime's Where (1.32) returns +0 where it selects a -0, whatever the comparison."""
    x = np.zeros((2, 4, 3, 5), f32)
    x[:, 1] = -0.0                   # group 0: +0 then -0 -> +0
    x[:, 2] = -0.0                   # group 1: -0 then +0 -> -0
    m = load_from_text(net('layer { name: "r" type: "ChannelReduce" bottom: "x" top: "o" '
                           'channel_reduce_param { num_channels: 2 operation: MAX } }', inputs={"x": x.shape}))
    for where, got in (("torch", m.run({"x": x})["o"]), ("model.py", model_py_outputs(m, {"x": x}, tmp_path)["o"])):
        got = np.asarray(got)
        assert not np.signbit(got[:, 0]).any() and np.signbit(got[:, 1]).all(), where


@pytest.mark.parametrize("groups", [4, 6])
def test_channel_reduce_refuses(groups):
    with pytest.raises(CaffeqError, match="num_channels"):
        load_from_text(net(f'layer {{ name: "r" type: "ChannelReduce" bottom: "x" top: "y" '
                           f'channel_reduce_param {{ num_channels: {groups} }} }}', inputs={"x": (1, 6, 3, 3)}))


# ---- DRT's Wtf* (base_conv_layer.cpp Reshape; forwards driven by MATLAB state) -----------------------

@pytest.mark.parametrize("kind, flag, shape", [
    ("Wtf", "mylayerone", (50, 1, 19, 19)),
    ("Wtfthird", "mylayerthird", (1, 1, 1, 1)),
    ("Wtffourth", "mylayerfourth", (2, 7, 9, 6)),
])
def test_drt_layers_are_sized_not_run(kind, flag, shape):
    m = load_from_text(net(f'layer {{ name: "f" type: "{kind}" bottom: "x" top: "y" convolution_param {{ '
                           f'num_output: 7 pad: 2 kernel_h: 5 kernel_w: 3 bias_term: false {flag}: true }} }}',
                           inputs={"x": (2, 4, 9, 4)}), random_weights=True)
    assert tuple(m.blob_shapes["y"]) == shape
    with pytest.raises(CaffeqError, match="correlation-filter"):
        m.run({"x": np.zeros((2, 4, 9, 4), f32)})


@pytest.mark.parametrize("flags, shape", [
    ("mylayerthird: true mylayerone: true", (50, 1, 19, 19)),      # Reshape tests one, then two, then third
    ("mylayerthird: true mylayerfourth: true", (1, 1, 1, 1)),
    ("mylayerfourth: true kstride: 2", (2, 7, 5, 4)),               # kernel spread to 9 x 5
    ("mylayerfourth: true kstride_h: 2 kstride_w: 1", (2, 7, 5, 6)),
])
def test_drt_top_shapes(flags, shape):
    m = load_from_text(net(f'layer {{ name: "f" type: "Wtffourth" bottom: "x" top: "y" convolution_param {{ '
                           f'num_output: 7 pad: 2 kernel_h: 5 kernel_w: 3 {flags} }} }}', inputs={"x": (2, 4, 9, 4)}))
    assert tuple(m.blob_shapes["y"]) == shape


@pytest.mark.parametrize("flags, blobs", [
    ("mylayerseventh: true", [(1, 1, 9, 4), (6,)]),                  # the distance transform's variables
    ("mylayerthird: true", [(6, 2, 5, 3), (6,)]),                    # Convolution's blobs (group 2)
])
def test_drt_blob_shapes(flags, blobs):
    m = load_from_text(net(f'layer {{ name: "f" type: "Wtf" bottom: "x" top: "y" convolution_param {{ '
                           f'num_output: 6 kernel_h: 5 kernel_w: 3 group: 2 {flags} }} }}', inputs={"x": (2, 4, 9, 4)}),
                       random_weights=True)
    assert [tuple(b.shape) for b in m.params["f"]] == blobs


def test_drt_second_needs_its_top_shape():
    text = net('layer { name: "f" type: "Wtfsecond" bottom: "x" top: "y" convolution_param { num_output: 7 '
               'kernel_size: 5 mylayertwo: true } }', inputs={"x": (1, 4, 9, 9)})
    with pytest.raises(CaffeqError, match="data.txt"):
        load_from_text(text)
    m = load_from_text(text, input_shapes={"y": (2, 4, 9, 9)})
    assert tuple(m.blob_shapes["y"]) == (2, 4, 9, 9)


def test_drt_refuses_bad_group():
    with pytest.raises(LayerError, match="multiple of group"):
        load_from_text(net('layer { name: "f" type: "Wtffourth" bottom: "x" top: "y" convolution_param { '
                           'num_output: 7 kernel_size: 3 group: 2 mylayerfourth: true } }', inputs={"x": (1, 4, 9, 9)}))


# ---- the corpus files read ---------------------------------------------------------------------------

@pytest.mark.parametrize("name, extra", [
    ("ZJULearning__SplitNet__image50__extract.prototxt", ["--input-shape", "data=2,4,100,100"]),
    ("ZJULearning__SplitNet__image50__train_test.prototxt", ["--input-shape", "data=2,4,100,100"]),
    ("aleksispi__pose-drl__models__agent__train_pose_drl_mubynet.prototxt", []),
    ("busyboxs__roi_roi__caffe__examples__mnist__lenet_train_test.prototxt", ["--input-shape", "data=2,1,28,28"]),
    ("cswaynecool__DRT__model__cnn-a.prototxt", []),
    ("cswaynecool__DRT__model__cnn-b.prototxt", ["--input-shape", "conv5_f1=2,512,46,46"]),
    ("cswaynecool__DRT__model__cnn-c.prototxt", []),
    ("cswaynecool__DRT__model__cnn-third.prototxt", []),
])
def test_corpus_files_read(name, extra):
    path = os.path.join(CORPUS, name)
    done = subprocess.run([sys.executable, os.path.join(ROOT, "cli.py"), "inspect", path, *extra],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "total:" in done.stdout
