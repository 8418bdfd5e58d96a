"""IR transforms: BatchNorm folding, identity removal, reshape merging keep every output."""
import numpy as np
import pytest
from conftest import FIXTURES, Case, assert_close, case_ids

import caffeq
from caffeq.model import load_from_text
from caffeq.transforms import (
    fold_batchnorm,
    merge_reshapes,
    optimize,
    remove_identities,
)


def randomize(model, seed=0, factor=999.98):
    """Realistic random blobs: conv/IP ~ N(0, 1/fan_in), BatchNorm statistics stored x factor."""
    rng = np.random.default_rng(seed)
    for node in model.layers:
        if not node.expected_param_shapes:
            continue
        blobs = []
        for i, shape in enumerate(node.expected_param_shapes):
            if node.type == "BatchNorm":
                c = shape[0] if shape else 1
                value = {0: rng.standard_normal(c) * factor, 1: rng.uniform(0.2, 3.0, c) * factor,
                         2: np.array([factor]), 3: rng.uniform(0.5, 1.5, c), 4: rng.standard_normal(c)}[i]
            elif node.type == "Scale":
                value = rng.uniform(0.5, 1.5, shape) if i == 0 else rng.standard_normal(shape)
            else:
                fan_in = max(1, int(np.prod(shape[1:]))) if len(shape) > 1 else 1
                value = rng.standard_normal(shape) / np.sqrt(fan_in)
            blobs.append(np.asarray(value, np.float32).reshape(shape))
        node.blobs = blobs
    return model


def net(body, shape=(2, 3, 9, 11)):
    dims = " ".join(f"dim: {d}" for d in shape)
    return load_from_text(f'layer {{ name: "data" type: "Input" top: "data" input_param {{ shape {{ {dims} }} }} }}\n'
                          + body, random_weights=True)


def types(model):
    return [n.type for n in model.layers]


def snapshot(model):
    return {n.name: [np.array(b, copy=True) for b in n.blobs] for n in model.layers if n.blobs}


def assert_unchanged(model, snap, n_layers):
    assert len(model.layers) == n_layers
    for name, blobs in snap.items():
        node = model.graph.node(name)
        assert len(node.blobs) == len(blobs)
        for a, b in zip(node.blobs, blobs):
            np.testing.assert_array_equal(a, b)


def assert_same_outputs(a, b, inputs, rtol=1e-5):
    ra, rb = a.run(inputs), b.run(inputs)
    assert sorted(ra) == sorted(rb)
    for k in ra:
        assert ra[k].shape == rb[k].shape, k
        scale = max(np.abs(ra[k]).max(), 1e-12)
        err = np.abs(ra[k].astype(np.float64) - rb[k]).max()
        assert err <= rtol * scale, f"{k}: {err:.3g} > {rtol} x {scale:.3g}"


def inputs_for(model, seed=1):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in model.inputs.items()}


CONV_BN_SCALE = """
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" convolution_param { num_output: 5 kernel_size: 3 pad: 1 } }
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv" batch_norm_param { eps: 0.001 } }
layer { name: "sc" type: "Scale" bottom: "conv" top: "conv" scale_param { bias_term: true } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
"""


@pytest.mark.parametrize("factor", [999.98, 1.0, 0.0])
def test_fold_conv_bn_scale_in_place(factor):
    model = randomize(net(CONV_BN_SCALE), factor=factor)
    if factor == 0:
        model.graph.node("bn").blobs[2][...] = 0  # Caffe: a zero factor means zero statistics
    snap, n = snapshot(model), len(model.layers)
    folded = fold_batchnorm(model)
    assert types(folded) == ["Input", "Convolution", "ReLU"]
    conv = folded.graph.node("conv")
    assert conv.attrs["bias_term"] and len(conv.blobs) == 2
    assert folded.outputs == model.outputs == ["conv"]
    x = inputs_for(model)
    assert_same_outputs(model, folded, x)
    assert_unchanged(model, snap, n)


