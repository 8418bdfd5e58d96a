"""sshige/rgbd-saliency's superpixel feature layers: read and sized as the fork's Reshape methods size them
(RGBDNet_test's shapes at 324 x 324: slic 1x1x324x324, flags 1x1x18x18, features 324x29x20x20 and 324x10x20x20),
refused to run or export with one message (the fork computes them on the GPU only)."""
from pathlib import Path

import numpy as np
import pytest
from conftest import cli_process, net, ok

from caffeq.errors import CaffeqError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

REALWORLD = Path(__file__).parent / "fixtures" / "realworld"

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


# ---- gylee1103/ELDNet's two-top LowlevelDistance (28bae54 caffe/include/caffe/layers/lowlevel_distance_layer.hpp:
# ExactNumTopBlobs 2, MinBottomBlobs 3; its Reshape sizes features and labels as sshige's) ----------------

ELD_LAYERS = '''layer { name: "genslic" type: "GenSlicinfo" bottom: "data" top: "slic" top: "deadmap"
  gen_slicinfo_param { image_size: 30 slic_size: 6 } }
layer { name: "initial_low" type: "LowlevelDistance" BOTTOMS top: "region_features" TOPS
  lowlevel_distance_param { feature_option: 2 grid_size: 7 train_region_per_image: REGIONS spixel_size: 6 } }
'''


def build_eld(regions=0, n=3, bottoms=("data", "slic", "deadmap"), tops=("region_labels",)):
    text = (ELD_LAYERS.replace("BOTTOMS", " ".join(f'bottom: "{b}"' for b in bottoms))
            .replace("TOPS", " ".join(f'top: "{t}"' for t in tops)).replace("REGIONS", str(regions)))
    return load_from_text(net(text, inputs={"data": (n, 3, 30, 30), "label": (n, 1, 30, 30), "extra": (n, 2)}))


@pytest.mark.parametrize("regions, rows", [(0, 3 * 25), (4, 3 * 4)])
def test_eldnet_two_tops(regions, rows):
    shapes = build_eld(regions=regions).blob_shapes
    assert shapes["deadmap"] == (3, 1, 5, 5)
    assert shapes["region_features"] == (rows, 20, 7, 7) and shapes["region_labels"] == (rows,)


def test_eldnet_takes_the_label_map_and_more_bottoms():
    # MinBottomBlobs 3 and no maximum: the kernel reads bottom[3] (the label map) and ignores the rest
    shapes = build_eld(bottoms=("data", "slic", "deadmap", "label", "extra")).blob_shapes
    assert shapes["region_features"] == (75, 20, 7, 7)


def test_eldnet_not_run_names_the_fork():
    model = build_eld()
    with pytest.raises(CaffeqError, match="as gylee1103/ELDNet's; a gSLICr port"):
        model.run({k: np.zeros(s, np.float32) for k, s in model.inputs.items()})


def test_lowlevel_distance_top_counts():
    with pytest.raises(LayerError, match="LowlevelDistance takes at least 3 bottoms and 2 or 3 tops, got 3 and 1"):
        build_eld(tops=())
    with pytest.raises(LayerError, match="got 2 and 2"):
        build_eld(bottoms=("data", "slic"))


@pytest.mark.parametrize("name", ["gylee1103__ELDNet__ELDNet_test.prototxt",
                                  "gylee1103__ELDNet__training__train.prototxt"])
def test_eldnet_real_files_read(name):
    out = ok(cli_process("inspect", str(REALWORLD / name)))
    assert "1x1x324x324; 1x1x18x18" in out and "324x29x20x20; 324" in out


def test_eldnet_every_region_of_non_square_flags():
    # review r132: Reshape's R is the flags' height times their width (bottom[2] shape(2) * shape(3)),
    # whatever made them; flags that GenSlicinfo did not make need not be square
    text = ('layer { name: "initial_low" type: "LowlevelDistance" bottom: "data" bottom: "slic" bottom: "flags" '
            'top: "region_features" top: "region_labels" '
            'lowlevel_distance_param { feature_option: 1 grid_size: 3 train_region_per_image: 0 } }')
    shapes = load_from_text(net(text, inputs={"data": (2, 3, 30, 20), "slic": (2, 1, 30, 20),
                                              "flags": (2, 1, 4, 6)})).blob_shapes
    assert shapes["region_features"] == (48, 2, 3, 3) and shapes["region_labels"] == (48,)
