"""synopsys-caffe (foss-for-synopsys-dwc-arc-processors/synopsys-caffe @977ba36a) TensorFlow-converted
layers: Squeeze, HardSwish, Pad, MirrorPad, ResizeNearestNeighbor, DepthToSpace, SpaceToBatchND,
BatchToSpaceND.

References are numpy re-derivations of the fork's C++ loops written here (src/caffe/layers/
<name>_layer.cpp: flat buffers, its index arithmetic and its copy order), on shapes whose axes all
differ.
"""
import math

import numpy as np
import pytest
from conftest import check_everywhere, inputs_text, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text


def one_layer(shape, ltype, param="", top="o", bottom="x"):
    return inputs_text(x=shape) + (
        f'layer {{ name: "l" type: "{ltype}" bottom: "{bottom}" top: "{top}" {param} }}')


def run_checks(shape, ltype, param, ref_fn, tmp_path, atol=0.0, rtol=0.0, seed=1):
    model = load_from_text(one_layer(shape, ltype, param))
    x = rng(seed).standard_normal(shape).astype(np.float32)
    ref = ref_fn(x)
    assert model.graph.shape("o") == ref.shape
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path, atol=atol, rtol=rtol)


def refused(shape, ltype, param, msg, **kw):
    with pytest.raises(CaffeqError, match=msg):
        load_from_text(one_layer(shape, ltype, param, **kw))


def unravel(offset, shape):
    """The fork's indices(): the coordinates of a flat offset, last axis fastest."""
    out = [0] * len(shape)
    for i in range(len(shape) - 1, -1, -1):
        out[i] = offset % shape[i]
        offset //= shape[i]
    return out


def ravel(coords, shape):
    """The fork's offset()."""
    off = 0
    for c, d in zip(coords, shape):
        off = off * d + c
    return off


# ---- Squeeze --------------------------------------------------------------------------------

def squeeze_ref(x, axes):
    n = x.ndim
    drop = [a % n for a in axes]
    keep = [d for i, d in enumerate(x.shape) if not (d == 1 and (not axes or i in drop))]
    return x.reshape(keep)   # ShareData: the same values in the same order


@pytest.mark.parametrize("shape, axes", [((2, 1, 5, 1), [1, -1]), ((2, 1, 5, 1), []), ((1, 3, 1, 7), []),
                                         ((2, 1, 5, 1), [-1]), ((1, 3, 1, 7), [2, 0, 2])])
def test_squeeze(shape, axes, tmp_path):
    param = "squeeze_param { " + " ".join(f"axis: {a}" for a in axes) + " }"
    run_checks(shape, "Squeeze", param, lambda x: squeeze_ref(x, axes), tmp_path)


def test_squeeze_shapes():
    model = load_from_text(one_layer((2, 1, 5, 1), "Squeeze", "squeeze_param { axis: 3 }"))
    assert model.graph.shape("o") == (2, 1, 5)


@pytest.mark.parametrize("param, msg", [
    ("squeeze_param { axis: 2 }", r"axis 2 has size 5, not 1"),
    ("squeeze_param { axis: 5 }", r"axis 5 is past the last axis"),
    ("squeeze_param { axis: 4 }", r"axis 4 out of range"),
    ("squeeze_param { axis: -5 }", r"axis -5 out of range"),
])
def test_squeeze_bad(param, msg):
    refused((2, 1, 5, 1), "Squeeze", param, msg)


def test_squeeze_in_place_refused():
    refused((2, 1, 5, 1), "Squeeze", "", "in-place", top="x")


# ---- HardSwish ------------------------------------------------------------------------------

def test_hard_swish(tmp_path):
    def ref(x):
        v = x.astype(np.float64)   # the fork: x * min(max(x + 3.0, 0.), 6.0) / 6.0 in double
        return (v * np.minimum(np.maximum(v + 3.0, 0.0), 6.0) / 6.0).astype(np.float32)
    shape = (2, 3, 5, 7)
    model = load_from_text(one_layer(shape, "HardSwish"))
    x = rng(2).standard_normal(shape).astype(np.float32) * 4   # across -3 and 3
    check_everywhere(model, {"x": x}, {"o": ref(x)}, tmp_path, atol=1e-6, rtol=1e-6)


# ---- Pad, MirrorPad -------------------------------------------------------------------------

