"""dedoogong/caffe-keypoint-rcnn 3527a81: PoolingCrop, RoIAlign, GenerateProposal, BBoxTransform against
numpy references written from the fork's C++ (caffeq/layers/keypoint_rcnn.py)."""
import numpy as np
import pytest
from conftest import assert_close, check_everywhere, model_py_outputs, net, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

F = np.float32


def test_pooling_crop(tmp_path):
    x = rng(1).standard_normal((2, 3, 5, 8)).astype(F)
    m = load_from_text(net('layer { name: "o" type: "PoolingCrop" bottom: "x" top: "o" }', inputs={"x": x.shape}))
    check_everywhere(m, {"x": x}, {"o": x[:, :, :4, :7]}, tmp_path)


def roi_align_ref(x, rois, ph, pw, scale, g):
    n, c, h, w = x.shape
    out = np.zeros((len(rois), c, ph, pw), F)

    def axis(v, size):
        if v < -1.0 or v > size:
            return None
        v = max(v, F(0))
        lo = int(v)
        if lo >= size - 1:
            return lo if lo == size - 1 else size - 1, size - 1, F(0)
        return lo, lo + 1, F(v - lo)

    for r, roi in enumerate(rois.astype(F)):
        b = int(roi[0])
        sx, sy, ex, ey = (F(v) * F(scale) for v in roi[1:])
        rw, rh = max(F(ex - sx), F(1)), max(F(ey - sy), F(1))
        bh, bw = F(rh / F(ph)), F(rw / F(pw))
        for p in range(ph):
            for q in range(pw):
                acc = np.zeros(c, F)
                for iy in range(g):
                    y = F(F(sy + F(p) * bh) + F(F(iy + 0.5) * bh) / F(g))
                    for ix in range(g):
                        xx = F(F(sx + F(q) * bw) + F(F(ix + 0.5) * bw) / F(g))
                        ay, ax = axis(y, h), axis(xx, w)
                        if ay is None or ax is None:
                            continue
                        (y0, y1, ly), (x0, x1, lx) = ay, ax
                        hy, hx = F(1) - ly, F(1) - lx
                        acc += (hy * hx * x[b, :, y0, x0] + hy * lx * x[b, :, y0, x1]
                                + ly * hx * x[b, :, y1, x0] + ly * lx * x[b, :, y1, x1])
                out[r, :, p, q] = acc / F(g * g)
    return out


@pytest.mark.parametrize("g", [2, 3])
def test_roi_align(tmp_path, g):
    x = rng(2).standard_normal((2, 3, 7, 10)).astype(F)
    rois = np.array([[0, 1.5, 2.25, 30.0, 20.0], [1, -8.0, -3.0, 12.0, 9.5], [1, 35.0, 24.0, 50.0, 40.0],
                     [0, 4.0, 4.0, 4.5, 4.2]], F)
    text = net(f'layer {{ name: "o" type: "RoIAlign" bottom: "x" bottom: "r" top: "o" roi_align_param {{ '
               f'pooled_h: 3 pooled_w: 4 spatial_scale: 0.25 sampling_ratio: {g} }} }}',
               inputs={"x": x.shape, "r": rois.shape})
    m = load_from_text(text)
    check_everywhere(m, {"x": x, "r": rois}, {"o": roi_align_ref(x, rois, 3, 4, 0.25, g)}, tmp_path,
                     atol=1e-5, rtol=1e-5, opsets=(16,))


def test_roi_align_zero_ratio_refused():
    text = net('layer { name: "o" type: "RoIAlign" bottom: "x" bottom: "r" top: "o" roi_align_param { '
               'pooled_h: 2 pooled_w: 2 sampling_ratio: 0 } }', inputs={"x": (1, 1, 4, 4), "r": (1, 5)})
    m = load_from_text(text)
    with pytest.raises(CaffeqError, match="sampling_ratio"):
        m.run({"x": np.zeros((1, 1, 4, 4), F), "r": np.zeros((1, 5), F)})


