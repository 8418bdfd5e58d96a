"""Joins of blobs that differ only in trailing axes of 1, as Caffe held them before N-D blobs (early
2015, when an InnerProduct gave (N, C, 1, 1)): the DQN nets of that era (muupan/dqn-in-the-caffe)
multiply an InnerProduct's Q values by a 4-axis MemoryData filter, and concatenate them with one.
Modern Caffe refuses these nets; the era they were written for ran them on the 4-axis blobs."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

f32 = np.float32


@pytest.mark.parametrize("op, ref", [("PROD", lambda a, b: a * b), ("SUM", lambda a, b: a + b),
                                     ("MAX", np.maximum)])
def test_eltwise_joins_a_2_axis_and_a_4_axis_blob(op, ref, tmp_path):
    g = rng(3)
    q = g.standard_normal((3, 5)).astype(f32)
    mask = g.standard_normal((3, 5, 1, 1)).astype(f32)
    model = load_from_text(net(f'layer {{ name: "e" type: "Eltwise" bottom: "q" bottom: "mask" top: "y" '
                               f'eltwise_param {{ operation: {op} }} }}', inputs={"q": q.shape, "mask": mask.shape}))
    assert model.blob_shapes["y"] == (3, 5, 1, 1)
    assert any("before N-D blobs" in n for n in model.warnings)
    check_everywhere(model, {"q": q, "mask": mask}, {"y": ref(q[:, :, None, None], mask)}, tmp_path)


def test_concat_joins_a_4_axis_and_a_2_axis_blob(tmp_path):
    g = rng(5)
    # toasthaha/tle's dqn.prototxt: concat of a (N, 1, 1, 1) frame number and a (N, 256) InnerProduct
    a = g.standard_normal((2, 1, 1, 1)).astype(f32)
    b = g.standard_normal((2, 4)).astype(f32)
    c = g.standard_normal((2, 3, 1)).astype(f32)
    model = load_from_text(net('layer { name: "c" type: "Concat" bottom: "a" bottom: "b" bottom: "c" top: "y" }',
                               inputs={"a": a.shape, "b": b.shape, "c": c.shape}))
    assert model.blob_shapes["y"] == (2, 8, 1, 1)
    ref = np.concatenate([a, b[:, :, None, None], c[:, :, :, None]], axis=1)
    check_everywhere(model, {"a": a, "b": b, "c": c}, {"y": ref}, tmp_path)


def test_v1_dqn_net_runs_as_its_era(tmp_path):
    g = rng(7)
    text = """
layers { name: "frames" type: MEMORY_DATA top: "frames" top: "d1"
  memory_data_param { batch_size: 2 channels: 3 height: 6 width: 5 } }
layers { name: "filter" type: MEMORY_DATA top: "filter" top: "d2"
  memory_data_param { batch_size: 2 channels: 4 height: 1 width: 1 } }
layers { name: "silence" type: SILENCE bottom: "d1" bottom: "d2" }
layers { name: "ip" type: INNER_PRODUCT bottom: "frames" top: "q" inner_product_param { num_output: 4 } }
layers { name: "eltwise" type: ELTWISE bottom: "q" bottom: "filter" top: "filtered"
  eltwise_param { operation: PROD } }
"""
    model = load_from_text(text, random_weights=True)
    assert model.blob_shapes["filtered"] == (2, 4, 1, 1)
    w, bias = (np.asarray(b, np.float64) for b in model.params["ip"])
    frames = g.standard_normal((2, 3, 6, 5)).astype(f32)
    mask = g.standard_normal((2, 4, 1, 1)).astype(f32)
    q = frames.reshape(2, -1).astype(np.float64) @ w.T + bias
    labels = np.zeros(2, f32)   # the MemoryData label tops, silenced
    feeds = {"frames": frames, "filter": mask, "d1": labels, "d2": labels}
    check_everywhere(model, feeds, {"filtered": q[:, :, None, None] * mask}, tmp_path, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layer, shapes, msg", [
    ('type: "Eltwise"', {"a": (3, 5), "b": (3, 5, 2)}, "Eltwise needs equal shapes"),
    ('type: "Eltwise"', {"a": (3, 5, 1, 1), "b": (3, 4, 1, 1)}, "Eltwise needs equal shapes"),
    ('type: "Concat"', {"a": (3, 5), "b": (3, 5, 2, 1)}, "must match except along axis 1"),
    ('type: "Concat"', {"a": (3, 5, 1, 1, 1), "b": (3, 5)}, "bottom 1 has 2 axes, bottom 0 has 5"),
])
def test_joins_that_no_caffe_era_reads_are_refused(layer, shapes, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net(f'layer {{ name: "j" {layer} bottom: "a" bottom: "b" top: "y" }}', inputs=shapes))
