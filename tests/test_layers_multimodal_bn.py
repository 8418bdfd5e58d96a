"""mancinimassimiliano/caffe's MultiModalBatchNorm (caffeq/layers/multimodal_bn.py) against its TEST forward
written here (multimodal_batch_norm_layer.cpp), in torch, onnxruntime and model.py, inside the fork's cifar10
pattern: one layer per latent domain, summed, then one Scale."""
import numpy as np
import pytest
from conftest import check_everywhere, net, node_of, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

F = np.float32

TEXT = ('layer {{ name: "bn1" type: "MultiModalBatchNorm" bottom: "x" bottom: "w1" top: "b1" {extra} }}\n'
        'layer {{ name: "bn2" type: "MultiModalBatchNorm" bottom: "x" bottom: "w2" top: "b2" {extra} }}\n'
        'layer {{ name: "sum" type: "Eltwise" bottom: "b1" bottom: "b2" top: "o" }}')


def mmbn_ref(x, w, mean, var, eps=1e-5):
    n, c = x.shape[:2]
    out = np.empty(x.shape)
    for i in range(n):
        for j in range(c):
            out[i, j] = float(w.reshape(-1)[i]) * (x[i, j] - mean[j]) / np.sqrt(float(var[j]) + eps)
    return out


def test_domain_normalizations_weighted_per_sample(tmp_path):
    shape = (3, 4, 2, 5)
    model = load_from_text(net(TEXT.format(extra=""), inputs={"x": shape, "w1": (3, 1), "w2": (3, 1)}),
                           random_weights=True)
    g = rng(8)
    stats = {}
    for name in ("bn1", "bn2"):
        mean, var = g.standard_normal(4).astype(F), g.uniform(0.5, 2, 4).astype(F)
        node_of(model, name).blobs = [mean, var, np.zeros(1, F)]
        stats[name] = (mean, var)
    x = g.standard_normal(shape).astype(F)
    w1 = g.uniform(0, 1, (3, 1)).astype(F)
    w2 = (1 - w1).astype(F)
    want = mmbn_ref(x, w1, *stats["bn1"]) + mmbn_ref(x, w2, *stats["bn2"])
    check_everywhere(model, {"x": x, "w1": w1, "w2": w2}, {"o": want.astype(F)}, tmp_path, atol=1e-5, rtol=1e-5)


def test_training_statistics_are_refused(tmp_path):
    model = load_from_text(net(TEXT.format(extra="multimodal_batch_norm_param { use_global_stats: false }"),
                               inputs={"x": (2, 3), "w1": (2, 1), "w2": (2, 1)}), random_weights=True)
    with pytest.raises(CaffeqError, match="training statistics .* not implemented"):
        model.run({"x": np.ones((2, 3), F), "w1": np.ones((2, 1), F), "w2": np.ones((2, 1), F)})
    # the exports refuse it too: they would compute with the stored statistics, which Caffe does not use
    with pytest.raises(CaffeqError, match="training statistics .* not implemented"):
        model.export_onnx(str(tmp_path / "m.onnx"))
    assert not (tmp_path / "m.onnx").exists()