def decode_ref(boxes, deltas, wts, offset):
    wd = boxes[:, 2] - boxes[:, 0] + F(1)
    ht = boxes[:, 3] - boxes[:, 1] + F(1)
    cx, cy = boxes[:, 0] + F(0.5) * wd, boxes[:, 1] + F(0.5) * ht
    clip = F(1.79588001734)
    dx, dy = deltas[:, 0] / F(wts[0]), deltas[:, 1] / F(wts[1])
    dw, dh = np.minimum(deltas[:, 2] / F(wts[2]), clip), np.minimum(deltas[:, 3] / F(wts[3]), clip)
    px, py = dx * wd + cx, dy * ht + cy
    pw, ph = np.exp(dw) * wd, np.exp(dh) * ht
    return np.stack([px - F(0.5) * pw, py - F(0.5) * ph, px + F(0.5) * pw - F(offset),
                     py + F(0.5) * ph - F(offset)], 1).astype(F)


def clip_ref(b, h, w):
    out = b.copy()
    out[:, 0::2] = np.maximum(np.minimum(b[:, 0::2], F(w - 1)), F(0))
    out[:, 1::2] = np.maximum(np.minimum(b[:, 1::2], F(h - 1)), F(0))
    return out


def proposals_ref(scores, deltas, info, anchors, scale, nms, pre, min_size, post, offset):
    a, h, w = scores.shape[1:]
    stride = F(F(1) / F(scale))
    allx = np.zeros((h * w * a, 4), F)
    sc = np.zeros(h * w * a, F)
    dl = np.zeros((h * w * a, 4), F)
    for y in range(h):
        for x in range(w):
            for k in range(a):
                i = (y * w + x) * a + k
                allx[i] = anchors[k] + np.array([x, y, x, y], F) * stride
                sc[i] = scores[0, k, y, x]
                dl[i] = deltas[0, 4 * k:4 * k + 4, y, x]
    order = sorted(range(len(sc)), key=lambda i: (-sc[i], i))
    if 0 < pre < len(order):
        order = order[:pre]
    props = clip_ref(decode_ref(allx[order], dl[order], [1, 1, 1, 1], offset), int(info[0, 0]), int(info[0, 1]))
    ss = sc[order]
    keep = []
    for i, b in enumerate(props):
        ws, hs = b[2] - b[0] + F(1), b[3] - b[1] + F(1)
        lim = F(min_size * float(info[0, 2]))     # double, then the float Eigen compares with
        if ws >= lim and hs >= lim and b[0] + ws / F(2) < info[0, 1] and b[1] + hs / F(2) < info[0, 0]:
            keep.append(i)
    top = post if 0 < post < len(keep) else -1
    kept, rest = [], list(keep)
    while rest and not (0 <= top <= len(kept)):
        i = rest.pop(0)
        kept.append(i)
        bi = props[i]
        ai = (bi[2] - bi[0] + F(1)) * (bi[3] - bi[1] + F(1))
        nxt = []
        for j in rest:
            bj = props[j]
            iw = max(min(bj[2], bi[2]) - max(bj[0], bi[0]) + F(1), F(0))
            ih = max(min(bj[3], bi[3]) - max(bj[1], bi[1]) + F(1), F(0))
            inter = F(iw * ih)
            aj = (bj[2] - bj[0] + F(1)) * (bj[3] - bj[1] + F(1))
            if F(inter / F(ai + aj - inter)) <= F(nms):
                nxt.append(j)
        rest = nxt
    rois = np.concatenate([np.zeros((len(kept), 1), F), props[kept]], 1)
    return rois, ss[kept].reshape(-1, 1)


GP = ('layer {{ name: "gp" type: "GenerateProposal" bottom: "s" bottom: "d" bottom: "i" bottom: "a" top: "rois" '
      'top: "probs" proposal_param {{ spatial_scale: 0.125 nms_thresh: 0.6 pre_nms_topn: {pre} min_size: {ms} '
      'post_nms_topn: {post} correct_transform_coords: {c} }} }}')