def pad_ref(x, paddings, value):
    """The fork's recursive PadLayer::Pad over flat buffers."""
    bs = x.shape
    ts = [d + paddings[2 * i] + paddings[2 * i + 1] for i, d in enumerate(bs)]
    top = np.full(math.prod(ts), value, np.float32)
    bottom = x.ravel()

    def level(lv, bi, ti):
        for ix in range(bs[lv]):
            bix, tix = bi + ix, ti + paddings[2 * lv] + ix
            if lv == len(bs) - 1:
                top[tix] = bottom[bix]
            else:
                level(lv + 1, bix * bs[lv + 1], tix * ts[lv + 1])
    level(0, 0, 0)
    return top.reshape(ts)


def mirror_pad_ref(x, paddings, value, mode):
    """MirrorPadLayer::Forward_cpu: copy the rows in, then per axis (innermost first) copy_n slabs."""
    bshape = list(x.shape)
    tshape = [d + paddings[2 * i] + paddings[2 * i + 1] for i, d in enumerate(bshape)]
    top = np.full(math.prod(tshape), value, np.float32)
    bottom = x.ravel()
    strides = bshape[-1]
    for position in range(x.size // strides):
        coord = unravel(position * strides, bshape)
        pt = ravel([c + paddings[2 * i] for i, c in enumerate(coord)], tshape)
        top[pt:pt + strides] = bottom[position * strides:(position + 1) * strides]
    if mode not in ("REFLECT", "SYMMETRIC", "EDGE"):
        return top.reshape(tshape)
    strides = 1
    for i in range(len(tshape) - 1, -1, -1):
        inner = strides
        strides *= tshape[i]
        p0, p1, b = paddings[2 * i], paddings[2 * i + 1], bshape[i]
        for position in range(top.size // strides):
            base = position * strides

            def copy(src, dst):
                top[base + inner * dst:base + inner * (dst + 1)] = top[base + inner * src:base + inner * (src + 1)]
            if mode == "REFLECT":
                for j in range(1, p0 + 1):
                    copy(p0 + j, p0 - j)
                for j in range(1, p1 + 1):
                    copy(b + p0 - 1 - j, b + p0 - 1 + j)
            elif mode == "SYMMETRIC":
                for j in range(p0):
                    copy(p0 + j, p0 - j - 1)
                for j in range(p1):
                    copy(b + p0 - 1 - j, b + p0 + j)
            else:
                for j in range(p0):
                    copy(p0, p0 - j - 1)
                for j in range(p1):
                    copy(b + p0 - 1, b + p0 + j)
    return top.reshape(tshape)


def pad_param(field, paddings, extra=""):
    return f"{field} {{ " + " ".join(f"paddings: {p}" for p in paddings) + f" {extra} }}"


PADS = [1, 0, 0, 2, 3, 1, 2, 4]   # N, C, H, W: (before, after) each


@pytest.mark.parametrize("paddings, value", [(PADS, 1.5), ([0, 0, 0, 0, 3, 3, 3, 3], 0.0)])
def test_pad(paddings, value, tmp_path):
    param = pad_param("pad_param", paddings, f"constant_values: {value}")
    run_checks((2, 3, 5, 7), "Pad", param, lambda x: pad_ref(x, paddings, value), tmp_path)


def test_pad_3_axes(tmp_path):
    paddings = [2, 1, 0, 3, 1, 1]
    run_checks((3, 4, 5), "Pad", pad_param("pad_param", paddings), lambda x: pad_ref(x, paddings, 0.0), tmp_path)


@pytest.mark.parametrize("mode", ["CONSTANT", "REFLECT", "SYMMETRIC", "EDGE"])
def test_mirror_pad(mode, tmp_path):
    paddings = [1, 0, 0, 2, 3, 1, 2, 4]   # 2, 3, 5, 7: inside every mode's limits
    param = pad_param("mirror_pad_param", paddings, f'constant_values: -2 mode: "{mode}"')
    run_checks((2, 3, 5, 7), "MirrorPad", param, lambda x: mirror_pad_ref(x, paddings, -2.0, mode), tmp_path)


@pytest.mark.parametrize("mode, paddings", [("REFLECT", [0, 0, 2, 3, 3, 1]), ("SYMMETRIC", [1, 1, 4, 1, 1, 4])])
def test_mirror_pad_wider_than_the_axis(mode, paddings, tmp_path):
    # axis 1 (size 3) padded by 3 or 4 on one side: the fork's copies read into the other pad
    param = pad_param("mirror_pad_param", paddings, f'constant_values: 7 mode: "{mode}"')
    run_checks((2, 3, 4), "MirrorPad", param, lambda x: mirror_pad_ref(x, paddings, 7.0, mode), tmp_path)


def test_mirror_pad_reference_is_tf_within_limits():
    x = rng(3).standard_normal((2, 3, 5, 7)).astype(np.float32)
    pads = [(1, 0), (0, 2), (3, 1), (2, 4)]
    for mode, np_mode in (("REFLECT", "reflect"), ("SYMMETRIC", "symmetric"), ("EDGE", "edge")):
        ours = mirror_pad_ref(x, [p for pair in pads for p in pair], 0.0, mode)
        assert np.array_equal(ours, np.pad(x, pads, mode=np_mode)), mode


@pytest.mark.parametrize("ltype, param, msg", [
    ("Pad", pad_param("pad_param", [1, 1, 1]), r"holds 3 values"),
    ("Pad", pad_param("pad_param", [1, 1, 1, 1]), r"holds 4 values; a 4-axis bottom needs 8"),
    ("MirrorPad", pad_param("mirror_pad_param", PADS, 'mode: "WRAP"'), r"mode 'WRAP' is not one of"),
    ("MirrorPad", pad_param("mirror_pad_param", [0, 0, 0, 0, 0, 0, 7, 0], 'mode: "REFLECT"'),
     r"REFLECT pads \(7, 0\) of axis 3 \(size 7\) make the fork read outside the axis"),
    ("MirrorPad", pad_param("mirror_pad_param", [0, 0, 0, 0, 0, 0, 0, 8], 'mode: "SYMMETRIC"'),
     r"SYMMETRIC pads \(0, 8\) of axis 3"),
])
def test_pad_bad(ltype, param, msg):
    refused((2, 3, 5, 7), ltype, param, msg)


# ---- ResizeNearestNeighbor -----------------------------------------------------------------

def nearest_index(n_in, n_out, mode):
    """The fork's in_h / in_w for every output index (float32 scale, floorf / roundf as its C++)."""
    f = np.float32
    scale = f(n_in - 1) / f(n_out - 1) if mode == "align_corners" and n_out > 1 else f(n_in) / f(n_out)
    out = []
    for i in range(n_out):
        if mode == "half_pixel_onnx":   # (float)(i + 0.5f) * scale, then - 0.5 in double, then floorf
            v = int(np.floor(f(np.float64(f(f(i) + f(0.5)) * scale) - 0.5)))
            out.append(max(min(v, n_in - 1), 0))
        elif mode == "half_pixel":
            out.append(max(min(int(np.floor(f(f(i) + f(0.5)) * scale)), n_in - 1), 0))
        elif mode == "align_corners":   # roundf: half away from zero
            out.append(min(int(math.floor(np.float64(f(i) * scale) + 0.5)), n_in - 1))
        else:
            out.append(min(int(np.floor(f(i) * scale)), n_in - 1))
    return np.array(out)


def resize_nearest_ref(x, ho, wo, mode, nhwc):
    ha = 1 if nhwc else 2
    h, w = x.shape[ha], x.shape[ha + 1]
    return x.take(nearest_index(h, ho, mode), axis=ha).take(nearest_index(w, wo, mode), axis=ha + 1)


MODES = {"asymmetric": "", "align_corners": "align_corners: true", "half_pixel": "half_pixel_centers: true",
         "half_pixel_onnx": "half_pixel_onnx: true"}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("fmt", ["NCHW", "NHWC"])
@pytest.mark.parametrize("ho, wo", [(9, 17), (3, 4)])
def test_resize_nearest(mode, fmt, ho, wo, tmp_path):
    shape = (2, 3, 5, 7) if fmt == "NCHW" else (2, 5, 7, 3)
    param = (f'resize_nearest_neighbor_param {{ output_height: {ho} output_width: {wo} data_format: "{fmt}" '
             f'{MODES[mode]} }}')
    run_checks(shape, "ResizeNearestNeighbor", param,
               lambda x: resize_nearest_ref(x, ho, wo, mode, fmt == "NHWC"), tmp_path)


def test_resize_nearest_indices_every_size():
    from caffeq.layers.synopsys_tf import nearest_sources
    for mode in MODES:
        for n_in in range(1, 33):
            for n_out in range(1, 70):
                ours = nearest_sources(n_in, n_out, mode).numpy()
                assert np.array_equal(ours, nearest_index(n_in, n_out, mode)), (mode, n_in, n_out)


def test_resize_nearest_scales_default_nhwc(tmp_path):
    # no data_format: NHWC; floor(5 * 2.5) = 12, floor(7 * 0.7) = 4 in float32
    shape = (2, 5, 7, 3)
    param = "resize_nearest_neighbor_param { scale_height: 2.5 scale_width: 0.7 half_pixel_centers: true }"
    run_checks(shape, "ResizeNearestNeighbor", param,
               lambda x: resize_nearest_ref(x, 12, 4, "half_pixel", True), tmp_path)


def test_resize_nearest_other_format_reads_as_nchw():
    model = load_from_text(one_layer((2, 3, 5, 7), "ResizeNearestNeighbor",
                                     'resize_nearest_neighbor_param { data_format: "nchw" scale_height: 2 }'))
    assert model.graph.shape("o") == (2, 3, 10, 7)


@pytest.mark.parametrize("param, msg", [
    ("align_corners: true half_pixel_centers: true", r"align_corners and half_pixel_centers exclude each other"),
    ("output_height: 0", r"output_height must be positive, got 0"),
    ("scale_width: -1", r"scale_width must be positive"),
    ('scale_height: 0.1 data_format: "NCHW"', r"output size 0x7"),
])
def test_resize_nearest_bad(param, msg):
    refused((2, 3, 5, 7), "ResizeNearestNeighbor", f"resize_nearest_neighbor_param {{ {param} }}", msg)


def test_resize_nearest_needs_4_axes():
    refused((2, 3, 5), "ResizeNearestNeighbor", "", r"needs a 4-axis input")


# ---- DepthToSpace ---------------------------------------------------------------------------

def depth_to_space_ref(x, b, fmt):
    """DepthToSpaceLayer::Forward_cpu's loops."""
    if fmt == "NHWC":
        n, ih, iw, idp = x.shape
        oh, ow, od = ih * b, iw * b, idp // (b * b)
        out = np.empty((n, oh, ow, od), x.dtype)
    else:
        n, idp, ih, iw = x.shape
        od, oh, ow = idp // (b * b), ih * b, iw * b
        out = np.empty((n, od, oh, ow), x.dtype)
    for bb in range(n):
        for h in range(oh):
            for w in range(ow):
                oh_, ow_ = h % b, w % b
                for d in range(od):
                    if fmt == "CRD":
                        ind = (d * b + oh_) * b + ow_
                    else:
                        ind = d + (oh_ * b + ow_) * od
                    if fmt == "NHWC":
                        out[bb, h, w, d] = x[bb, h // b, w // b, ind]
                    else:
                        out[bb, d, h, w] = x[bb, ind, h // b, w // b]
    return out


@pytest.mark.parametrize("fmt", ["NHWC", "NCHW", "DCR", "CRD"])
@pytest.mark.parametrize("b", [2, 3])
def test_depth_to_space(fmt, b, tmp_path):
    c = 2 * b * b
    shape = (2, 3, 4, c) if fmt == "NHWC" else (2, c, 3, 4)
    param = f'depth_to_space_param {{ block_size: {b} data_format: "{fmt}" }}'
    run_checks(shape, "DepthToSpace", param, lambda x: depth_to_space_ref(x, b, fmt), tmp_path)


@pytest.mark.parametrize("param, msg", [
    ('data_format: "NCHW"', r"block_size is required"),
    ("block_size: 0", r"block_size must be >= 1, got 0"),
    ('block_size: 2 data_format: "NDHWC"', r"data_format 'NDHWC' is not one of"),
    ('block_size: 2 data_format: "NCHW"', r"7 channels are not divisible by block_size² = 4"),
])
def test_depth_to_space_bad(param, msg):
    refused((2, 7, 3, 4), "DepthToSpace", f"depth_to_space_param {{ {param} }}", msg)


# ---- SpaceToBatchND, BatchToSpaceND ---------------------------------------------------------

def space_to_batch_ref(x, block, pads):
    """SpaceToBatchNDLayer::Forward_cpu: zero-pad by rows, then its permuted_order walk."""
    m, bshape = len(block), list(x.shape)
    top_shape = list(bshape)
    for i in range(m):
        top_shape[i + 1] += pads[2 * i] + pads[2 * i + 1]
    top = np.zeros(math.prod(top_shape), np.float32)
    bottom = x.ravel()
    strides = math.prod(bshape[m:])
    for position in range(x.size // strides):
        coord = unravel(position * strides, bshape)
        for i in range(m):
            coord[i + 1] += pads[2 * i]
        pt = ravel(coord, top_shape)
        top[pt:pt + strides] = bottom[position * strides:(position + 1) * strides]
    out_shape = [bshape[0] * math.prod(block)] + [top_shape[i + 1] // block[i] for i in range(m)] + bshape[m + 1:]
    permuted_shape = list(top_shape)
    order = list(range(2 * len(top_shape) + 1))
    order[m] = 0
    s = 1
    for i in range(m):
        top_shape[i + s] //= block[i]
        permuted_shape[i + s] = top_shape[i + s]
        order[i + m + 1] = i + s
        s += 1
        top_shape.insert(i + s, block[i])
        permuted_shape.insert(i, block[i])
        order[i] = i + s
    temp, out = top.copy(), np.empty_like(top)
    for i in range(temp.size):
        old = unravel(i, top_shape)
        out[ravel([old[order[j]] for j in range(len(old))], permuted_shape)] = temp[i]
    return out.reshape(out_shape)


def batch_to_space_ref(x, block, crops):
    """BatchToSpaceNDLayer::Forward_cpu: its permuted copy by strides, then the cropped read."""
    m, bshape = len(block), list(x.shape)
    temp_shape = list(block) + bshape
    for b in block:
        temp_shape[m] //= b
    permuted_shape, order = list(temp_shape), list(range(len(temp_shape)))
    for i in range(m):
        permuted_shape[2 * i + 1] = temp_shape[i + m + 1]
        permuted_shape[2 * i + 2] = temp_shape[i]
        order[2 * i + 1] = i + m + 1
        order[2 * i + 2] = i
    order[0] = m
    permuted_shape[0] = temp_shape[m]
    strides = math.prod(temp_shape[2 * m + 1:])
    bottom, temp = x.ravel(), np.empty(x.size, np.float32)
    for position in range(x.size // strides):
        cb = unravel(position * strides, temp_shape)
        pp = ravel([cb[order[i]] for i in range(len(cb))], permuted_shape)
        temp[pp:pp + strides] = bottom[position * strides:(position + 1) * strides]
    for i in range(m):
        permuted_shape[1 + i] *= permuted_shape[2 + i]
        del permuted_shape[2 + i]
    top_shape = ([bshape[0] // math.prod(block)]
                 + [bshape[i + 1] * block[i] - crops[2 * i] - crops[2 * i + 1] for i in range(m)] + bshape[m + 1:])
    top = np.empty(math.prod(top_shape), np.float32)
    for i in range(top.size):
        ct = unravel(i, top_shape)
        for k in range(m):
            ct[k + 1] += crops[2 * k]
        top[i] = temp[ravel(ct, permuted_shape)]
    return top.reshape(top_shape)


def block_param(field, block, pads_name, pads):
    return (f"{field} {{ " + " ".join(f"block_shape: {b}" for b in block) + " "
            + " ".join(f"{pads_name}: {p}" for p in pads) + " }")


S2B_CASES = [((2, 3, 5, 6), [1, 2, 3], [0, 0, 1, 2, 2, 1]),   # the zoo's form on N, C, H, W
             ((2, 5, 6, 3), [2, 3], [1, 2, 2, 1]),             # TF's NHWC form
             ((3, 4, 2), [2], [1, 1])]


@pytest.mark.parametrize("shape, block, pads", S2B_CASES)
def test_space_to_batch_nd(shape, block, pads, tmp_path):
    param = block_param("space_to_batch_nd_param", block, "paddings", pads)
    run_checks(shape, "SpaceToBatchND", param, lambda x: space_to_batch_ref(x, block, pads), tmp_path)


@pytest.mark.parametrize("shape, block, crops", [((12, 3, 4, 3), [1, 2, 3], [0, 0, 1, 2, 2, 1]),
                                                 ((12, 4, 3, 5), [3, 2], [2, 0, 1, 1]),
                                                 ((6, 4, 2), [3], [1, 1])])
def test_batch_to_space_nd(shape, block, crops, tmp_path):
    param = block_param("batch_to_space_nd_param", block, "crops", crops)
    run_checks(shape, "BatchToSpaceND", param, lambda x: batch_to_space_ref(x, block, crops), tmp_path)


def test_space_to_batch_round_trip(tmp_path):
    # the zoo's dilated depthwise pattern: SpaceToBatchND, then BatchToSpaceND with crops = pads
    text = inputs_text(x=(2, 3, 5, 6)) + "\n".join([
        'layer { name: "s2b" type: "SpaceToBatchND" bottom: "x" top: "s" '
        + block_param("space_to_batch_nd_param", [1, 2, 3], "paddings", [0, 0, 1, 2, 2, 1]) + " }",
        'layer { name: "b2s" type: "BatchToSpaceND" bottom: "s" top: "o" '
        + block_param("batch_to_space_nd_param", [1, 2, 3], "crops", [0, 0, 1, 2, 2, 1]) + " }"])
    model = load_from_text(text)
    x = rng(4).standard_normal((2, 3, 5, 6)).astype(np.float32)
    check_everywhere(model, {"x": x}, {"o": x}, tmp_path)


@pytest.mark.parametrize("ltype, param, msg", [
    ("SpaceToBatchND", block_param("space_to_batch_nd_param", [2, 2], "paddings", [0, 0, 0]),
     r"paddings holds 3 values; 2 block axes need 4"),
    ("SpaceToBatchND", block_param("space_to_batch_nd_param", [0, 2], "paddings", [0, 0, 0, 0]),
     r"block_shape must be >= 1"),
    ("SpaceToBatchND", block_param("space_to_batch_nd_param", [1, 2], "paddings", [0, 0, 1, 1]),
     r"block_shape\[1\] = 2 does not divide axis 2 \(5 \+ paddings 1 \+ 1\)"),
    ("SpaceToBatchND", block_param("space_to_batch_nd_param", [1, 1, 1, 1], "paddings", [0] * 8),
     r"block_shape has 4 axes; a 4-axis bottom has 3 after the batch"),
    ("BatchToSpaceND", block_param("batch_to_space_nd_param", [2, 2], "crops", [0, 0, 0, 0]),
     r"the batch 2 is not divisible by the block size 4"),
    ("BatchToSpaceND", block_param("batch_to_space_nd_param", [2], "crops", [3, 3]),
     r"crops 3 \+ 3 leave nothing of axis 1 \(3 x 2\)"),
    ("BatchToSpaceND", block_param("batch_to_space_nd_param", [2], "crops", [1]),
     r"crops holds 1 values; 1 block axes need 2"),
])
def test_block_layers_bad(ltype, param, msg):
    refused((2, 3, 5, 6), ltype, param, msg)


# ---- Mul, Add, Sub, Div ---------------------------------------------------------------------

BINARY = {"Mul": lambda p, q: p * q, "Add": lambda p, q: p + q, "Sub": lambda p, q: p - q,
          "Div": lambda p, q: p / q}


def fork_count(shape, i):
    """Blob::count(i): the product of the axes from i on."""
    return math.prod(shape[i:])


def fork_binary_shape(s0, s1):
    """The fork's Reshape: the top shape from the two operands' shapes."""
    diff, dim = len(s0) - len(s1), max(len(s0), len(s1))
    if not s0 or not s1:
        return tuple(s1 if not s0 else s0)
    if diff >= 0:
        return tuple(s0[i] if i < diff else max(s0[i], s1[i - diff]) for i in range(dim))
    return tuple(s1[i] if i < -diff else max(s0[i + diff], s1[i]) for i in range(dim))


def fork_binary_ref(op, b0, b1):
    """The fork's Forward_cpu over flat buffers: top offset d -> offset0 / offset1, axis by axis as its
    three branches (equal ranks, bottom[0] longer, operand longer), or its scalar branches."""
    s0, s1, f = b0.shape, b1.shape, BINARY[op]
    ts = fork_binary_shape(s0, s1)
    p, q = b0.ravel(), b1.ravel()
    top = np.zeros(math.prod(ts), np.float32)
    if not s0 or not s1:
        for d in range(top.size):
            if not s1:   # bottom[1] a scalar: copy bottom[0], then add -s / scale / divide
                top[d] = p[d] + (-q[0]) if op == "Sub" else f(p[d], q[0])
            else:        # bottom[0] a scalar
                top[d] = (np.float32(-1) * q[d]) + p[0] if op == "Sub" else f(p[0], q[d])
        return top.reshape(ts)
    diff, dim = len(s0) - len(s1), len(ts)
    for d in range(top.size):
        o0 = o1 = 0
        for i in range(dim - 1):
            num = (d % fork_count(ts, i)) // fork_count(ts, i + 1)
            if diff >= 0:
                o0 += (0 if s0[i] == 1 else num) * fork_count(s0, i + 1)
                if i >= diff:
                    o1 += (0 if s1[i - diff] == 1 else num) * fork_count(s1, i - diff + 1)
            else:
                o1 += (0 if s1[i] == 1 else num) * fork_count(s1, i + 1)
                if i >= -diff:
                    o0 += (0 if s0[i + diff] == 1 else num) * fork_count(s0, i + diff + 1)
        z = d % ts[dim - 1]
        o0 += 0 if s0[-1] == 1 else z
        o1 += 0 if s1[-1] == 1 else z
        top[d] = f(p[o0], q[o1])
    return top.reshape(ts)


def operands(s0, s1, op, seed):
    g = rng(seed)
    a = g.standard_normal(s0).astype(np.float32)
    b = g.standard_normal(s1).astype(np.float32)
    if op == "Div":   # divisors away from zero
        b = (np.sign(b) + (b == 0)) * (np.abs(b) + 0.5)
    return a, np.asarray(b, np.float32)


BINARY_SHAPES = [((2, 3, 4, 5), (2, 3, 4, 5)), ((2, 3, 4, 5), (2, 1, 4, 1)), ((1, 3, 1, 5), (2, 3, 4, 1)),
                 ((2, 3, 4, 5), (4, 1)), ((5,), (2, 3, 4, 5)), ((3, 1, 5), (2, 3, 4, 1)),
                 ((2, 3, 4), ()), ((), (3, 4, 2))]


@pytest.mark.parametrize("op", list(BINARY))
@pytest.mark.parametrize("s0, s1", BINARY_SHAPES)
def test_binary_two_bottoms(op, s0, s1, tmp_path):
    text = inputs_text(a=s0, b=s1) + f'layer {{ name: "l" type: "{op}" bottom: "a" bottom: "b" top: "o" }}'
    model = load_from_text(text)
    a, b = operands(s0, s1, op, 7)
    ref = fork_binary_ref(op, a, b)
    assert model.graph.shape("o") == ref.shape
    check_everywhere(model, {"a": a, "b": b}, {"o": ref}, tmp_path)


def test_binary_scalars_give_a_scalar(tmp_path):
    text = inputs_text(a=(), b=()) + 'layer { name: "l" type: "Div" bottom: "a" bottom: "b" top: "o" }'
    model = load_from_text(text)
    assert model.graph.shape("o") == ()
    a, b = np.float32(3.0), np.float32(-4.0)
    check_everywhere(model, {"a": np.array(a), "b": np.array(b)}, {"o": np.array(a / b)}, tmp_path)


def test_binary_operand_order(tmp_path):
    """Sub and Div take bottom[1] from bottom[0], whichever is longer."""
    text = inputs_text(a=(4,), b=(3, 4)) + "".join(
        f'layer {{ name: "{op}" type: "{op}" bottom: "a" bottom: "b" top: "{op}" }}' for op in ("Sub", "Div"))
    model = load_from_text(text)
    a, b = np.float32([1, 2, 3, 4]), np.full((3, 4), 2, np.float32)
    check_everywhere(model, {"a": a, "b": b}, {"Sub": a - b, "Div": a / b}, tmp_path)


def mul_weights(tmp_path, blob):
    from caffeq.io.schema import caffe_pb2
    saved = caffe_pb2.NetParameter()
    b = saved.layer.add(name="l", type="Mul").blobs.add()
    b.shape.SetInParent()   # a scalar blob: shape {} with no dim
    b.shape.dim.extend(blob.shape)
    b.data.extend(blob.ravel().tolist())
    path = tmp_path / "w.caffemodel"
    path.write_bytes(saved.SerializeToString())
    return str(path)


@pytest.mark.parametrize("x_shape, mul_shape", [((2, 3, 4, 5), (3, 1, 5)), ((2, 3, 4), ()),
                                                ((3, 4), (2, 1, 4)), ((2, 3, 4, 5), (2, 1, 4, 1))])
def test_mul_one_bottom_blob(x_shape, mul_shape, tmp_path):
    param = "mul_param { " + " ".join(f"mul_shape: {d}" for d in mul_shape) + " }"
    x, w = operands(x_shape, mul_shape, "Mul", 8)
    model = load_from_text(one_layer(x_shape, "Mul", param), weights=mul_weights(tmp_path, w))
    ref = fork_binary_ref("Mul", x, w)
    assert model.graph.shape("o") == ref.shape
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path)


def test_mul_one_bottom_weights_of_another_shape(tmp_path):
    from caffeq.errors import WeightsError
    w = np.ones((3, 5), np.float32)
    with pytest.raises(WeightsError, match="shape"):
        load_from_text(one_layer((2, 3, 4, 5), "Mul", "mul_param { mul_shape: 5 }"), weights=mul_weights(tmp_path, w))


def test_mul_two_bottoms_ignore_mul_shape_and_extra_bottoms(tmp_path):
    text = inputs_text(a=(2, 3), b=(3,), c=(7,)) + (
        'layer { name: "l" type: "Mul" bottom: "a" bottom: "b" bottom: "c" top: "o" mul_param { mul_shape: 9 } }')
    model = load_from_text(text)
    a, b = operands((2, 3), (3,), "Mul", 9)
    c = np.zeros(7, np.float32)
    check_everywhere(model, {"a": a, "b": b, "c": c}, {"o": fork_binary_ref("Mul", a, b)}, tmp_path)


def test_binary_in_place_on_operand_of_the_top_shape(tmp_path):
    text = inputs_text(a=(3, 1), b=(3, 4)) + (
        'layer { name: "l" type: "Sub" bottom: "a" bottom: "b" top: "b" }'
        'layer { name: "m" type: "Mul" bottom: "b" bottom: "a" top: "o" }')
    model = load_from_text(text)
    a, b = operands((3, 1), (3, 4), "Sub", 10)
    sub = fork_binary_ref("Sub", a, b)   # the in-place top, read by the next layer
    check_everywhere(model, {"a": a, "b": b}, {"o": fork_binary_ref("Mul", sub, a)}, tmp_path)


@pytest.mark.parametrize("shapes, layer, msg", [
    ({"a": (2, 3), "b": (2, 4)}, 'type: "Add" bottom: "a" bottom: "b" top: "o"',
     r"Add: bottom shapes \[2, 3\] and \[2, 4\] differ at axis 1 \(3 vs 4\); the fork needs equal sizes or 1"),
    ({"a": (2, 3, 4), "b": (3,)}, 'type: "Mul" bottom: "a" bottom: "b" top: "o"',
     r"differ at axis 2 of the top \(4 vs 3\); the fork does not check ranks that differ"),
    ({"a": (2,), "b": (2, 3, 4)}, 'type: "Div" bottom: "a" bottom: "b" top: "o"', r"would read outside"),
    ({"a": (2, 3)}, 'type: "Mul" bottom: "a" top: "a"', r"Mul does not allow in-place computation"),
    ({"a": (2, 3), "b": (3,)}, 'type: "Sub" bottom: "a" bottom: "b" top: "b"',
     r"Sub in place on bottom\[1\] \(\[3\]\) reshapes it to the top's \[2, 3\]"),
    ({"a": (2, 3)}, 'type: "Add" bottom: "a" top: "o"', r"Add with one bottom reads a blob the fork's Add never makes"),
    ({"a": (2, 3)}, 'type: "Div" bottom: "a" top: "o"', r"give it two bottoms"),
    ({"a": (2, 3)}, 'type: "Mul" bottom: "a" top: "o" mul_param { mul_shape: 0 mul_shape: 3 }',
     r"mul_param.mul_shape \[0, 3\] makes an empty blob"),
    ({"a": (2, 3)}, 'type: "Mul" top: "o"', r"Mul takes at least one bottom"),
    ({"a": (2, 3), "b": (3,)}, 'type: "Sub" bottom: "a" bottom: "b" top: "o" top: "p"', r"and one top, got 2 and 2"),
])
def test_binary_bad(shapes, layer, msg):
    with pytest.raises(CaffeqError, match=msg):
        load_from_text(inputs_text(**shapes) + f'layer {{ name: "l" {layer} }}')
