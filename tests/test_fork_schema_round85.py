"""Fork fields met in the round-85 to 88 corpora: HazyResearch/CaffeConTroll's LayerParameter additions
(620236e, src/parser/cnn.proto): V2 blobs_lr / weight_decay and the gpu_* batch / depth proportions,
read and ignored (training and device placement only); scott89/caffe's (STCT) Convolution `mask`, applied
at TRAIN only."""

import numpy as np
import pytest
from conftest import REPO, cli_process, net, ok
from google.protobuf import text_format

from caffeq.io.schema import caffe_pb2
from caffeq.model import load_from_text

CORPUS = REPO / "tests" / "fixtures" / "realworld"
CCT = ["caffenet_train_val_8_split", "caffenet_train_val_8_time_cpu_gpu", "resnet_train_gpu"]


def test_caffecontroll_fields_parse():
    lp = text_format.Parse('name: "c" type: "Convolution" blobs_lr: 1 blobs_lr: 2 weight_decay: 1 weight_decay: 0 '
                           'gpu_0_batch_proportion: 0.5 gpu_1_batch_proportion: 0.5 gpu_2_batch_proportion: 0 '
                           'gpu_3_batch_proportion: 0 gpu_0_depth_proportion: 0.25 gpu_1_depth_proportion: 0.25 '
                           'gpu_2_depth_proportion: 0.25 gpu_3_depth_proportion: 0.25', caffe_pb2.LayerParameter())
    assert list(lp.blobs_lr) == [1, 2] and list(lp.weight_decay) == [1, 0]
    assert lp.gpu_0_batch_proportion == 0.5 and lp.gpu_3_depth_proportion == 0.25
    # the numbers that moved keep clear of blobs (7) and include (8)
    fields = caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name
    assert fields["blobs_lr"].number == 85007 and fields["blobs"].number == 7
    assert fields["weight_decay"].number == 85008 and fields["include"].number == 8


def test_v2_blobs_lr_and_gpu_proportions_do_not_change_inference():
    conv = ('layer {{ name: "c" type: "Convolution" bottom: "x" top: "o" {extra} '
            'convolution_param {{ num_output: 3 kernel_size: 3 }} }}')
    extra = "blobs_lr: 1 blobs_lr: 2 weight_decay: 1 weight_decay: 0 gpu_0_batch_proportion: 1.0"
    marked = load_from_text(net(conv.format(extra=extra), inputs={"x": (2, 2, 5, 7)}), random_weights=True, seed=3)
    plain = load_from_text(net(conv.format(extra=""), inputs={"x": (2, 2, 5, 7)}), random_weights=True, seed=3)
    x = np.random.default_rng(0).standard_normal((2, 2, 5, 7)).astype(np.float32)
    assert marked.blob_shapes["o"] == (2, 3, 3, 5)
    np.testing.assert_array_equal(marked.run({"x": x})["o"], plain.run({"x": x})["o"])


@pytest.mark.skipif(not CORPUS.exists(), reason="corpus not on this machine")
@pytest.mark.parametrize("stem", CCT)
def test_caffecontroll_benchmark_nets_read(stem):
    path = CORPUS / f"HazyResearch__CaffeConTroll__benchmark__train_val__{stem}.prototxt"
    shape = "data=2,3,224,224" if stem.startswith("resnet") else "data=2,3,227,227"
    out = ok(cli_process("inspect", path, "--input-shape", shape))
    assert "parameters" in out.splitlines()[-1]


def test_stct_convolution_mask_is_the_plain_convolution_at_test():
    """scott89/caffe stct 09220c6: conv_layer.cpp/.cu apply the mask only when phase_ == TRAIN."""
    layer = ('layer {{ name: "c" type: "Convolution" bottom: "x" top: "y" convolution_param {{ num_output: 3 '
             'kernel_size: 3 pad: 1 {} }} }}')
    masked = load_from_text(net(layer.format("mask: true"), inputs={"x": (2, 2, 5, 4)}), random_weights=True)
    plain = load_from_text(net(layer.format(""), inputs={"x": (2, 2, 5, 4)}), random_weights=True)
    assert any("convolution_param.mask" in w and "TRAIN forward only" in w for w in masked.warnings)
    x = np.random.default_rng(3).standard_normal((2, 2, 5, 4)).astype(np.float32)
    for a, b in zip(masked.params["c"], plain.params["c"]):   # the same seeded random weights
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    want = plain.run({"x": x})["y"]
    assert np.abs(want).max() > 0
    np.testing.assert_array_equal(masked.run({"x": x})["y"], want)
