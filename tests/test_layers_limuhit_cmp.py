"""limuhit's image-compression layers (caffeq/layers/limuhit_cmp.py) against loops written here from the forks'
kernels (TrimmedConvolution / CCN cudnn_conv_layer.cu, multobin_layer.cu, mtranspose_layer.cu; round_layer.cu,
imp_map_layer.cu, entropy_pack_layer.cu), in torch, onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import REPO, assert_close, check_everywhere, net, rng
from conftest import conv_ref as grouped_conv_ref

import caffeq
from caffeq.io.caffemodel import BlobData
from caffeq.io.prototxt import parse_prototxt_text
from caffeq.io.writer import write_caffemodel
from caffeq.layers import LayerError
from caffeq.model import load_from_text
from caffeq.quant import get_quantizer
from caffeq.transforms import fold_batchnorm

F32 = np.float32
CORPUS = REPO / "tests" / "fixtures" / "realworld"


def trimmed_mask_ref(shape, constrain, gi, go):
    """The fork's per-index kernels: 0 where the weight is zeroed."""
    n, ch, kh, kw = shape
    sz, h = kw, kw // 2
    mask = np.ones(n * ch * kh * kw, F32)
    for i in range(mask.size):
        tw, th = i % sz, (i // sz) % sz
        tc, tn = (i // sz // sz) % ch // gi, i // sz // sz // ch // go
        if constrain in (1, 2):
            if tn > tc:
                continue
            if tn == tc and (th < h or (th == h and (tw < h if constrain == 1 else tw <= h))):
                continue
            mask[i] = 0
        elif constrain == 3:
            if tn > tc:
                mask[i] = 0 if not (th <= h and tw <= h) else 1
            elif tn == tc:
                mask[i] = 1 if (th < h and tw <= h) or (th == h and tw < h) else 0
            else:
                mask[i] = 0
        elif constrain == 4:
            mask[i] = 1 if tn >= tc and th <= h and tw <= h else 0
        elif constrain in (5, 15, 16):
            d = tw + th + tc - (tn + sz - 1)
            if constrain == 5:
                mask[i] = 0 if d >= 0 else 1
                continue
            tcg = (i // sz // sz) % ch % gi // (gi // 4)
            tng = (i // sz // sz // ch) % go // (go // 4)
            if d > 0:
                mask[i] = 0
            elif d == 0:
                if constrain == 15:
                    if tng == 0 or (tng in (1, 2) and tcg >= 1) or (tng >= 3 and tcg == 3):
                        mask[i] = 0
                elif (tng == 0 and tcg > 0) or (tng in (1, 2) and tcg > 2):
                    mask[i] = 0
        elif constrain == 6:
            mask[i] = 0 if d_of(tw, th, tc, tn, sz) > 0 else 1
        elif constrain in (9, 10):
            mask[i] = 0 if (tw + th >= sz - 1 if constrain == 9 else tw + th > sz - 1) else 1
        elif constrain in (13, 14):
            mask[i] = 0 if (th + tc >= tn + h if constrain == 13 else th + tc > tn + h) else 1
        elif constrain == 17:
            mask[i] = 0 if tn <= tc else 1
    return mask.reshape(shape)


def d_of(tw, th, tc, tn, sz):
    return tw + th + tc - (tn + sz - 1)


def conv_ref(x, w, b, pad):
    n, c, hh, ww = x.shape
    o, _, kh, kw = w.shape
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    ho, wo = hh + 2 * pad - kh + 1, ww + 2 * pad - kw + 1
    y = np.zeros((n, o, ho, wo))
    for i in range(kh):
        for j in range(kw):
            y += np.einsum("nchw,oc->nohw", xp[:, :, i:i + ho, j:j + wo], w[:, :, i, j].astype(np.float64))
    return (y + b.reshape(1, -1, 1, 1)).astype(F32)


@pytest.mark.parametrize("constrain, cin, cout, k, gi, go", [
    (1, 3, 12, 5, 1, 4), (2, 8, 8, 3, 2, 2), (2, 8, 4, 3, 4, 1), (3, 6, 6, 3, 2, 2), (4, 4, 8, 3, 1, 2),
    (5, 4, 8, 3, 1, 2), (6, 6, 6, 5, 2, 2), (9, 2, 3, 3, 1, 1), (10, 2, 3, 3, 1, 1), (13, 4, 4, 3, 1, 1),
    (14, 4, 4, 3, 1, 1), (15, 8, 8, 3, 4, 4), (16, 8, 8, 3, 4, 4), (17, 4, 4, 3, 2, 2)])
def test_trimmed_convolution_masks_the_weight(constrain, cin, cout, k, gi, go, tmp_path):
    r = rng(constrain)
    shape = (2, cin, 7, 10)
    x = r.standard_normal(shape).astype(F32)
    pad = k // 2
    model = load_from_text(net(f'layer {{ name: "c" type: "Convolution" bottom: "x" top: "y" convolution_param {{ '
                               f'num_output: {cout} kernel_size: {k} pad: {pad} constrain: {constrain} group_in: {gi} '
                               f'group_out: {go} }} }}', inputs={"x": shape}), random_weights=True)
    node = next(n for n in model.layers if n.name == "c")
    w, b = (np.asarray(a) for a in node.blobs)
    mask = trimmed_mask_ref(w.shape, constrain, gi, go)
    assert 0 < mask.sum() < mask.size
    assert np.array_equal(w != 0, mask > 0)   # the random weight zeroed where the fork's blob is
    w = r.standard_normal(w.shape).astype(F32)   # every tap nonzero: the forward's own mask
    node.blobs[0] = w
    check_everywhere(model, {"x": x}, {"y": conv_ref(x, w * mask, b, pad)}, tmp_path, atol=2e-5, rtol=2e-5)


def test_trimmed_convolution_grouped_and_rectangular(tmp_path):
    """cuDNN's grouped blob (O, C / group, kh, kw): the mask runs over its flat index with sz = kernel_w (the
    fork reads the kernel as square), channels = C / group."""
    shape = (2, 4, 9, 8)
    x = rng(12).standard_normal(shape).astype(F32)
    model = load_from_text(net('layer { name: "c" type: "Convolution" bottom: "x" top: "y" convolution_param { '
                               'num_output: 6 kernel_h: 3 kernel_w: 5 pad_h: 1 pad_w: 2 group: 2 constrain: 6 '
                               'group_in: 1 group_out: 2 } }', inputs={"x": shape}), random_weights=True)
    w, b = (np.asarray(a) for a in next(n for n in model.layers if n.name == "c").blobs)
    mask = trimmed_mask_ref(w.shape, 6, 1, 2)
    assert 0 < mask.sum() < mask.size and np.all(w[mask == 0] == 0)   # random weights as the fork's blob
    ref = grouped_conv_ref(x, w * mask, b, (1, 1), (1, 2), group=2).astype(F32)
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=2e-5, rtol=2e-5)
    node = next(n for n in model.layers if n.name == "c")
    node.blobs[0] = rng(13).standard_normal(w.shape).astype(F32)   # weights set after loading: masked in forward
    model.clear_cache()
    ref = grouped_conv_ref(x, node.blobs[0] * mask, b, (1, 1), (1, 2), group=2).astype(F32)
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=2e-5, rtol=2e-5)


def conv_bn_text(shape, conv):
    return net(f'layer {{ name: "c" type: "Convolution" bottom: "x" top: "c" convolution_param {{ {conv} }} }}',
               'layer { name: "bn" type: "BatchNorm" bottom: "c" top: "c" batch_norm_param { use_global_stats: true } }',
               'layer { name: "sc" type: "Scale" bottom: "c" top: "c" scale_param { bias_term: true } }',
               inputs={"x": shape})


@pytest.mark.parametrize("target", ["fp32", "int8", "binary"])
def test_trimmed_convolution_with_batchnorm_folded_and_quantized(target, tmp_path):
    """The fork zeroes the trimmed taps of its weight blob before each forward: a caffemodel's values there
    (here large ones and a NaN) never reach the output, nor the quantizers' per-channel scales, nor BatchNorm
    folding; the default (folded, packed) path, the layer-by-layer one, ONNX and model.py all agree."""
    r = rng(11)
    shape = (2, 4, 7, 10)
    x = r.standard_normal(shape).astype(F32)
    text = conv_bn_text(shape, "num_output: 6 kernel_size: 3 pad: 1 constrain: 2 group_in: 2 group_out: 2")
    w = (r.standard_normal((6, 4, 3, 3)) * 0.3).astype(F32)
    mask = trimmed_mask_ref(w.shape, 2, 2, 2)
    wm = w * mask
    w[mask == 0] = 40.0
    w[0, 3, 2, 2] = np.nan
    b = r.standard_normal(6).astype(F32)
    mean, var = r.standard_normal(6).astype(F32), r.uniform(0.5, 2, 6).astype(F32)
    gamma, beta = r.uniform(0.5, 2, 6).astype(F32), r.standard_normal(6).astype(F32)
    proto, weights = tmp_path / "n.prototxt", tmp_path / "n.caffemodel"
    proto.write_text(text)
    write_caffemodel(parse_prototxt_text(text), {"c": [BlobData(w), BlobData(b)],
                                                 "bn": [BlobData(mean * 2), BlobData(var * 2), BlobData(np.array([2], F32))],
                                                 "sc": [BlobData(gamma), BlobData(beta)]}, str(weights))
    model = caffeq.load(str(proto), str(weights))
    # Caffe's BatchNorm (stored sums / factor, eps 1e-5) and Scale, in float64
    a = gamma.astype(np.float64) / np.sqrt(var.astype(np.float64) + 1e-5)
    c = beta - mean.astype(np.float64) * a

    def quantized(weight):
        if target == "fp32":
            return weight
        return get_quantizer(target).quantize(weight, 0, 1).dequantize() * mask

    feeds = {"x": x}
    ref = conv_ref(x, quantized(wm), b, 1) * a.reshape(1, -1, 1, 1) + c.reshape(1, -1, 1, 1)
    q = model if target == "fp32" else caffeq.quantize(model, target, keep="none")
    assert_close(q.run(feeds, exact=True)["c"], ref, 2e-5, 2e-5, "layer by layer")
    check_everywhere(q, feeds, {"c": ref}, tmp_path, atol=2e-5, rtol=2e-5)   # run(): the default, folded path
    # BatchNorm + Scale folded into the convolution before quantizing
    wf = (wm.astype(np.float64) * a.reshape(-1, 1, 1, 1)).astype(F32)
    ref = conv_ref(x, quantized(wf), (b * a + c).astype(F32), 1)
    folded = fold_batchnorm(model)
    assert [n.type for n in folded.layers if n.type != "Input"] == ["Convolution"]
    fq = folded if target == "fp32" else caffeq.quantize(folded, target, keep="none")
    check_everywhere(fq, feeds, {"c": ref}, tmp_path, atol=2e-5, rtol=2e-5)


def test_trimmed_convolution_refusals():
    text = 'layer {{ name: "c" type: "Convolution" bottom: "x" top: "y" convolution_param {{ num_output: 4 ' \
           'kernel_size: 3 {} }} }}'
    with pytest.raises(LayerError, match="constrain 7 is not supported"):
        load_from_text(net(text.format("constrain: 7"), inputs={"x": (1, 2, 5, 5)}))
    with pytest.raises(LayerError, match="group_in must be >= 1"):
        load_from_text(net(text.format("constrain: 1 group_in: 0"), inputs={"x": (1, 2, 5, 5)}))
    with pytest.raises(LayerError, match="constrain 9 with dilation"):   # layer_factory.cpp: CAFFE's engine then
        load_from_text(net(text.format("constrain: 9 dilation: 2"), inputs={"x": (1, 2, 7, 7)}))
    with pytest.raises(LayerError, match="constrain 10 with engine CAFFE"):
        load_from_text(net(text.format("constrain: 10 engine: CAFFE"), inputs={"x": (1, 2, 7, 7)}))
    load_from_text(net(text.format("constrain: 6 dilation: 2"), inputs={"x": (1, 2, 7, 7)}))   # CAFFE's GPU applies 1-7


def round_multi_ref(x, groups):
    step = F32(1.0 / groups)
    table = [step * F32(i) + step for i in range(groups)] + [F32(1)]
    t = np.where(x < 0, F32(0), np.where(x > 1, F32(1), x)).astype(F32)
    return np.array(table, F32)[(t * F32(groups)).astype(np.int64)]


def test_round_methods(tmp_path):
    x = rng(5).uniform(-0.5, 1.5, (2, 3, 5, 7)).astype(F32)
    x[0, 0, 0, :4] = [0.5, 0.0, 1.0, 0.25]
    layers = [f'layer {{ name: "{t}" type: "Round" bottom: "x" top: "{t}" round_param {{ {p} }} }}'
              for t, p in (("r01", "scale: 0.01"), ("rpm", "method: ONE_MINUS_ONE"), ("rm", "method: MULTI groups: 4"))]
    model = load_from_text(net(*layers, inputs={"x": x.shape}), random_weights=True, outputs=["r01", "rpm", "rm"])
    refs = {"r01": (x > F32(0.5)).astype(F32), "rpm": np.where(x > 0, F32(1), F32(-1)),
            "rm": round_multi_ref(x, 4)}
    check_everywhere(model, {"x": x}, refs, tmp_path)


def imp_map_ref(x, groups, channel_out, lquantize):
    n, _, h, w = x.shape
    cpg = channel_out // groups
    table = [i * cpg + (0 if lquantize else cpg) for i in range(groups)] + [channel_out]
    out = np.zeros((n, channel_out, h, w), F32)
    for idx in np.ndindex(n, h, w):
        k = int(np.float64(x[idx[0], 0, idx[1], idx[2]] * F32(groups)) + 0.00001)
        out[idx[0], :table[k], idx[1], idx[2]] = 1
    return out


@pytest.mark.parametrize("lquantize", ["true", "false"])
def test_imp_map(lquantize, tmp_path):
    x = rng(6).uniform(0, 1, (2, 1, 5, 7)).astype(F32)
    x[0, 0, 0, :5] = [0.0, 1.0, 0.25, 0.5, F32(0.75) - F32(1e-6)]
    model = load_from_text(net(f'layer {{ name: "m" type: "ImpMap" bottom: "x" top: "m" imp_map_param {{ method: GLOBAL '
                               f'lquantize: {lquantize} groups: 4 channel_out: 12 cmp_ratio: 0.2 }} }}',
                               inputs={"x": x.shape}), random_weights=True)
    check_everywhere(model, {"x": x}, {"m": imp_map_ref(x, 4, 12, lquantize == "true")}, tmp_path)
    with pytest.raises(LayerError, match="multiple of groups"):
        load_from_text(net('layer { name: "m" type: "ImpMap" bottom: "x" top: "m" imp_map_param { groups: 5 '
                           'channel_out: 12 } }', inputs={"x": x.shape}))


def test_imp_map_param_numbers():
    """limuhit/Caffe_Gan's and CCN's ImpMethod: GLOBAL 0, LOCAL 1 (the default); CCN adds alpha = 9."""
    from caffeq.io.schema import caffe_pb2
    p = caffe_pb2.ImpMapParameter()
    assert p.method == p.LOCAL == 1 and p.GLOBAL == 0
    p.ParseFromString(bytes([8, 0, 77]) + np.array([0.01], "<f4").tobytes())   # method (1): 0, alpha (9)
    assert p.method == p.GLOBAL and abs(p.alpha - 0.01) < 1e-9


def entropy_pack_ref(x, imp, start, samples, ks, depth):
    _, c, h, w = x.shape
    half = ks // 2
    rows = samples * c * h * w
    top = np.zeros(rows * depth * ks * ks, F32)
    xs = x[start:start + samples].reshape(-1)
    ms = imp[start:start + samples].reshape(-1) if imp is not None else None
    for index in range(top.size):
        tw, th = index % ks, (index // ks) % ks
        tc, tn = (index // ks // ks) % depth, index // ks // ks // depth
        if ms is not None and ms[tn] < 0.5:
            continue
        if tc == depth - 1 and ((tw >= half and th == half) or th > half):
            continue
        bw, bh, bc, bn = tn % w, (tn // w) % h, (tn // w // h) % c, tn // w // h // c
        pw, ph, pc = bw + tw - half, bh + th - half, bc + tc - depth + 1
        if pw < 0 or pw >= w or ph < 0 or ph >= h or pc < 0:
            continue
        idx = ((bn * c + pc) * h + ph) * w + pw
        if ms is None or ms[idx] > 0:
            top[index] = xs[idx] + F32(1)
    label = xs + (ms if ms is not None else F32(1))
    return top.reshape(rows, depth, ks, ks), label.reshape(rows, 1, 1, 1).astype(F32)


@pytest.mark.parametrize("with_mask, ks, start", [(True, 5, 2), (False, 4, 0)])
def test_entropy_pack(with_mask, ks, start, tmp_path):
    r = rng(7)
    shape = (4, 3, 5, 6)
    x = r.integers(0, 2, shape).astype(F32)
    m = (r.uniform(0, 1, shape) > 0.4).astype(F32)
    bottoms = ' bottom: "x" bottom: "m"' if with_mask else ' bottom: "x"'
    text = net(f'layer {{ name: "p" type: "EntropyPack"{bottoms} top: "cube" top: "label" entropy_pack_param {{ '
               f'kernel: {ks} channels: 2 samples: 2 }} }}', inputs={"x": shape, "m": shape})
    model = load_from_text(text, random_weights=True)
    next(n for n in model.layers if n.name == "p").blobs[0][...] = start
    cube, label = entropy_pack_ref(x, m if with_mask else None, start, 2, ks, 2)
    check_everywhere(model, {"x": x, "m": m}, {"cube": cube, "label": label}, tmp_path)


def mul_to_bin_ref(x, levels, nmod, inverse, imp):
    n, c, h, w = x.shape
    mod = 1 << nmod
    top = np.zeros((n, c * levels, h, w), F32)
    for i in np.ndindex(n, c, h, w):
        data = int(np.trunc(x[i])) & 0xFFFFFFFF
        flag = 1
        if imp:
            flag = 1 if data > 0 else 0
            data -= flag
        for j in range(levels):
            ch = i[1] * levels + (levels - 1 - j if inverse else j)
            digit = data % mod
            top[i[0], ch, i[2], i[3]] = digit * flag + flag if imp else digit
            data >>= nmod
    return top


@pytest.mark.parametrize("levels, nmod, inverse, imp", [(8, 1, False, False), (3, 2, True, False),
                                                        (4, 1, False, True), (2, 20, True, False),
                                                        (3, 16, False, False)])
def test_mul_to_bin(levels, nmod, inverse, imp, tmp_path):
    x = rng(8).uniform(-300, 300, (2, 2, 3, 5)).astype(F32)
    x[0, 0, 0, :3] = [0.0, -1.0, 255.9]
    model = load_from_text(net(f'layer {{ name: "b" type: "MulToBin" bottom: "x" top: "b" multobin_param {{ '
                               f'levels: {levels} mod: {nmod} inverse: {str(inverse).lower()} imp: {str(imp).lower()} '
                               f'}} }}', inputs={"x": x.shape}))
    check_everywhere(model, {"x": x}, {"b": mul_to_bin_ref(x, levels, nmod, inverse, imp)}, tmp_path)


def mtranspose_ref(x, groups):
    n, c, h, w = x.shape
    s = h * w
    top = np.zeros(x.size, F32)
    flat = x.reshape(-1)
    for i in range(x.size):
        pn, pc, ps = i // s // c, (i // s) % c, i % s
        top[(pn * s * c // groups + pc // groups * s + ps) * groups + pc % groups] = flat[i]
    return top.reshape(-1, groups)


def test_mtranspose_and_its_inverse(tmp_path):
    x = rng(9).standard_normal((2, 6, 3, 5)).astype(F32)
    text = net('layer { name: "t" type: "MTranspose" bottom: "x" top: "t" mtranspose_param { groups: 3 } }',
               'layer { name: "i" type: "MTranspose" bottom: "t" top: "i" mtranspose_param { groups: 3 inverse: true '
               'channel: 6 height: 3 width: 5 } }', inputs={"x": x.shape})
    model = load_from_text(text, outputs=["t", "i"])
    check_everywhere(model, {"x": x}, {"t": mtranspose_ref(x, 3), "i": x}, tmp_path)
    with pytest.raises(LayerError, match="multiple of mtranspose_param.groups"):
        load_from_text(net('layer { name: "t" type: "MTranspose" bottom: "x" top: "t" mtranspose_param { groups: 4 } }',
                           inputs={"x": x.shape}))


@pytest.mark.parametrize("name, shape", [
    ("limuhit__ImageCompression__model__cmp__compress_v1_deploy.prototxt", None),
    ("limuhit__ImageCompression__model__entropy__extract_entropy_package.prototxt", None),
    ("limuhit__TrimmedConvolution__experiment2__lossless_cmp_v1_deploy.prototxt", None),
    ("limuhit__TrimmedConvolution__ccmp_entropy_v3.prototxt", (1, 1, 16, 24)),
    ("limuhit__TrimmedConvolution__experiment1__cmp_test_imp.prototxt", (2, 1, 8, 12)),
    ("limuhit__TrimmedConvolution__experiment1__extract_binary_data__compress_v1_extract_data.prototxt", (1, 3, 64, 96)),
    ("limuhit__ImageCompression__model__cmp__compress_v1.prototxt", (1, 3, 64, 96))])
def test_corpus_files_read(name, shape):
    path = CORPUS / name
    from caffeq.model import load
    model = load(str(path), input_shapes={"data": shape} if shape else None, random_weights=True)
    assert model.layers
