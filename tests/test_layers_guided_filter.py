"""zlmzju/caffe's GuidedFilter (caffeq/layers/guided_filter.py) against loops written from the fork's C++
(guidedfilter_layer.cpp Forward_cpu, its mean filter being pooling_layer.cpp's AVE loop), and the fork's own
test vectors (src/caffe/test/test_guidedfilter_layer.cpp)."""
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import check_everywhere, model_py_outputs, net, onnx_outputs, rng

from caffeq.__main__ import main
from caffeq.errors import CaffeqError, ExportError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F32 = np.float32
REALWORLD = Path(__file__).parent / "fixtures" / "realworld"


def caffe_ave_pool(x, kernel, pad):
    """PoolingLayer::Forward_cpu, AVE, stride 1, of one (H, W) map: the window's sum over the image, divided by
    its size clipped only to height + pad and width + pad."""
    h, w = x.shape
    ph_count, pw_count = -(-(h + 2 * pad - kernel) // 1) + 1, -(-(w + 2 * pad - kernel) // 1) + 1
    out = np.zeros((ph_count, pw_count), F32)
    for ph in range(ph_count):
        for pw in range(pw_count):
            hs, ws = ph - pad, pw - pad
            he, we = min(hs + kernel, h + pad), min(ws + kernel, w + pad)
            size = (he - hs) * (we - ws)
            acc = F32(0)
            for y in range(max(hs, 0), min(he, h)):
                for xx in range(max(ws, 0), min(we, w)):
                    acc = F32(acc + x[y, xx])
            out[ph, pw] = F32(acc / F32(size))
    return out


def fork_guided_filter(guide, coarse, window, epsilon=1e-8):
    """GuidedFilterLayer::Forward_cpu: per channel of each image, the same coarse map p."""
    h, w = coarse.shape[-2:]
    p = coarse.reshape(h, w)

    def mean(x):
        return caffe_ave_pool(x, window + 1, window // 2)

    out = np.zeros_like(guide)
    flat_out = out.reshape(-1, h, w)
    for i, image in enumerate(guide.reshape(-1, h, w)):
        mean_i, mean_p = mean(image), mean(p)
        cov = mean(image * p) - mean_i * mean_p
        var = mean(image * image) - mean_i * mean_i
        a = cov / (var + F32(epsilon))
        b = mean_p - a * mean_i
        flat_out[i] = mean(a) * image + mean(b)
    return out


def guided_net(guide_shape, coarse_shape, params="window_size: 2"):
    return net(f'layer {{ name: "g" type: "GuidedFilter" bottom: "i" bottom: "p" top: "o" '
               f'guided_filter_param {{ {params} }} }}', inputs={"i": guide_shape, "p": coarse_shape})


@pytest.mark.parametrize("guide_shape, window, epsilon", [((2, 3, 6, 9), 2, None), ((3, 2, 7, 5), 4, 0.01),
                                                          ((2, 3, 5, 8), 0, None), ((1, 2, 4, 6), 12, 0.001)])
def test_guided_filter_matches_the_forks_steps(guide_shape, window, epsilon, tmp_path):
    params = f"window_size: {window}" + (f" epsilon: {epsilon}" if epsilon is not None else "")
    coarse_shape = (1, 1) + guide_shape[2:]
    model = load_from_text(guided_net(guide_shape, coarse_shape, params))
    assert model.blob_shapes["o"] == guide_shape
    r = rng(window)
    guide = r.standard_normal(guide_shape).astype(F32)
    coarse = r.random(coarse_shape).astype(F32)
    ref = fork_guided_filter(guide, coarse, window, 1e-8 if epsilon is None else epsilon)
    check_everywhere(model, {"i": guide, "p": coarse}, {"o": ref}, tmp_path, atol=2e-5, rtol=2e-5)


def test_guided_filter_default_window_is_32(tmp_path):
    """The default window (32: kernel 33, pad 16) is wider than this map: every window reaches the padding."""
    model = load_from_text(guided_net((2, 1, 9, 11), (1, 1, 9, 11), ""))
    r = rng(3)
    guide, coarse = r.random((2, 1, 9, 11)).astype(F32), r.random((1, 1, 9, 11)).astype(F32)
    check_everywhere(model, {"i": guide, "p": coarse}, {"o": fork_guided_filter(guide, coarse, 32)}, tmp_path,
                     atol=2e-5, rtol=2e-5)


FORK_I = [0.780016225238193, 0.749580424362298, 0.740414372089090, 0.741393586774514, 0.751388236837560,
          0.737811008594189, 0.681265649729138, 0.659440609971576, 0.616152738174030, 0.587378842763567,
          0.563849430998861, 0.537335198750416, 0.532537855905660, 0.557046482355789, 0.579252979102189,
          0.572817689949016, 0.577676006720180, 0.596196484818137, 0.599882503466579, 0.595320710600831,
          0.608940405385914, 0.592571440096101, 0.608300181147616, 0.600457043892714, 0.585665050984911]
FORK_P = [0.564705882352941, 0.615686274509804, 0.619607843137255, 0.611764705882353, 0.592156862745098,
          0.721568627450980, 0.690196078431373, 0.690196078431373, 0.752941176470588, 0.729411764705882,
          0.788235294117647, 0.780392156862745, 0.827450980392157, 0.780392156862745, 0.768627450980392,
          0.827450980392157, 0.843137254901961, 0.843137254901961, 0.847058823529412, 0.874509803921569,
          0.854901960784314, 0.921568627450980, 0.866666666666667, 0.866666666666667, 0.854901960784314]
FORK_Q = [0.305451764936534, 0.445733832171568, 0.437143672489376, 0.461166976004217, 0.316816551726667,
          0.474597728734006, 0.685150618246553, 0.682412051907470, 0.696731160483050, 0.457467394868920,
          0.501004634015045, 0.762760047468481, 0.812850720701027, 0.776202999019964, 0.514125286875935,
          0.539212757413632, 0.817764745227509, 0.834357568317334, 0.837447876355424, 0.555031486259445,
          0.392313547968571, 0.573363834433404, 0.582377960487621, 0.574635206634875, 0.373106238623831]


def test_guided_filter_gives_the_forks_test_values(tmp_path):
    """The fork's TestForward (window_size 2 on its 5 x 5 image and map, every channel the same; 1e-5 there), with
    one coarse map, the only count its forward reads within the blobs."""
    guide = np.tile(np.array(FORK_I, F32).reshape(1, 1, 5, 5), (2, 2, 1, 1))
    coarse = np.array(FORK_P, F32).reshape(1, 1, 5, 5)
    model = load_from_text(guided_net(guide.shape, coarse.shape))
    want = np.tile(np.array(FORK_Q, F32).reshape(1, 1, 5, 5), (2, 2, 1, 1))
    check_everywhere(model, {"i": guide, "p": coarse}, {"o": want}, tmp_path, atol=1e-5, rtol=0)


def test_guided_filter_reads_a_guide_of_the_maps_count_flat(tmp_path):
    """A guide channel of 3 x 10 values is read as the coarse map's 5 x 6 (the fork's flat offsets)."""
    r = rng(5)
    guide, coarse = r.standard_normal((2, 3, 3, 10)).astype(F32), r.random((1, 1, 5, 6)).astype(F32)
    model = load_from_text(guided_net(guide.shape, coarse.shape))
    assert model.blob_shapes["o"] == (2, 3, 3, 10)
    ref = fork_guided_filter(guide.reshape(2, 3, 5, 6), coarse, 2).reshape(guide.shape)
    check_everywhere(model, {"i": guide, "p": coarse}, {"o": ref}, tmp_path, atol=2e-5, rtol=2e-5)


def test_guided_filter_reads_three_axis_blobs_as_legacy_shapes(tmp_path):
    """(N, C, H) blobs are N x C x H x 1 to the fork's accessors: a map of one column."""
    r = rng(6)
    guide, coarse = r.standard_normal((2, 3, 7)).astype(F32), r.random((1, 1, 7)).astype(F32)
    model = load_from_text(guided_net(guide.shape, coarse.shape))
    ref = fork_guided_filter(guide.reshape(2, 3, 7, 1), coarse.reshape(1, 1, 7, 1), 2).reshape(guide.shape)
    check_everywhere(model, {"i": guide, "p": coarse}, {"o": ref}, tmp_path, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("channels", [2, 0])
def test_coarse_map_needs_one_channel(channels):
    with pytest.raises(LayerError, match=r"GuidedFilter's coarse map \(bottom 1\) must have 1 channel"):
        load_from_text(guided_net((1, 3, 4, 5), (1, channels, 4, 5)))


def test_guided_filter_takes_two_bottoms():
    text = net('layer { name: "g" type: "GuidedFilter" bottom: "i" top: "o" }', inputs={"i": (1, 1, 4, 5)})
    with pytest.raises(LayerError, match="GuidedFilter takes 2 bottoms"):
        load_from_text(text)


@pytest.mark.parametrize("guide_shape, coarse_shape, params, words", [
    ((1, 2, 6, 7), (1, 1, 6, 7), "window_size: 3", "guided_filter_param.window_size 3 is odd"),
    ((1, 2, 6, 7), (1, 1, 6, 7), "window_size: 1", "guided_filter_param.window_size 1 is odd"),
    ((2, 2, 6, 7), (2, 1, 6, 7), "window_size: 2", "the coarse map [2, 1, 6, 7] has 2 images"),
    ((2, 2, 6, 7), (0, 1, 6, 7), "window_size: 2", "the coarse map [0, 1, 6, 7] has 0 images"),
    ((1, 2, 6, 8), (1, 1, 6, 7), "window_size: 2", "do not hold the coarse map's 6 x 7 values"),
    ((1, 2, 6, 6), (1, 1, 6, 7), "window_size: 2", "do not hold the coarse map's 6 x 7 values"),
    ((1, 2, 6, 7), (1, 1, 6, 7), "window_size: 46340", "divides by the kernel's area 2147488281 as an int"),
])
def test_forwards_the_fork_leaves_undefined_are_refused(guide_shape, coarse_shape, params, words, tmp_path):
    model = load_from_text(guided_net(guide_shape, coarse_shape, params))
    assert model.blob_shapes["o"] == guide_shape   # the fork's Reshape accepts them
    feeds = {"i": np.zeros(guide_shape, F32), "p": np.zeros(coarse_shape, F32)}
    with pytest.raises(CaffeqError, match=f"layer 'g' \\(GuidedFilter\\): .*{words.replace('[', '.').replace(']', '.')}"):
        model.run(feeds)
    with pytest.raises(ExportError, match="GuidedFilter"):
        onnx_outputs(model, feeds, tmp_path)
    with pytest.raises(ExportError, match="GuidedFilter"):
        model_py_outputs(model, feeds, tmp_path)


def test_the_largest_window_whose_area_fits_the_forks_int(tmp_path):
    """window_size 46338: kernel 46339, whose area 2147302921 still fits Caffe's int pool_size (46340 does not)."""
    model = load_from_text(guided_net((2, 3, 5, 4), (1, 1, 5, 4), "window_size: 46338 epsilon: 0.001"))
    r = rng(11)
    guide, coarse = r.standard_normal((2, 3, 5, 4)).astype(F32), r.random((1, 1, 5, 4)).astype(F32)
    ref = fork_guided_filter(guide, coarse, 46338, 0.001)
    check_everywhere(model, {"i": guide, "p": coarse}, {"o": ref}, tmp_path, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [2 ** 31, 2 ** 32 - 2])
def test_a_window_past_the_forks_int_is_refused(window):
    """The fork's int window_size_ wraps negative: PoolingLayer's kernel_size > 0 CHECK fails at set-up."""
    with pytest.raises(LayerError, match=f"guided_filter_param.window_size {window} is past the fork's int"):
        load_from_text(guided_net((1, 2, 4, 5), (1, 1, 4, 5), f"window_size: {window}"))


def test_the_forks_deploy_file_reads(capsys):
    path = REALWORLD / "zlmzju__caffe__examples__finetune_fcn__guide__deploy.prototxt"
    assert main(["inspect", str(path)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("guided_filter"))
    assert "GuidedFilter" in line and "edge1,map -> guided_map" in line and "1x1x500x500" in line


def test_guided_filter_stays_on_the_blobs_device():
    """On an emulated GPU (cuda_emulation.py) the epsilon and the pools follow the blobs."""
    from cuda_emulation import run_on_emulated_cuda
    model = load_from_text(guided_net((2, 3, 6, 9), (1, 1, 6, 9), "window_size: 4 epsilon: 0.01"))
    feeds = {"i": rng(8).random((2, 3, 6, 9)).astype(F32), "p": rng(9).random((1, 1, 6, 9)).astype(F32)}
    out, mixes = run_on_emulated_cuda(model, feeds)
    assert not mixes, "\n".join(sorted(set(mixes)))
    np.testing.assert_allclose(out.as_subclass(torch.Tensor).numpy(), model.run(feeds, exact=True)["o"], rtol=1e-6,
                               atol=1e-6)
