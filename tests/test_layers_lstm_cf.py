"""LSTM-CF's Mask, Transpose and ConvolutionDeeplab (caffeq/layers/lstm_cf.py) against loops written here from
icemansina/LSTM-CF's mask_layer.cpp, transpose_layer.cpp and conv_deeplab_layer.cpp, on asymmetric shapes, in
torch, onnxruntime and model.py; and its column LSTM (Mask + Transpose + BVLC's LSTM) end to end."""
import numpy as np
import pytest
from conftest import check_everywhere, conv_ref, net, node_of, rng
from test_layers_sequence import lstm_ref

from caffeq.errors import CaffeqError
from caffeq.io.writer import write_model_caffemodel
from caffeq.model import load, load_from_text

F = np.float32
MASK_TYPES = {"VERTICAL": 0, "HORIZONTAL": 1}
DIRECTIONS = {"LEFT2RIGHT": 0, "RIGHT2LEFT": 1, "TOP2BOTTOM": 2, "BOTTOM2TOP": 3}


def ref_mask(height, width, masktype, direction):
    """MaskLayer::Forward_cpu on its zero-filled [height, width] blob: caffe_set runs from a pointer that
    offset(1) (= width on a 2-axis blob) advances."""
    top = np.zeros(height * width, F)
    at = 0

    def fill(count, value, start):
        top[start:start + count] = value

    if masktype == "VERTICAL" and direction == "TOP2BOTTOM":
        fill(width, 0, at)
        at += width
        fill((height - 1) * width, 1, at)
    elif masktype == "VERTICAL" and direction == "BOTTOM2TOP":
        fill((height - 1) * width, 1, at)
        at += width
        fill(width, 0, at)
    elif masktype == "HORIZONTAL" and direction == "LEFT2RIGHT":
        for _ in range(height):
            top[at] = 0
            fill(width - 1, 1, at + 1)
            at += width
    elif masktype == "HORIZONTAL" and direction == "RIGHT2LEFT":
        for _ in range(height):
            fill(width - 1, 1, at + 1)
            top[at + width - 1] = 0
            at += width
    return top.reshape(height, width)


def mask_layer(name, height, width, masktype, direction):
    return (f'layer {{ name: "{name}" type: "Mask" top: "{name}" mask_param {{ width: {width} height: {height} '
            f'masktype: {masktype} direction: {direction} }} }}')


@pytest.mark.parametrize("masktype", list(MASK_TYPES))
@pytest.mark.parametrize("direction", list(DIRECTIONS))
def test_mask_is_the_forks_pattern(masktype, direction, tmp_path):
    ref = ref_mask(4, 5, masktype, direction)
    if (masktype, direction) == ("VERTICAL", "BOTTOM2TOP"):
        assert ref[1].sum() == 0 and ref[3].sum() == 0 and ref[0].all() and ref[2].all()   # row 1, not the last
    if (masktype, direction) == ("HORIZONTAL", "RIGHT2LEFT"):
        assert (ref[:, 0] == 0).all() and (ref[:, 4] == 0).all()
    # the net needs an input for the backends; the mask ignores it
    model = load_from_text(net(mask_layer("m", 4, 5, masktype, direction), inputs={"x": (1, 1)}))
    assert model.blob_shapes["m"] == (4, 5)
    check_everywhere(model, {"x": np.zeros((1, 1), F)}, {"m": ref}, tmp_path)


def ref_transpose(x, to_rows, top_shape):
    """TransposeLayer::Forward_cpu: per image n, CONVTOLSTM top[off + i*C + c] = bottom[off + c*S + i], LSTMTOCONV
    the reverse, C = channels(), S = height() * width() of the bottom."""
    shape = tuple(x.shape) + (1,) * (4 - x.ndim)
    num, channels, spatial = shape[0], shape[1], shape[2] * shape[3]
    flat, top = x.reshape(-1), np.empty(x.size, F)
    per = x.size // num
    for n in range(num):
        off = per * n
        for c in range(channels):
            for i in range(spatial):
                if to_rows:
                    top[off + i * channels + c] = flat[off + c * spatial + i]
                else:
                    top[off + c * spatial + i] = flat[off + i * channels + c]
    return top.reshape(top_shape)


@pytest.mark.parametrize("kind, bottom, top", [
    ("CONVTOLSTM", (2, 3, 4, 5), (2, 20, 3)),
    ("CONVTOLSTM", (1, 3, 4, 5), (4, 5, 3)),        # LSTM-CF's use: rows as time, columns as streams
    ("LSTMTOCONV", (1, 7, 4, 5), (1, 7, 4, 5)),     # after its Reshape of (T, N, H) to (1, H, T, N)
    ("LSTMTOCONV", (2, 6, 5), (2, 5, 6, 1)),        # a 3-axis bottom: width() is 1
])
def test_transpose_is_the_forks_cpu_loops(kind, bottom, top, tmp_path):
    x = rng(3).standard_normal(bottom).astype(F)
    dims = " ".join(f"dim: {d}" for d in top)
    model = load_from_text(net(f'layer {{ name: "t" type: "Transpose" bottom: "x" top: "t" transpose_param {{ '
                               f'transposetype: {kind} shape {{ {dims} }} }} }}', inputs={"x": bottom}))
    notes = " ".join(model.warnings)
    assert ("GPU kernel" in notes) == (bottom[0] > 1)
    check_everywhere(model, {"x": x}, {"t": ref_transpose(x, kind == "CONVTOLSTM", top)}, tmp_path)


