"""FlowNet's Mean layer (flownet-release mean_layer.cpp): top = output_scale (input_scale x + mean_scale (+-value[c
% n])), per bottom, in torch, onnxruntime and model.py; a reference loop written from the fork's formula."""
import numpy as np
import pytest
from conftest import check_everywhere, net

from caffeq.errors import CaffeqError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

f32 = np.float32


def fork_mean(x, values, subtract, mean_scale=1.0, input_scale=1.0, output_scale=1.0):
    """The fork's value branch: each (n, c, j) in float32, mean = values[c % len], negated by SUBTRACT."""
    out = np.empty_like(x)
    for n in range(x.shape[0]):
        for c in range(x.shape[1]):
            mean = f32(values[c % len(values)])
            if subtract:
                mean = -mean
            out[n, c] = f32(output_scale) * (f32(input_scale) * x[n, c] + f32(mean_scale) * mean)
    return out


def mean_layer(bottoms, tops, params):
    b = "".join(f' bottom: "{x}"' for x in bottoms)
    t = "".join(f' top: "{x}"' for x in tops)
    return f'layer {{ name: "m" type: "Mean"{b}{t} mean_param {{ {params} }} }}'


def test_flownet_mean_subtracts_per_channel_means_after_scaling_to_unit_range(tmp_path):
    # the FlowNet deploy file's Mean1 / Mean2: both images scaled by 1/255, then their channel means removed
    values = [0.411451, 0.432060, 0.450141]
    params = "operation: SUBTRACT input_scale: 0.0039216 " + " ".join(f"value: {v}" for v in values)
    model = load_from_text(net(mean_layer(["a", "b"], ["a_aug", "b_aug"], params),
                               inputs={"a": (2, 3, 5, 7), "b": (1, 3, 4, 6)}))
    g = np.random.default_rng(3)
    a = (g.random((2, 3, 5, 7)) * 255).astype(f32)
    b = (g.random((1, 3, 4, 6)) * 255).astype(f32)
    assert model.blob_shapes["a_aug"] == (2, 3, 5, 7) and model.blob_shapes["b_aug"] == (1, 3, 4, 6)
    refs = {"a_aug": fork_mean(a, values, True, input_scale=0.0039216),
            "b_aug": fork_mean(b, values, True, input_scale=0.0039216)}
    check_everywhere(model, {"a": a, "b": b}, refs, tmp_path, atol=1e-6)


def test_flownet_mean_adds_scaled_values_cycled_over_more_channels(tmp_path):
    params = "operation: ADD value: 0.25 value: -1.5 mean_scale: 2 input_scale: 0.5 output_scale: 3"
    model = load_from_text(net(mean_layer(["x"], ["y"], params), inputs={"x": (2, 6, 3, 4)}))
    x = np.random.default_rng(4).standard_normal((2, 6, 3, 4)).astype(f32)
    ref = fork_mean(x, [0.25, -1.5], False, mean_scale=2, input_scale=0.5, output_scale=3)
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path, atol=1e-6)


@pytest.mark.parametrize("params, message", [
    ("operation: SUBTRACT value: 1 value: 2", "not a multiple of the 2 mean_param values"),
    ("value: 1", r"operation \(ADD or SUBTRACT\) is required"),
    ("operation: ADD", r"needs its values \(value\) or a mean blob \(file\)"),
])
def test_flownet_mean_refuses_what_the_fork_checks(params, message):
    with pytest.raises(LayerError, match=message):
        load_from_text(net(mean_layer(["x"], ["y"], params), inputs={"x": (1, 3, 4, 4)}))


def test_flownet_mean_from_a_file_is_sized_and_refused_at_run():
    model = load_from_text(net(mean_layer(["x"], ["y"], 'operation: SUBTRACT file: "mean.binaryproto"'),
                               inputs={"x": (1, 3, 4, 4)}))
    assert model.blob_shapes["y"] == (1, 3, 4, 4)
    with pytest.raises(CaffeqError, match="reads its mean blob from 'mean.binaryproto'"):
        model.run({"x": np.zeros((1, 3, 4, 4), f32)})