def test_zero_factor_means_zero_statistics():
    """Independent check of Caffe's rule: factor 0 -> mean = var = 0, y = x / sqrt(eps)."""
    model = randomize(net("""
layer { name: "bn" type: "BatchNorm" bottom: "data" top: "bn" batch_norm_param { eps: 0.01 } }
layer { name: "sc" type: "Scale" bottom: "bn" top: "y" scale_param { bias_term: true } }
"""))
    model.graph.node("bn").blobs[2][...] = 0
    gamma, beta = model.graph.node("sc").blobs
    x = inputs_for(model)
    expect = x["data"] / np.sqrt(0.01) * gamma.reshape(1, -1, 1, 1) + beta.reshape(1, -1, 1, 1)
    folded = fold_batchnorm(model)
    assert types(folded) == ["Input", "Scale"]
    for m in (model, folded):
        np.testing.assert_allclose(m.run(x)["y"], expect, rtol=1e-5, atol=1e-5)


def test_bn_scale_not_after_a_conv_becomes_one_scale():
    model = randomize(net("""
layer { name: "bn" type: "BatchNorm" bottom: "data" top: "data2" }
layer { name: "sc" type: "Scale" bottom: "data2" top: "data2" scale_param { bias_term: true } }
layer { name: "relu" type: "ReLU" bottom: "data2" top: "out" }
"""))
    folded = fold_batchnorm(model)
    assert types(folded) == ["Input", "Scale", "ReLU"]
    bn = model.graph.node("bn")
    gamma, beta = model.graph.node("sc").blobs
    mean, var = bn.blobs[0] / bn.blobs[2][0], bn.blobs[1] / bn.blobs[2][0]
    x = inputs_for(model)["data"]
    b = (1, -1, 1, 1)
    expect = np.maximum((x - mean.reshape(b)) / np.sqrt(var.reshape(b) + 1e-5) * gamma.reshape(b)
                        + beta.reshape(b), 0)
    np.testing.assert_allclose(folded.run(x)["out"], expect, rtol=1e-5, atol=1e-5)
    assert_same_outputs(model, folded, {"data": x})


def test_fold_deconvolution_groups_without_bias():
    model = randomize(net("""
layer { name: "up" type: "Deconvolution" bottom: "data" top: "up"
  convolution_param { num_output: 4 kernel_size: 3 stride: 2 group: 2 bias_term: false } }
layer { name: "bn" type: "BatchNorm" bottom: "up" top: "up" }
layer { name: "sc" type: "Scale" bottom: "up" top: "up" scale_param { bias_term: false } }
""", shape=(2, 4, 5, 6)))
    folded = fold_batchnorm(model)
    assert types(folded) == ["Input", "Deconvolution"]
    assert_same_outputs(model, folded, inputs_for(model))


@pytest.mark.parametrize("transpose", ["false", "true"])
def test_fold_inner_product(transpose):
    model = randomize(net(f"""
layer {{ name: "fc" type: "InnerProduct" bottom: "data" top: "fc"
  inner_product_param {{ num_output: 6 transpose: {transpose} }} }}
layer {{ name: "bn" type: "BatchNorm" bottom: "fc" top: "bn" }}
layer {{ name: "sc" type: "Scale" bottom: "bn" top: "sc" scale_param {{ bias_term: true }} }}
"""))
    folded = fold_batchnorm(model)
    assert types(folded) == ["Input", "InnerProduct"]
    assert folded.outputs == ["sc"]
    assert_same_outputs(model, folded, inputs_for(model))


def test_depthwise_and_lone_batchnorm():
    model = randomize(net("""
layer { name: "dw" type: "Convolution" bottom: "data" top: "dw" convolution_param { num_output: 3 group: 3 kernel_size: 3 } }
layer { name: "bn" type: "BatchNorm" bottom: "dw" top: "dw" }
"""))
    folded = fold_batchnorm(model)
    assert types(folded) == ["Input", "Convolution"]
    assert_same_outputs(model, folded, inputs_for(model))