def test_caffe_ocrs_transpose_is_still_a_permute():
    model = load_from_text(net('layer { name: "t" type: "Transpose" bottom: "x" top: "t" '
                               'transpose_param { dim: 1 dim: 0 dim: 2 } }', inputs={"x": (2, 3, 4)}))
    assert model.blob_shapes["t"] == (3, 2, 4)


def test_conv_deeplab_is_a_hole_convolution_with_a_four_axis_bias(tmp_path):
    x = rng(5).standard_normal((2, 3, 9, 11)).astype(F)
    text = net('layer { name: "c" type: "ConvolutionDeeplab" bottom: "x" top: "c" convolution_deeplab_param { '
               'num_output: 4 pad: 2 hole: 2 kernel_size: 3 } }', inputs={"x": x.shape})
    model = load_from_text(text, random_weights=True)
    node = node_of(model, "c")
    assert [tuple(b.shape) for b in node.blobs] == [(4, 3, 3, 3), (1, 1, 1, 4)]
    node.blobs[1][...] = rng(6).standard_normal((1, 1, 1, 4))
    # a dilated kernel is the 5 x 5 kernel with zeros between the taps
    w = node.blobs[0]
    spread = np.zeros((4, 3, 5, 5), F)
    spread[:, :, ::2, ::2] = w
    ref = conv_ref(x, spread, node.blobs[1].reshape(-1), (1, 1), (2, 2))
    assert ref.shape == (2, 4, 9, 11)
    check_everywhere(model, {"x": x}, {"c": ref}, tmp_path, atol=1e-5, rtol=1e-5)
    # the fork's caffemodel stores that bias blob, and it loads back
    weights = tmp_path / "w.caffemodel"
    write_model_caffemodel(model, weights)
    (tmp_path / "n.prototxt").write_text(text)
    again = load(tmp_path / "n.prototxt", weights)
    np.testing.assert_allclose(again.run({"x": x})["c"], ref, atol=1e-5, rtol=1e-5)


def test_column_lstm_runs_down_each_column_from_the_mask(tmp_path):
    """LSTM-CF's deploy pattern: a (1, C, H, W) map to H steps of W streams, BVLC's LSTM with the Mask as its
    continuation input, back to (1, hidden, H, W) through Reshape and LSTMTOCONV."""
    c, h, w, hidden = 3, 4, 5, 2
    layers = [
        f'layer {{ name: "rows" type: "Transpose" bottom: "x" top: "rows" transpose_param {{ '
        f'transposetype: CONVTOLSTM shape {{ dim: {h} dim: {w} dim: {c} }} }} }}',
        mask_layer("cont", h, w, "VERTICAL", "TOP2BOTTOM"),
        f'layer {{ name: "lstm" type: "LSTM" bottom: "rows" bottom: "cont" top: "lstm" '
        f'recurrent_param {{ num_output: {hidden} }} }}',
        f'layer {{ name: "r" type: "Reshape" bottom: "lstm" top: "r" reshape_param {{ shape {{ dim: 1 dim: {hidden} '
        f'dim: {h} dim: {w} }} }} }}',
        f'layer {{ name: "o" type: "Transpose" bottom: "r" top: "o" transpose_param {{ transposetype: LSTMTOCONV '
        f'shape {{ dim: 1 dim: {hidden} dim: {h} dim: {w} }} }} }}',
    ]
    model = load_from_text(net(*layers, inputs={"x": (1, c, h, w)}), random_weights=True)
    w_xc, b_c, w_hc = node_of(model, "lstm").blobs
    x = rng(7).standard_normal((1, c, h, w)).astype(F)
    seq = x[0].transpose(1, 2, 0)                                   # (time = row, stream = column, C)
    hs = lstm_ref(seq, w_xc, w_hc, b_c, clip=ref_mask(h, w, "VERTICAL", "TOP2BOTTOM"))
    ref = hs.transpose(2, 0, 1)[None]                               # (1, hidden, H, W)
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layer, message", [
    ('type: "Mask" top: "m" mask_param { height: 2 }', r"mask_param.width is required"),
    ('type: "Mask" top: "m" mask_param { width: 0 height: 2 }', r"mask_param.width must be >= 1, got 0"),
    ('type: "Mask" top: "m" mask_param { width: 2 height: 2 scale: 2 }', r"scale is faceID's Mask"),
    ('type: "Mask" top: "m" mask_param { width: 3 height: 1 direction: BOTTOM2TOP }',
     r"height 1 with BOTTOM2TOP makes the fork zero the row after the blob's end"),
    ('type: "Transpose" bottom: "x" top: "m" transpose_param { shape { dim: 6 } }', r"transposetype is required"),
    ('type: "Transpose" bottom: "x" top: "m" transpose_param { transposetype: CONVTOLSTM }', r"shape is required"),
    ('type: "Transpose" bottom: "x" top: "m" transpose_param { transposetype: CONVTOLSTM shape { dim: 5 } }',
     r"shape \[5\] holds 5 values, the bottom \[2, 3\] 6"),
    ('type: "ConvolutionDeeplab" bottom: "x" top: "m"', r"reads convolution_deeplab_param, which is missing"),
])
def test_what_the_fork_refuses_is_one_line(layer, message):
    with pytest.raises(CaffeqError, match=message):
        load_from_text(net(f'layer {{ name: "l" {layer} }}', inputs={"x": (2, 3)}))
