"""R*CNN's MIL and Sum (gkioxari/caffe-fast-rcnn 7048851, mil_layer.cpp and sum_layer.cpp/.cu)
against loops written from the fork's Forward_cpu, in torch, onnxruntime and the generated model.py;
their parameter and shape checks; R*CNN's own MIL -> Sum chain."""
import numpy as np
import pytest
from conftest import check_everywhere, inputs_text

from caffeq.layers import LayerError
from caffeq.model import load_from_text

RNG = np.random.default_rng(140)


def mil_net(shape, params="context_per_roi: 3", bottoms=("x",), top="o"):
    bottom = " ".join(f'bottom: "{b}"' for b in bottoms)
    return ('name: "t"\n' + inputs_text(x=shape)
            + f'layer {{ name: "mil" type: "MIL" {bottom} top: "{top}" mil_param {{ {params} }} }}')


def sum_net(shapes, top="o", bottoms=None):
    names = [f"x{i}" for i in range(len(shapes))]
    bottom = " ".join(f'bottom: "{b}"' for b in (bottoms or names))
    return ('name: "t"\n' + inputs_text(**dict(zip(names, shapes)))
            + f'layer {{ name: "sum" type: "Sum" {bottom} top: "{top}" }}')


def ref_mil(x, context_per_roi):
    """The fork's loop: num_rois = num / K, channels = channels(); for k < C, i < num_rois:
    top[i*C + k] = max over j < K of bottom[(i*K + j)*C + k] (from -FLT_MAX), top (R, C, 1, 1)."""
    data = x.reshape(-1)
    num, channels = x.shape[0], x.shape[1] if x.ndim > 1 else 1
    rois = num // context_per_roi
    top = np.empty(rois * channels, x.dtype)
    for k in range(channels):
        for i in range(rois):
            prob = np.float32(-np.finfo(np.float32).max)
            for j in range(context_per_roi):
                prob = max(prob, data[(i * context_per_roi + j) * channels + k])
            top[i * channels + k] = prob
    return top.reshape(rois, channels, 1, 1)


def ref_sum(*xs):
    """The fork's forward: copy bottom 0 into the top, then top += 1.0 * bottom i (axpby), element by
    element over bottom 0's count; the top is shaped as bottom 0."""
    top = xs[0].reshape(-1).copy()
    for x in xs[1:]:
        flat = x.reshape(-1)
        for e in range(top.size):
            top[e] = np.float32(1.0) * flat[e] + np.float32(1.0) * top[e]
    return top.reshape(xs[0].shape)


@pytest.mark.parametrize("shape, k", [((12, 5), 3), ((14, 5), 4), ((30, 11), 10), ((7, 3, 2, 1), 2),
                                      ((6, 4, 1, 1), 6), ((5, 2, 3), 2), ((9,), 3)])
def test_mil_matches_the_forks_loop(shape, k, tmp_path):
    x = RNG.standard_normal(shape).astype(np.float32)
    model = load_from_text(mil_net(shape, f"context_per_roi: {k}"))
    ref = ref_mil(x, k)
    assert model.blob_shapes["o"] == ref.shape
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path)


def test_mil_is_a_max_over_each_rois_consecutive_rows():
    """Rows i*K .. i*K + K-1 are roi i's context boxes (not every R-th row); trailing rows are left out."""
    x = np.arange(14 * 2, dtype=np.float32).reshape(14, 2)
    x[1, 0] = 100.0                        # roi 0 (rows 0..3), channel 0
    x[13, 1] = 1000.0                      # row 13: past 3 rois x 4, left out
    out = load_from_text(mil_net((14, 2), "context_per_roi: 4")).run({"x": x})["o"]
    assert out.shape == (3, 2, 1, 1)
    np.testing.assert_array_equal(out[:, :, 0, 0], [[100.0, 7.0], [14.0, 15.0], [22.0, 23.0]])


@pytest.mark.parametrize("shapes", [[(3, 11), (3, 11, 1, 1)], [(2, 3, 4, 5)] * 3, [(4, 3), (4, 3)],
                                    [(2, 3, 1, 1), (2, 3), (2, 3, 1)]])
def test_sum_matches_the_forks_forward(shapes, tmp_path):
    xs = [RNG.standard_normal(s).astype(np.float32) for s in shapes]
    model = load_from_text(sum_net(shapes))
    ref = ref_sum(*xs)
    assert model.blob_shapes["o"] == tuple(shapes[0])
    check_everywhere(model, {f"x{i}": x for i, x in enumerate(xs)}, {"o": ref}, tmp_path,
                     atol=1e-6, rtol=1e-6)


def test_sum_in_place_over_bottom_0():
    """Caffe's copy of bottom 0 into itself is a no-op: in place over bottom 0 is a plain sum."""
    xs = [RNG.standard_normal((3, 4)).astype(np.float32) for _ in range(2)]
    model = load_from_text(sum_net([(3, 4), (3, 4)], top="x0"))
    np.testing.assert_array_equal(model.run({"x0": xs[0], "x1": xs[1]})["x0"], ref_sum(*xs))


