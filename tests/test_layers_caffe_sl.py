"""wanji/caffe-sl's layers (caffeq/layers/caffe_sl.py) against formulas written here from its
dotproduct_similarity_layer.cpp, euclidean_similarity_layer.cpp and triplet_image_data_layer.cpp, in torch,
onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


@pytest.mark.parametrize("a_shape, b_shape", [((4, 3, 2, 5), (4, 3, 2, 5)), ((3, 7), (3, 7, 1, 1)),
                                              ((2, 6), (2, 3, 4))])   # the fork reads dim = count / num of bottom 0
def test_similarities_match_the_forks_loops(a_shape, b_shape, tmp_path):
    text = net('layer { name: "d" type: "DotProductSimilarity" bottom: "a" bottom: "b" top: "dot" }',
               *(['layer { name: "e" type: "EuclideanSimilarity" bottom: "a" bottom: "b" top: "euc" }']
                 if np.prod(a_shape) == np.prod(b_shape) else []),
               inputs={"a": a_shape, "b": b_shape})
    model = load_from_text(text)
    a = rng(1).standard_normal(a_shape).astype(F)
    b = rng(2).standard_normal(b_shape).astype(F)
    n = a_shape[0]
    dim = a.size // n
    fa, fb = a.astype(np.float64).reshape(n, dim), b.astype(np.float64).reshape(-1)[:n * dim].reshape(n, dim)
    refs = {"dot": (fa * fb).sum(1).reshape(n, 1, 1, 1).astype(F)}
    if "euc" in model.blob_shapes:
        refs["euc"] = (-0.5 * ((fa - fb) ** 2).sum(1)).reshape(n, 1, 1, 1).astype(F)
    assert model.blob_shapes["dot"] == (n, 1, 1, 1)
    check_everywhere(model, {"a": a, "b": b}, refs, tmp_path, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layer, b_shape, message", [
    ("DotProductSimilarity", (3, 4), "same num"),
    ("DotProductSimilarity", (2, 2), "fewer values"),
    ("EuclideanSimilarity", (2, 5), "samples of the same size"),
])
def test_similarities_refuse_what_the_fork_checks_or_reads_past(layer, b_shape, message):
    with pytest.raises(LayerError, match=message):
        load_from_text(net(f'layer {{ name: "s" type: "{layer}" bottom: "a" bottom: "b" top: "s" }}',
                           inputs={"a": (2, 4), "b": b_shape}))


def test_triplet_image_data_holds_three_batches():
    # the mnist_sl example: 16 lines of (query, positive, negative) -> a (48, C, 28, 28) blob, sliced at 16 and 32
    text = ('layer { name: "mnist" type: "TripletImageData" top: "data" transform_param { scale: 0.00390625 } '
            'image_data_param { source: "t10k.tri" new_width: 28 new_height: 28 batch_size: 16 is_color: false } }\n'
            'layer { name: "t" type: "Slice" bottom: "data" top: "q" top: "p" top: "n" slice_param { axis: 0 '
            'slice_point: 16 slice_point: 32 } }')
    model = load_from_text(text)
    assert model.blob_shapes["data"] == (48, 1, 28, 28)
    assert model.blob_shapes["q"] == model.blob_shapes["n"] == (16, 1, 28, 28)
