"""Fork items 110: xiaolonw's ReshapeBlock, lzx1413's DeformConvolution, stupiding's thresholded Accuracy,
He-Zhenwei/MAF's RandomMaclaurin (numpy references written from the forks' C++)."""
import numpy as np
import pytest
import torch
from conftest import REPO, check_everywhere, inspect_corpus_file, net, rng

from caffeq.io.schema import caffe_pb2
from caffeq.layers import LayerError, registry
from caffeq.layers.registry import spec_for
from caffeq.model import load_from_text


def test_reshape_block(tmp_path):
    # C = pw * ph * C' = 3 * 2 * 2, H x W = 3 x 5: top (2, 2, 6, 15)
    x = rng(1).standard_normal((2, 12, 3, 5)).astype(np.float32)
    ref = np.zeros((2, 2, 6, 15), np.float32)
    for n in range(2):
        for h in range(3):
            for w in range(5):
                cnt = 0
                for nw in range(3):
                    for nh in range(2):
                        for nc in range(2):
                            ref[n, nc, h * 2 + nh, w * 3 + nw] = x[n, cnt, h, w]
                            cnt += 1
    m = load_from_text(net('layer { name: "r" type: "ReshapeBlock" bottom: "x" top: "r" reshape_block_param { '
                           'new_channel: 2 new_height: 6 new_width: 15 new_patch_width: 3 new_patch_height: 2 } }',
                           inputs={"x": (2, 12, 3, 5)}))
    check_everywhere(m, {"x": x}, {"r": ref}, tmp_path)


def test_reshape_block_refuses_mismatch():
    with pytest.raises(LayerError, match="new_height"):
        load_from_text(net('layer { name: "r" type: "ReshapeBlock" bottom: "x" top: "r" reshape_block_param { '
                           'new_channel: 2 new_height: 5 new_width: 15 new_patch_width: 3 new_patch_height: 2 } }',
                           inputs={"x": (2, 12, 3, 5)}))


def _bilinear_v1(img, y, x):
    h, w = img.shape
    if not (y >= 0 and x >= 0 and y < h and x < w):
        return 0.0
    y0, x0 = int(np.floor(y)), int(np.floor(x))
    if y0 >= h - 1:
        y0 = y1 = h - 1
        y = float(y0)
    else:
        y1 = y0 + 1
    if x0 >= w - 1:
        x0 = x1 = w - 1
        x = float(x0)
    else:
        x1 = x0 + 1
    ly, lx = y - y0, x - x0
    return ((1 - ly) * (1 - lx) * img[y0, x0] + (1 - ly) * lx * img[y0, x1] + ly * (1 - lx) * img[y1, x0]
            + ly * lx * img[y1, x1])


