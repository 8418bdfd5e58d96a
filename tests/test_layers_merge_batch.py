"""yifita/caffe's MergeBatch (caffeq/layers/merge_batch.py) against merge_batch_layer.cpp's loops written here, on
asymmetric shapes, in torch, onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

F = np.float32
FLT_MAX = np.finfo(F).max


def ref_merge(op, coeff, xs):
    """MergeBatchLayer::Forward_cpu: SUM with caffe_axpy per item (coefficient (i, j) or 1); MAX from -FLT_MAX,
    replaced where top < bottom, items with coefficient 0 skipped."""
    items, inner = xs[0].shape[0], int(np.prod(xs[0].shape[1:]))
    top = np.zeros(items * inner, F) if op == "SUM" else np.full(items * inner, -FLT_MAX, F)
    c = None if coeff is None else coeff.reshape(-1)
    for i, x in enumerate(xs):
        flat = x.reshape(-1)
        for j in range(items):
            w = F(1) if c is None else c[i * items + j]
            for k in range(inner):
                at = j * inner + k
                if op == "SUM":
                    top[at] = F(top[at] + w * flat[at])
                elif (c is None or w != 0) and top[at] < flat[at]:
                    top[at] = flat[at]
    return top.reshape(xs[0].shape)


@pytest.mark.parametrize("op", ["SUM", "MAX"])
@pytest.mark.parametrize("weighted", [False, True])
def test_merge_batch_matches_the_forks_loops(op, weighted, tmp_path):
    shape = (3, 2, 5, 4)
    r = rng(21)
    xs = [r.standard_normal(shape).astype(F) for _ in range(3)]
    if op == "MAX":
        xs[1][0, 0, 0, 0] = np.nan                 # the strict < never takes a NaN in
    coeff = np.array([[1, 0, 0.5], [0, 0, 2], [-1, 0, 0]], F).reshape(1, 1, 3, 3)   # item 1 skipped by every bottom
    inputs = {"c": coeff.shape} if weighted else {}
    inputs.update({f"x{i}": shape for i in range(3)})
    bottoms = ('bottom: "c" ' if weighted else "") + " ".join(f'bottom: "x{i}"' for i in range(3))
    text = net(f'layer {{ name: "m" type: "MergeBatch" {bottoms} top: "y" merge_batch_param {{ operation: {op} '
               f'{"ignore_blob: true" if weighted else ""} }} }}', inputs=inputs)
    model = load_from_text(text)
    feeds = {f"x{i}": x for i, x in enumerate(xs)}
    if weighted:
        feeds["c"] = coeff
    ref = ref_merge(op, coeff if weighted else None, xs)
    if weighted and op == "MAX":
        assert (ref[1] == -FLT_MAX).all()
    check_everywhere(model, feeds, {"y": ref}, tmp_path, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("layer, message", [
    ('bottom: "a" bottom: "b" top: "y" merge_batch_param { operation: MEAN }', "MEAN: the fork's forward aborts"),
    ('bottom: "a" bottom: "c" top: "y"', r"the data bottoms must all have one shape, got \[\[2, 3\], \[3, 3\]\]"),
    ('bottom: "a" bottom: "b" top: "y" merge_batch_param { ignore_blob: true }', r"MergeBatch takes at least 3 "
     r"bottoms \(coefficients, data, data, ...\)"),
    ('bottom: "k" bottom: "a" bottom: "b" top: "y" merge_batch_param { ignore_blob: true }',
     r"coefficients must be \(1, 1, 2 data bottoms, 2 items\), got \[1, 1, 2, 3\]"),
])
def test_merge_batch_refusals(layer, message):
    with pytest.raises(CaffeqError, match=message):
        load_from_text(net(f'layer {{ name: "m" type: "MergeBatch" {layer} }}',
                           inputs={"a": (2, 3), "b": (2, 3), "c": (3, 3), "k": (1, 1, 2, 3)}))


def test_merge_batch_reads_the_first_values_of_a_larger_coefficient_blob(tmp_path):
    # the fork CHECKs only axes 2 and 3 of the coefficients and reads their first D x B values
    xs = [rng(22 + i).standard_normal((2, 3)).astype(F) for i in range(2)]
    coeff = np.arange(8, dtype=F).reshape(2, 1, 2, 2) - 2
    text = net('layer { name: "m" type: "MergeBatch" bottom: "c" bottom: "a" bottom: "b" top: "y" merge_batch_param { '
               'ignore_blob: true } }', inputs={"c": coeff.shape, "a": (2, 3), "b": (2, 3)})
    ref = ref_merge("SUM", coeff.reshape(-1)[:4], xs)
    check_everywhere(load_from_text(text), {"c": coeff, "a": xs[0], "b": xs[1]}, {"y": ref}, tmp_path, atol=1e-6)