@pytest.mark.parametrize("pre,post,ms,c", [(40, 12, 2.0, 1), (0, 0, 0.0, 0)])
def test_generate_proposal(tmp_path, pre, post, ms, c):
    g = rng(3)
    a, h, w = 3, 5, 7
    scores = g.permutation(2 * a * h * w)[: 2 * a * h * w].reshape(2, a, h, w).astype(F) / F(300)
    deltas = (g.standard_normal((2, 4 * a, h, w)) * 0.4).astype(F)
    info = np.array([[37.0, 52.0, 1.5], [30.0, 30.0, 1.0]], F)
    anchors = np.array([[-8, -8, 7, 7], [-16, -6, 15, 5], [-4, -12, 3, 11]], F)
    m = load_from_text(net(GP.format(pre=pre, post=post, ms=ms, c=c),
                           inputs={"s": scores.shape, "d": deltas.shape, "i": info.shape, "a": anchors.shape}))
    feeds = {"s": scores, "d": deltas, "i": info, "a": anchors}
    rois, probs = proposals_ref(scores, deltas, info, anchors, 0.125, 0.6, pre, ms, post, c)
    assert 0 < len(rois) < a * h * w
    ours = m.run(feeds)
    assert_close(ours["rois"], rois, 1e-4, 1e-5, "torch rois")
    assert_close(ours["probs"], probs, 0, 0, "torch probs")
    got = model_py_outputs(m, feeds, tmp_path)
    assert_close(got["rois"], rois, 1e-4, 1e-5, "model.py rois")
    assert_close(got["probs"], probs, 0, 0, "model.py probs")


def test_generate_proposal_bad_params():
    with pytest.raises(CaffeqError, match="nms_thresh"):
        load_from_text(net(GP.format(pre=1, post=1, ms=0.0, c=1).replace("0.6", "1.5"),
                           inputs={"s": (1, 1, 2, 2), "d": (1, 4, 2, 2), "i": (1, 3), "a": (1, 4)}))


@pytest.mark.parametrize("apply", [0, 1])
def test_bbox_transform(tmp_path, apply):
    g = rng(4)
    rois = np.concatenate([np.zeros((5, 1)), g.uniform(0, 40, (5, 2)), g.uniform(40, 90, (5, 2))], 1).astype(F)
    deltas = (g.standard_normal((5, 12)) * 0.8).astype(F)
    info = np.array([[61.0, 83.0, 1.3]], F)
    text = net('layer { name: "o" type: "BBoxTransform" bottom: "r" bottom: "d" bottom: "i" top: "o" '
               f'bboxtransform_param {{ weights_1: 10 weights_2: 8 weights_3: 5 weights_4: 4 '
               f'correct_transform_coords: 1 apply_scale: {apply} }} }}',
               inputs={"r": rois.shape, "d": deltas.shape, "i": info.shape})
    m = load_from_text(text)
    scale = info[0, 2]
    ih, iw = int(float(info[0, 0] / scale) + 0.5), int(float(info[0, 1] / scale) + 0.5)
    boxes = rois[:, 1:] / scale
    ref = np.concatenate([clip_ref(decode_ref(boxes, deltas[:, 4 * k:4 * k + 4], [10, 8, 5, 4], 1), ih, iw)
                          for k in range(3)], 1)
    ref = ref * scale if apply else ref
    feeds = {"r": rois, "d": deltas, "i": info}
    assert_close(m.run(feeds)["o"], ref, 1e-4, 1e-5, "torch")
    assert_close(model_py_outputs(m, feeds, tmp_path)["o"], ref, 1e-4, 1e-5, "model.py")


def test_bbox_transform_batch_refused():
    with pytest.raises(CaffeqError, match="im_info"):
        load_from_text(net('layer { name: "o" type: "BBoxTransform" bottom: "r" bottom: "d" bottom: "i" top: "o" }',
                           inputs={"r": (3, 5), "d": (3, 8), "i": (2, 3)}))


