"""Round 107a forks: AmirooR/caffe_video_segmentation's FlowWarping against its GPU kernel
(flow_warping_layer.cu FlowWarpingBilinearCoefs and the cuSPARSE product, f991df5), written out per pixel in
float32, through torch, onnxruntime and model.py; t2mhanh/caffe_convLSTM_WTA's SpatialConvWta, which the fork
declares nowhere: read, sized, refused."""
import numpy as np
import pytest
from conftest import REPO, check_everywhere, cli_process, net, rng

from caffeq.errors import CaffeqError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

f32 = np.float32
CORPUS = REPO / "tests" / "fixtures" / "realworld"


def cuda_int(v):
    """CUDA's (int) of a float: toward zero, NaN -> 0."""
    return 0 if np.isnan(v) else int(v)


def ref_flow_warping(image, disp):
    n, c, h, w = image.shape
    out = np.zeros_like(image)
    for b in range(n):
        for i in range(h):
            for j in range(w):
                y = f32(disp[b, 0, i, j] + f32(i))
                x = f32(disp[b, 1, i, j] + f32(j))
                r, q = cuda_int(y), cuda_int(x)
                ry, rx = f32(y - f32(r)), f32(x - f32(q))
                ny, nx = f32(1) - ry, f32(1) - rx
                acc = np.zeros(c, f32)
                for rr, qq, coef in ((r, q, ny * nx), (r, q + 1, ny * rx), (r + 1, q, ry * nx),
                                     (r + 1, q + 1, ry * rx)):
                    if 0 <= rr < h and 0 <= qq < w:      # a tap outside keeps weight 0
                        acc = acc + f32(coef) * image[b, :, rr, qq]
                out[b, :, i, j] = acc
    return out


def warping_net(n, c, h, w):
    layer = 'layer { name: "fw" type: "FlowWarping" bottom: "im" bottom: "disp" top: "out" }'
    return net(layer, inputs={"im": (n, c, h, w), "disp": (n, 2, h, w)})


@pytest.mark.parametrize("n, c, h, w", [(2, 3, 5, 7), (2, 1, 8, 3)])
def test_flow_warping_matches_the_kernel(n, c, h, w, tmp_path):
    g = rng(h * w)
    feeds = {"im": g.standard_normal((n, c, h, w)).astype(f32),
             "disp": (g.standard_normal((n, 2, h, w)) * 2.5).astype(f32)}
    ref = ref_flow_warping(feeds["im"], feeds["disp"])
    check_everywhere(load_from_text(warping_net(n, c, h, w)), feeds, {"out": ref}, tmp_path, atol=1e-5, rtol=1e-5)


def test_flow_warping_rows_first_truncation_and_edges(tmp_path):
    n, c, h, w = 2, 2, 4, 6
    im = (np.arange(n * c * h * w, dtype=f32).reshape(n, c, h, w) / 5 - 3).astype(f32)
    disp = np.zeros((n, 2, h, w), f32)
    disp[0, 0, 1, 2] = 1.0            # channel 0 moves rows: out(1, 2) reads row 2
    disp[0, 1, 2, 1] = 2.0            # channel 1 moves columns: out(2, 1) reads column 3
    disp[0, 1, 0, 0] = -0.25          # x = -0.25 truncates to column 0: extrapolates, weight 1.25
    disp[0, 0, 3, 4] = -4.5           # y = -1.5: r = -1, only row 0 counts, with weight ry = -0.5
    disp[1, 1, 1, 5] = 0.5            # c + 1 = W: the far column adds nothing
    disp[1, 0, 2, 2] = np.nan         # NaN -> index 0, NaN weights
    disp[1, 1, 3, 3] = 7.0            # all four taps outside: 0
    ref = ref_flow_warping(im, disp)
    np.testing.assert_array_equal(ref[0, :, 1, 2], im[0, :, 2, 2])
    np.testing.assert_array_equal(ref[0, :, 2, 1], im[0, :, 2, 3])
    np.testing.assert_allclose(ref[0, :, 0, 0], 1.25 * im[0, :, 0, 0] - 0.25 * im[0, :, 0, 1], rtol=1e-6)
    np.testing.assert_allclose(ref[0, :, 3, 4], -0.5 * im[0, :, 0, 4], rtol=1e-6)
    np.testing.assert_allclose(ref[1, :, 1, 5], 0.5 * im[1, :, 1, 5], rtol=1e-6)
    assert np.isnan(ref[1, :, 2, 2]).all() and (ref[1, :, 3, 3] == 0).all()
    check_everywhere(load_from_text(warping_net(n, c, h, w)), {"im": im, "disp": disp}, {"out": ref}, tmp_path,
                     atol=1e-5, rtol=1e-5)


def test_flow_warping_bad_displacement_is_one_line():
    layer = 'layer { name: "fw" type: "FlowWarping" bottom: "im" bottom: "disp" top: "out" }'
    with pytest.raises(CaffeqError, match=r"FlowWarping's displacement must be \(N, 2, H, W\)"):
        load_from_text(net(layer, inputs={"im": (2, 3, 5, 7), "disp": (2, 1, 5, 7)}))
    with pytest.raises(CaffeqError, match="FlowWarping"):
        load_from_text(net('layer { name: "fw" type: "FlowWarping" bottom: "im" top: "out" }',
                           inputs={"im": (2, 3, 5, 7)}))


def test_spatial_conv_wta_is_sized_and_refused():
    layer = 'layer { name: "wta" type: "SpatialConvWta" bottom: "x" top: "wta" }'
    model = load_from_text(net(layer, inputs={"x": (2, 3, 5, 7)}))
    assert tuple(model.blob_shapes["wta"]) == (2, 3, 5, 7)
    with pytest.raises(LayerError, match=r"layer 'wta' \(SpatialConvWta\): .* declares no SpatialConvWta"):
        model.run({"x": np.zeros((2, 3, 5, 7), f32)})


def test_corpus_files_read(tmp_path):
    warp = CORPUS / "AmirooR__caffe_video_segmentation__video_segmentation__test_layers__test_warping_layer.prototxt"
    wta = [CORPUS / f"t2mhanh__caffe_convLSTM_WTA__examples__mnist_wta_autoencoder__mnist_wta_autoencoder{s}.prototxt"
           for s in ("3", "_test")]
    res = cli_process("inspect", str(warp))
    assert res.returncode == 0 and "FlowWarping" in res.stdout and "1x3x100x100" in res.stdout
    model = load_from_text(warp.read_text(), random_weights=True)
    g = rng(3)
    feeds = {"data": g.standard_normal((1, 3, 100, 100)).astype(f32),
             "disp": (g.standard_normal((1, 2, 100, 100)) * 10).astype(f32)}
    out = model.run(feeds)["out"]
    assert out.shape == (1, 3, 100, 100) and np.isfinite(out).all()
    for f in wta:
        res = cli_process("inspect", str(f), "--input-shape", "data=2,1,28,28")
        assert res.returncode == 0 and "SpatialConvWta" in res.stdout and "2x64x28x28" in res.stdout
