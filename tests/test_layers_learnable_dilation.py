"""SSAW14/LearnableDilationNetwork (4838c44): the fork's Convolution with a dilation bottom (2 bottoms, 1 top),
against a numpy reference written from caffe-dynamic-dilation/src/caffe/util/im2col.cu im2col_dynamic_gpu_kernel
and base_conv_layer.cpp's gemm."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.errors import CaffeqError
from caffeq.layers import LayerError
from caffeq.model import load, load_from_text

ROOT = Path(__file__).parent.parent
FIXTURE = Path(__file__).parent / "fixtures" / "realworld" / "SSAW14__LearnableDilationNetwork__train.prototxt"
CORPUS = FIXTURE.parent


def c_div(a, b):
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


def ref_dynamic_conv(x, dmap, weight, bias, stride, pad, group):
    """im2col_dynamic_gpu_kernel, one thread per (c_im, h, w) of each sample (num = 1 per call), then the
    grouped gemm and the bias.  Sums in float64 like the kernel's double dist."""
    n, c, h, w = x.shape
    o, cg, kh, kw = weight.shape
    (sh, sw), (ph, pw) = stride, pad
    hc = c_div(h + 2 * ph - (kh + (kh - 1) * (ph - 1)), sh) + 1
    wc = c_div(w + 2 * pw - (kw + (kw - 1) * (pw - 1)), sw) + 1
    out = np.zeros((n, o, hc, wc), np.float64)
    for s in range(n):
        im = x[s].reshape(-1).astype(np.float64)      # bottom_data + n * bottom_dim_
        dil = dmap[s].reshape(-1)                      # bottom[1]->offset(n)
        col = np.zeros((c * kh * kw, hc * wc), np.float64)
        for ci in range(c):
            for hh in range(hc):
                for ww in range(wc):
                    dv = np.float32(dil[(ci * h + hh) * w + ww])
                    fl = int(dv)
                    ce = fl + 1
                    if fl == ph:
                        fl, ce = fl - 1, ce - 1
                    dist = float(np.float32(ce) - dv)   # int - float: a float, then widened to double
                    hce, wce = hh * sh - ce, ww * sw - ce
                    hfl, wfl = hh * sh - fl, ww * sw - fl
                    for i in range(kh):
                        for j in range(kw):
                            r = (ci * kh + i) * kw + j
                            if 0 <= hce + i * ce < h and 0 <= wce + j * ce < w:
                                def at(row, cl):
                                    return im[(ci * h + row) * w + cl]
                                col[r, hh * wc + ww] = (
                                    at(hce + i * ce, wce + j * ce) * (1 - dist) * (1 - dist)
                                    + at(hce + i * ce, wfl + j * fl) * (1 - dist) * dist
                                    + at(hfl + i * fl, wce + j * ce) * dist * (1 - dist)
                                    + at(hfl + i * fl, wfl + j * fl) * dist * dist)
        og, k = o // group, cg * kh * kw
        for g in range(group):
            res = weight[g * og:(g + 1) * og].reshape(og, k).astype(np.float64) @ col[g * k:(g + 1) * k]
            out[s, g * og:(g + 1) * og] = res.reshape(og, hc, wc)
        if bias is not None:
            out[s] += bias.reshape(o, 1, 1)
    return out.astype(np.float32)


def layer(params, bottoms=("x", "d")):
    b = " ".join(f'bottom: "{v}"' for v in bottoms)
    return f'layer {{ name: "c" type: "Convolution" {b} top: "o" convolution_param {{ {params} }} }}'


