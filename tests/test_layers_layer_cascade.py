"""Deep Layer Cascade's Mask, SpatialFilter and SegData (caffeq/layers/layer_cascade.py) against loops written
here from lxx1991/caffe_mpi_backup's mask_layer.cu (90fa387 and f1c8ae6), spatial_filter_layer.cu and
seg_data_layer.cpp, in torch, onnxruntime and model.py.  Both layers' Reshape checks num() == 1: the batch is 1,
and a batch of 2 is refused."""
import numpy as np
import pytest
from conftest import FIXTURES, check_everywhere, net, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

F = np.float32


def ref_mask(prob, label, version, thr_easy=1.0, thr_hard=1.0, ignore=0, negative=None):
    """The GPU kernels, one thread per pixel; the double 1e-9 as Caffe adds it to a float threshold."""
    c, h, w = prob.shape[1:]
    s = h * w
    p = prob.reshape(c, s).astype(np.float64)
    eps = 1e-9 if version else 0.0
    easy, hard = float(F(thr_easy)) + eps, float(F(thr_hard)) + eps
    mask = np.zeros(s, F)
    new = None if label is None else np.zeros(label.size, F)
    for i in range(s):
        mask[i] = 1
        if label is None:
            if version == 0 and negative is not None:
                if p[negative, i] > easy:
                    mask[i] = 0
            else:
                for k in range(c):
                    if p[k, i] > easy:
                        mask[i] = 0
            continue
        lv = int(label.reshape(-1)[i])     # static_cast<int>: toward zero
        new[i] = lv
        if version == 0 and negative is not None:
            drop = p[negative, i] > easy and lv == negative
        elif version == 0:
            drop = 0 <= lv < c and p[lv, i] > easy
        else:
            drop = 0 <= lv < c and p[lv, i] > easy
            if not drop:
                drop = any(p[k, i] > hard for k in range(c))
        if drop:
            mask[i] = 0
            new[i] = ignore
    mask = mask.reshape(1, 1, h, w)
    return mask if label is None else (mask, new.reshape(label.shape))


def probs(c, h, w, seed=0):
    g = rng(seed)
    x = g.standard_normal((1, c, h, w)).astype(F) * 3
    e = np.exp(x - x.max(1, keepdims=True))
    return (e / e.sum(1, keepdims=True)).astype(F)


def labels(c, h, w, seed=1):
    g = rng(seed)
    lab = g.integers(0, c, (1, 1, h, w)).astype(F) + F(0.7)   # truncated by the kernel
    lab.reshape(-1)[:3] = [255, -0.5, c]                       # ignore, rounds to 0, past the channels
    return lab


def mask_net(c, h, w, params, two=True):
    bottoms = 'bottom: "prob" bottom: "label" top: "mask" top: "new_label"' if two else 'bottom: "prob" top: "mask"'
    inputs = {"prob": (1, c, h, w)} | ({"label": (1, 1, h, w)} if two else {})
    return net(f'layer {{ name: "m" type: "Mask" {bottoms} mask_param {{ {params} }} }}', inputs=inputs)


@pytest.mark.parametrize("easy,hard", [(0.6, 0.9), (0.9, 0.45), (0.98, 0.98)])
def test_mask_two_tops_head_version(easy, hard, tmp_path):
    c, h, w = 5, 7, 9
    prob, label = probs(c, h, w), labels(c, h, w)
    model = load_from_text(mask_net(c, h, w, f"threshold_easy: {easy} threshold_hard: {hard} ignore_label: 255"))
    mask, new = ref_mask(prob, label, 1, easy, hard, 255)
    assert 0 < mask.sum() < mask.size
    check_everywhere(model, {"prob": prob, "label": label}, {"mask": mask, "new_label": new}, tmp_path)


def test_mask_one_top_reads_threshold_easy_only(tmp_path):
    c, h, w = 4, 5, 11
    prob = probs(c, h, w, 3)
    model = load_from_text(mask_net(c, h, w, "threshold_easy: 0.55 threshold_hard: 0.1", two=False))
    mask = ref_mask(prob, None, 1, 0.55, 0.1)
    assert 0 < mask.sum() < mask.size
    check_everywhere(model, {"prob": prob}, {"mask": mask}, tmp_path)


