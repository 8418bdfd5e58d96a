"""StarStyleSky/caffe's and jialinwu17/segawareatt's AttentionConvolution, StarStyleSky's CrossConvolution,
segawareatt's DynamicSampleConvolution and Python kernel_all_bias_layer.KernelBiasLayer against loops written
from the forks' C++ / CUDA (attention_conv_layer.cu, cross_conv_layer.cu with base_conv_layer's gemm,
dynamic_sample_conv_layer.cu), in torch, onnxruntime and model.py."""

import numpy as np
import pytest
from conftest import REPO, check_everywhere, net, rng

from caffeq.errors import CaffeqError
from caffeq.model import load, load_from_text

f32 = np.float32
CORPUS = REPO / "tests" / "fixtures" / "realworld"


def out_size(size, k, p, s, d):
    return (size + 2 * p - (d * (k - 1) + 1)) // s + 1


def im2col(x, kh, kw, ph, pw, sh, sw, dh, dw):
    """Caffe's im2col of one image (C, H, W) -> (C kh kw, H' W'), rows in (c, i, j) order."""
    c, h, w = x.shape
    oh, ow = out_size(h, kh, ph, sh, dh), out_size(w, kw, pw, sw, dw)
    cols = np.zeros((c * kh * kw, oh * ow), f32)
    for ci in range(c):
        for i in range(kh):
            for j in range(kw):
                for y in range(oh):
                    for z in range(ow):
                        hy, wz = y * sh - ph + i * dh, z * sw - pw + j * dw
                        if 0 <= hy < h and 0 <= wz < w:
                            cols[(ci * kh + i) * kw + j, y * ow + z] = x[ci, hy, wz]
    return cols, oh, ow


def attention_conv_ref(x, att, weight, bias, kh, kw, ph=0, pw=0, sh=1, sw=1, dh=1, dw=1):
    """attention_conv_layer.cu's Forward_gpu: columns times the attention read flat from n K H W, then the gemm."""
    n, _, h, w = x.shape
    o = weight.shape[0]
    k = weight[0].size
    flat = att.reshape(-1).astype(np.float64)
    tops = []
    for b in range(n):
        cols, oh, ow = im2col(x[b], kh, kw, ph, pw, sh, sw, dh, dw)
        a = flat[b * k * h * w:b * k * h * w + k * oh * ow].reshape(k, oh * ow)
        y = weight.reshape(o, k).astype(np.float64) @ (cols[:k].astype(np.float64) * a)
        if bias is not None:
            y = y + bias.reshape(o, 1)
        tops.append(y.reshape(o, oh, ow))
    return np.stack(tops).astype(f32)


def cross_conv_ref(x, filters, o, kh, kw, ph=0, pw=0, sh=1, sw=1, dh=1, dw=1, group=1):
    """cross_conv_layer.cu's Forward_gpu: image n's gemm per group with the filters at n * count(1)."""
    n, c, h, w = x.shape
    cg, og = c // group, o // group
    kd = cg * kh * kw
    per = filters.reshape(filters.shape[0], -1).astype(np.float64)
    tops = []
    for b in range(n):
        cols, oh, ow = im2col(x[b], kh, kw, ph, pw, sh, sw, dh, dw)
        wt = per[b, :o * kd].reshape(o, kd)
        y = np.concatenate([wt[g * og:(g + 1) * og] @ cols[g * kd:(g + 1) * kd] for g in range(group)])
        tops.append(y.reshape(o, oh, ow))
    return np.stack(tops).astype(f32)