CASES = [
    # (x shape, num_output, params, stride, pad, group, dilation values)
    ((2, 3, 7, 9), 4, "num_output: 4 kernel_size: 3 pad: 2 dilation: 2", (1, 1), (2, 2), 1,
     [1.0, 1.25, 1.5, 2.0, 2.5, 2.75, 3.0, 3.4, 4.0]),
    ((2, 4, 9, 6), 6, "num_output: 6 kernel_size: 3 pad: 1 dilation: 1 group: 2", (1, 1), (1, 1), 2,
     [0.0, 0.3, 1.0, 1.6, 2.0, 2.2, 3.7]),
    ((2, 2, 11, 8), 3, "num_output: 3 kernel_size: 3 pad: 3 dilation: 3 stride: 2", (2, 2), (3, 3), 1,
     [1.0, 2.5, 3.0, 3.5, 4.0, 5.25]),
    ((2, 2, 8, 7), 3, "num_output: 3 kernel_h: 3 kernel_w: 5 pad_h: 2 pad_w: 1 dilation: 2 dilation: 1 "
     "bias_term: false",
     (1, 1), (2, 1), 1, [1.0, 1.5, 2.0, 2.5]),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_dynamic_dilation_matches_the_forks_gpu_im2col(tmp_path, case):
    shape, o, params, stride, pad, group, values = CASES[case]
    r = rng(case)
    x = r.standard_normal(shape).astype(np.float32)
    dmap = r.choice(np.array(values, np.float32), size=shape)
    model = load_from_text(net(layer(params), inputs={"x": shape, "d": shape}), random_weights=True)
    node = next(nd for nd in model.layers if nd.name == "c")
    w = np.asarray(node.blobs[0])
    b = np.asarray(node.blobs[1]) if len(node.blobs) > 1 else None
    if b is not None:
        b = r.standard_normal(b.shape).astype(np.float32)
        node.blobs[1][...] = b
    ref = ref_dynamic_conv(x, dmap, w, b, stride, pad, group)
    assert model.blob_shapes["o"] == ref.shape
    check_everywhere(model, {"x": x, "d": dmap}, {"o": ref}, tmp_path, atol=1e-5, rtol=1e-5)


def test_integer_dilation_equal_to_pad_is_the_dilated_convolution(tmp_path):
    """D == pad everywhere: floor == pad moves both down, dist 0, the ceil taps alone: Caffe's dilated conv."""
    shape = (2, 3, 9, 7)
    x = rng(7).standard_normal(shape).astype(np.float32)
    dyn = load_from_text(net(layer("num_output: 2 kernel_size: 3 pad: 2 dilation: 2"),
                             inputs={"x": shape, "d": shape}), random_weights=True)
    plain = load_from_text(net(layer("num_output: 2 kernel_size: 3 pad: 2 dilation: 2", ("x",)),
                               inputs={"x": shape}), random_weights=True)
    dn = next(nd for nd in dyn.layers if nd.name == "c")
    pn = next(nd for nd in plain.layers if nd.name == "c")
    for i in range(2):
        pn.blobs[i][...] = dn.blobs[i]
    want = plain.run({"x": x})["o"]
    got = dyn.run({"x": x, "d": np.full(shape, 2.0, np.float32)})["o"]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_one_by_one_two_bottom_conv_is_not_taken_for_the_fork():
    """The fork's 1x1 kernel never reads the map (is_1x1_), so a 2-bottom, 1-top 1x1 Convolution is more likely
    another fork's fused residual (Intel's merged ResNets): it stays Caffe's refusal, not a silent plain conv."""
    shape = (2, 3, 5, 4)
    with pytest.raises(CaffeqError, match="produces 2 tops but the prototxt names 1"):
        load_from_text(net(layer("num_output: 2 kernel_size: 1"), inputs={"x": shape, "d": shape}),
                       random_weights=True)


@pytest.mark.parametrize("params, d_shape, match", [
    ("num_output: 2 kernel_size: 3 pad: 2 dilation: 1", (2, 3, 7, 9), "set pad equal to dilation"),
    ("num_output: 2 kernel_size: 3 pad: 2 dilation: 2", (2, 1, 7, 9), "one dilation per channel and pixel"),
    ("num_output: 2 kernel_size: 3 pad: 2 dilation: 2 engine: CUDNN", (2, 3, 7, 9), "engine CUDNN"),
])
def test_bad_dynamic_dilation_layers_are_refused(params, d_shape, match):
    with pytest.raises(LayerError, match=match):
        load_from_text(net(layer(params), inputs={"x": (2, 3, 7, 9), "d": d_shape}), random_weights=True)


def test_bvlc_convolution_with_two_tops_is_untouched():
    model = load_from_text(net('layer { name: "c" type: "Convolution" bottom: "x" bottom: "d" top: "o" top: "p" '
                               'convolution_param { num_output: 2 kernel_size: 3 } }',
                               inputs={"x": (1, 3, 5, 5), "d": (1, 3, 5, 5)}), random_weights=True)
    assert model.blob_shapes["o"] == model.blob_shapes["p"] == (1, 2, 3, 3)


def test_learnable_dilation_train_net_reads():
    model = load(str(FIXTURE), phase="TRAIN")
    s = model.blob_shapes
    assert s["conv5_1"] == s["conv5_3"] == (10, 512, 41, 41)
    assert s["fc6_2"] == (10, 1024, 41, 41)


@pytest.mark.parametrize("name", ["SSAW14__LearnableDilationNetwork__train.prototxt",
                                  "SSAW14__LearnableDilationNetwork__train_fixed.prototxt"])
def test_corpus_files_inspect(name):
    path = CORPUS / name
    done = subprocess.run([sys.executable, str(ROOT / "cli.py"), "inspect", str(path)], capture_output=True,
                          text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