def test_mask_epsilon_at_a_zero_threshold(tmp_path):
    """prob > 0 + 1e-9 in double: a positive prob at or below 1e-9 keeps the pixel."""
    c, h, w = 2, 3, 5
    prob = np.zeros((1, c, h, w), F)
    prob[0, 0, 0, :3] = [F(1e-9), F(5e-10), F(2e-9)]
    model = load_from_text(mask_net(c, h, w, "threshold_easy: 0", two=False))
    mask = ref_mask(prob, None, 1, 0.0)
    assert mask[0, 0, 0, :3].tolist() == [1.0, 1.0, 0.0]
    check_everywhere(model, {"prob": prob}, {"mask": mask}, tmp_path)


@pytest.mark.parametrize("negative", [None, 2])
@pytest.mark.parametrize("two", [True, False])
def test_mask_before_90fa387(negative, two, tmp_path):
    c, h, w = 4, 6, 9
    prob, label = probs(c, h, w, 5), labels(c, h, w, 6)
    label.reshape(-1)[5:20] = 2
    params = "threshold: 0.5 ignore_label: 255" + (f" negative_label: {negative}" if negative is not None else "")
    model = load_from_text(mask_net(c, h, w, params, two))
    if two:
        mask, new = ref_mask(prob, label, 0, 0.5, ignore=255, negative=negative)
        refs, feeds = {"mask": mask, "new_label": new}, {"prob": prob, "label": label}
    else:
        mask = ref_mask(prob, None, 0, 0.5, negative=negative)
        refs, feeds = {"mask": mask}, {"prob": prob}
    assert 0 < mask.sum() < mask.size
    check_everywhere(model, feeds, refs, tmp_path)


def test_mask_before_90fa387_compares_without_epsilon(tmp_path):
    """f1c8ae6's prob > threshold has no + 1e-9: at threshold 0 a prob of 5e-10 drops the pixel, a prob equal
    to the threshold keeps it."""
    c, h, w = 2, 3, 5
    prob = np.zeros((1, c, h, w), F)
    prob[0, 1, 0, :3] = [F(5e-10), F(1e-9), F(-1e-9)]
    model = load_from_text(mask_net(c, h, w, "threshold: 0", two=False))
    mask = ref_mask(prob, None, 0, 0.0)
    assert mask[0, 0, 0, :4].tolist() == [0.0, 0.0, 1.0, 1.0]
    check_everywhere(model, {"prob": prob}, {"mask": mask}, tmp_path)


def test_other_forks_masks_are_not_claimed():
    """caffe-gan's Mask (imp_map_param, 1 bottom, 1 top), LSTM-CF's (no bottom) and faceID's (2 bottoms, 1 top,
    with or without mask_param) keep their own specs."""
    from caffeq.io.prototxt import parse_prototxt_text
    from caffeq.layers.registry import spec_for
    text = ('layer { name: "g" type: "Mask" bottom: "x" top: "g" imp_map_param { channel_out: 4 } }'
            'layer { name: "l" type: "Mask" top: "l" mask_param { width: 5 height: 4 } }'
            'layer { name: "f" type: "Mask" bottom: "x" bottom: "w" top: "f" }'
            'layer { name: "s" type: "Mask" bottom: "x" bottom: "w" top: "s" mask_param { scale: 2 } }'
            'layer { name: "c" type: "Mask" bottom: "x" top: "c" }')
    modules = [type(spec_for(lp)).__module__.rsplit(".", 1)[-1] for lp in parse_prototxt_text(text).layer]
    assert modules == ["caffe_gan", "lstm_cf", "faceid", "faceid", "layer_cascade"]