def test_no_fold_when_the_conv_output_is_used_elsewhere():
    model = randomize(net("""
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" convolution_param { num_output: 4 kernel_size: 1 } }
layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "bn" }
layer { name: "sc" type: "Scale" bottom: "bn" top: "bn" scale_param { bias_term: true } }
layer { name: "other" type: "ReLU" bottom: "conv" top: "other" }
"""))
    folded = fold_batchnorm(model)
    conv = folded.graph.node("conv")
    np.testing.assert_array_equal(conv.blobs[0], model.graph.node("conv").blobs[0])
    assert types(folded) == ["Input", "Convolution", "Scale", "ReLU"]   # BN+Scale still merged
    assert_same_outputs(model, folded, inputs_for(model))


def test_no_fold_with_batch_statistics():
    model = randomize(net(CONV_BN_SCALE.replace("eps: 0.001", "eps: 0.001 use_global_stats: false")))
    folded = fold_batchnorm(model)
    assert "BatchNorm" in types(folded)
    assert_same_outputs(model, folded, inputs_for(model))


def test_no_fold_into_shared_or_quantized_weights():
    model = randomize(net("""
layer { name: "c1" type: "Convolution" bottom: "data" top: "c1" param { name: "w" } param { name: "b" }
  convolution_param { num_output: 3 kernel_size: 1 } }
layer { name: "bn" type: "BatchNorm" bottom: "c1" top: "c1" }
layer { name: "c2" type: "Convolution" bottom: "c1" top: "c2" param { name: "w" } param { name: "b" }
  convolution_param { num_output: 3 kernel_size: 1 } }
"""))
    caffeq.graph_weights.share_params(model.graph)
    folded = fold_batchnorm(model)
    assert "BatchNorm" in types(folded)
    assert_same_outputs(model, folded, inputs_for(model))
    q = caffeq.quantize(randomize(net(CONV_BN_SCALE + """
layer { name: "conv2" type: "Convolution" bottom: "conv" top: "conv2" convolution_param { num_output: 2 kernel_size: 1 } }
""")), "int8", keep="none")
    assert q.graph.node("conv").quant
    fq = fold_batchnorm(q)
    # the int8 codes stay as quantized: BatchNorm+Scale become one Scale after the conv instead
    assert types(fq) == ["Input", "Convolution", "Scale", "ReLU", "Convolution"]
    np.testing.assert_array_equal(fq.graph.node("conv").blobs[0], q.graph.node("conv").blobs[0])
    assert fq.graph.node("conv").quant[0] is q.graph.node("conv").quant[0]
    assert_same_outputs(q, fq, inputs_for(q))


# ---- identities and reshapes ------------------------------------------------------------------

IDENTITIES = """
layer { name: "sp" type: "Split" bottom: "data" top: "d1" top: "d2" }
layer { name: "fc" type: "InnerProduct" bottom: "d1" top: "fc" inner_product_param { num_output: 7 } }
layer { name: "drop" type: "Dropout" bottom: "fc" top: "fc" dropout_param { dropout_ratio: 0.5 } }
layer { name: "fc2" type: "InnerProduct" bottom: "d2" top: "fc2" inner_product_param { num_output: 7 } }
layer { name: "drop2" type: "Dropout" bottom: "fc2" top: "fc2b" }
layer { name: "sum" type: "Eltwise" bottom: "fc" bottom: "fc2b" top: "sum" }
layer { name: "c" type: "InnerProduct" bottom: "fc2b" top: "c" inner_product_param { num_output: 2 } }
layer { name: "s" type: "Silence" bottom: "c" }
"""


def test_remove_identities():
    model = randomize(net(IDENTITIES))
    snap, n = snapshot(model), len(model.layers)
    out = remove_identities(model)
    # "c" fed only the Silence: nothing depends on it any more
    assert types(out) == ["Input", "InnerProduct", "InnerProduct", "Eltwise"]
    assert out.outputs == model.outputs == ["sum"]
    # the plain Caffe names survive: fc's layer now writes "fc" itself
    assert out.graph.node("fc").outputs == ["fc"]
    assert_same_outputs(model, out, inputs_for(model))
    assert_unchanged(model, snap, n)


