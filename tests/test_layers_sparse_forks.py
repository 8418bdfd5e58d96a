"""Lanselott's Sparsify and vadim-v-lebedev's SparseConvolution (caffeq/layers/sparse_forks.py) against numpy
loops written here from the forks' C++ (sparsify_layer.cpp/.cu; sparse_conv_layer.cpp compressKernel,
im2col_cpu_sparse, forward_cpu_gemm), in torch, onnxruntime and model.py."""

import numpy as np
import pytest
import torch
from conftest import REPO, check_everywhere, inspect_corpus_file, net, node_of, rng

from caffeq.layers import LayerError
from caffeq.model import load, load_from_text

F32 = np.float32
CORPUS = str(REPO / "tests" / "fixtures" / "realworld")


def sparsify_ref(x, thre):
    """sparsify_layer.cpp Forward_cpu: a copy for thre 0, else the loop over fabs(x) <= thre."""
    if thre == 0:
        return x.copy()
    y = np.empty_like(x)
    for i, v in enumerate(x.reshape(-1)):
        if abs(v) <= thre:
            y.reshape(-1)[i] = 0
        elif v > thre:
            y.reshape(-1)[i] = v - thre
        else:
            y.reshape(-1)[i] = v + thre
    return y


def sparsify_net(shape, params):
    return net(f'layer {{ name: "s" type: "Sparsify" bottom: "x" top: "y" sparsify_param {{ {params} }} }}',
               inputs={"x": shape})


def test_sparsify_soft_threshold(tmp_path):
    shape = (2, 3, 5, 7)
    x = rng(1).standard_normal(shape).astype(F32)
    thre = F32(0.4)
    x[0, 0, 0, :4] = [thre, -thre, np.nextafter(thre, F32(1)), -np.nextafter(thre, F32(1))]   # at the edge
    model = load_from_text(sparsify_net(shape, "thre: 0.4 coef: 0.001"))
    ref = sparsify_ref(x, thre)
    assert ref[0, 0, 0, 0] == 0 and ref[0, 0, 0, 1] == 0 and ref[0, 0, 0, 2] != 0 and (ref == 0).sum() > 20
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path)


def test_sparsify_thre_zero_copies(tmp_path):
    shape = (2, 4, 3, 6)
    x = rng(2).standard_normal(shape).astype(F32)
    x[1, 2, 0, :2] = [-0.0, 0.0]
    model = load_from_text(sparsify_net(shape, "coef: 4.5e-10"))   # the corpus files' form: coef only
    check_everywhere(model, {"x": x}, {"y": sparsify_ref(x, 0.0)}, tmp_path)
    assert np.signbit(model.run({"x": x})["y"][1, 2, 0, 0])   # caffe_copy keeps -0 (a threshold of 0 would not)


def test_sparsify_refuses_a_negative_threshold():
    with pytest.raises(LayerError, match="sparsify_param.thre must be >= 0"):
        load_from_text(sparsify_net((1, 2, 3, 3), "thre: -0.1"))
    with pytest.raises(LayerError, match="sparsify_param.coef must be >= 0"):
        load_from_text(sparsify_net((1, 2, 3, 3), "coef: -1"))


def sparse_conv_ref(x, w, b, pad):
    """sparse_conv_layer.cpp: compressKernel packs every nonzero value in order into O·C·nnz zeros (nnz = the
    nonzero taps of filter 0, the pattern); im2col of the pattern's taps (or the input itself for a 1x1, pad-0
    kernel); gemm (O x nnz) · (nnz x out); then the bias."""
    o, c, kh, kw = w.shape
    flat = w.reshape(-1)
    nnz = int((flat[:c * kh * kw] != 0).sum())
    packed = np.zeros(o * c * nnz, np.float64)
    values = flat[flat != 0]
    packed[:values.size] = values
    pattern = [(ww, hh, cc) for cc in range(c) for hh in range(kh) for ww in range(kw)
               if flat[cc * kh * kw + hh * kw + ww] != 0]
    n, _, h, wd = x.shape
    oh, ow = h + 2 * pad[0] - kh + 1, wd + 2 * pad[1] - kw + 1
    one_by_one = (kh, kw) == (1, 1) and tuple(pad) == (0, 0)
    out = np.zeros((n, o, oh, ow))
    for i in range(n):
        if one_by_one:
            col = x[i].reshape(c, h * wd)[:nnz].astype(np.float64)
        else:
            col = np.zeros((nnz, oh * ow))
            for k, (w_off, h_off, c_im) in enumerate(pattern):
                for y in range(oh):
                    for z in range(ow):
                        hp, wp = y - pad[0] + h_off, z - pad[1] + w_off
                        if 0 <= hp < h and 0 <= wp < wd:
                            col[k, y * ow + z] = x[i, c_im, hp, wp]
        out[i] = (packed[:o * nnz].reshape(o, nnz) @ col).reshape(o, oh, ow) + b.reshape(o, 1, 1)
    return out.astype(F32)


def sparse_conv_model(shape, params):
    return load_from_text(net(f'layer {{ name: "c" type: "SparseConvolution" bottom: "x" top: "y" '
                              f'convolution_param {{ {params} }} }}', inputs={"x": shape}), random_weights=True)


