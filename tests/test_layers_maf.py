"""He-Zhenwei/MAF's Enlarge and InnerProductCLS: references written from the fork's enlargeforward CUDA
kernel (its index arithmetic, loop by loop) and inner_product_cls_layer.cpp's Forward (InnerProduct, then a
copy of the weight blob), compared in torch, onnxruntime and the generated model.py."""

import numpy as np
import pytest
from conftest import REPO, check_everywhere, net, node_of, rng

from caffeq.layers import LayerError
from caffeq.model import load, load_from_text

CORPUS = REPO / "tests" / "fixtures" / "realworld"


def enlarge_ref(x, s):
    """enlargeforward: one thread per top element, index = ((b * C' + j) * H' + h) * W' + w."""
    n, c, h, w = x.shape
    th, tw, tc = h // s, w // s, c * s * s
    top = np.empty((n, tc, th, tw), x.dtype)
    for b in range(n):
        for j in range(tc):
            src_c, dy, dx = j // (s * s), (j % (s * s)) // s, j % s
            for y in range(th):
                for z in range(tw):
                    top[b, j, y, z] = x[b, src_c, y * s + dy, z * s + dx]
    return top


@pytest.mark.parametrize("scale, shape", [(2, (2, 3, 6, 4)), (4, (1, 2, 9, 10)), (3, (2, 1, 7, 5))])
def test_enlarge(scale, shape, tmp_path):
    model = load_from_text(net(f'layer {{ name: "e" type: "Enlarge" bottom: "x" top: "y" '
                               f'enlarge_param {{ scale: {scale} }} }}', inputs={"x": shape}))
    x = rng(31).standard_normal(shape).astype(np.float32)
    ref = enlarge_ref(x, scale)
    assert model.blob_shapes["y"] == ref.shape
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path)


def test_enlarge_scale_must_exceed_one():
    with pytest.raises(LayerError, match="scale must be > 1"):
        load_from_text(net('layer { name: "e" type: "Enlarge" bottom: "x" top: "y" enlarge_param { scale: 1 } }',
                           inputs={"x": (1, 1, 4, 4)}))


@pytest.mark.parametrize("extra", ["", "bias_term: false", "transpose: true"])
def test_inner_product_cls(extra, tmp_path):
    model = load_from_text(net('layer { name: "q" type: "InnerProductCLS" bottom: "x" top: "y" top: "w" '
                               f'inner_product_param {{ num_output: 5 {extra} }} }}', inputs={"x": (3, 2, 2, 2)}),
                           random_weights=True)
    blobs = node_of(model, "q").blobs
    x = rng(32).standard_normal((3, 2, 2, 2)).astype(np.float32)
    w = blobs[0].astype(np.float64)
    product = x.reshape(3, -1).astype(np.float64) @ (w if "transpose" in extra else w.T)
    if len(blobs) > 1:
        product = product + blobs[1]
    check_everywhere(model, {"x": x}, {"y": product, "w": blobs[0]}, tmp_path, atol=1e-5)


@pytest.mark.skipif(not CORPUS.exists(), reason="the corpus files are not on this machine")
def test_maf_train_net_sizes_its_domain_branch():
    model = load(CORPUS / "He-Zhenwei__MAF__caffe-fast-rcnn__python__train_m.prototxt",
                 input_shapes={"data": (1, 3, 600, 1000), "im_info": (1, 3), "gt_boxes": (1, 5)},
                 phase="TRAIN", unknown_shapes_ok=True)
    assert model.blob_shapes["conv3_up_size"] == model.blob_shapes["conv4_up_size"] == (1, 1024, 37, 62)
