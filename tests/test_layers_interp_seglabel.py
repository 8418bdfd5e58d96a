"""LeYangNwpu/SROWN's Interp with `is_seglabel: true` (47f59d5 caffe-master/src/caffe/util/interp.cpp
caffe_cpu_interp2, the unpacked path interp_layer.cpp runs): label maps resized by the nearest source pixel.
The reference is the fork's loop in float32: rheight = float(H - 1) / (H' - 1), h1r = rheight * h2,
h1 = (int) h1r, and h1 + 1 where h1r - h1 >= 0.5 and h1 is not the last row (the same along the width)."""
import numpy as np
import pytest
from conftest import check_everywhere, net

from caffeq.layers import LayerError
from caffeq.model import load_from_text

f32 = np.float32


def seglabel_rows(n_in, n_out):
    """The source index of each output row (or column), as the fork's caffe_cpu_interp2 picks it."""
    ratio = f32(n_in - 1) / f32(n_out - 1) if n_out > 1 else f32(0)
    rows = []
    for i in range(n_out):
        pos = f32(ratio * f32(i))
        base = int(pos)
        has_next = base < n_in - 1
        rows.append(base + 1 if has_next and f32(pos - f32(base)) >= f32(0.5) else base)
    return np.array(rows)


def seglabel_ref(x, ho, wo):
    if x.shape[2:] == (ho, wo):   # the fork's special case: a copy
        return x.copy()
    return x[:, :, seglabel_rows(x.shape[2], ho)][:, :, :, seglabel_rows(x.shape[3], wo)]


def labels(shape, seed):
    """A label map: small integers, so that a bilinear mix would show as a fraction."""
    return np.random.default_rng(seed).integers(0, 21, size=shape).astype(f32)


@pytest.mark.parametrize("params, in_shape, out_hw", [
    ("height: 9 width: 4", (2, 3, 5, 7), (9, 4)),
    ("height: 13 width: 11", (3, 2, 7, 6), (13, 11)),       # halves exactly at odd rows: rounded up
    ("zoom_factor: 3", (2, 3, 4, 5), (10, 13)),              # thirds
    ("height: 6 width: 19", (2, 3, 3, 7), (6, 19)),          # ratios 2/5 and 1/3, not exact in float32
    ("shrink_factor: 2 pad_beg: -1 pad_end: -1", (1, 2, 11, 8), (5, 3)),
    ("height: 1 width: 5", (2, 3, 5, 7), (1, 5)),            # one row: row 0
    ("height: 5 width: 7", (2, 3, 5, 7), (5, 7)),            # the same size: a copy
])
def test_seglabel_takes_the_nearest_source_pixel(params, in_shape, out_hw, tmp_path):
    text = net(f'layer {{ name: "i" type: "Interp" bottom: "x" top: "o" interp_param {{ {params} '
               f'is_seglabel: true }} }}', inputs={"x": in_shape})
    model = load_from_text(text)
    assert model.blob_shapes["o"] == in_shape[:2] + out_hw
    x = labels(in_shape, 1)
    crop = 1 if "pad_beg" in params else 0
    xc = x[:, :, crop:in_shape[2] - crop, crop:in_shape[3] - crop]
    check_everywhere(model, {"x": x}, {"o": seglabel_ref(xc, *out_hw)}, tmp_path)


def test_the_srown_mask_interps_shrink_the_label_map(tmp_path):
    """network_semantic_ranking/tri_TVS_train_val.prototxt's mask_56 and mask_112 on a 224 x 224 mask: every
    output a label of the input (no bilinear mix), at the fork's rounded positions."""
    text = net('layer { name: "mask_56" type: "Interp" bottom: "mask" top: "mask_56"\n'
               '  interp_param { shrink_factor: 4 pad_beg: 0 pad_end: 0 is_seglabel: true } }\n'
               'layer { name: "mask_112" type: "Interp" bottom: "mask" top: "mask_112"\n'
               '  interp_param { shrink_factor: 2 pad_beg: 0 pad_end: 0 is_seglabel: true } }',
               inputs={"mask": (2, 1, 224, 224)})
    model = load_from_text(text)
    assert model.blob_shapes["mask_56"] == (2, 1, 56, 56) and model.blob_shapes["mask_112"] == (2, 1, 112, 112)
    x = labels((2, 1, 224, 224), 2)
    refs = {"mask_56": seglabel_ref(x, 56, 56), "mask_112": seglabel_ref(x, 112, 112)}
    # 223 / 55 puts some rows past a half: the rounding takes the next row, not the truncated one
    assert (seglabel_rows(224, 56) != (f32(223) / f32(55) * np.arange(56, dtype=f32)).astype(int)).any()
    check_everywhere(model, {"mask": x}, refs, tmp_path)


def test_without_seglabel_the_interp_stays_bilinear():
    text = net('layer { name: "i" type: "Interp" bottom: "x" top: "o" interp_param { height: 9 width: 4 '
               'is_seglabel: false } }', inputs={"x": (2, 3, 5, 7)})
    x = labels((2, 3, 5, 7), 3)
    got = load_from_text(text).run({"x": x}, exact=True)["o"]
    assert not np.array_equal(got, np.round(got))   # fractions: the labels were mixed


def test_seglabel_with_a_bilinear_interp_type_is_one_error():
    text = net('layer { name: "lab" type: "Interp" bottom: "x" top: "o" interp_param { height: 9 width: 4 '
               'is_seglabel: true interp_type: "bilinear" } }', inputs={"x": (2, 3, 5, 7)})
    with pytest.raises(LayerError, match=r"layer 'lab'.*interp_param.is_seglabel .* contradicts interp_type "
                                         r"'bilinear'"):
        load_from_text(text)


def test_seglabel_rounds_the_float32_position_where_the_exact_one_is_a_half(tmp_path):
    """shrink_factor 2 on 54 rows: ratio 53 / 26 puts output row 13 at 26.5 exactly but at 26.499998 in the fork's
    float32, so the fork keeps row 26 (ONNX Resize's exact align_corners position would round it to 27); 182
    columns likewise (181 / 90 x 45 = 90.5)."""
    text = net('layer { name: "i" type: "Interp" bottom: "x" top: "o" interp_param { shrink_factor: 2 '
               'is_seglabel: true } }', inputs={"x": (2, 3, 54, 182)})
    model = load_from_text(text)
    assert model.blob_shapes["o"] == (2, 3, 27, 91)
    rows, cols = seglabel_rows(54, 27), seglabel_rows(182, 91)
    assert rows[13] == 26 and cols[45] == 90
    x = labels((2, 3, 54, 182), 4)
    check_everywhere(model, {"x": x}, {"o": seglabel_ref(x, 27, 91)}, tmp_path)