def _deform_ref(x, off, wgt, bias, stride, pad, dg, group):
    n, c, h, w = x.shape
    cout, cin, kh, kw = wgt.shape
    ho = (h + 2 * pad[0] - kh) // stride[0] + 1
    wo = (w + 2 * pad[1] - kw) // stride[1] + 1
    offf = off.reshape(n, -1)
    col = np.zeros((n, c * kh * kw, ho * wo), np.float64)
    for b in range(n):
        for ci in range(c):
            g = ci // (c // dg)
            for i in range(kh):
                for j in range(kw):
                    for oy in range(ho):
                        for ox in range(wo):
                            base = g * 2 * kh * kw * ho * wo
                            dy = offf[b, base + (2 * (i * kw + j)) * ho * wo + oy * wo + ox]
                            dx = offf[b, base + (2 * (i * kw + j) + 1) * ho * wo + oy * wo + ox]
                            yy = oy * stride[0] - pad[0] + i + dy
                            xx = ox * stride[1] - pad[1] + j + dx
                            col[b, (ci * kh + i) * kw + j, oy * wo + ox] = _bilinear_v1(x[b, ci], yy, xx)
    out = np.zeros((n, cout, ho * wo))
    for b in range(n):
        for g in range(group):
            wg = wgt[g * cout // group:(g + 1) * cout // group].reshape(cout // group, -1)
            out[b, g * cout // group:(g + 1) * cout // group] = wg @ col[b, g * cin * kh * kw:(g + 1) * cin * kh * kw]
    return (out.reshape(n, cout, ho, wo) + bias.reshape(1, -1, 1, 1)).astype(np.float32)


def _deform_net(kernel, stride, pad, dg, off_c, group=1):
    return net(f'layer {{ name: "d" type: "DeformConvolution" bottom: "x" bottom: "o" top: "d" convolution_param {{ '
               f'num_output: 4 kernel_size: {kernel} stride: {stride} pad: {pad} deform_group: {dg} group: {group} }} }}',
               inputs={"x": (2, 4, 5, 7), "o": (2, off_c, 5, 7)})


def test_deform_convolution(tmp_path):
    r = rng(2)
    x = r.standard_normal((2, 4, 5, 7)).astype(np.float32)
    off = (r.standard_normal((2, 36, 5, 7)) * 1.5).astype(np.float32)
    m = load_from_text(_deform_net(3, 1, 1, 2, 36, group=2), random_weights=True)
    wgt, bias = (np.asarray(p, np.float64) for p in m.params["d"])
    ref = _deform_ref(x.astype(np.float64), off.astype(np.float64), wgt, bias, (1, 1), (1, 1), 2, 2)
    check_everywhere(m, {"x": x, "o": off}, {"d": ref}, tmp_path, atol=2e-5, rtol=1e-5)


def test_deform_convolution_1x1_reads_no_offsets(tmp_path):
    x = rng(3).standard_normal((2, 4, 5, 7)).astype(np.float32)
    off = rng(4).standard_normal((2, 3, 5, 7)).astype(np.float32)
    m = load_from_text(_deform_net(1, 1, 0, 4, 3), random_weights=True)
    wgt, bias = (np.asarray(p) for p in m.params["d"])
    ref = np.einsum("oc,nchw->nohw", wgt[:, :, 0, 0], x) + bias.reshape(1, -1, 1, 1)
    check_everywhere(m, {"x": x, "o": off}, {"d": ref}, tmp_path, atol=1e-5, rtol=1e-5)


def test_deform_convolution_refuses_short_offsets():
    # the corpus lenet's case: 18 offset channels for deform_group 4
    m = load_from_text(_deform_net(3, 1, 1, 4, 18), random_weights=True)
    with pytest.raises(Exception, match="past the"):
        m.run({"x": np.zeros((2, 4, 5, 7), np.float32), "o": np.zeros((2, 18, 5, 7), np.float32)})


def _acc_layer(thred, bottoms, tops=1):
    from google.protobuf import text_format
    lp = caffe_pb2.LayerParameter()
    text = f'name: "a" type: "Accuracy" {"".join(f"bottom: {b!r} " for b in bottoms)}top: "a" ' + \
        ('top: "pc" ' if tops == 2 else "") + \
        f'accuracy_param {{ {" ".join(f"thred: {t}" for t in thred)} }}'
    text_format.Parse(text.replace("'", '"'), lp)
    return lp


def test_thresholded_accuracy():
    r = rng(5)
    s = r.standard_normal((7, 1)).astype(np.float32)
    lab = r.integers(0, 2, (7, 1)).astype(np.float32)
    g1, g2 = r.random((7, 1)).astype(np.float32), r.random((7, 1)).astype(np.float32)
    lp = _acc_layer([0.3, 0.5], ["s", "l", "g1", "g2"], tops=2)
    spec = spec_for(lp)
    attrs = spec.parse(lp)
    spec.infer(attrs, [s.shape, lab.shape, g1.shape, g2.shape])
    acc, pc = spec.forward(attrs, [], *(torch.from_numpy(v) for v in (s, lab, g1, g2)))
    right = cnt = 0
    for i in range(7):
        if g1[i, 0] >= np.float32(0.3) and g2[i, 0] >= np.float32(0.5):
            right += (lab[i, 0] == 1 and s[i, 0] > 0) or (lab[i, 0] == 0 and s[i, 0] <= 0)
            cnt += 1
    assert cnt > 0 and float(acc) == np.float32(right) / np.float32(cnt)
    assert pc.tolist() == [0.0]


def test_thresholded_accuracy_refusals():
    lp = _acc_layer([0.3], ["s", "l"])
    with pytest.raises(LayerError, match="bottom"):
        spec_for(lp).parse(lp)
    lp = _acc_layer([0.3], ["s", "l", "g"])
    spec = spec_for(lp)
    attrs = spec.parse(lp)
    assert spec.cannot_run(attrs, [(7, 3), (7,), (7, 3)]) is not None
    # no thred: BVLC's Accuracy, untouched
    assert type(spec_for(_acc_layer([], ["s", "l"]))).__name__ == "Accuracy"


def _maclaurin_net(kind, extra=""):
    return net(f'layer {{ name: "m" type: "RandomMaclaurin" bottom: "a" bottom: "b" top: "m" random_maclaurin_param '
               f'{{ num_output: 5 distribution_type: "{kind}" {extra} }} }}', inputs={"a": (2, 3), "b": (2, 4, 1, 1)})


@pytest.mark.parametrize("kind, extra, factor", [
    ("bernoulli", "", np.float32(5)),
    ("gaussian", "std1: 0.7 std2: 1.3", np.float32(np.float32(5) * np.float32(0.7)) * np.float32(1.3)),
    ("uniform", "b1: 0.6 b2: 1.1", np.float32(np.float32(5) * np.float32(0.6)) * np.float32(1.1) / np.float32(3)),
])
def test_random_maclaurin(tmp_path, kind, extra, factor):
    r = rng(6)
    a = r.standard_normal((2, 3)).astype(np.float32)
    b = r.standard_normal((2, 4, 1, 1)).astype(np.float32)
    m = load_from_text(_maclaurin_net(kind, extra), random_weights=True)
    w1, w2 = (np.asarray(p) for p in m.params["m"])
    assert w1.shape == (3, 5) and w2.shape == (4, 5)
    ref = (a @ w1) * (b.reshape(2, 4) @ w2) * np.float32(1.0 / float(factor))
    check_everywhere(m, {"a": a, "b": b}, {"m": ref}, tmp_path, atol=1e-6, rtol=1e-6)


def test_random_maclaurin_refusals():
    with pytest.raises(LayerError, match="distribution_type"):
        load_from_text(_maclaurin_net("laplace"))
    with pytest.raises(LayerError, match="shape"):
        load_from_text(net('layer { name: "m" type: "RandomMaclaurin" bottom: "a" bottom: "b" top: "m" '
                           'random_maclaurin_param { num_output: 5 } }', inputs={"a": (2, 3, 2), "b": (2, 4)}))


CORPUS = REPO / "tests" / "fixtures" / "realworld"
# xiaolonw/caffe-3dnormal's LICENSE is CMU's non-commercial licence, so its file stays out of tests/fixtures
CMU_NON_COMMERCIAL = pytest.mark.skip(reason="not shipped: licence (xiaolonw/caffe-3dnormal is non-commercial)")


@pytest.mark.parametrize("name, args, row", [
    pytest.param("xiaolonw__caffe-3dnormal__3dscript__fusion_test__seg_test_2fc_3dnormal_fusion.prototxt", (),
                 "reshape_3d  ReshapeBlock  fc8_3dnorm -> reshape_3d  300x40x13x13", marks=CMU_NON_COMMERCIAL),
    ("lzx1413__caffe__examples__mnist__lenet_train_test.prototxt",
     ("--input-shape", "data=2,1,28,28", "--input-shape", "label=2"), "2x128x30x30"),
    ("stupiding__face-detection__face_detection_models__24in_models__24in_12in_16c5s2p0_32c5s2p0_"
     "128c3s1p0_1c1s1p0__model.prototxt", ("--input-shape", "data=2,3,24,24", "--input-shape", "info=2,5"),
     "accuracy_2  Accuracy"),
    ("stupiding__face-detection__face_detection_models__48in_models__model.prototxt",
     ("--input-shape", "data=2,3,48,48", "--input-shape", "info=2,5"),
     "loss_cls_3  SigmoidCrossEntropyLoss  conv6_3,is_face,pred_1,pred_2 -> loss_cls_3"),
    ("He-Zhenwei__MAF__caffe-fast-rcnn__python__train_rcdan_alex.prototxt", (), "RandomMaclaurin"),
])
def test_corpus_files_read(name, args, row):
    out = inspect_corpus_file(CORPUS / name, *args)
    assert row in out, out


@pytest.mark.parametrize("kernel, stride, pad, dg, off_c", [
    (3, 1, 1, None, 36),   # deform_group unset: 1; twice the offsets the kernel reads (Ho x Wo = H x W)
    (3, 2, 1, 2, 40),      # deform_group 2 with group 1; offsets of any shape, read from each image's start
])
def test_deform_convolution_reads_offsets_from_image_start(tmp_path, kernel, stride, pad, dg, off_c):
    r = rng(7)
    x = r.standard_normal((2, 4, 5, 7)).astype(np.float32)
    off = (r.standard_normal((2, off_c, 5, 7)) * 1.5).astype(np.float32)
    text = _deform_net(kernel, stride, pad, dg, off_c)
    if dg is None:
        text = text.replace(" deform_group: None", "")
    m = load_from_text(text, random_weights=True)
    wgt, bias = (np.asarray(p, np.float64) for p in m.params["d"])
    ref = _deform_ref(x.astype(np.float64), off.astype(np.float64), wgt, bias, (stride, stride), (pad, pad),
                      dg or 1, 1)
    assert any("DeformConvolution computed as MSRA's v1 kernel intends" in w for w in m.warnings)
    check_everywhere(m, {"x": x, "o": off}, {"d": ref}, tmp_path, atol=2e-5, rtol=1e-5)


def _run_acc(thred, s, lab, *gates):
    lp = _acc_layer(thred, ["s", "l"] + [f"g{i}" for i in range(len(gates))])
    spec = spec_for(lp)
    assert type(spec).__name__ == "ThresholdedAccuracy"
    attrs = spec.parse(lp)
    arrays = [np.asarray(v, np.float32).reshape(-1, 1) for v in (s, lab, *gates)]
    spec.infer(attrs, [a.shape for a in arrays])
    return float(spec.forward(attrs, [], *(torch.from_numpy(a) for a in arrays)))


def test_thresholded_accuracy_edges():
    # a gate equal to its thred counts (the fork skips g < thred); a score of 0 is right for label 0 only
    assert _run_acc([0.5], [0.0, 0.0, 2.0], [0, 1, 1], [0.5, 0.5, 0.25]) == np.float32(0.5)
    # a NaN gate passes (NaN < thred is false)
    assert _run_acc([0.5, 0.5], [1.0, -1.0], [1, 1], [np.nan, 0.0], [0.7, 0.7]) == 1.0
    # nothing counted: 0 / 0
    assert np.isnan(_run_acc([0.9], [1.0, -1.0], [1, 0], [0.1, 0.2]))
    with pytest.raises(LayerError, match="labels 0 or 1"):
        _run_acc([0.1], [1.0, -1.0], [2, 0], [0.5, 0.5])


def test_thresholded_accuracy_claims_before_other_forks():
    # three bottoms and one top: xiaolonw's UnwrittenAccuracy without thred, stupiding's with it
    assert type(spec_for(_acc_layer([0.1], ["s", "l", "g"]))).__name__ == "ThresholdedAccuracy"
    assert type(spec_for(_acc_layer([], ["s", "l", "g"]))).__name__ == "UnwrittenAccuracy"
    assert sum(type(e[2]).__name__ == "ThresholdedAccuracy" for e in registry._CLAIMS) == 1


def test_random_maclaurin_zero_factor_and_redraw_note():
    with pytest.raises(LayerError, match="normalize factor of 0"):
        load_from_text(_maclaurin_net("gaussian", "std1: 0"))
    note = "RandomMaclaurin with epoch_size 0"
    assert any(note in w for w in load_from_text(_maclaurin_net("bernoulli")).warnings)
    assert not any(note in w for w in load_from_text(_maclaurin_net("bernoulli", "epoch_size: 10")).warnings)


def test_reshape_block_refuses_zero_field():
    with pytest.raises(LayerError, match=">= 1"):
        load_from_text(net('layer { name: "r" type: "ReshapeBlock" bottom: "x" top: "r" reshape_block_param { '
                           'new_channel: 2 new_height: 6 new_width: 15 new_patch_width: 3 } }',
                           inputs={"x": (2, 12, 3, 5)}))


def test_gated_sigmoid_cross_entropy_loss():
    from google.protobuf import text_format
    r = rng(8)
    x = r.standard_normal((6, 1)).astype(np.float32) * 3
    t = r.integers(0, 2, (6, 1)).astype(np.float32)
    g1 = np.array([[0.5], [0.05], [0.1], [0.7], [np.nan], [0.3]], np.float32)
    g2 = np.array([[0.9], [0.9], [0.2], [0.1], [0.9], [0.9]], np.float32)
    lp = caffe_pb2.LayerParameter()
    text_format.Parse('name: "l" type: "SigmoidCrossEntropyLoss" bottom: "x" bottom: "t" bottom: "g1" bottom: "g2" '
                      'top: "l" loss_param { thred: 0.1 thred: 0.2 }', lp)
    spec = spec_for(lp)
    assert type(spec).__name__ == "GatedSigmoidCrossEntropyLoss"
    attrs = spec.parse(lp)
    assert spec.infer(attrs, [x.shape, t.shape, g1.shape, g2.shape]) == [()]
    loss = float(spec.forward(attrs, [], *(torch.from_numpy(v) for v in (x, t, g1, g2))))
    xs, ts = x.astype(np.float64).ravel(), t.astype(np.float64).ravel()
    per = np.maximum(xs, 0) - xs * ts + np.log1p(np.exp(-np.abs(xs)))
    counted = [0, 2, 4, 5]          # g1 < 0.1 drops 1, g2 < 0.2 drops 3; the NaN gate passes
    np.testing.assert_allclose(loss, per[counted].sum() / 4, rtol=1e-6)
    none = float(spec.forward(attrs, [], *(torch.from_numpy(v) for v in (x, t, np.zeros_like(g1), g2))))
    assert np.isnan(none)
    lp.ClearField("bottom")
    lp.bottom.extend(["x", "t", "g1"])
    with pytest.raises(LayerError, match="gate bottoms"):
        spec.parse(lp)


def test_deform_convolution_refuses_another_batch():
    text = net('layer { name: "d" type: "DeformConvolution" bottom: "x" bottom: "o" top: "d" convolution_param { '
               'num_output: 4 kernel_size: 3 pad: 1 } }', inputs={"x": (2, 4, 5, 7), "o": (1, 36, 5, 7)})
    m = load_from_text(text, random_weights=True)
    with pytest.raises(Exception, match="batch"):
        m.run({"x": np.zeros((2, 4, 5, 7), np.float32), "o": np.zeros((1, 36, 5, 7), np.float32)})
