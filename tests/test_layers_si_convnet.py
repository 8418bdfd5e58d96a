"""akanazawa/si-convnet's UP, DOWNPOOL, TIEDCONV and TICONV (caffeq/layers/si_convnet.py): the fork's own
unit-test values, and a per-pixel float32 loop written here from transformation.cpp's GenCoordMat and
Interp (scales only) in torch, onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, conv_ref, node_of, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

F32 = np.float32


def v1_net(inputs, *layers):
    heads = "".join(f'input: "{name}"\n' + "".join(f"input_dim: {d}\n" for d in shape)
                    for name, shape in inputs.items())
    return 'name: "sicnn"\n' + heads + "\n".join(layers)


def entries(scales, extra=""):
    return " ".join(f"transformations {{ scale: {s} {extra} }}" for s in scales)


def up_layer(scales, tops, extra=""):
    top_text = " ".join(f'top: "{t}"' for t in tops)
    return f'layers {{ name: "up" type: UP bottom: "x" {top_text} {entries(scales, extra)} }}'


# ---- a loop from transformation.cpp (pure scales) --------------------------------------------

def source_grid(h, w, scale, invert):
    """(Hn, Wn, rows, cols): each output pixel's source coordinates, in the fork's float32 order."""
    sigma = F32(1.0 / scale) if invert else F32(scale)
    hn, wn = int(F32(h) * sigma), int(F32(w) * sigma)
    step = sigma / (sigma * sigma)                     # Invert3x3 of S(sigma): sigma / det
    rows = [(F32(r) * step + -(F32(hn - 1) / F32(2)) * step) + F32(h - 1) / F32(2) for r in range(hn)]
    cols = [(F32(c) * step + -(F32(wn - 1) / F32(2)) * step) + F32(w - 1) / F32(2) for c in range(wn)]
    return hn, wn, rows, cols


def sample_ref(x, rows, cols, nearest):
    """Interp: bilinear with the edge pixel within half a pixel, 0 beyond; nearest rounds halves away from 0."""
    n, c, h, w = x.shape
    out = np.zeros((n, c, len(rows), len(cols)), F32)
    valid = np.zeros((len(rows), len(cols)), bool)
    for i, row in enumerate(rows):
        for j, col in enumerate(cols):
            if nearest:
                r, q = int(np.floor(abs(row) + 0.5)) * (1 if row >= 0 else -1), \
                    int(np.floor(abs(col) + 0.5)) * (1 if col >= 0 else -1)
                if 0 <= r < h and 0 <= q < w:
                    out[:, :, i, j], valid[i, j] = x[:, :, r, q], True
                continue
            if row >= h - 0.5 or row < -0.5 or col >= w - 0.5 or col < -0.5:
                continue
            r0, c0 = int(row), int(col)
            r1, c1 = min(int(row + F32(1)), h - 1), min(int(col + F32(1)), w - 1)
            dr = F32(0) if r0 == r1 else F32(row - F32(r0))
            dc = F32(0) if c0 == c1 else F32(col - F32(c0))
            one = F32(1)
            w00, w01, w10, w11 = (one - dc) * (one - dr), (one - dr) * dc, (one - dc) * dr, dr * dc
            out[:, :, i, j] = ((w00 * x[:, :, r0, c0] + w01 * x[:, :, r0, c1]) + w10 * x[:, :, r1, c0]) \
                + w11 * x[:, :, r1, c1]
            valid[i, j] = True
    return out, valid


def up_ref(x, scale, nearest=False):
    if scale == 1:
        return x.copy()
    _, _, rows, cols = source_grid(x.shape[2], x.shape[3], scale, invert=False)
    return sample_ref(x, rows, cols, nearest)[0]


def centre_spans(old, new):
    """CropCenter along one axis: (old start, new start, length)."""
    return (0, -(-(new - old) // 2), old) if old < new else (-(-(old - new) // 2), 0, new)


def downpool_ref(xs, scales):
    out = xs[0].copy()
    height, width = out.shape[2:]
    for x, s in zip(xs[1:], scales[1:]):
        _, _, rows, cols = source_grid(x.shape[2], x.shape[3], s, invert=True)
        mapped, valid = sample_ref(x, rows, cols, nearest=False)
        (oh, nh, mh), (ow, nw, mw) = centre_spans(len(rows), height), centre_spans(len(cols), width)
        grid = np.full(out.shape, -np.inf, F32)
        grid[:, :, nh:nh + mh, nw:nw + mw] = np.where(valid[oh:oh + mh, ow:ow + mw], mapped[:, :, oh:oh + mh,
                                                      ow:ow + mw], -np.inf)
        out = np.where(grid > out, grid, out)
    return out


# ---- the fork's own test vectors ---------------------------------------------------------------

def run_up(x, scales, extra=""):
    tops = [f"t{i}" for i in range(len(scales))]
    model = load_from_text(v1_net({"x": x.shape}, up_layer(scales, tops, extra)))
    out = model.run({"x": x})
    return [out[t] for t in tops]


def test_up_matches_the_forks_test_vectors():
    x = np.array([[0, 1], [1, 0]], F32)[None, None]
    got = run_up(x, [2, 0.5], "final_width: 2 final_height: 2")        # TestSimpleForwardWithCrop
    np.testing.assert_allclose(got[0][0, 0], [[0.375, 0.625], [0.625, 0.375]], rtol=0, atol=1e-7)
    np.testing.assert_array_equal(got[1][0, 0], [[0, 0], [0, 0.5]])
    nn = run_up(x, [2], "interp: 0")[0][0, 0]                          # TestSimpleForward
    np.testing.assert_array_equal(nn, [[0, 0, 1, 1], [0, 0, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0]])
    # nearest at scale 0.5 meets exact halves (2r + 0.5) and rounds them away from zero
    half = run_up(np.arange(16, dtype=F32).reshape(1, 1, 4, 4), [0.5], "interp: 0")[0][0, 0]
    np.testing.assert_array_equal(half, [[5, 7], [13, 15]])
    ramp = run_up(np.array([[1, 2], [3, 4]], F32)[None, None], [1.5])[0][0, 0]
    np.testing.assert_allclose(ramp, [[1, 1.5, 2], [2, 2.5, 3], [3, 3.5, 4]], rtol=0, atol=1e-6)


def test_downpool_matches_the_forks_rotation_test(tmp_path):
    # TestSimpleForwardBackwardBilinear: identity, scale 2, scale 4 and a -90 degree rotation
    x0 = np.ones((1, 1, 2, 2), F32)
    x1 = np.zeros((1, 1, 4, 4), F32)
    x1[0, 0, 2:] = 2
    x2 = np.zeros((1, 1, 8, 8), F32)
    x2[0, 0, 4:, 4:] = 3
    x3 = np.array([[0, 0], [0, 4]], F32)[None, None]
    layer = ('layers { name: "down" type: DOWNPOOL bottom: "x0" bottom: "x1" bottom: "x2" bottom: "x3" top: "y" '
             'transformations { } transformations { scale: 2 } transformations { scale: 4 } '
             'transformations { rotation: -90 } }')
    model = load_from_text(v1_net({"x0": x0.shape, "x1": x1.shape, "x2": x2.shape, "x3": x3.shape}, layer))
    feeds = {"x0": x0, "x1": x1, "x2": x2, "x3": x3}
    check_everywhere(model, feeds, {"y": np.array([[1, 4], [2, 3]], F32)[None, None]}, tmp_path)


def test_downpool_leaves_padding_out_of_the_max():
    x0 = np.full((1, 1, 4, 4), -1, F32)
    layer = ('layers { name: "down" type: DOWNPOOL bottom: "x0" bottom: "x1" top: "y" '
             'transformations { } transformations { scale: 0.5 } }')
    model = load_from_text(v1_net({"x0": x0.shape, "x1": (1, 1, 1, 1)}, layer))
    y = model.run({"x0": x0, "x1": np.full((1, 1, 1, 1), 5, F32)})["y"][0, 0]
    np.testing.assert_array_equal(y, [[-1] * 4, [-1, 5, 5, -1], [-1, 5, 5, -1], [-1] * 4])
    # the padded border is not 0: a smaller value keeps -1 there and everywhere
    y = model.run({"x0": x0, "x1": np.full((1, 1, 1, 1), -5, F32)})["y"]
    np.testing.assert_array_equal(y, x0)


# ---- against the loop ----------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(2, 3, 28, 28), (1, 2, 7, 11)])
@pytest.mark.parametrize("nearest", [False, True])
def test_up_matches_the_loop_at_the_nets_scales(shape, nearest, tmp_path):
    scales = [1, 0.63, 0.7937, 1.2599, 1.5874, 2, 0.4286]
    x = rng(31).standard_normal(shape).astype(F32)
    tops = [f"t{i}" for i in range(len(scales))]
    model = load_from_text(v1_net({"x": shape}, up_layer(scales, tops, "interp: 0" if nearest else "")))
    refs = {t: up_ref(x, s, nearest) for t, s in zip(tops, scales)}
    assert model.blob_shapes["t1"][2:] == (int(F32(shape[2]) * F32(0.63)), int(F32(shape[3]) * F32(0.63)))
    check_everywhere(model, {"x": x}, refs, tmp_path, atol=0, rtol=0)


def test_float32_sizes_truncate_as_the_fork_does():
    # 5 * 0.6f = 3.0000001 and 7 * 0.4286f = 3.0002: both 3 (the farabet net's down layers)
    model = load_from_text(v1_net({"x": (1, 1, 5, 7)}, up_layer([0.6, 0.4286], ["a", "b"])))
    assert model.blob_shapes["a"][2:] == (3, 4) and model.blob_shapes["b"][2:] == (2, 3)


TICONV = ('layers {{ name: "conv1" type: TICONV bottom: "x" top: "conv1" blobs_lr: 1 blobs_lr: 2 '
          'convolution_param {{ num_output: 4 kernel_size: {k} stride: 1 }} transformations {{ }} {scales} }}')


@pytest.mark.parametrize("shape, k", [((2, 2, 28, 28), 7), ((1, 3, 11, 11), 5)])
def test_ticonv_is_the_maximum_over_scales_mapped_back(shape, k, tmp_path):
    scales = [1, 0.63, 0.7937, 1.2599, 1.5874, 2]
    x = rng(32).standard_normal(shape).astype(F32)
    model = load_from_text(v1_net({"x": shape}, TICONV.format(k=k, scales=entries(scales[1:]))),
                           random_weights=True)
    w, b = node_of(model, "conv1").blobs
    w, b = np.asarray(w), np.asarray(b).reshape(-1)
    convs = [conv_ref(up_ref(x, s), w, b, (1, 1), (0, 0)).astype(F32) for s in scales]
    ref = downpool_ref(convs, scales)
    assert model.blob_shapes["conv1"] == (shape[0], 4, shape[2] - k + 1, shape[3] - k + 1)
    check_everywhere(model, {"x": x}, {"conv1": ref}, tmp_path, atol=2e-5, rtol=1e-5)


def test_tiedconv_shares_its_blobs_over_bottoms_of_other_sizes(tmp_path):
    a = rng(33).standard_normal((1, 2, 9, 9)).astype(F32)
    b = rng(34).standard_normal((1, 2, 14, 12)).astype(F32)
    layer = ('layers { name: "tied" type: TIEDCONV bottom: "a" bottom: "b" top: "ya" top: "yb" '
             'convolution_param { num_output: 3 kernel_size: 5 pad: 1 } }')
    model = load_from_text(v1_net({"a": a.shape, "b": b.shape}, layer), random_weights=True)
    w, bias = (np.asarray(v) for v in node_of(model, "tied").blobs)
    refs = {"ya": conv_ref(a, w, bias.reshape(-1), (1, 1), (1, 1)), "yb": conv_ref(b, w, bias.reshape(-1), (1, 1), (1, 1))}
    assert model.blob_shapes["yb"] == (1, 3, 12, 10)
    check_everywhere(model, {"a": a, "b": b}, refs, tmp_path, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("layer, message", [
    (up_layer([0], ["t"]), "scale must be > 0"),
    (up_layer([0.01], ["t"]), "leave nothing"),
    (up_layer([2], ["t"], "final_width: 4"), "final_width and final_height must both be > 0"),
    ('layers { name: "down" type: DOWNPOOL bottom: "x" bottom: "x" top: "y" transformations { } '
     'transformations { scale: 2 } pooling_param { pool: AVE } }', "MAX pooling only"),
    ('layers { name: "up" type: UP bottom: "x" top: "t" }', "needs one or more `transformations`"),
])
def test_bad_transformations_are_refused(layer, message):
    with pytest.raises(CaffeqError, match=message):
        load_from_text(v1_net({"x": (1, 1, 6, 6)}, layer))
