"""zkl20061823/DRML's layers (b62b9c4): Box, Splice, Batch, MultiSigmoidCrossEntropyLoss, MultilabelImageData.

The Box and Splice references are numpy loops written here from box_layer.cpp's and splice.cpp's Forward_cpu,
with their flat indexes b*c*H*W + c*H*W + ... on zero-filled tops; each layer runs in torch, onnxruntime and
the generated model.py.
"""

import numpy as np
import pytest
from conftest import REPO, assert_close, check_everywhere, model_py_outputs, net, node_of, onnx_outputs, rng

from caffeq.errors import CaffeqError
from caffeq.io.schema import caffe_pb2
from caffeq.layers import LayerError
from caffeq.layers.registry import spec_for
from caffeq.model import load, load_from_text

CORPUS = REPO / "tests" / "fixtures" / "realworld"


def box_ref(x, corners, hh, ww):
    """Forward_cpu: for each box n, image b, channel c, row h of the box, width_ values from the bottom's
    b*c*H*W + c*H*W + h*W + w into the top's b*c*hh*ww + c*hh*ww + (h - v)*ww."""
    n, c, h, w = x.shape
    flat = x.reshape(-1)
    tops = []
    for v, u in corners:
        top = np.zeros(n * c * hh * ww, np.float32)
        for b in range(n):
            for ch in range(c):
                for row in range(v, v + hh):
                    ib = b * ch * h * w + ch * h * w + row * w + u
                    it = b * ch * hh * ww + ch * hh * ww + (row - v) * ww
                    top[it:it + ww] = flat[ib:ib + ww]
        tops.append(top.reshape(n, c, hh, ww))
    return tops


def splice_ref(bottoms, corners):
    """Forward_cpu: top (N, C, int(h sqrt(k)), int(w sqrt(k))); bottom i's row (h - v) at the top's
    b*c*H*W + c*H*W + h*W + w, bottoms in order, on a zero-filled top."""
    n, c, h, w = bottoms[0].shape
    k = len(bottoms)
    th, tw = int(h * np.sqrt(k)), int(w * np.sqrt(k))
    top = np.zeros(n * c * th * tw, np.float32)
    for x, (v, u) in zip(bottoms, corners):
        flat = x.reshape(-1)
        for b in range(n):
            for ch in range(c):
                for row in range(v, v + h):
                    ib = b * ch * h * w + ch * h * w + (row - v) * w
                    it = b * ch * th * tw + ch * th * tw + row * tw + u
                    top[it:it + w] = flat[ib:ib + w]
    return top.reshape(n, c, th, tw)


def box_text(corners, hh, ww, tops=None):
    tops = tops or [f"o{i}" for i in range(len(corners))]
    coords = " ".join(f"xcoord: {u}" for _, u in corners) + " " + " ".join(f"ycoord: {v}" for v, _ in corners)
    return ('layer { name: "box" type: "Box" bottom: "x" ' + " ".join(f'top: "{t}"' for t in tops)
            + f" box_param {{ width: {ww} height: {hh} {coords} }} }}")


def splice_text(corners, names):
    coords = " ".join(f"xcoord: {u}" for _, u in corners) + " " + " ".join(f"ycoord: {v}" for v, _ in corners)
    return ('layer { name: "sp" type: "Splice" ' + " ".join(f'bottom: "{b}"' for b in names)
            + f' top: "o" splice_param {{ {coords} }} }}')


@pytest.mark.parametrize("shape,corners", [
    ((1, 3, 7, 9), [(0, 0), (4, 5), (2, 1), (4, 0)]),   # (row, column); the last two overlap others
    ((2, 3, 7, 9), [(0, 0), (4, 5), (2, 1), (4, 0)]),
    ((3, 2, 8, 11), [(0, 0), (4, 5), (2, 1), (4, 0)]),
    ((2, 3, 7, 9), [(3, 2)]),                            # one box, one top: num_ = top.size()
])
def test_box_cuts_the_forks_windows(shape, corners, tmp_path):
    hh, ww = 3, 4
    model = load_from_text(net(box_text(corners, hh, ww), inputs={"x": shape}))
    assert model.blob_shapes["o0"] == (shape[0], shape[1], hh, ww)
    x = rng(1).standard_normal(shape).astype(np.float32)
    refs = dict(zip([f"o{i}" for i in range(len(corners))], box_ref(x, corners, hh, ww)))
    if shape[0] > 1:   # the fork's b*c indexing leaves planes other than c*(b+1) at zero
        assert not np.any(refs["o0"][-1, -1])
    check_everywhere(model, {"x": x}, refs, tmp_path)