def test_small_keypoint_rcnn_pattern_end_to_end(tmp_path):
    """The R-50 file's layer pattern (PoolingCrop, RPN, GenerateProposal, RoIAlign, box head, BBoxTransform)
    with random weights: torch and model.py agree, and the last layer matches its reference on the run's blobs."""
    conv = 'convolution_param {{ num_output: {n} kernel_size: {k} pad: {p} weight_filler {{ type: "xavier" }} }}'
    layers = [
        'layer { name: "c1" type: "Convolution" bottom: "img" top: "c1" ' + conv.format(n=4, k=3, p=1) + ' }',
        'layer { name: "crop" type: "PoolingCrop" bottom: "c1" top: "crop" }',
        'layer { name: "cls" type: "Convolution" bottom: "crop" top: "cls" ' + conv.format(n=2, k=1, p=0) + ' }',
        'layer { name: "prob" type: "Sigmoid" bottom: "cls" top: "prob" }',
        'layer { name: "bbox" type: "Convolution" bottom: "crop" top: "bbox" ' + conv.format(n=8, k=1, p=0) + ' }',
        GP.format(pre=50, post=10, ms=0.0, c=1).replace('bottom: "s" bottom: "d"', 'bottom: "prob" bottom: "bbox"'),
        'layer { name: "pool" type: "RoIAlign" bottom: "crop" bottom: "rois" top: "pool" roi_align_param { '
        'pooled_h: 3 pooled_w: 3 spatial_scale: 0.125 } }',
        'layer { name: "fc" type: "InnerProduct" bottom: "pool" top: "fc" inner_product_param { num_output: 8 '
        'weight_filler { type: "xavier" } } }',
        'layer { name: "o" type: "BBoxTransform" bottom: "rois" bottom: "fc" bottom: "i" top: "o" }',
    ]
    info = np.array([[70.0, 90.0, 1.0]], F)
    anchors = np.array([[-8, -8, 7, 7], [-16, -6, 15, 5]], F)
    img = rng(5).standard_normal((1, 3, 10, 12)).astype(F)
    m = load_from_text(net(*layers, inputs={"img": img.shape, "i": info.shape, "a": anchors.shape}),
                       random_weights=True)
    feeds = {"img": img, "i": info, "a": anchors}
    ours = m.run(feeds, all_blobs=True)
    assert ours["crop"].shape == (1, 4, 9, 11) and 0 < ours["rois"].shape[0] <= 10
    ref = np.concatenate([clip_ref(decode_ref(ours["rois"][:, 1:], ours["fc"][:, 4 * k:4 * k + 4], [10, 10, 5, 5], 1),
                                   70, 90) for k in range(2)], 1)
    assert_close(ours["o"], ref, 1e-4, 1e-5, "torch")
    got = model_py_outputs(m, feeds, tmp_path)
    assert_close(got["o"], ours["o"], 1e-5, 1e-5, "model.py")


def test_generate_proposal_min_size_compared_as_float(tmp_path):
    """filter_boxes_upright: min_size (double) * im_info[2] is compared with the float widths as a float
    (Eigen's array-scalar comparison): 12.5 * 0.8f = 10.000000149 in double, 10.0 as a float, so a
    proposal exactly 10 wide and high is kept."""
    scores = np.array([0.9, 0.4], F).reshape(1, 2, 1, 1)
    deltas = np.zeros((1, 8, 1, 1), F)
    anchors = np.array([[2, 3, 11, 12], [0, 0, 8, 8]], F)    # 10 x 10 and 9 x 9 with the +1
    info = np.array([[40.0, 50.0, 0.8]], F)
    m = load_from_text(net(GP.format(pre=0, post=0, ms=12.5, c=1),
                           inputs={"s": scores.shape, "d": deltas.shape, "i": info.shape, "a": anchors.shape}))
    feeds = {"s": scores, "d": deltas, "i": info, "a": anchors}
    rois, probs = proposals_ref(scores, deltas, info, anchors, 0.125, 0.6, 0, 12.5, 0, 1)
    assert rois.tolist() == [[0, 2, 3, 11, 12]]
    ours = m.run(feeds)
    assert_close(ours["rois"], rois, 0, 0, "torch rois")
    assert_close(ours["probs"], probs, 0, 0, "torch probs")
    got = model_py_outputs(m, feeds, tmp_path)
    assert_close(got["rois"], rois, 0, 0, "model.py rois")


