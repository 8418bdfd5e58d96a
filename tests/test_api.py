"""The Python API: load, to_torch, run, register_layer."""
import numpy as np
import pytest
import torch
from conftest import FIXTURES, Case, assert_close

import caffeq
from caffeq.model import load_from_text


def test_load_exposes_pycaffe_like_attributes():
    case = Case(FIXTURES / "conv_basic")
    m = case.load()
    assert m.inputs == {"data": (2, 3, 11, 13)}
    assert m.outputs == ["conv"]
    assert [n.name for n in m.layers] == ["data", "conv"]
    w, b = m.params["conv"]
    assert w.shape == (5, 3, 3, 3) and b.shape == (5,)


def test_to_torch_positional_and_keyword_inputs_and_grad():
    case = Case(FIXTURES / "conv_basic")
    m = case.load()
    net = m.to_torch()
    x = torch.from_numpy(case.inputs["data"]).requires_grad_()
    y1 = net(x)
    y2 = net(data=x)
    assert torch.equal(y1, y2)
    assert_close(y1.detach().numpy(), case.outputs["conv"], *case.tolerance, "conv")
    y1.square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert net.conv.weight.grad is not None


def test_generated_code_reads_like_the_prototxt():
    m = Case(FIXTURES / "conv_basic").load()
    code = m.to_torch().code
    assert "self.conv(data)" in code


def test_in_place_blobs_get_ssa_names_but_keep_caffe_names():
    m = load_from_text("""
    layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 2 dim: 5 dim: 4 } } }
    layer { name: "c" type: "Convolution" bottom: "data" top: "c" convolution_param { num_output: 3 kernel_size: 1 } }
    layer { name: "d" type: "Dropout" bottom: "c" top: "c" }
    layer { name: "p" type: "Pooling" bottom: "c" top: "p" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
    layer { name: "q" type: "Pooling" bottom: "c" top: "q" pooling_param { pool: AVE kernel_size: 2 stride: 1 } }
    """, random_weights=True)
    g = m.graph
    assert g.node("c").outputs == ["c@c"]
    assert g.node("d").outputs == ["c"]
    # an implicit split: one blob read by two layers, no extra node
    assert g.node("p").inputs == g.node("q").inputs == ["c"]
    assert sorted(m.outputs) == ["p", "q"]
    assert m.blob_shapes["p"] == (1, 3, 3, 2)  # ceil rounding


def test_register_custom_layer():
    @caffeq.register_layer("TimesK")
    class TimesK(caffeq.Layer):
        def parse(self, lp):
            return {"k": 3.0}

        def forward(self, attrs, params, x):
            return x * attrs["k"]

    m = load_from_text("""
    layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 } } }
    layer { name: "t" type: "TimesK" bottom: "data" top: "t" }
    """)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(m.run(x)["t"], x * 3)
    assert "TimesK" in caffeq.supported_types()
    with pytest.raises(ValueError):
        @caffeq.register_layer("TimesK")
        class Again(caffeq.Layer):
            pass


def test_unknown_types_fail_before_anything_runs():
    with pytest.raises(caffeq.CaffeqError) as e:
        load_from_text("""
        layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 } } }
        layer { name: "a" type: "NopeA" bottom: "data" top: "a" }
        layer { name: "b" type: "NopeB" bottom: "a" top: "b" }
        """)
    assert "NopeA" in str(e.value) and "NopeB" in str(e.value)


def test_batch_override():
    case = Case(FIXTURES / "conv_basic")
    m = caffeq.load(case.prototxt, case.weights, batch=5)
    assert m.inputs["data"] == (5, 3, 11, 13)
    assert m.blob_shapes["conv"] == (5, 5, 11, 13)
    x = np.concatenate([case.inputs["data"]] * 3)[:5]
    out = m.run(x)["conv"]
    assert_close(out[:2], case.outputs["conv"], *case.tolerance, "conv")