def test_box_and_splice_exports_follow_the_run_time_batch(tmp_path):
    """An export at batch 1 (ONNX dim 0 dynamic, model.py by the input's shape) run on 3 images keeps the
    fork's planes c*(b+1) only, as Caffe does at batch 3."""
    corners = [(0, 0), (1, 1)]
    text = net(box_text(corners, 3, 4), splice_text(corners, ["o0", "o1"]).replace('top: "o"', 'top: "y"'),
               inputs={"x": (1, 3, 5, 7)})
    model = load_from_text(text)
    x = rng(5).standard_normal((3, 3, 5, 7)).astype(np.float32)
    tops = box_ref(x, corners, 3, 4)
    ref = splice_ref(tops, corners)
    assert ref.shape == (3, 3, 4, 5) and not np.any(ref[1, 2]) and not np.any(ref[2, 2]) and np.any(ref[2, 0])
    assert_close(onnx_outputs(model, {"x": x}, tmp_path)["y"], ref, 0.0, 0.0, "onnx y")
    assert_close(model_py_outputs(model, {"x": x}, tmp_path)["y"], ref, 0.0, 0.0, "model.py y")

@pytest.mark.parametrize("shape,corners", [
    ((1, 3, 3, 5), [(0, 0), (0, 5), (3, 0), (3, 5)]),            # a 2 x 2 grid, 6 x 10
    ((2, 3, 3, 5), [(0, 0), (2, 4), (3, 0), (1, 1)]),            # overlapping, later wins; holes stay 0
    ((2, 2, 3, 4), [(0, 0), (2, 2), (1, 1)]),                    # 3 bottoms: int(3 sqrt 3) x int(4 sqrt 3) = 5 x 6
])
def test_splice_writes_each_bottom_at_its_corner(shape, corners, tmp_path):
    names = [f"b{i}" for i in range(len(corners))]
    model = load_from_text(net(splice_text(corners, names), inputs={b: shape for b in names}))
    g = rng(2)
    feeds = {b: g.standard_normal(shape).astype(np.float32) for b in names}
    ref = splice_ref([feeds[b] for b in names], corners)
    assert model.blob_shapes["o"] == ref.shape
    check_everywhere(model, feeds, {"o": ref}, tmp_path)


def test_drmls_region_layer_box_then_splice(tmp_path):
    corners = [(v, u) for v in (0, 3) for u in (0, 4)]
    text = net(box_text(corners, 3, 4),
               'layer { name: "s" type: "Scale" bottom: "o2" top: "s2" scale_param { bias_term: false } }',
               splice_text(corners, ["o0", "o1", "s2", "o3"]).replace('top: "o"', 'top: "y"'),
               inputs={"x": (1, 2, 6, 8)})
    model = load_from_text(text, random_weights=True)
    node_of(model, "s").blobs = [np.array([2.0, -1.0], np.float32)]
    x = rng(3).standard_normal((1, 2, 6, 8)).astype(np.float32)
    ref = x.copy()
    ref[:, :, 3:6, 0:4] *= np.array([2.0, -1.0], np.float32)[None, :, None, None]
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path)


def test_multi_sigmoid_cross_entropy_loss_ignores_zero_labels():
    text = net('layer { name: "l" type: "MultiSigmoidCrossEntropyLoss" bottom: "x" bottom: "t" top: "l" }',
               inputs={"x": (3, 5), "t": (3, 5, 1, 1)})
    model = load_from_text(text)
    g = rng(4)
    x = (g.standard_normal((3, 5)) * 4).astype(np.float32)
    t = g.integers(-1, 2, (3, 5, 1, 1)).astype(np.float32)
    xd, td = x.astype(np.float64), t.reshape(3, 5).astype(np.float64)
    pos = (xd >= 0).astype(np.float64)
    per = xd * ((td > 0) - pos) - np.log(1 + np.exp(xd - 2 * xd * pos))
    ref = -per[td != 0].sum() / 3
    assert_close(model.run({"x": x, "t": t})["l"], ref, 0.0, 1e-6, "loss")
    with pytest.raises(LayerError, match="same count"):
        load_from_text(text.replace("dim: 3 dim: 5 dim: 1", "dim: 3 dim: 4 dim: 1"))


