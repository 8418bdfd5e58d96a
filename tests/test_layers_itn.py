"""zlmzju/caffe 67b1536 (itn branch) TransformOffset and TransformAnchor (transform_offset_layer.cu
matrix_to_offset, transform_anchor_layer.cu matrix_to_anchor), against loops written from the kernels; that
fork's DeformableConvolution (convolution_param, the deformable group from the offsets' channels) against
MSRA's v1 kernel loop of test_layers_deformable_conv (deformable_im2col.cu's deformable_im2col_gpu_kernel and
deformable_im2col_bilinear are that kernel, line for line); LianaWang/itn 77507a3's ProposalLayer (4 bottoms)
against numpy written from lib/rpn/proposal_layer.py and fast_rcnn/bbox_transform.py, its NMSLayer read only;
the four ITN nets read by `inspect`."""
import math

import numpy as np
import pytest
from conftest import REPO, check_everywhere, cli_process, net, node_of, ok, rng
from test_layers_deformable_conv import fork_forward

from caffeq.errors import ExportError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32
REALWORLD = REPO / "tests" / "fixtures" / "realworld"


def mapped(t, x_old, y_old):
    """(x', y') of one location as the kernels compute them: T0 + 1.0 and the sums in double, T1 y and T3 x
    float32 products, the result stored as float32."""
    x_new = F((float(t[0]) + 1.0) * float(x_old) + float(F(t[1] * y_old)) + float(t[2]))
    y_new = F(float(F(t[3] * x_old)) + (float(t[4]) + 1.0) * float(y_old) + float(t[5]))
    return x_new, y_new


