"""Wangyupei/CED's PeriodicShuffle (sub-pixel upsampling) against a loop written from the fork's
Forward_cpu index arithmetic (periodic_shuffle_layer.cpp, a7ce091), in torch, onnxruntime and the
generated model.py; its parameter and shape checks."""
import numpy as np
import pytest
from conftest import check_everywhere, inputs_text

from caffeq.layers import LayerError
from caffeq.model import load_from_text

RNG = np.random.default_rng(11)


def shuffle_net(shape, params="", top="o", bottom="x"):
    return ('name: "t"\n' + inputs_text(x=shape)
            + f'layer {{ name: "up" type: "PeriodicShuffle" bottom: "{bottom}" top: "{top}" '
              f'periodic_shuffle_param {{ {params} }} }}')


def ref_periodic_shuffle(x, num_output, group_size):
    """The fork's loop over the bottom: element (n, c1, h1, w1) goes to top (n, c2, h2, w2) with
    c2 = c1 % num_output, h2 = g*h1 + (c1 / num_output) / g, w2 = g*w1 + (c1 / num_output) % g."""
    n, c, h, w = x.shape
    g = group_size
    out = np.full((n, num_output, h * g, w * g), np.nan, x.dtype)
    for b in range(n):
        for c1 in range(c):
            for h1 in range(h):
                for w1 in range(w):
                    c2 = c1 % num_output
                    h2 = g * h1 + (c1 // num_output) // g
                    w2 = g * w1 + (c1 // num_output) % g
                    out[b, c2, h2, w2] = x[b, c1, h1, w1]
    assert not np.isnan(out).any()
    return out


@pytest.mark.parametrize("num_output, g, shape", [(3, 2, (2, 12, 3, 5)), (2, 3, (3, 18, 4, 2)),
                                                  (5, 2, (1, 20, 2, 3)), (1, 3, (2, 9, 5, 3)),
                                                  (4, 1, (2, 4, 3, 2))])
def test_periodic_shuffle_matches_the_forks_loop(num_output, g, shape, tmp_path):
    x = RNG.standard_normal(shape).astype(np.float32)
    model = load_from_text(shuffle_net(shape, f"group_size: {g} num_output: {num_output}"))
    ref = ref_periodic_shuffle(x, num_output, g)
    assert model.blob_shapes["o"] == ref.shape
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path)


def test_periodic_shuffle_is_not_torchs_pixel_shuffle():
    """The sub-pixel offset is the outer part of the channel index (ONNX DCR), not the inner one."""
    import torch
    import torch.nn.functional as F
    x = RNG.standard_normal((1, 8, 2, 3)).astype(np.float32)
    ref = ref_periodic_shuffle(x, 2, 2)
    assert not np.allclose(F.pixel_shuffle(torch.from_numpy(x), 2).numpy(), ref)
    # input channel 1 (k = 0, c = 1) is output channel 1's top-left sub-pixel
    np.testing.assert_array_equal(ref[0, 1, ::2, ::2], x[0, 1])
    # input channel 2 (k = 1: dy 0, dx 1) is output channel 0's top-right sub-pixel
    np.testing.assert_array_equal(ref[0, 0, ::2, 1::2], x[0, 2])


def test_periodic_shuffle_defaults_are_16_and_2():
    model = load_from_text(shuffle_net((1, 64, 3, 5)))
    assert model.blob_shapes["o"] == (1, 16, 6, 10)


@pytest.mark.parametrize("shape, params, msg", [
    ((1, 12, 3, 5), "num_output: 4 group_size: 2", r"the bottom's 12 channels are not num_output 4 x group_size 2\^2 = 16"),
    ((1, 16, 3, 3), "num_output: 0", r"periodic_shuffle_param.num_output must be > 0, got 0"),
    ((1, 16, 3, 3), "group_size: 0", r"periodic_shuffle_param.group_size must be > 0, got 0"),
    ((4, 16, 3), "num_output: 4", r"needs a 4-axis bottom \(N, C, H, W\), got \[4, 16, 3\]"),
])
def test_periodic_shuffle_refusals(shape, params, msg):
    with pytest.raises(LayerError, match=msg) as e:
        load_from_text(shuffle_net(shape, params))
    assert "\n" not in str(e.value)


def test_periodic_shuffle_refuses_in_place():
    with pytest.raises(LayerError, match="does not allow in-place computation") as e:
        load_from_text(shuffle_net((1, 16, 3, 3), "num_output: 4", top="x"))
    assert "\n" not in str(e.value)


def test_ced_deploy_layer_reads_and_field_numbers():
    """Wangyupei/CED examples/CED/deploy.prototxt's conv5_up line, as written; the fork's 153 is
    taken here (psroi_context_pooling_param), so its field is 10153 and the message's fields 1, 2."""
    from caffeq.io.schema import caffe_pb2
    text = ('name: "t"\n' + inputs_text(conv5_subConv=(1, 1024, 5, 7))
            + 'layer {type: "PeriodicShuffle" name: "conv5_up" bottom: "conv5_subConv" top: "conv5_up" '
              'periodic_shuffle_param{ group_size: 2 num_output: 256 } }\n')
    assert load_from_text(text).blob_shapes["conv5_up"] == (1, 256, 10, 14)
    assert caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name["periodic_shuffle_param"].number == 10153
    fields = caffe_pb2.PeriodicShuffleParameter.DESCRIPTOR.fields_by_name
    assert (fields["num_output"].number, fields["group_size"].number) == (1, 2)