def test_silence_kept_when_it_hides_one_top_of_a_live_layer():
    model = randomize(net("""
layer { name: "sl" type: "Slice" bottom: "data" top: "a" top: "b" slice_param { axis: 1 slice_point: 1 } }
layer { name: "s" type: "Silence" bottom: "b" }
layer { name: "drop" type: "Dropout" bottom: "a" top: "a" }
"""))
    out = remove_identities(model)
    assert types(out) == ["Input", "Slice", "Silence"]
    assert out.outputs == model.outputs == ["a"]
    assert_same_outputs(model, out, inputs_for(model))


def test_transformed_models_reshape_and_rebuild_consistently():
    model = Case(FIXTURES / "net_resnet_mini").load()
    opt = optimize(model)
    assert [lp.name for lp in opt.net.layer] == [n.name for n in opt.layers]
    four = opt.reshaped(4)
    assert four.inputs["data"][0] == 4 and types(four) == types(opt)
    x = np.random.default_rng(0).standard_normal((4,) + tuple(model.inputs["data"][1:])).astype(np.float32)
    assert_same_outputs(model, four, {"data": x})


def test_identity_kept_between_an_input_and_an_output():
    case = Case(FIXTURES / "dropout_test")
    model = case.load()
    out = remove_identities(model)
    assert out.outputs == model.outputs
    atol, rtol = case.tolerance
    assert_close(out.run(case.inputs)["data"], case.outputs["data"], atol, rtol, "data")


RESHAPES = """
layer { name: "flat" type: "Flatten" bottom: "data" top: "flat" }
layer { name: "re" type: "Reshape" bottom: "flat" top: "re" reshape_param { shape { dim: 0 dim: 11 dim: -1 } } }
layer { name: "re2" type: "Reshape" bottom: "re" top: "re2" reshape_param { shape { dim: 0 dim: 0 dim: 3 dim: 9 } } }
layer { name: "fc" type: "InnerProduct" bottom: "re2" top: "fc" inner_product_param { num_output: 4 axis: 2 } }
"""


def test_merge_reshapes():
    model = randomize(net(RESHAPES))
    out = merge_reshapes(model)
    assert types(out) == ["Input", "Reshape", "InnerProduct"]
    assert out.graph.node("re2").inputs == ["data"]
    x = inputs_for(model)
    assert_same_outputs(model, out, x)
    assert_same_outputs(model, out, {"data": x["data"][:1]})   # dim 0 still follows the batch


def test_reshape_that_moves_the_batch_is_not_merged():
    model = randomize(net("""
layer { name: "a" type: "Reshape" bottom: "data" top: "a" reshape_param { shape { dim: -1 dim: 11 } } }
layer { name: "b" type: "Reshape" bottom: "a" top: "b" reshape_param { shape { dim: 0 dim: 1 dim: 11 } } }
"""))
    assert types(merge_reshapes(model)) == types(model)


# ---- all of them, on every reference case -------------------------------------------------------

@pytest.mark.parametrize("name", case_ids())
def test_optimize_keeps_every_reference_output(name):
    case = Case(FIXTURES / name)
    model = case.load()
    opt = optimize(model)
    assert opt.outputs == model.outputs
    assert len(opt.layers) <= len(model.layers)
    inputs = case.inputs
    ref, got = model.run(inputs), opt.run(inputs)
    atol, rtol = case.tolerance
    for k in ref:
        assert got[k].shape == ref[k].shape
        scale = max(np.abs(ref[k]).max(), 1e-12) if ref[k].size else 1
        assert np.abs(got[k].astype(np.float64) - ref[k]).max(initial=0) <= 1e-5 * scale, k
        if k in case.outputs:
            assert_close(got[k], case.outputs[k], atol, rtol, f"{name}/{k} vs Caffe")


def test_optimize_shrinks_the_resnet():
    model = Case(FIXTURES / "net_resnet_mini").load()
    opt, notes = optimize(model, with_notes=True)
    assert "BatchNorm" not in types(opt) and "Scale" not in types(opt)
    assert len(opt.layers) < len(model.layers) and notes
