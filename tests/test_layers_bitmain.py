"""Bitmain's BM1880 toolchain dialect: InputParameter.enable_quantize (its int8 mode's input), BMNet (a compiled
sub-graph: sized from bmnet_param.output_shape, not run) and upsample_param.size (its yolov3's nearest
upsampling), against the shapes and values those files need."""
import numpy as np
import pytest
from conftest import check_everywhere, rng

from caffeq.errors import CaffeqError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

INPUT = 'layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 2 dim: 3 dim: 4 } enable_quantize: 1 } }\n'


def test_upsample_size_is_nearest_upsampling_by_that_factor(tmp_path):
    # Edge-Development-Toolchain's yolov3: upsample_param { size: 2 }; a factor 3 shows size is read, not the default
    model = load_from_text(INPUT + 'layer { name: "up" type: "Upsample" bottom: "data" top: "up" '
                                   'upsample_param { size: 3 } }')
    assert model.net.layer[0].input_param.enable_quantize
    assert any("upsample_param.size 3: read as nearest upsampling" in w for w in model.warnings)
    x = rng(98).standard_normal((1, 2, 3, 4)).astype(np.float32)
    check_everywhere(model, {"data": x}, {"up": x.repeat(3, axis=2).repeat(3, axis=3)}, tmp_path)
    with pytest.raises(LayerError, match="upsample_param.size .* no other field: scale"):
        load_from_text(INPUT + 'layer { name: "up" type: "Upsample" bottom: "data" top: "up" '
                               'upsample_param { size: 2 scale: 2 } }')
    with pytest.raises(LayerError, match="upsample_param.size .* no other field: stride"):
        load_from_text(INPUT + 'layer { name: "up" type: "Upsample" bottom: "data" top: "up" '
                               'upsample_param { size: 3 stride: 2 } }')


BMNET = INPUT.replace(" enable_quantize: 1", "") + '''layer { name: "bmnet" type: "BMNet" bottom: "data" top: "cls" top: "box"
  bmnet_param { input_shape { dim: 1 dim: 2 dim: 3 dim: 4 data_type_size: 1 }
                output_shape { dim: 1 dim: 4 dim: 10 dim: 10 data_type_size: 1 }
                output_shape { dim: 1 dim: 8 dim: 10 dim: 10 data_type_size: 1 }
                in_threshold: 152.09 bmodel: "/disk2/bmtap2/out/tiny_ssh.bmodel" } }
'''


def test_bmnet_is_sized_from_its_output_shapes_and_not_run():
    model = load_from_text(BMNET)
    assert (model.blob_shapes["cls"], model.blob_shapes["box"]) == ((1, 4, 10, 10), (1, 8, 10, 10))
    assert model.net.layer[1].bmnet_param.output_shape[0].data_type_size == 1
    with pytest.raises(CaffeqError, match=r"layer 'bmnet' \(BMNet\): a sub-graph compiled for Bitmain's BM1880 chip "
                                          r"\(/disk2/bmtap2/out/tiny_ssh.bmodel\)"):
        model.run({"data": np.zeros((1, 2, 3, 4), np.float32)})


@pytest.mark.parametrize("edit, message", [
    (('top: "box"', ""), "gives 2 output_shape\\(s\\) for 1 tops"),
    (("dim: 1 dim: 2 dim: 3 dim: 4 data_type_size", "dim: 1 dim: 2 dim: 5 dim: 4 data_type_size"),
     "bottom 0 is \\[1, 2, 3, 4\\]; bmnet_param.input_shape says \\[1, 2, 5, 4\\]")])
def test_bmnet_refusals(edit, message):
    with pytest.raises(LayerError, match=message):
        load_from_text(BMNET.replace(*edit))