def dynamic_sample_ref(x, across, within, o, k, d, s, t):
    """dynamic_sample_conv_layer.cu: object_kernel_conv_im2col_kernel's columns (H, W, s, s, C, k, k), then
    object_forward's sum over (c, i, j) of (across at the centre tap + within) times the column."""
    n, c, h, w = x.shape
    sp, kp = (s - 1) // 2, (k - 1) // 2
    a_all = across.reshape(across.shape[0], -1).astype(np.float64)
    w_all = within.reshape(within.shape[0], -1).astype(np.float64)
    top = np.zeros((n, h, w, s, s, o), np.float64)
    for b in range(n):
        a = a_all[b, :h * w * o * c].reshape(h, w, o, c)
        wi = w_all[b, :h * w * o * k * k].reshape(h, w, o, k, k)
        for y in range(h):
            for z in range(w):
                for hs in range(s):
                    for ws in range(s):
                        bh, bw = y + (hs - s + sp + 1) * t, z + (ws - s + sp + 1) * t
                        col = np.zeros((c, k, k))
                        for i in range(k):
                            for j in range(k):
                                yy, zz = bh + d * (i - k + 1 + kp), bw + d * (j - k + 1 + kp)
                                if 0 <= yy < h and 0 <= zz < w:
                                    col[:, i, j] = x[b, :, yy, zz]
                        for oc in range(o):
                            wt = np.broadcast_to(wi[y, z, oc], (c, k, k)).copy()
                            wt[:, (k - 1) // 2, (k - 1) // 2] += a[y, z, oc]
                            top[b, y, z, hs, ws, oc] = (wt * col).sum()
    return top.reshape(n, h, w, s * s * o).astype(f32)


def conv_text(type_, params, bottoms=("x", "a")):
    bots = " ".join(f'bottom: "{b}"' for b in bottoms)
    return f'layer {{ name: "c" type: "{type_}" {bots} top: "y" convolution_param {{ {params} }} }}'


def weights_of(model, name="c"):
    return [np.asarray(b) for b in model.params[name]]


@pytest.mark.parametrize("shape,params,geometry,att_extra", [
    # the nets' 3x3, pad 1 on an odd non-square map, with a bias
    ((2, 3, 5, 7), "num_output: 4 kernel_size: 3 pad: 1", dict(kh=3, kw=3, ph=1, pw=1), 0),
    # group 2: only the first C / 2 channels' columns, for every output; no bias
    ((2, 4, 3, 6), "num_output: 5 kernel_size: 3 pad: 1 group: 2 bias_term: false", dict(kh=3, kw=3, ph=1, pw=1), 0),
    # 1x1 (the GPU's im2col; the fork's CPU forward would read an unwritten buffer), dilation unused
    ((2, 3, 4, 5), "num_output: 2 kernel_size: 1", dict(kh=1, kw=1), 0),
    # H' x W' = 3 x 8 from a 4 x 6 map: the attention is read flat as (K, H' W')
    ((2, 2, 4, 6), "num_output: 3 kernel_h: 2 kernel_w: 1 pad_h: 0 pad_w: 1", dict(kh=2, kw=1, ph=0, pw=1), 0),
    # an attention blob of more channels than K: image 1 starts at K H W, inside image 0's rows
    ((2, 2, 3, 5), "num_output: 3 kernel_size: 3 pad: 1", dict(kh=3, kw=3, ph=1, pw=1), 2),
    # dilation 2 with pad 2 keeps H x W
    ((2, 2, 5, 6), "num_output: 3 kernel_size: 3 pad: 2 dilation: 2", dict(kh=3, kw=3, ph=2, pw=2, dh=2, dw=2), 0),
    # stride 2 down, pad 3 across: H' x W' = 2 x 12 from a 4 x 6 map
    ((2, 3, 4, 6), "num_output: 2 kernel_size: 1 stride_h: 2 stride_w: 1 pad_h: 0 pad_w: 3",
     dict(kh=1, kw=1, pw=3, sh=2), 0),
])
def test_attention_convolution(tmp_path, shape, params, geometry, att_extra):
    n, c, h, w = shape
    group = 2 if "group: 2" in params else 1
    k = c // group * geometry["kh"] * geometry["kw"]
    g = rng(1)
    x = g.standard_normal(shape).astype(f32)
    att = g.uniform(0.5, 1.5, (n, k + att_extra, h, w)).astype(f32)
    model = load_from_text(net(conv_text("AttentionConvolution", params), inputs={"x": shape, "a": att.shape}),
                           random_weights=True)
    blobs = model.params["c"]
    bias = None
    if len(blobs) > 1:          # a non-zero bias
        blobs[1][...] = g.standard_normal(blobs[1].shape).astype(f32)
        bias = np.asarray(blobs[1])
    weight = np.asarray(blobs[0])
    ref = attention_conv_ref(x, att, weight, bias, **geometry)
    check_everywhere(model, {"x": x, "a": att}, {"y": ref}, tmp_path, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("shape,params,geometry,o,group,fshape", [
    # deploy 2's form: depthwise (group = C = num_output), 3x3 pad 1, the filters (N, O, 3, 3)
    ((2, 4, 5, 7), "num_output: 4 kernel_size: 3 pad: 1 group: 4", dict(kh=3, kw=3, ph=1, pw=1), 4, 4, (2, 4, 3, 3)),
    # deploy 5's form: group 1, the filters (N, O C kh kw, 1, 1)
    ((2, 3, 6, 5), "num_output: 2 kernel_size: 3 pad: 1", dict(kh=3, kw=3, ph=1, pw=1), 2, 1, (2, 54, 1, 1)),
    # stride 2, dilation 2, non-square kernel; more filter values and images than read
    ((2, 2, 9, 8), "num_output: 3 kernel_h: 3 kernel_w: 2 stride: 2 dilation: 2 pad_h: 1 pad_w: 0",
     dict(kh=3, kw=2, ph=1, pw=0, sh=2, sw=2, dh=2, dw=2), 3, 1, (3, 40)),
])
def test_cross_convolution(tmp_path, shape, params, geometry, o, group, fshape):
    g = rng(2)
    x = g.standard_normal(shape).astype(f32)
    f = g.standard_normal(fshape).astype(f32)
    model = load_from_text(net(conv_text("CrossConvolution", params), inputs={"x": shape, "a": fshape}),
                           random_weights=True)
    assert [b.shape for b in weights_of(model)] == [(o, shape[1] // group, geometry["kh"], geometry["kw"]), (o,)]
    blobs = model.params["c"]   # the layer's own weight and a non-zero bias: cross_conv_layer.cu reads neither
    blobs[1][...] = g.uniform(1, 2, blobs[1].shape).astype(f32)
    ref = cross_conv_ref(x, f, o, group=group, **geometry)
    check_everywhere(model, {"x": x, "a": f}, {"y": ref}, tmp_path, atol=2e-5, rtol=1e-5)


def dsc_text(params):
    return ('layer { name: "c" type: "DynamicSampleConvolution" bottom: "x" bottom: "across" bottom: "within" '
            f'top: "y" object_kernel_convolution_param {{ {params} }} }}')


@pytest.mark.parametrize("shape,o,k,d,s,t,params,across_extra", [
    # the res_att net's form: 3x3 kernel, dilation 1, 3 x 3 samples 2 apart (pad and lr_mul unread)
    ((2, 3, 5, 7), 2, 3, 1, 3, 2, "num_output: 2 kernel_size: 3 dilation: 1 pad: 1 lr_mul: 0.0001 kernel_stride: 2 "
                                  "samples: 3", 0),
    # the defaults samples 3 and kernel_stride 2 with a 1x1 kernel (dilation 0, its unset value)
    ((2, 2, 4, 6), 3, 1, 0, 3, 2, "num_output: 3 kernel_size: 1", 0),
    # an even sample count: offsets (u - 1) t; across holds more values per image than read (image 1 at count(1))
    ((2, 2, 6, 5), 2, 3, 1, 2, 1, "num_output: 2 kernel_size: 3 dilation: 1 samples: 2 kernel_stride: 1", 2),
])
def test_dynamic_sample_convolution(tmp_path, shape, o, k, d, s, t, params, across_extra):
    n, c, h, w = shape
    g = rng(3)
    x = g.standard_normal(shape).astype(f32)
    across = g.standard_normal((n, h, w, o * c + across_extra)).astype(f32)
    within = g.standard_normal((n, h * w * o * k * k + 3)).astype(f32)     # extra values per image: unread
    model = load_from_text(net(dsc_text(params), inputs={"x": shape, "across": across.shape,
                                                          "within": within.shape}))
    ref = dynamic_sample_ref(x, across, within, o, k, d, s, t)
    assert ref.shape == (n, h, w, s * s * o)
    check_everywhere(model, {"x": x, "across": across, "within": within}, {"y": ref}, tmp_path, atol=3e-5,
                     rtol=1e-5)


@pytest.mark.parametrize("param_str,div", [("", f32(1.0)), ("'div': 256", f32(256)), ("{'div': 0.1}", f32(0.1))])
def test_kernel_all_bias_layer(tmp_path, param_str, div):
    text = net('layer { name: "b" type: "Python" bottom: "x" top: "y" python_param { module: '
               f'"kernel_all_bias_layer" layer: "KernelBiasLayer" param_str: "{param_str}" }} }}',
               inputs={"x": (2, 3, 4, 5)})
    x = rng(4).standard_normal((2, 3, 4, 5)).astype(f32)
    check_everywhere(load_from_text(text), {"x": x}, {"y": x + div}, tmp_path)


@pytest.mark.parametrize("text,message", [
    (net(conv_text("AttentionConvolution", "num_output: 2 kernel_size: 3 stride: 2 pad: 1"),
         inputs={"x": (1, 2, 6, 6), "a": (1, 18, 6, 6)}), "as many pixels"),
    (net(conv_text("AttentionConvolution", "num_output: 2 kernel_size: 3 pad: 1"),
         inputs={"x": (1, 2, 6, 6), "a": (1, 9, 6, 6)}), "attention bottom"),
    (net(conv_text("CrossConvolution", "num_output: 2 kernel_size: 3 pad: 1"),
         inputs={"x": (2, 2, 6, 6), "a": (1, 36)}), "filters bottom"),
    (net(dsc_text("num_output: 2 kernel_size: 3 dilation: 2"),
         inputs={"x": (1, 2, 6, 6), "across": (1, 144), "within": (1, 648)}), "dilation 2"),
    (net(dsc_text("kernel_size: 3 dilation: 1"),
         inputs={"x": (1, 2, 6, 6), "across": (1, 144), "within": (1, 648)}), "num_output must be >= 1"),
    # the res_att nets' in-place use on the 5-D across weights: the fork cuts the blob to its first four axes
    (net('layer { name: "b" type: "Python" bottom: "x" top: "x" python_param { module: "kernel_all_bias_layer" '
         'layer: "KernelBiasLayer" param_str: "\'div\': 256" } }', inputs={"x": (1, 3, 4, 2, 5)}), "needs a 4-D bottom"),
])
def test_bad_parameters(text, message):
    with pytest.raises(CaffeqError, match=message) as e:
        load_from_text(text)
    assert "\n" not in str(e.value)


def corpus(name):
    return str(CORPUS / f"StarStyleSky__caffe__models__kernel_attention_module_{name}__deploy.prototxt")


def test_starstyle_attention_deploy_runs():
    model = load(corpus(3), random_weights=True, batch=1)
    x = rng(5).standard_normal((1, 3, 224, 224)).astype(f32)
    prob = model.run({"data": x})["prob"]
    assert prob.shape == (1, 1000)
    assert np.isfinite(prob).all() and abs(float(prob.sum()) - 1) < 1e-4


@pytest.mark.parametrize("name,python", [(2, "provide_roi_layer"), (5, "provide_roi_layer")])
def test_starstyle_cross_deploys_read(name, python):
    """CrossConvolution reads; the nets' own Python layers (not published by the fork) stop the run clearly."""
    model = load(corpus(name), random_weights=True, batch=1, unknown_shapes_ok=True)
    types = {n.type for n in model.graph.nodes}
    assert "CrossConvolution" in types
    with pytest.raises(CaffeqError, match=python):
        model.run({"data": np.zeros((1, 3, 224, 224), f32)})
