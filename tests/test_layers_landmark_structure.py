"""JiajianZeng/ContextWithStructure's landmark layers (caffeq/layers/landmark_structure.py): AveragePoint
against average_point_layer.cu's sums; its training-only FacialLandmarkPerformance and PatchSemantic, which
the inference graph drops (caffeq/training_layers.py)."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

F32 = np.float32


def test_average_point_means_the_landmarks(tmp_path):
    x = rng(2).standard_normal((3, 10)).astype(F32)   # 5 (x, y) pairs per image
    model = load_from_text(net('layer { name: "a" type: "AveragePoint" bottom: "lm" top: "root" '
                               'average_point_param { num_landmark: 5 } }', inputs={"lm": x.shape}))
    assert model.graph.tensors["root"].shape == (3, 2, 1, 1)
    pairs = x.reshape(3, 5, 2)
    ref = np.stack([pairs[:, :, 0].sum(1), pairs[:, :, 1].sum(1)], 1) / F32(5)
    check_everywhere(model, {"lm": x}, {"root": ref.reshape(3, 2, 1, 1)}, tmp_path, atol=1e-6, rtol=1e-6)
    with pytest.raises(LayerError, match=r"must hold 4 \(x, y\) pairs per image"):
        load_from_text(net('layer { name: "a" type: "AveragePoint" bottom: "lm" top: "root" '
                           'average_point_param { num_landmark: 4 } }', inputs={"lm": x.shape}))


TRAIN_NET = """
layer { name: "fc" type: "InnerProduct" bottom: "feat" top: "pred" inner_product_param { num_output: 10 } }
layer { name: "perf" type: "FacialLandmarkPerformance" bottom: "pred" bottom: "lm" bottom: "eyedist"
  top: "average_error" top: "false_rate" facial_landmark_performance_param { num_landmark: 5 } }
layer { name: "ps" type: "PatchSemantic" bottom: "lm" bottom: "pred" bottom: "feat4" top: "partial_derivatives"
  patch_semantic_param { num_landmark: 5 image_w: 40 image_h: 40 patch_w: 8 patch_h: 8
    spatial_operation_param { name: "conv1" kernel_size: 3 used: true } } }
layer { name: "res" type: "Eltwise" bottom: "pred" bottom: "lm" top: "residuals" eltwise_param { coeff: 1 coeff: -1 } }
layer { name: "loss" type: "PerceptualLoss" bottom: "residuals" bottom: "partial_derivatives" top: "loss"
  perceptual_loss_param { num_landmark: 5 } }
"""


def test_the_training_only_layers_are_dropped_at_inference():
    shapes = {"feat": (2, 6), "lm": (2, 10), "eyedist": (2, 1), "feat4": (2, 3, 4, 4)}
    model = load_from_text(net(TRAIN_NET, inputs=shapes), random_weights=True)
    assert [n.type for n in model.graph.nodes if n.type != "Input"] == ["InnerProduct", "Eltwise"]
    assert any("FacialLandmarkPerformance" in w and "PatchSemantic" in w for w in model.warnings)
    out = model.run({k: rng(1).standard_normal(s).astype(F32) for k, s in shapes.items()})
    assert "residuals" in out and not {"average_error", "false_rate", "partial_derivatives", "loss"} & set(out)
