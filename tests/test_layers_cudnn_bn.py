"""hujie-frank/GENet's CuDNNBatchNorm (ae791f8 cudnn_batch_norm_layer.cu; SKNet's nets give it
batch_norm_param): scale (x - mean) / sqrt(variance + max(eps, 1e-5)) + bias at TEST.  cuDNN's own order of
operations is unknown: compared to 1e-6."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


@pytest.mark.parametrize("param, eps", [("cudnn_batch_norm_param { eps: 1e-3 }", 1e-3),
                                        ("cudnn_batch_norm_param { eps: 1e-7 }", 1e-5),     # cuDNN's minimum
                                        ("batch_norm_param { frozen: false momentum: 0.95 }", 1e-5)])   # SKNet's
def test_inference_with_running_statistics(param, eps, tmp_path):
    x = rng(1).standard_normal((2, 3, 4, 5)).astype(F)
    model = load_from_text(net(f'layer {{ name: "bn" type: "CuDNNBatchNorm" bottom: "x" top: "o" {param} }}',
                               inputs={"x": x.shape}), random_weights=True)
    node = model.layers[-1]
    g = rng(2)
    scale, bias, mean = (g.standard_normal((1, 3, 1, 1)).astype(F) for _ in range(3))
    var = g.uniform(0.5, 2, (1, 3, 1, 1)).astype(F)
    node.blobs = [scale, bias, mean, var]
    want = (scale.astype(np.float64) * (x - mean) / np.sqrt(var.astype(np.float64) + eps) + bias).astype(F)
    check_everywhere(model, {"x": x}, {"o": want}, tmp_path, rtol=1e-6, atol=1e-6)


def test_sknet_fields_belong_to_cudnn_batch_norm_only():
    with pytest.raises(LayerError, match="SKNet's CuDNNBatchNorm field"):
        load_from_text(net('layer { name: "bn" type: "BatchNorm" bottom: "x" top: "o" batch_norm_param { frozen: true } }',
                           inputs={"x": (1, 2, 3, 3)}))
    with pytest.raises(LayerError, match="not use_global_stats"):
        load_from_text(net('layer { name: "bn" type: "CuDNNBatchNorm" bottom: "x" top: "o" '
                           'batch_norm_param { use_global_stats: true } }', inputs={"x": (1, 2, 3, 3)}))