def test_faceid_mask_still_reads():
    text = net('layer { name: "m" type: "Mask" bottom: "x" bottom: "w" top: "y" mask_param { scale: 2 } }',
               inputs={"x": (2, 3, 4, 5), "w": (2, 1, 4, 5)})
    x, m = rng(2).standard_normal((2, 3, 4, 5)).astype(F), rng(3).standard_normal((2, 1, 4, 5)).astype(F)
    np.testing.assert_array_equal(load_from_text(text).run({"x": x, "w": m})["y"], x * (m * F(2)))


@pytest.mark.parametrize("layer,needle", [
    ('bottom: "prob" bottom: "label" top: "mask" mask_param { threshold_easy: 0.9 }', "lxx1991's"),
    ('bottom: "prob" bottom: "label" top: "mask" top: "l2" mask_param { scale: 2 }', "ambiguous Mask"),
    ('bottom: "prob" top: "mask" mask_param { threshold: 0.9 threshold_hard: 0.5 }', "one version's fields"),
    ('bottom: "prob" top: "mask" mask_param { threshold: 0.9 negative_label: 7 }', "negative_label 7"),
])
def test_mask_refusals(layer, needle):
    text = net(f'layer {{ name: "m" type: "Mask" {layer} }}', inputs={"prob": (1, 4, 3, 5), "label": (1, 1, 3, 5)})
    with pytest.raises(CaffeqError, match=needle) as e:
        load_from_text(text)
    assert "\n" not in str(e.value)


def test_mask_refuses_a_batch_of_two():
    with pytest.raises(CaffeqError, match="CHECK_EQ"):
        load_from_text(mask_net(3, 4, 5, "threshold_easy: 0.9", two=False).replace("dim: 1 dim: 3", "dim: 2 dim: 3"))


def ref_filter(mask, data):
    c = data.shape[1]
    s = mask.size
    m, x = mask.reshape(s), data.reshape(c, s)
    out = np.empty_like(x)
    for i in range(s):
        for k in range(c):
            out[k, i] = 0 if m[i] < 0.5 else x[k, i]
    return out.reshape(data.shape)


def test_spatial_filter(tmp_path):
    c, h, w = 6, 5, 7
    g = rng(7)
    mask = g.uniform(0, 1, (1, 1, h, w)).astype(F)
    mask.reshape(-1)[:3] = [0.5, np.nextafter(F(0.5), F(0)), np.nan]
    data = g.standard_normal((1, c, h, w)).astype(F)
    model = load_from_text(net('layer { name: "f" type: "SpatialFilter" bottom: "m" bottom: "x" top: "y" }',
                               inputs={"m": (1, 1, h, w), "x": (1, c, h, w)}))
    ref = ref_filter(mask, data)
    assert (ref.reshape(c, -1)[:, 1] == 0).all() and (ref.reshape(c, -1)[:, 2] == data.reshape(c, -1)[:, 2]).all()
    check_everywhere(model, {"m": mask, "x": data}, {"y": ref}, tmp_path)


@pytest.mark.parametrize("shapes,needle", [
    (((1, 2, 5, 7), (1, 6, 5, 7)), "one-channel mask"),
    (((2, 1, 5, 7), (2, 6, 5, 7)), "num-1"),
    (((1, 1, 5, 7), (1, 6, 7, 5)), "height and width"),
])
def test_spatial_filter_refusals(shapes, needle):
    text = net('layer { name: "f" type: "SpatialFilter" bottom: "m" bottom: "x" top: "y" }',
               inputs={"m": shapes[0], "x": shapes[1]})
    with pytest.raises(CaffeqError, match=needle):
        load_from_text(text)


SEG = """layer { name: "data" type: "SegData" top: "data" top: "label"
  seg_data_param { source: "list.txt" root_dir: "d/" shuffle: true balance: true }
  transform_param { stride: 32 upper_height: 448 upper_width: 896 mean_value: [104, 117, 123] } }
layer { name: "sm" type: "Softmax" bottom: "data" top: "prob" }
layer { name: "m" type: "Mask" bottom: "prob" bottom: "label" top: "mask" top: "new"
  mask_param { threshold_easy: 0.5 threshold_hard: 0.9 ignore_label: 255 } }
layer { name: "f" type: "SpatialFilter" bottom: "mask" bottom: "data" top: "y" }
"""