def set_weights(model, w, b):
    node = node_of(model, "c")
    node.blobs[0], node.blobs[1] = w, b
    model.clear_cache()


def test_sparse_convolution_shared_mask_is_the_masked_convolution(tmp_path):
    """The fork's demo: one mask for every filter and channel; the forward is the convolution with the stored
    (masked) weight."""
    r = rng(3)
    shape = (2, 3, 9, 8)
    x = r.standard_normal(shape).astype(F32)
    model = sparse_conv_model(shape, "num_output: 4 kernel_h: 3 kernel_w: 5 pad_h: 1 pad_w: 2")
    assert node_of(model, "c").blobs[0].shape == (4, 3, 3, 5) and node_of(model, "c").blobs[1].shape == (4,)
    mask = np.array([[0, 0, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 0, 1]], F32)
    w = (r.standard_normal((4, 3, 3, 5)) * mask).astype(F32)
    b = r.standard_normal(4).astype(F32)
    set_weights(model, w, b)
    ref = sparse_conv_ref(x, w, b, (1, 2))
    assert ref.shape == (2, 4, 9, 8)
    plain = torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b), padding=(1, 2))
    np.testing.assert_allclose(plain.numpy(), ref, atol=2e-5, rtol=2e-5)
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=2e-5, rtol=2e-5)


def test_sparse_convolution_unshared_zeros_follow_the_packing(tmp_path):
    """Filters whose zeros differ from filter 0's: each filter takes the next nnz packed values (and the last
    ones zeros), not its own taps."""
    r = rng(4)
    shape = (2, 2, 7, 10)
    x = r.standard_normal(shape).astype(F32)
    model = sparse_conv_model(shape, "num_output: 3 kernel_size: 3 pad: 1")
    w = r.standard_normal((3, 2, 3, 3)).astype(F32)
    w[0, 0, 0, :] = 0            # filter 0: 15 nonzero taps
    w[1, 1, 2, 2] = 0            # filter 1: 17; filter 2: 18 -> 50 values in 3·2·15 = 90 places
    w[2, 0, 1, 1] = -0.0         # -0 is a zero
    b = r.standard_normal(3).astype(F32)
    set_weights(model, w, b)
    ref = sparse_conv_ref(x, w, b, (1, 1))
    plain = torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b), padding=1)
    assert np.abs(plain.numpy() - ref).max() > 0.1
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=2e-5, rtol=2e-5)


def test_sparse_convolution_1x1_reads_the_first_channels(tmp_path):
    """is_1x1_: no im2col, the gemm reads input channels 0..nnz-1 whatever the pattern."""
    r = rng(5)
    shape = (2, 5, 3, 7)
    x = r.standard_normal(shape).astype(F32)
    model = sparse_conv_model(shape, "num_output: 6 kernel_size: 1")
    w = r.standard_normal((6, 5, 1, 1)).astype(F32)
    w[:, [0, 2], :, :] = 0       # shared pattern: channels 1, 3, 4
    b = r.standard_normal(6).astype(F32)
    set_weights(model, w, b)
    ref = sparse_conv_ref(x, w, b, (0, 0))
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=2e-5, rtol=2e-5)


def test_sparse_convolution_refusals():
    with pytest.raises(LayerError, match="convolution_param.stride"):
        sparse_conv_model((1, 2, 8, 8), "num_output: 2 kernel_size: 3 stride: 2")
    model = sparse_conv_model((1, 1, 5, 6), "num_output: 2 kernel_size: 2")
    w = np.ones((2, 1, 2, 2), F32)
    w[0, 0, :, 1] = 0            # filter 0: 2 taps -> 4 places for 6 values
    set_weights(model, w, np.zeros(2, F32))
    with pytest.raises(LayerError, match="writes past its buffer"):
        model.run({"x": np.ones((1, 1, 5, 6), F32)})


@pytest.mark.parametrize("name, shapes", [
    ("Lanselott__FM_caffe__examples__cifar10__0.001_featuredecay_0.00000000045_Thu_Jun_21_06-41-07_UTC_2018__net"
     ".prototxt", ["data=2,3,32,32"]),
    ("Lanselott__FM_caffe__examples__cifar10__template_cifar10_resnet_regularize_train_test_n3.prototxt",
     ["data=2,3,32,32"]),
    ("Lanselott__caffe-1__models__bvlc_alexnet__template_train_val.prototxt", ["data=2,3,227,227"]),
    ("vadim-v-lebedev__caffe__examples__sparse__net_sparse.prototxt", ["data=2,1,28,28"]),
    ("vadim-v-lebedev__caffe__examples__sparse__net_sparse_deploy.prototxt", []),
])
def test_corpus_files_read(name, shapes):
    args = [a for s in shapes for a in ("--input-shape", s)]
    out = inspect_corpus_file(f"{CORPUS}/{name}", *args)
    assert "Sparsify" in out or "SparseConvolution" in out


def test_corpus_sparse_deploy_runs_with_random_weights():
    path = f"{CORPUS}/vadim-v-lebedev__caffe__examples__sparse__net_sparse_deploy.prototxt"
    model = load(path, random_weights=True)
    y = model.run({"data": rng(6).standard_normal((1, 1, 28, 28)).astype(F32)})["ip2"]
    assert y.shape == (1, 10) and np.isfinite(y).all()