def test_generate_proposal_past_its_top_refused():
    """Reshape sizes the tops N * 1000 rows; more proposals are written past them."""
    h, w = 1, 1001
    scores = np.arange(h * w, dtype=F).reshape(1, 1, h, w)
    m = load_from_text(net(GP.format(pre=0, post=0, ms=0.0, c=1),
                           inputs={"s": (1, 1, h, w), "d": (1, 4, h, w), "i": (1, 3), "a": (1, 4)}))
    feeds = {"s": scores, "d": np.zeros((1, 4, h, w), F), "i": np.array([[100.0, 8000.0, 1.0]], F),
             "a": np.array([[0, 0, 7, 7]], F)}
    with pytest.raises(CaffeqError, match="1000 per image"):
        m.run(feeds)


def test_proposal_param_read_by_layer_type():
    """The shared name: GenerateProposal's proposal_param is the fork's message, wherever its type is
    written; every other layer's proposal_param stays Faster R-CNN's, whatever fields it sets."""
    from caffeq.io.prototxt import parse_prototxt_text
    text = ('layer { name: "a" proposal_param { nms_thresh: 0.5 pre_nms_topn: 7 } type: "GenerateProposal" }\n'
            'layer { name: "b" type: "Proposal" proposal_param { nms_thresh: 0.5 pre_nms_topn: 7 } }\n'
            'layer { name: "c" type: "Proposal" proposal_param { spatial_scale: 0.25 } }\n')
    warnings = []
    layers = parse_prototxt_text(text, ignore_unknown=True, warnings=warnings).layer
    assert layers[0].HasField("generate_proposals_param") and not layers[0].HasField("proposal_param")
    assert layers[0].generate_proposals_param.pre_nms_topn == 7
    assert layers[1].HasField("proposal_param") and layers[1].proposal_param.pre_nms_topn == 7
    assert not layers[2].HasField("generate_proposals_param")
    assert any("spatial_scale" in str(x) for x in warnings)


@pytest.mark.parametrize("ratio,match", [(0.5, "adaptive grid"), (0, "aborts")])
def test_roi_align_ratio_below_one_refused(ratio, match):
    """int(sampling_ratio): 0.5 passes the fork's float CHECK_GT but runs Detectron's adaptive grid."""
    text = net('layer { name: "o" type: "RoIAlign" bottom: "x" bottom: "r" top: "o" roi_align_param { '
               f'pooled_h: 2 pooled_w: 2 sampling_ratio: {ratio} }} }}', inputs={"x": (1, 1, 4, 4), "r": (1, 5)})
    m = load_from_text(text)
    with pytest.raises(CaffeqError, match=match):
        m.run({"x": np.zeros((1, 1, 4, 4), F), "r": np.zeros((1, 5), F)})


def test_roi_align_truncated_ratio(tmp_path):
    """sampling_ratio 2.7 is the C++ int 2."""
    x = rng(6).standard_normal((1, 2, 6, 9)).astype(F)
    rois = np.array([[0, 3.0, 1.0, 27.0, 19.0]], F)
    text = net('layer { name: "o" type: "RoIAlign" bottom: "x" bottom: "r" top: "o" roi_align_param { '
               'pooled_h: 2 pooled_w: 3 spatial_scale: 0.25 sampling_ratio: 2.7 } }',
               inputs={"x": x.shape, "r": rois.shape})
    check_everywhere(load_from_text(text), {"x": x, "r": rois}, {"o": roi_align_ref(x, rois, 2, 3, 0.25, 2)},
                     tmp_path, atol=1e-5, rtol=1e-5, opsets=(16,))