def test_seg_data_label_follows_the_data(tmp_path):
    model = load_from_text(SEG, input_shapes={"data": (1, 3, 7, 9)})
    x = rng(9).standard_normal((1, 3, 7, 9)).astype(F) * 2
    lab = labels(3, 7, 9, 10)
    e = np.exp(x - x.max(1, keepdims=True))
    prob = (e / e.sum(1, keepdims=True)).astype(F)
    out = model.run({"data": x, "label": lab}, all_blobs=True)
    mask, new = ref_mask(out["prob"], lab, 1, 0.5, 0.9, 255)
    np.testing.assert_allclose(out["prob"], prob, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(out["mask"], mask)
    np.testing.assert_array_equal(out["new"], new)
    np.testing.assert_array_equal(out["y"], ref_filter(mask, x))


def test_seg_data_needs_the_image_size_and_batch_one():
    with pytest.raises(CaffeqError, match="--input-shape data="):
        load_from_text(SEG)
    with pytest.raises(CaffeqError, match="batch of 1"):
        load_from_text(SEG, input_shapes={"data": (2, 3, 7, 9)})


def mix_and_match_seg(batch, crop):
    crop_field = f"crop_size: {crop} " if crop else ""
    return ('layer { name: "data" type: "SegData" top: "data" top: "label" '
            f'seg_data_param {{ source: "l.txt" batch_size: {batch} shuffle: true }} '
            f'transform_param {{ mirror: true {crop_field}mean_value: [104, 117, 123] ignore_label: 255 }} }}\n'
            'layer { name: "c" type: "Convolution" bottom: "data" top: "c" convolution_param { num_output: 2 kernel_size: 3 } }')


def test_mix_and_match_seg_data_sizes_a_batch_by_crop_size():
    # XiaohangZhan/mix-and-match's SegData: batch_size colour images cropped to crop_size, labels of one channel
    model = load_from_text(mix_and_match_seg(5, 13), phase="TRAIN")
    shapes = model.blob_shapes
    assert shapes["data"] == (5, 3, 13, 13) and shapes["label"] == (5, 1, 13, 13)
    assert shapes["c"] == (5, 2, 11, 11)


def test_mix_and_match_seg_data_refusals():
    with pytest.raises(CaffeqError, match="batch_size 4 needs transform_param.crop_size"):
        load_from_text(mix_and_match_seg(4, 0), phase="TRAIN")
    with pytest.raises(CaffeqError, match=r"seg_data_param\.batch_size must be >= 1"):
        load_from_text(mix_and_match_seg(0, 13), phase="TRAIN")
    with pytest.raises(CaffeqError, match="--input-shape data="):   # batch 1 without a crop: the image decides
        load_from_text(mix_and_match_seg(1, 0), phase="TRAIN")


@pytest.mark.parametrize("name", ["XiaohangZhan__mix-and-match__Alexnet__jigsaw__train_graph.prototxt"])
def test_mix_and_match_file_reads(name):
    model = load_from_text((FIXTURES.parent / "realworld" / name).read_text(), phase="TRAIN", unknown_shapes_ok=True)
    assert model.blob_shapes["data"] == (40, 3, 512, 512)


def test_mix_and_match_seg_data_of_batch_one_is_still_cropped():
    # seg_data_layer.cpp: has_crop_size() sizes the tops whatever batch_size is (an explicit 1 here)
    shapes = load_from_text(mix_and_match_seg(1, 13), phase="TRAIN").blob_shapes
    assert shapes["data"] == (1, 3, 13, 13) and shapes["label"] == (1, 1, 13, 13)


def test_mix_and_match_seg_data_refuses_another_batch_from_the_input_shape():
    with pytest.raises(CaffeqError, match=r"SegData gives a batch of 5 \(seg_data_param.batch_size\), got "
                                          r"--input-shape \[2, 3, 13, 13\]"):
        load_from_text(mix_and_match_seg(5, 13), phase="TRAIN", input_shapes={"data": (2, 3, 13, 13)})