STAGED = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 2 } } }
layer { name: "a" type: "Dropout" bottom: "data" top: "a" include { phase: TEST stage: "deploy" } }
layer { name: "b" type: "Dropout" bottom: "data" top: "b" exclude { stage: "deploy" } }
layer { name: "c" type: "Dropout" bottom: "data" top: "c" include { phase: TRAIN } }
layer { name: "d" type: "Dropout" bottom: "data" top: "d" include { min_level: 2 } }
"""


@pytest.mark.parametrize("kw,layers", [
    ({}, ["data", "b"]),
    ({"stages": ("deploy",)}, ["data", "a"]),
    ({"phase": "TRAIN"}, ["data", "b", "c"]),
    ({"level": 2}, ["data", "b", "d"]),
])
def test_phase_stage_and_level_rules(kw, layers):
    assert [n.name for n in load_from_text(STAGED, **kw).layers] == layers


def test_stage_flag_on_the_cli(tmp_path):
    import json
    import subprocess
    import sys

    from conftest import REPO
    p = tmp_path / "s.prototxt"
    p.write_text(STAGED)
    out = subprocess.run([sys.executable, str(REPO / "cli.py"), "inspect", str(p), "--stage", "deploy",
                          "--json"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert [L["name"] for L in json.loads(out.stdout)["layers"]] == ["data", "a"]


@pytest.mark.parametrize("layer", [
    'type: "Convolution" convolution_param { num_output: 2 kernel_size: 3 kernel_h: 3 kernel_w: 3 }',
    'type: "Convolution" convolution_param { num_output: 2 kernel_size: 3 pad: 1 pad_h: 1 pad_w: 1 }',
    'type: "Pooling" pooling_param { kernel_size: 2 kernel_h: 2 kernel_w: 2 }',
])
def test_scalar_and_hw_forms_together_are_refused_as_caffe_does(layer):
    with pytest.raises(caffeq.CaffeqError, match="not both"):
        load_from_text('layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 1 '
                       'dim: 6 dim: 6 } } }\nlayer { name: "l" ' + layer + ' bottom: "data" top: "l" }')


def _conv_net(params):
    return ('layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 5 dim: 7 } } }\n'
            'layer { name: "l" type: "Convolution" bottom: "data" top: "l" convolution_param { num_output: 4 '
            + params + ' } }')


def test_convolution_takes_an_unset_pad_h_or_pad_w_as_0_as_caffe_does():
    """BaseConvolutionLayer reads pad_h and pad_w when either is set; the other keeps its proto default
    0 (rodney-wang/crnn.caffe's deploy sets pad_w alone).  Pooling, unlike it, wants both."""
    model = load_from_text(_conv_net("kernel_size: 3 pad_w: 1"), random_weights=True)
    x = np.random.default_rng(0).standard_normal((2, 3, 5, 7)).astype(np.float32)
    w, b = (torch.from_numpy(np.asarray(v)) for v in model.graph.nodes[-1].blobs)
    want = torch.nn.functional.conv2d(torch.from_numpy(x), w, b, padding=(0, 1)).numpy()
    assert model.blob_shapes["l"] == (2, 4, 3, 7)
    np.testing.assert_allclose(model.run({"data": x})["l"], want, rtol=1e-5, atol=1e-5)
    with pytest.raises(caffeq.CaffeqError, match="both pad_h and pad_w are required"):
        load_from_text(_conv_net("kernel_size: 3").replace('"Convolution"', '"Pooling"').replace(
            "convolution_param { num_output: 4 kernel_size: 3", "pooling_param { kernel_size: 3 pad_w: 1"))


@pytest.mark.parametrize("params, msg", [("kernel_h: 3", r"kernel_w must be >= 1, got 0 \(not set\)"),
                                         ("kernel_size: 3 stride_w: 2", r"stride_h must be >= 1, got 0 \(not set\)")])
def test_convolution_refuses_an_unset_kernel_or_stride_half(params, msg):
    with pytest.raises(caffeq.CaffeqError, match=msg):
        load_from_text(_conv_net(params))