@pytest.mark.parametrize("text, msg", [
    (mil_net((12, 5), "context_per_roi: 0"), r"MIL needs mil_param.context_per_roi >= 1"),
    (mil_net((4, 5), "context_per_roi: 10"), r"MIL: the bottom's 4 rows are fewer than mil_param.context_per_roi 10"),
    (mil_net((12, 5), "context_per_roi: 3", bottoms=("x", "x")), r"MIL takes one bottom and one top, got 2 and 1"),
    (mil_net((12, 5, 1, 1, 1), "context_per_roi: 3"), r"MIL reads num/channels/height/width, which need at most 4"),
    (sum_net([(3, 4)]), r"a one-bottom Sum is ambiguous"),
    (sum_net([(3, 4), (3, 5)]), r"Sum's bottoms must have bottom 0's num, channels, height and width: "
                                r"bottom 1 is \[3, 5\], bottom 0 \[3, 4\]"),
    (sum_net([(3, 4), (4, 3)]), r"bottom 1 is \[4, 3\]"),
    (sum_net([(3, 4), (3, 4)], top="x1"), r"Sum cannot write its top over bottom 1 \('x1'\)"),
])
def test_refusals_are_one_line(text, msg):
    with pytest.raises(LayerError, match=msg) as e:
        load_from_text(text)
    assert "\n" not in str(e.value)


def test_rstar_cnn_mil_sum_chain_and_field_number(tmp_path):
    """VGG16_RstarCNN/train.prototxt's score layers as written (fc7 of 3 rois, context_fc7 of 30 boxes)."""
    from caffeq.io.schema import caffe_pb2
    text = ('name: "t"\n' + inputs_text(fc7=(3, 6), context_fc7=(30, 6))
            + 'layer { name: "cls_score" type: "InnerProduct" bottom: "fc7" top: "cls_score" '
              'inner_product_param { num_output: 11 } }\n'
            + 'layer { name: "context_cls_score" type: "InnerProduct" bottom: "context_fc7" '
              'top: "context_cls_score" inner_product_param { num_output: 11 } }\n'
            + 'layer {\n  name: "MIL_score"\n  type: "MIL"\n  bottom: "context_cls_score"\n'
              '  top: "mil_context_cls_score"\n  mil_param {\n    context_per_roi: 10\n  }\n}\n'
            + 'layer {\n  name: "sum_scores"\n  type: "Sum"\n  bottom: "cls_score"\n'
              '  bottom: "mil_context_cls_score"\n  top: "sum_cls_score"\n}\n')
    model = load_from_text(text, random_weights=True)
    assert model.blob_shapes["mil_context_cls_score"] == (3, 11, 1, 1)
    assert model.blob_shapes["sum_cls_score"] == (3, 11)
    feeds = {"fc7": RNG.standard_normal((3, 6)).astype(np.float32),
             "context_fc7": RNG.standard_normal((30, 6)).astype(np.float32)}
    blobs = model.run(feeds, all_blobs=True)
    ref = ref_sum(blobs["cls_score"], ref_mil(blobs["context_cls_score"], 10))
    check_everywhere(model, feeds, {"sum_cls_score": ref}, tmp_path, atol=1e-6, rtol=1e-6)
    assert caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name["mil_param"].number == 20140
    assert caffe_pb2.MILParameter.DESCRIPTOR.fields_by_name["context_per_roi"].number == 1



def visual_concepts_mil_ref(x, noisy_or):
    """s-gupta/caffe's mil_layer.cpp: per (n, c) over the map in row-major order, from -FLT_MAX / 1 in float32."""
    n, c = x.shape[:2]
    out = np.zeros((n, c, 1, 1), np.float32)
    for i in range(n):
        for j in range(c):
            best, miss = np.float32(-3.4028235e38), np.float32(1.0)
            for v in x[i, j].reshape(-1):
                best = max(best, v)
                miss = np.float32(miss * (np.float32(1.0) - v))
            out[i, j] = max(np.float32(1.0) - miss, best) if noisy_or else best
    return out


@pytest.mark.parametrize("params, noisy_or", [("type: NOR", True), ("type: MAX", False), ("", False)])
def test_visual_concepts_mil_over_each_map(params, noisy_or, tmp_path):
    # s-gupta/visual-concepts mil_finetune.prototxt.deploy: Sigmoid, then MIL NOR (and MAX on the raw scores);
    # an empty mil_param is its default MAX (R*CNN's reading needs context_per_roi)
    x = np.random.default_rng(5).random((2, 3, 4, 5)).astype(np.float32)
    model = load_from_text(mil_net(x.shape, params))
    assert model.blob_shapes["o"] == (2, 3, 1, 1)
    check_everywhere(model, {"x": x}, {"o": visual_concepts_mil_ref(x, noisy_or)}, tmp_path, atol=1e-6, rtol=1e-6)


def test_visual_concepts_mil_nor_refuses_values_that_are_not_probabilities():
    model = load_from_text(mil_net((1, 2, 3, 3), "type: NOR"))
    with pytest.raises(LayerError, match="takes probabilities in \\[0, 1\\]"):
        model.run({"x": np.full((1, 2, 3, 3), 1.5, np.float32)})