def test_bbox_transform_nonzero_batch_refused():
    """With one im_info row the fork CHECKs every roi's int batch index below 1."""
    text = net('layer { name: "o" type: "BBoxTransform" bottom: "r" bottom: "d" bottom: "i" top: "o" }',
               inputs={"r": (2, 5), "d": (2, 8), "i": (1, 3)})
    m = load_from_text(text)
    rois = np.array([[0.5, 1, 2, 9, 9], [1, 1, 2, 9, 9]], F)
    with pytest.raises(CaffeqError, match="batch index"):
        m.run({"r": rois, "d": np.zeros((2, 8), F), "i": np.array([[20.0, 20.0, 1.0]], F)})


@pytest.mark.parametrize("pre", [4, 0])
def test_generate_proposal_crafted(tmp_path, pre):
    """Boxes the C++ decodes exactly: at the first position a 10 x 5 box inside a 10 x 10 one has IoU 0.5,
    kept at nms_thresh 0.5 (a box goes only when IoU > thresh); pre_nms_topn 4 drops the second position's
    two; the last box's dw 5 is clipped to 1.79588 (10 e^1.79588 wide, not 10 e^5)."""
    scores = np.array([[0.9, 0.3, 0.7], [0.8, 0.2, 0.6]], F).reshape(1, 2, 1, 3)
    deltas = np.zeros((1, 8, 1, 3), F)
    deltas[0, 6, 0, 2] = 5.0
    anchors = np.array([[0, 0, 9, 9], [0, 0, 9, 4]], F)
    info = np.array([[40.0, 200.0, 1.0]], F)
    text = net(GP.format(pre=pre, post=0, ms=0.0, c=1).replace("nms_thresh: 0.6", "nms_thresh: 0.5"),
               inputs={"s": scores.shape, "d": deltas.shape, "i": info.shape, "a": anchors.shape})
    m = load_from_text(text)
    feeds = {"s": scores, "d": deltas, "i": info, "a": anchors}
    rois, probs = proposals_ref(scores, deltas, info, anchors, 0.125, 0.5, pre, 0.0, 0, 1)
    assert probs.ravel().tolist() == F([0.9, 0.8, 0.7, 0.6] + ([] if pre else [0.3, 0.2])).tolist()
    assert rois[1].tolist() == [0, 0, 0, 9, 4] and 50 < rois[3, 3] < 50.2
    ours = m.run(feeds)
    assert_close(ours["rois"], rois, 1e-5, 1e-6, "torch rois")
    assert_close(ours["probs"], probs, 0, 0, "torch probs")
    got = model_py_outputs(m, feeds, tmp_path)
    assert_close(got["rois"], rois, 1e-5, 1e-6, "model.py rois")


def test_generate_proposal_centre_outside_image(tmp_path):
    """im_info height 0.4: every box is clipped to y = 0 (int(0.4) - 1 = -1, then 0), its centre 0.5 is not
    below 0.4, so no proposal is kept."""
    scores = np.array([0.9, 0.4], F).reshape(1, 2, 1, 1)
    anchors = np.array([[2, 3, 11, 12], [0, 0, 8, 8]], F)
    info = np.array([[0.4, 50.0, 1.0]], F)
    m = load_from_text(net(GP.format(pre=0, post=0, ms=0.0, c=1),
                           inputs={"s": scores.shape, "d": (1, 8, 1, 1), "i": info.shape, "a": anchors.shape}))
    feeds = {"s": scores, "d": np.zeros((1, 8, 1, 1), F), "i": info, "a": anchors}
    rois, _ = proposals_ref(scores, feeds["d"], info, anchors, 0.125, 0.6, 0, 0.0, 0, 1)
    assert rois.shape == (0, 5)
    assert m.run(feeds)["rois"].shape == (0, 5)
    assert model_py_outputs(m, feeds, tmp_path)["rois"].shape == (0, 5)


def test_roi_align_rois_must_be_two_axis():
    """The fork CHECKs rois' shape().size() == 2."""
    with pytest.raises(CaffeqError, match="2-axis"):
        load_from_text(net('layer { name: "o" type: "RoIAlign" bottom: "x" bottom: "r" top: "o" roi_align_param { '
                           'pooled_h: 2 pooled_w: 2 } }', inputs={"x": (1, 1, 4, 4), "r": (3, 5, 1, 1)}))
