"""WeitaoVan/faceID's Mask against its GPU kernel's formula (mask_layer.cu at 888d874), in torch,
onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, net

from caffeq.layers import LayerError
from caffeq.model import load_from_text

f32 = np.float32


@pytest.mark.parametrize("param", ["", "mask_param { scale: 0.75 }"])
def test_mask_weights_every_channel_by_the_spatial_mask(param, tmp_path):
    model = load_from_text(net(f'layer {{ name: "m" type: "Mask" bottom: "x" bottom: "w" top: "y" {param} }}',
                               inputs={"x": (2, 3, 4, 5), "w": (2, 1, 4, 5)}))
    g = np.random.default_rng(6)
    x, w = g.standard_normal((2, 3, 4, 5)).astype(f32), g.random((2, 1, 4, 5)).astype(f32)
    scale = f32(0.75 if param else 1.0)
    ref = np.empty_like(x)
    for n in range(2):
        for c in range(3):    # MaskCopyGPU repeats each sample's map per channel; scaled, then multiplied
            ref[n, c] = x[n, c] * (w[n, 0] * scale)
    assert model.blob_shapes["y"] == (2, 3, 4, 5)
    check_everywhere(model, {"x": x, "w": w}, {"y": ref}, tmp_path)


@pytest.mark.parametrize("mask", [(2, 3, 4, 5), (2, 1, 4, 4), (1, 1, 4, 5)])
def test_mask_refuses_masks_its_setup_refuses(mask):
    with pytest.raises(LayerError, match="must have one channel"):
        load_from_text(net('layer { name: "m" type: "Mask" bottom: "x" bottom: "w" top: "y" }',
                           inputs={"x": (2, 3, 4, 5), "w": mask}))