def test_multilabel_image_data_shapes_its_label_top():
    text = ('layer { name: "data" type: "MultilabelImageData" top: "data" top: "label" '
            'transform_param { crop_size: 17 } image_data_param { source: "none.txt" batch_size: 5 multilabel_num: 12 } }\n'
            'layer { name: "c" type: "Convolution" bottom: "data" top: "c" convolution_param { num_output: 2 kernel_size: 3 } }')
    model = load_from_text(text, random_weights=True)
    assert model.blob_shapes["data"] == (5, 3, 17, 17)
    assert model.blob_shapes["label"] == (5, 12, 1, 1)
    with pytest.raises(LayerError, match="image_data_param.multilabel_num must be >= 1"):
        load_from_text(text.replace(" multilabel_num: 12", ""), random_weights=True)


def test_batch_is_sized_and_refused_in_one_line():
    text = net('layer { name: "bn" type: "Batch" bottom: "x" top: "y" batch_param { use_global_stats: false } '
               'param { lr_mult: 0 } param { lr_mult: 0 } param { lr_mult: 0 } }', inputs={"x": (2, 3, 5, 7)})
    model = load_from_text(text)
    assert model.blob_shapes["y"] == (2, 3, 5, 7)
    with pytest.raises(CaffeqError, match=r"layer 'bn' \(Batch\): .*ships no source") as e:
        model.run({"x": np.zeros((2, 3, 5, 7), np.float32)})
    assert "\n" not in str(e.value)


def test_the_box_types_resolve_by_their_fields():
    drml = caffe_pb2.LayerParameter(type="Box", bottom=["x"], top=["a", "b"])
    drml.box_param.width = 2
    brave = caffe_pb2.LayerParameter(type="Box", bottom=["x"], top=["y"])
    brave.box_param.box_height = 4
    assert type(spec_for(drml)).__name__ == "DrmlBox"
    assert type(spec_for(brave)).__name__ == "Box"


@pytest.mark.parametrize("layer,shapes,match", [
    (box_text([(0, 0), (4, 6)], 3, 4), {"x": (1, 2, 7, 9)}, "box at row 4, column 6 leaves the 7 x 9 bottom"),
    (box_text([(0, 0)], 3, 4, tops=["a", "b"]), {"x": (1, 2, 7, 9)}, "xcoord and a ycoord for each of its 2 boxes"),
    (box_text([(0, 0), (1, 1)], 0, 4), {"x": (1, 2, 7, 9)}, "box_param.height must be >= 1"),
    (splice_text([(0, 0), (0, 5)], ["a", "b"]), {"a": (1, 2, 3, 5), "b": (1, 2, 3, 4)}, "bottom 1 is"),
    (splice_text([(0, 0), (2, 2)], ["a", "b"]), {"a": (1, 2, 3, 5), "b": (1, 2, 3, 5)},
     "bottom at row 2, column 2 leaves the 4 x 7 top"),
])
def test_bad_boxes_are_one_line_errors(layer, shapes, match):
    with pytest.raises(LayerError, match=match) as e:
        load_from_text(net(layer, inputs=shapes))
    assert "\n" not in str(e.value)


@pytest.mark.skipif(not CORPUS.exists(), reason="the prototxt corpus is not on this machine")
def test_the_forks_three_nets_read():
    drml = load(str(CORPUS / "zkl20061823__DRML__prototxt__DRML.prototxt"))
    assert drml.blob_shapes["out64"] == (64, 32, 20, 20)
    assert drml.blob_shapes["concat"] == (64, 32, 160, 160)
    assert drml.blob_shapes["label"] == (64, 12, 1, 1)
    for name in ("AlexNet", "ConvNet"):
        model = load(str(CORPUS / f"zkl20061823__DRML__prototxt__{name}.prototxt"))
        assert model.blob_shapes["fc8"] == (64, 12)
        assert model.blob_shapes["label"] == (64, 12, 1, 1)


def test_happynears_multilabelimagedata_is_not_drmls():
    """happynear/caffe-windows' MultiLabelImageData (its own fields, labels from the list) differs from DRML's
    MultilabelImageData by one capital only: it is not re-spelled into DRML's, and stays an unknown fork data
    layer whose tops --input-shape gives."""
    text = ('layer { name: "data" type: "MultiLabelImageData" top: "data" top: "label" '
            'image_data_param { source: "list.txt" batch_size: 4 } }\n'
            'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 3 } }\n')
    model = load_from_text(text, input_shapes={"data": (4, 3, 8, 8), "label": (4, 7)})
    assert model.layers[0].type == "MultiLabelImageData"
    assert model.blob_shapes["label"] == (4, 7) and model.blob_shapes["ip"] == (4, 3)