def offset_ref(m, num_output):
    n, _, h, w = m.shape
    k = int(math.sqrt(num_output // 2))
    center = F((k - 1.0) / 2.0)
    out = np.zeros((n, num_output, h, w), F)
    for i in range(n):
        for c in range(num_output * h * w // 2 // (h * w)):
            x_old, y_old = F(F(c % k) - center), F(F((c // k) % k) - center)
            for yy in range(h):
                for xx in range(w):
                    x_new, y_new = mapped(m[i, :8, yy, xx], x_old, y_old)
                    out[i, 2 * c, yy, xx] = F(y_new - y_old)
                    out[i, 2 * c + 1, yy, xx] = F(x_new - x_old)
    return out


def anchor_ref(m, kernel):
    n, _, h, w = m.shape
    box = [-1, -1, 1, -1, 1, 1, -1, 1]
    anchor = [0, 0, 1, 0, 1, 1, 0, 1]
    scale = F((kernel - 1.0) / 2.0)
    out = np.zeros((n, 8, h, w), F)
    for i in range(n):
        for c in range(4):
            x_old, y_old = F(box[2 * c] * scale), F(box[2 * c + 1] * scale)
            for yy in range(h):
                for xx in range(w):
                    x_new, y_new = mapped(m[i, :8, yy, xx], x_old, y_old)
                    out[i, 2 * c, yy, xx] = F(x_new - F(anchor[2 * c]))
                    out[i, 2 * c + 1, yy, xx] = F(y_new - F(anchor[2 * c + 1]))
    return out


def matrices(shape, seed):
    m = rng(seed).standard_normal(shape).astype(F) * F(0.3)
    m[0, :, 0, 0] = 0            # the identity: offsets 0, anchors the corners' displacement
    m[-1, 2, 1, 2] = F(1e-9)     # a tiny T2: x' = x + 1e-9 rounds back in float32
    return m


def offset_net(shape, num_output):
    return net(f'layer {{ name: "t" type: "TransformOffset" bottom: "m" top: "o" '
               f'transform_offset_param {{ num_output: {num_output} }} }}', inputs={"m": shape})


def anchor_net(shape, param="transform_anchor_param { stride: 8 kernel_size: 7 }"):
    return net(f'layer {{ name: "t" type: "TransformAnchor" bottom: "m" top: "o" {param} }}', inputs={"m": shape})


@pytest.mark.parametrize("shape, num_output", [((2, 8, 5, 7), 98), ((3, 11, 4, 6), 18), ((2, 9, 3, 5), 20),
                                               ((2, 8, 4, 3), 2)])
def test_transform_offset(shape, num_output, tmp_path):
    """98: 7 x 7 taps (ITN's); 18: 3 x 3 with channels past T7 unread; 20: 10 pairs on (int) sqrt(10) = 3, the
    tenth tap wrapping to (0, 0) of the 3 x 3; 2: one tap at (0, 0)."""
    m = matrices(shape, 1)
    model = load_from_text(offset_net(shape, num_output))
    assert model.blob_shapes["o"] == (shape[0], num_output) + shape[2:]
    want = offset_ref(m, num_output)
    assert (want[0, :, 0, 0] == 0).all()
    check_everywhere(model, {"m": m}, {"o": want}, tmp_path)


@pytest.mark.parametrize("shape, param, kernel", [
    ((2, 8, 5, 7), "transform_anchor_param { stride: 8 kernel_size: 7 }", 7),
    ((3, 10, 6, 4), "", 7),                                        # the defaults: kernel_size 7
    ((2, 8, 3, 5), "transform_anchor_param { kernel_size: 4 }", 4),   # a half-pixel box: (4 - 1) / 2
])
def test_transform_anchor(shape, param, kernel, tmp_path):
    m = matrices(shape, 2)
    model = load_from_text(anchor_net(shape, param))
    assert model.blob_shapes["o"] == (shape[0], 8) + shape[2:]
    want = anchor_ref(m, kernel)
    s = (kernel - 1) / 2
    np.testing.assert_array_equal(want[0, :, 0, 0], F([-s, -s, s - 1, -s, s - 1, s - 1, -s, s - 1]))
    check_everywhere(model, {"m": m}, {"o": want}, tmp_path)


def test_products_round_as_the_kernel(tmp_path):
    """T1 y is a float32 product before the double sum: on matrices where that rounding changes the float32
    x' (a double product would give another), every backend gives the kernel's value."""
    t = rng(5).standard_normal((8, 20000)).astype(F)
    x_old = y_old = F(-3.0)           # TransformAnchor's first corner, kernel_size 7
    kernel = ((t[0].astype(np.float64) + 1.0) * x_old + (t[1] * y_old).astype(np.float64) + t[2]).astype(F)
    wide = ((t[0].astype(np.float64) + 1.0) * x_old + t[1].astype(np.float64) * y_old + t[2]).astype(F)
    cols = np.flatnonzero(kernel != wide)[:40]
    assert len(cols) >= 10
    m = np.ascontiguousarray(t[:, cols].reshape(1, 8, 2, -1))
    model = load_from_text(anchor_net(m.shape))
    want = anchor_ref(m, 7)
    np.testing.assert_array_equal(want[0, 0].ravel(), kernel[cols])
    assert (want[0, 0].ravel() != wide[cols]).all()
    check_everywhere(model, {"m": m}, {"o": want}, tmp_path)


@pytest.mark.parametrize("text, shape, match", [
    ('layer { name: "t" type: "TransformOffset" bottom: "m" top: "o" transform_offset_param { num_output: 97 } }',
     (1, 8, 3, 3), "transform_offset_param.num_output must be even"),
    ('layer { name: "t" type: "TransformOffset" bottom: "m" top: "o" }', (1, 8, 3, 3),
     "transform_offset_param.num_output must be even and >= 2"),
    ('layer { name: "t" type: "TransformOffset" bottom: "m" top: "o" transform_offset_param { num_output: 18 } }',
     (1, 6, 3, 3), "reads 8 matrix channels"),
    ('layer { name: "t" type: "TransformAnchor" bottom: "m" top: "o" }', (1, 8, 3), "4-axis matrix bottom"),
    ('layer { name: "t" type: "TransformAnchor" bottom: "m" top: "m" }', (1, 8, 3, 3), "in-place"),
])
def test_refusals(text, shape, match):
    with pytest.raises(LayerError, match=match):
        load_from_text(net(text, inputs={"m": shape}))


def zlmzju_net(x_shape, off_shape, param):
    return net(f'layer {{ name: "d" type: "DeformableConvolution" bottom: "x" bottom: "o" top: "y" '
               f'convolution_param {{ {param} }} }}', inputs={"x": x_shape, "o": off_shape})


@pytest.mark.parametrize("x_shape, off_shape, param, y_shape, dg", [
    # ITN's rpn_conv on a small map: 98 offset channels of a 7 x 7 kernel, deformable group 1
    ((2, 3, 9, 11), (2, 98, 9, 11), "num_output: 5 kernel_size: 7 pad: 3", (2, 5, 9, 11), 1),
    # 4 offset channels past 2 x 3 x 2 x 3 = 36: group 3 (C's 40 / 6 / 2), the extra channels unread
    ((2, 6, 5, 7), (2, 40, 5, 7), "num_output: 4 kernel_h: 3 kernel_w: 2 pad_h: 1 pad_w: 0 group: 2",
     (2, 4, 5, 6), 3),
    # a stride: offsets of another height and width, each image's first 2 x 9 x 2 x 3 x 4 values read
    ((2, 4, 6, 8), (2, 36, 4, 5), "num_output: 3 kernel_size: 3 stride: 2 pad: 1 dilation: 1 bias_term: false",
     (2, 3, 3, 4), 2),
    # a 1 x 1 kernel still samples at the offsets (the fork has no 1 x 1 shortcut)
    ((2, 2, 4, 3), (2, 2, 4, 3), "num_output: 3 kernel_size: 1", (2, 3, 4, 3), 1),
    # 4 channels past 2 x 9 x 2 on an unchanged 5 x 6 map: each image's first 36 x 5 x 6 values read
    ((2, 4, 5, 6), (2, 40, 5, 6), "num_output: 3 kernel_size: 3 pad: 1", (2, 3, 5, 6), 2),
])
def test_zlmzju_deformable_convolution(x_shape, off_shape, param, y_shape, dg, tmp_path):
    model = load_from_text(zlmzju_net(x_shape, off_shape, param), random_weights=True)
    node = node_of(model, "d")
    assert model.blob_shapes["y"] == y_shape and node.attrs["deformable_group"] == dg
    if len(node.blobs) == 2:
        node.blobs = [node.blobs[0], rng(3).standard_normal(node.blobs[1].shape).astype(F)]
    x = rng(1).standard_normal(x_shape).astype(F)
    off = (rng(2).standard_normal(off_shape) * 2.0).astype(F)
    off.reshape(-1)[::5] = np.round(off.reshape(-1)[::5])     # whole pixels: taps on the image's edges
    a = node.attrs
    bias = node.blobs[1] if a["bias_term"] else None
    want = fork_forward(x, off, node.blobs[0], bias, a["stride"], a["pad"], a["dilation"], a["group"], dg)
    check_everywhere(model, {"x": x, "o": off}, {"y": want}, tmp_path, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("x_shape, off_shape, param, match", [
    ((1, 4, 5, 5), (1, 17, 5, 5), "num_output: 2 kernel_size: 3 pad: 1", "need at least 2 x 3 x 3 = 18 channels"),
    ((1, 3, 5, 5), (1, 36, 5, 5), "num_output: 2 kernel_size: 3 pad: 1", "not divisible by the deformable group 2"),
    ((1, 4, 5, 5), (1, 18, 5, 5), "kernel_size: 3 pad: 1", "convolution_param.num_output is required"),
    ((1, 4, 5, 5), (1, 18, 5, 5), "num_output: 2 kernel_size: 3 pad: 1 axis: 2", "convolution_param.axis must be 1"),
])
def test_zlmzju_deformable_refusals(x_shape, off_shape, param, match):
    with pytest.raises(LayerError, match=match):
        load_from_text(zlmzju_net(x_shape, off_shape, param))


def test_zlmzju_deformable_refuses_to_read_past_the_offsets(tmp_path):
    """Offsets of 18 x 2 x 2 for a 4 x 4 output: the kernel would read past each image's 72 values."""
    model = load_from_text(zlmzju_net((1, 2, 4, 4), (1, 18, 2, 2), "num_output: 2 kernel_size: 3 pad: 1"),
                           random_weights=True)
    assert model.blob_shapes["y"] == (1, 2, 4, 4)
    with pytest.raises(LayerError, match="reads 2 x 3 x 3 x deformable group 1 x 4 x 4 = 288 offsets per image"):
        model.run({"x": np.zeros((1, 2, 4, 4), F), "o": np.zeros((1, 18, 2, 2), F)})
    with pytest.raises(ExportError, match="past the 72 of the offsets"):
        model.export_onnx(tmp_path / "m.onnx")


def test_zlmzju_deformable_batch_and_claim():
    """Offsets of a smaller batch would be read past their end; a layer that also sets
    deformable_convolution_param is SAR_plane's / Xdet's (which checks 2 x 3 x 3 x deformable_group channels)."""
    model = load_from_text(zlmzju_net((2, 2, 4, 4), (1, 18, 4, 4), "num_output: 2 kernel_size: 3 pad: 1"),
                           random_weights=True)
    with pytest.raises(LayerError, match="need the data's batch 2"):
        model.run({"x": np.zeros((2, 2, 4, 4), F), "o": np.zeros((1, 18, 4, 4), F)})
    both = zlmzju_net((1, 4, 5, 5), (1, 40, 5, 5), "num_output: 2 kernel_size: 3 pad: 1").replace(
        "convolution_param {", "deformable_convolution_param { num_output: 2 kernel_size: 3 pad: 1 "
        "deformable_group: 2 } convolution_param {")
    with pytest.raises(LayerError, match="need 2 x kernel_h x kernel_w x deformable_group = 2 x 3 x 3 x 2 = 36 "
                                         "channels, got 40"):
        load_from_text(both)


def test_itn_proposal_claim_needs_kernel_size():
    """A 4-bottom ProposalLayer without 'kernel_size' in its param_str is not ITN's."""
    text = proposal_net((1, 2, 3, 4), (1, 8, 3, 4), "{'feat_stride': 16}")
    try:
        model = load_from_text(text)
    except LayerError as err:
        assert "rpnbbox_pred" not in str(err)
    else:
        assert type(node_of(model, "proposal").spec).__name__ != "ItnProposalLayer"


def itn_proposals_ref(prob, deltas, im_info, stride):
    """lib/rpn/proposal_layer.py forward with 4 bottoms, as numpy runs it."""
    _, _, h, w = prob.shape
    base = np.array([1, 1, stride, 1, stride, stride, 1, stride]) - 1.0
    sx, sy = np.meshgrid(np.arange(0, w) * stride, np.arange(0, h) * stride)
    shifts = np.vstack([sx.ravel(), sy.ravel()] * 4).transpose()
    boxes = (base.reshape(1, 8) + shifts).astype(F)                    # bbox_transform_inv's astype
    d = deltas.transpose((0, 2, 3, 1)).reshape((-1, 8))
    x, y = boxes[:, 0::2], boxes[:, 1::2]

    def side(a, b):
        return np.sqrt((np.fabs(x[:, a] - x[:, b]) + 1) ** 2 + (np.fabs(y[:, a] - y[:, b]) + 1) ** 2)

    w1, w2, h1, h2 = side(0, 1), side(2, 3), side(0, 3), side(1, 2)
    scale = np.stack([w1, h1, w1, h2, w2, h2, w2, h1], axis=1)
    pred = d * scale + boxes
    for col in range(8):      # clip_boxes: x to im_info[1] - 1, y to im_info[0] - 1
        pred[:, col] = np.maximum(np.minimum(pred[:, col], im_info[0, 1 - col % 2] - 1), 0)
    rois = np.hstack((np.zeros((pred.shape[0], 1), F), pred.astype(F)))
    return rois, prob[:, 1:].transpose((0, 2, 3, 1)).reshape((-1, 1))


def proposal_net(prob, deltas, param="{'feat_stride': 8, 'kernel_size': 7}"):
    return net(f"""layer {{ name: "proposal" type: "Python" bottom: "p" bottom: "d" bottom: "info" bottom: "data"
        top: "rois" top: "scores" python_param {{ module: "rpn.proposal_layer" layer: "ProposalLayer"
        param_str: "{param}" }} }}""", inputs={"p": prob, "d": deltas, "info": (1, 3), "data": (1, 3, 40, 56)})


@pytest.mark.parametrize("prob_shape, stride", [((1, 2, 5, 7), 8), ((1, 3, 4, 6), 16)])
def test_itn_proposal_layer(prob_shape, stride, tmp_path):
    """Two channels as ITN's nets (3: the module's scores are every channel after the first); deltas of up to
    a few sides, so that boxes leave the image on both edges and are clipped."""
    _, c, h, w = prob_shape
    model = load_from_text(proposal_net(prob_shape, (1, 8, h, w), f"{{'feat_stride': {stride}, 'kernel_size': 7}}"))
    assert model.blob_shapes["rois"] == (h * w, 9) and model.blob_shapes["scores"] == (h * w * (c - 1), 1)
    prob = rng(4).random(prob_shape).astype(F)
    deltas = (rng(5).standard_normal((1, 8, h, w)) * 1.5).astype(F)
    info = np.array([[h * stride - 5.5, w * stride - 9.0, 1.6]], F)
    rois, scores = itn_proposals_ref(prob, deltas, info, stride)
    assert (rois[:, 1:] == 0).any() and (rois[:, 1::2] == info[0, 1] - 1).any()
    check_everywhere(model, {"p": prob, "d": deltas, "info": info, "data": np.zeros((1, 3, 40, 56), F)},
                     {"rois": rois, "scores": scores}, tmp_path)


@pytest.mark.parametrize("prob, deltas, param, match", [
    ((1, 2, 3, 4), (1, 4, 3, 4), "{'feat_stride': 8, 'kernel_size': 7}", "rpnbbox_pred must be \\(1, 8, 3, 4\\)"),
    ((2, 2, 3, 4), (2, 8, 3, 4), "{'feat_stride': 8, 'kernel_size': 7}", "the module asserts one image"),
    ((1, 2, 3, 4), (1, 8, 3, 4), "{'feat_stride': 0, 'kernel_size': 7}", "'feat_stride' must be a positive number"),
])
def test_itn_proposal_refusals(prob, deltas, param, match):
    with pytest.raises(LayerError, match=match):
        load_from_text(proposal_net(prob, deltas, param))


def test_itn_nms_is_read_not_run(tmp_path):
    text = net("""layer { name: "nms" type: "Python" bottom: "r" bottom: "s" top: "rois" top: "scores"
        python_param { module: "rpn.nms_layer" layer: "NMSLayer" } }""", inputs={"r": (1500, 9), "s": (1500, 1)})
    model = load_from_text(text)
    assert model.blob_shapes["rois"] == (1000, 9) and model.blob_shapes["scores"] == (1000, 1)
    with pytest.raises(LayerError, match="layer 'nms' \\(rpn.nms_layer.NMSLayer\\): ITN's soft-NMS"):
        model.run({"r": np.zeros((1500, 9), F), "s": np.zeros((1500, 1), F)})
    bad = text.replace("(1500, 9)", "").replace('dim: 1500 dim: 9', 'dim: 1500 dim: 5')
    with pytest.raises(LayerError, match="rois_pre_nms must be \\(R, 9\\)"):
        load_from_text(bad)


def itn_file(arch, phase):
    return REALWORLD / f"LianaWang__itn__experiments__itn_{arch}__proto__{phase}.pt.prototxt"


def rows_of(out, *names):
    """{layer name: its inspect row's cells after the type}."""
    rows = {}
    for line in out.splitlines():
        cells = line.split()
        if cells and cells[0] in names:
            rows[cells[0]] = " ".join(cells[2:])
    return rows


@pytest.mark.parametrize("arch, rpn_conv", [("vgg", "12.85M 10.15G"), ("resnet", "25.69M 20.30G")])
def test_realworld_test_nets(arch, rpn_conv):
    """The test nets (data 1 x 3 x 224 x 224, stride 8: a 28 x 28 map) through the deformable RPN, the
    proposals (784 quadrilaterals) and the NMS's bound."""
    rows = rows_of(ok(cli_process("inspect", itn_file(arch, "test"))), "fusion_offset", "rpn_conv",
                   "anchor_offset", "proposal", "nms")
    assert rows["fusion_offset"] == "fusion_matrix -> fusion_offset 1x98x28x28"
    assert rows["rpn_conv"] == f"fusion,fusion_offset -> rpn/output 1x512x28x28 {rpn_conv}"
    assert rows["anchor_offset"] == "fusion_matrix -> anchor_offset 1x8x28x28"
    assert rows["proposal"] == "rpn_cls_prob_reshape,rpnbbox_pred,im_info,data -> rois_pre_nms,scores_pre_nms 784x9; 784x1"
    assert rows["nms"] == "rois_pre_nms,scores_pre_nms -> rois,scores 784x9; 784x1"


@pytest.mark.parametrize("arch", ["vgg", "resnet"])
def test_realworld_train_nets(arch):
    """The train nets: RoIDataLayer's tops are py-faster-rcnn's but for gt_boxes (1, 8), which nothing in the
    file tells from py-faster-rcnn's (1, 4), so they come from --input-shape (its setup's cfg.TRAIN sizes);
    rpn-data (the AnchorTargetLayer with the homography top) only feeds the losses and is dropped."""
    res = cli_process("inspect", itn_file(arch, "train"), "--input-shape", "data=1,3,600,1000",
                      "--input-shape", "im_info=1,3", "--input-shape", "gt_boxes=1,8")
    rows = rows_of(ok(res), "rpn_conv", "combine_offset", "rpn_cls_score_reshape")
    assert "dropped 4 training-only layer(s)" in res.stderr and "rpn-data (Python)" in res.stderr
    assert rows["rpn_conv"].startswith("fusion,fusion_offset -> rpn/output 1x512x75x125 ")
    assert rows["combine_offset"] == "rpnbbox_offset,anchor_offset -> rpnbbox_pred 1x8x75x125"
    assert rows["rpn_cls_score_reshape"] == "rpncls_score -> rpn_cls_score_reshape 1x2x75x125"
