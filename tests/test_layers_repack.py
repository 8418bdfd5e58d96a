"""tinghuiz/learn-reflectance's Repack (31ab326, caffe/src/caffe/layers/repack_layer.cpp) against loops
written from its pack_cpu / unpack_cpu, in torch, onnxruntime and the generated model.py; its checks; the
fork's feat.prototxt."""

import numpy as np
import pytest
from conftest import REPO, check_everywhere, cli_process, net, ok

from caffeq.layers import LayerError
from caffeq.model import load_from_text

RNG = np.random.default_rng(85)
CORPUS = REPO / "tests" / "fixtures" / "realworld"


def repack_layer(params, bottoms=("x",), top="o", name="r"):
    bots = " ".join(f'bottom: "{b}"' for b in bottoms)
    return f'layer {{ name: "{name}" type: "Repack" {bots} top: "{top}" repack_param {{ {params} }} }}'


def ref_pack(x, s_h, s_w):
    """pack_cpu: o runs over (y, x, n, c, j, i); output[o] = input[n, c, j s_h + y, i s_w + x] or 0."""
    n_, c_, h, w = x.shape
    oh, ow = (h - 1) // s_h + 1, (w - 1) // s_w + 1
    out = np.empty(s_h * s_w * n_ * c_ * oh * ow, x.dtype)
    o = 0
    for y in range(s_h):
        for xx in range(s_w):
            for n in range(n_):
                for c in range(c_):
                    for j in range(oh):
                        for i in range(ow):
                            inside = j * s_h + y < h and i * s_w + xx < w
                            out[o] = x[n, c, j * s_h + y, i * s_w + xx] if inside else 0
                            o += 1
    return out.reshape(s_h * s_w * n_, c_, oh, ow)


def ref_unpack(x, s_h, s_w, out_h, out_w):
    """unpack_cpu: the bottom's data read flat from its start over (y, x, n, c, j, i), j < ih, i < iw,
    written to top (n, c, j s_h + y, i s_w + x) where inside."""
    flat = x.reshape(-1)
    out_n, c_ = x.shape[0] // (s_h * s_w), x.shape[1]
    ih, iw = (out_h - 1) // s_h + 1, (out_w - 1) // s_w + 1
    out = np.full((out_n, c_, out_h, out_w), np.nan, x.dtype)
    o = 0
    for y in range(s_h):
        for xx in range(s_w):
            for n in range(out_n):
                for c in range(c_):
                    for j in range(ih):
                        for i in range(iw):
                            if j * s_h + y < out_h and i * s_w + xx < out_w:
                                out[n, c, j * s_h + y, i * s_w + xx] = flat[o]
                            o += 1
    assert not np.isnan(out).any()
    return out


@pytest.mark.parametrize("shape, params, strides", [
    ((2, 3, 7, 5), "stride: 2", (2, 2)),
    ((2, 2, 5, 8), "stride_h: 3 stride_w: 2", (3, 2)),
    ((1, 3, 4, 9), "stride_h: 1 stride_w: 4", (1, 4)),
    ((2, 3, 5, 3), "", (1, 1)),
    ((3, 2, 6, 4), "operation: PACK_IMAGE stride: 3", (3, 3)),
])
def test_pack_matches_pack_cpu(shape, params, strides, tmp_path):
    x = RNG.standard_normal(shape).astype(np.float32)
    model = load_from_text(net(repack_layer(params), inputs={"x": shape}))
    ref = ref_pack(x, *strides)
    assert model.blob_shapes["o"] == ref.shape
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path)


def test_pack_reads_a_two_axis_bottom_as_n_c_1_1(tmp_path):
    x = RNG.standard_normal((3, 5)).astype(np.float32)
    model = load_from_text(net(repack_layer("stride_h: 2 stride_w: 3"), inputs={"x": (3, 5)}))
    ref = ref_pack(x.reshape(3, 5, 1, 1), 2, 3)
    assert model.blob_shapes["o"] == (18, 5, 1, 1)
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path)


