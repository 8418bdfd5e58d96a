"""zhaoys87/LU's RSImageData (caffe-master rsimage_data_layer.cpp): multi-band remote-sensing images whose band
count only the first image tells; batch from rsimage_data_param, H x W from crop_size else new_height/new_width."""
import pytest
from conftest import FIXTURES

from caffeq.errors import CaffeqError
from caffeq.model import load, load_from_text

REST = ('layer { name: "s" type: "Slice" bottom: "data" top: "rgb" top: "rest" slice_param { axis: 1 slice_point: 3 } }\n'
        'layer { name: "c" type: "Convolution" bottom: "rgb" top: "c" convolution_param { num_output: 2 kernel_size: 3 } }')


def text(batch=5, crop=""):
    return (f'layer {{ name: "data" type: "RSImageData" top: "data" top: "label" transform_param {{ {crop} }} '
            f'rsimage_data_param {{ source: "list.txt" batch_size: {batch} new_height: 31 new_width: 37 }} }}\n'
            + REST)


def test_the_bands_come_from_the_user():
    with pytest.raises(CaffeqError, match=r"RSImageData takes its channels from the bands of the first image of "
                                          r"'list.txt' \(batch 5, H x W 31x37\).*--input-shape data="):
        load_from_text(text())
    model = load_from_text(text(), input_shapes={"data": (5, 8, 31, 37)})
    shapes = model.blob_shapes
    assert shapes["label"] == (5,) and shapes["rgb"] == (5, 3, 31, 37) and shapes["rest"] == (5, 5, 31, 37)


def test_crop_size_wins_over_the_resize():
    with pytest.raises(CaffeqError, match=r"batch 7, H x W 23x23"):
        load_from_text(text(7, "crop_size: 23"))


def test_a_zero_batch_is_one_error():
    with pytest.raises(CaffeqError, match=r"rsimage_data_param\.batch_size must be >= 1"):
        load_from_text(text(0))


def test_the_real_file_lists_with_unknown_shapes_and_runs_with_bands_given():
    path = FIXTURES.parent / "realworld" / "zhaoys87__LU__hk-wv3__transfer_ft__ft1_train_val_alexnet.prototxt"
    listed = load(path, unknown_shapes_ok=True)
    assert listed.blob_shapes.get("data") is None
    model = load(path, input_shapes={"data": (5, 8, 227, 227)})
    assert model.blob_shapes["data_other"] == (5, 5, 227, 227)
