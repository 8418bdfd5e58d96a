"""sshige/rgbd-saliency's superpixel feature layers: read and sized as the fork's Reshape methods size them
(RGBDNet_test's shapes at 324 x 324: slic 1x1x324x324, flags 1x1x18x18, features 324x29x20x20 and 324x10x20x20),
refused to run or export with one message (the fork computes them on the GPU only)."""
import numpy as np
import pytest
from conftest import net

from caffeq.errors import CaffeqError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

LAYERS = '''layer { name: "genslic" type: "GenSlicinfo" bottom: "data" top: "slic" top: "deadmap"
  gen_slicinfo_param { image_size: SIZE slic_size: 6 coh_weight: 1.4 cielab: true min_pixel_num: 10 } }
layer { name: "initial_low" type: "LowlevelDistance" bottom: "data" bottom: "slic" bottom: "deadmap"
  top: "region_features" top: "region_labels" top: "query_index_cue"
  lowlevel_distance_param { feature_option: OPTION grid_size: 5 train_region_per_image: REGIONS spixel_size: 6 } }
layer { name: "depth_low" type: "LowlevelDepth" bottom: "depth" bottom: "fill" bottom: "gap" bottom: "slic"
  bottom: "deadmap" bottom: "query_index_cue" top: "depth_features"
  lowlevel_depth_param { grid_size: 5 train_region_per_image: REGIONS spixel_size: 6 } }
'''


def build(size=24, option=3, regions=0, n=1, image=None):
    text = LAYERS.replace("SIZE", str(size)).replace("OPTION", str(option)).replace("REGIONS", str(regions))
    shape = (n, 3, size, size)
    return load_from_text(net(text, inputs={"data": image or shape, "depth": shape, "fill": shape, "gap": shape}))


@pytest.mark.parametrize("option, channels", [(0, 164), (1, 2), (2, 20), (3, 29), (7, 164)])
def test_every_superpixel_at_test(option, channels):
    model = build(option=option)
    shapes = model.blob_shapes
    assert shapes["slic"] == (1, 1, 24, 24) and shapes["deadmap"] == (1, 1, 4, 4)
    assert shapes["region_features"] == (16, channels, 5, 5)
    assert shapes["region_labels"] == shapes["query_index_cue"] == (16,)
    assert shapes["depth_features"] == (16, 10, 5, 5)


def test_regions_per_image_times_the_batch():
    shapes = build(regions=7, n=2).blob_shapes
    assert shapes["region_features"] == (14, 29, 5, 5) and shapes["depth_features"] == (14, 10, 5, 5)


def test_read_but_not_run():
    model = build()
    with pytest.raises(CaffeqError, match="layer 'genslic' \\(GenSlicinfo\\): sshige/rgbd-saliency's GPU-only"):
        model.run({k: np.zeros(s, np.float32) for k, s in model.inputs.items()})


def test_an_image_of_another_size_is_refused():
    with pytest.raises(LayerError, match="GenSlicinfo takes a 3-channel 24x24 image"):
        build(image=(1, 3, 24, 20))