@pytest.mark.parametrize("shape, params, strides", [
    ((8, 3, 4, 3), "operation: UNPACK_IMAGE stride: 2", (2, 2)),
    ((13, 2, 3, 5), "operation: UNPACK_IMAGE stride_h: 3 stride_w: 2", (3, 2)),   # 13 = 2 x 6 + 1 unread
    ((2, 3, 5, 4), "operation: UNPACK_IMAGE", (1, 1)),
])
def test_unpack_matches_unpack_cpu(shape, params, strides, tmp_path):
    x = RNG.standard_normal(shape).astype(np.float32)
    model = load_from_text(net(repack_layer(params), inputs={"x": shape}))
    s_h, s_w = strides
    ref = ref_unpack(x, s_h, s_w, shape[2] * s_h, shape[3] * s_w)
    assert model.blob_shapes["o"] == ref.shape
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path)


@pytest.mark.parametrize("shape, size, params, strides", [
    ((8, 3, 4, 3), (7, 5), "stride: 2", (2, 2)),
    ((12, 2, 3, 5), (9, 9), "stride_h: 3 stride_w: 2", (3, 2)),
    ((2, 2, 3, 5), (2, 9), "stride_h: 1 stride_w: 2", (1, 2)),    # ih 2 < Hb 3: rows read misaligned
])
def test_unpack_takes_its_size_from_bottom_1(shape, size, params, strides, tmp_path):
    x = RNG.standard_normal(shape).astype(np.float32)
    r = RNG.standard_normal((1, 1) + size).astype(np.float32)
    model = load_from_text(net(repack_layer("operation: UNPACK_IMAGE " + params, ("x", "r")),
                               inputs={"x": shape, "r": (1, 1) + size}))
    ref = ref_unpack(x, *strides, *size)
    assert model.blob_shapes["o"] == ref.shape
    check_everywhere(model, {"x": x, "r": r}, {"o": ref}, tmp_path)


def test_unpack_with_bottom_1_undoes_pack(tmp_path):
    x = RNG.standard_normal((2, 3, 7, 5)).astype(np.float32)
    model = load_from_text(net(repack_layer("stride_h: 2 stride_w: 3", top="p", name="pack"),
                               repack_layer("operation: UNPACK_IMAGE stride_h: 2 stride_w: 3", ("p", "x")),
                               inputs={"x": x.shape}))
    check_everywhere(model, {"x": x}, {"o": x}, tmp_path)


def test_stride_w_without_stride_h_is_ignored_with_a_note():
    model = load_from_text(net(repack_layer("stride: 2 stride_w: 3"), inputs={"x": (1, 2, 5, 5)}))
    assert model.blob_shapes["o"] == (4, 2, 3, 3)
    assert any("stride_w 3 without stride_h is ignored" in w for w in model.warnings)


@pytest.mark.parametrize("params, bottoms, shapes, msg", [
    ("stride: 0", ("x",), {"x": (1, 2, 4, 4)}, r"repack_param.stride must be > 0, got 0"),
    ("stride_h: 2", ("x",), {"x": (1, 2, 4, 4)}, r"repack_param.stride_w must be > 0 when stride_h is set, got 0"),
    ("stride: 2", ("x", "r"), {"x": (1, 2, 4, 4), "r": (1, 1, 8, 8)}, r"Repack takes one bottom \(data\) and one top, got 2 and 1"),
    ("operation: UNPACK_IMAGE stride: 2", ("x", "r"), {"x": (4, 2, 4, 4), "r": (1, 1, 6, 8)},
     r"bottom\[1\] height 6 should be within 1 below the computed height 8"),
    ("operation: UNPACK_IMAGE stride: 2", ("x",), {"x": (3, 2, 4, 4)},
     r"the bottom's batch 3 is smaller than stride_h x stride_w = 4"),
])
def test_repack_refusals(params, bottoms, shapes, msg):
    with pytest.raises(LayerError, match=msg) as e:
        load_from_text(net(repack_layer(params, bottoms), inputs=shapes))
    assert "\n" not in str(e.value)


def test_repack_refuses_in_place():
    with pytest.raises(LayerError, match="does not allow in-place computation"):
        load_from_text(net(repack_layer("stride: 2", top="x"), inputs={"x": (1, 2, 4, 4)}))


@pytest.mark.skipif(not CORPUS.exists(), reason="corpus not on this machine")
def test_the_forks_nets_read():
    import caffeq
    model = caffeq.load(str(CORPUS / "tinghuiz__learn-reflectance__net__feat.prototxt"))
    assert model.blob_shapes["Repack3"] == (64, 64, 8, 8)
    assert model.blob_shapes["DenseFeat"] == (1, 64, 64, 64)
    ok(cli_process("inspect", CORPUS / "tinghuiz__learn-reflectance__net__rref.prototxt"))
