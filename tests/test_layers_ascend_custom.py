"""Huawei Atlas OMG custom-operator demos (caffeq/layers/ascend_custom.py): custom_Reduction, custom_Tile,
custom_Upsample, custom_Concat, custom_Exp, custom_Log, custom_Power, against numpy references written from
the operators' formulas (huaweiatlas-test/AtkOps 3b01a2c, huaweiatlas-test/CustomOperator fbd42b0), in torch,
onnxruntime and the generated model.py."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.errors import CaffeqError
from caffeq.model import load, load_from_text

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "tests" / "fixtures" / "realworld"
CORPUS_FILES = [CORPUS / f"huaweiatlas-test__AtkOps__common__customOp__caffeOp__custom_{op}__omg_verify__custom_{op}.prototxt"
                for op in ("Reduction", "Tile", "Upsample")] + \
    [CORPUS / f"huaweiatlas-test__CustomOperator__caffeOp__custom_{op}__omg_verify__custom_{op}.prototxt"
     for op in ("Concat", "Exp", "Log", "Power")]


def one_layer(type_name, params, shapes, tops="y"):
    bottoms = " ".join(f'bottom: "x{i}"' for i in range(len(shapes)))
    return load_from_text(net(f'layer {{ name: "l" type: "{type_name}" {bottoms} top: "{tops}" {params} }}',
                              inputs={f"x{i}": s for i, s in enumerate(shapes)}))


def feeds_for(shapes, low=-2.0, high=2.0, seed=0):
    r = rng(seed)
    return {f"x{i}": r.uniform(low, high, s).astype(np.float32) for i, s in enumerate(shapes)}


# ---- custom_Reduction -------------------------------------------------------------------

def reduction_ref(x, first, op, coeff):
    """The TBE operator: each value (|x| for ASUM, x*x for SUMSQ) times cof, summed over the axes from
    `first` on, kept with size 1; MEAN's cof = coeff / the count of the reduced values."""
    size = int(np.prod(x.shape[first:]))
    t = {"SUM": x, "ASUM": np.abs(x), "SUMSQ": x * x, "MEAN": x}[op].astype(np.float64)
    cof = np.float32(coeff / size) if op == "MEAN" else np.float32(coeff)
    axes = tuple(range(first, x.ndim))
    return (t * np.float64(cof)).sum(axis=axes, keepdims=True).astype(np.float32)


@pytest.mark.parametrize("op", ["SUM", "ASUM", "SUMSQ", "MEAN"])
@pytest.mark.parametrize("shape, axis, first, out", [
    ((2, 7), -1, 1, (2, 1)),               # the demo's case: -1 of a 2-axis blob is axis 1
    ((2, 3, 5, 7), -1, 1, (2, 1, 1, 1)),   # -1 is axis 1 whatever the rank (axis - 2 of 4 axes)
    ((2, 3, 5, 7), -2, 0, (1, 1, 1, 1)),
    ((2, 3, 5, 7), 2, 2, (2, 3, 1, 1)),
    ((2, 5, 7), 0, 0, (1, 1, 1)),
    ((2, 7), 3, 2, (2, 7)),                # only OMG's padded axes: each value scaled, nothing summed
])
def test_reduction(op, shape, axis, first, out, tmp_path):
    model = one_layer("custom_Reduction", f"custom_reduction_param {{ operation: {op} axis: {axis} coeff: 0.75 }}",
                      [shape])
    assert model.blob_shapes["y"] == out
    feeds = feeds_for([shape])
    check_everywhere(model, feeds, {"y": reduction_ref(feeds["x0"], first, op, 0.75)}, tmp_path,
                     atol=1e-5, rtol=1e-5)


def test_reduction_defaults_sum_everything(tmp_path):
    model = one_layer("custom_Reduction", "", [(2, 3, 5)])
    assert model.blob_shapes["y"] == (1, 1, 1)
    feeds = feeds_for([(2, 3, 5)])
    check_everywhere(model, feeds, {"y": reduction_ref(feeds["x0"], 0, "SUM", 1.0)}, tmp_path, atol=1e-5, rtol=1e-5)


def test_a_negative_reduction_axis_is_noted():
    model = one_layer("custom_Reduction", "custom_reduction_param { axis: -1 }", [(2, 3, 5, 7)])
    assert any("axis - 2" in w and "from 1 on" in w for w in model.warnings)


@pytest.mark.parametrize("axis", [4, -7])
def test_reduction_axis_out_of_range(axis):
    with pytest.raises(CaffeqError, match=r"custom_reduction_param.axis .* out of range") as e:
        one_layer("custom_Reduction", f"custom_reduction_param {{ axis: {axis} }}", [(2, 7)])
    assert "\n" not in str(e.value)


def test_reduction_refuses_more_than_four_axes():
    with pytest.raises(CaffeqError, match="at most 4 axes"):
        one_layer("custom_Reduction", "", [(2, 3, 1, 5, 7)])


# ---- custom_Tile ------------------------------------------------------------------------

@pytest.mark.parametrize("shape, axis, tiles", [((2, 3, 5, 7), 2, 3), ((2, 3, 5, 7), 0, 2), ((2, 7), 1, 4),
                                                ((2, 3, 5, 7), 3, 1)])
def test_tile(shape, axis, tiles, tmp_path):
    model = one_layer("custom_Tile", f"custom_tile_param {{ axis: {axis} tiles: {tiles} }}", [shape])
    feeds = feeds_for([shape])
    reps = [1] * len(shape)
    reps[axis] = tiles
    check_everywhere(model, feeds, {"y": np.tile(feeds["x0"], reps)}, tmp_path)


def test_tile_default_axis_is_channels(tmp_path):
    model = one_layer("custom_Tile", "custom_tile_param { tiles: 2 }", [(2, 3, 5, 7)])
    feeds = feeds_for([(2, 3, 5, 7)])
    check_everywhere(model, feeds, {"y": np.tile(feeds["x0"], (1, 2, 1, 1))}, tmp_path)


@pytest.mark.parametrize("params, message", [("", r"custom_tile_param.tiles must be >= 1, got 0"),
                                             ("tiles: 2 axis: -1", r"custom_tile_param.axis must be >= 0"),
                                             ("tiles: 2 axis: 4", r"custom_tile_param.axis 4 out of range")])
def test_tile_bad_parameters(params, message):
    with pytest.raises(CaffeqError, match=message):
        one_layer("custom_Tile", f"custom_tile_param {{ {params} }}", [(2, 3, 5, 7)])


# ---- custom_Upsample --------------------------------------------------------------------

@pytest.mark.parametrize("scale", [1, 2, 3])
def test_upsample_nearest(scale, tmp_path):
    model = one_layer("custom_Upsample", f"custom_upsample_param {{ scale: {scale} }}", [(2, 3, 5, 7)])
    assert model.blob_shapes["y"] == (2, 3, 5 * scale, 7 * scale)
    feeds = feeds_for([(2, 3, 5, 7)])
    x = feeds["x0"]
    h, w = np.arange(5 * scale) // scale, np.arange(7 * scale) // scale
    check_everywhere(model, feeds, {"y": x[:, :, h][:, :, :, w]}, tmp_path)


def test_upsample_channels_last(tmp_path):
    """The operator reads the 4-axis blob as (N, H, W, C) and repeats axes 1 and 2; the plugin's shape
    inference declares (N, C, 2H, 2W) for those same values."""
    model = one_layer("custom_Upsample", 'custom_upsample_param { scale: 2 data_format: "channels_last" }',
                      [(2, 3, 5, 7)])
    assert model.blob_shapes["y"] == (2, 3, 10, 14)
    feeds = feeds_for([(2, 3, 5, 7)])
    x = feeds["x0"]
    out = np.empty((2, 6, 10, 7), np.float32)
    for a in range(6):
        for b in range(10):
            out[:, a, b, :] = x[:, a // 2, b // 2, :]
    check_everywhere(model, feeds, {"y": out.reshape(2, 3, 10, 14)}, tmp_path)


@pytest.mark.parametrize("params, message", [("scale: 0", r"custom_upsample_param.scale must be >= 1, got 0"),
                                             ('data_format: "NHWC"', r"custom_upsample_param.data_format")])
def test_upsample_bad_parameters(params, message):
    with pytest.raises(CaffeqError, match=message):
        one_layer("custom_Upsample", f"custom_upsample_param {{ {params} }}", [(2, 3, 5, 7)])


# ---- custom_Concat ----------------------------------------------------------------------

@pytest.mark.parametrize("axis, shapes", [(1, [(2, 3, 5, 7), (2, 1, 5, 7), (2, 4, 5, 7)]),
                                          (2, [(2, 3, 5, 7), (2, 3, 2, 7)]),
                                          (3, [(2, 3, 5, 7), (2, 3, 5, 1)])])
def test_concat(axis, shapes, tmp_path):
    model = one_layer("custom_Concat", f"custom_concat_param {{ axis: {axis} }}", shapes)
    feeds = feeds_for(shapes)
    check_everywhere(model, feeds, {"y": np.concatenate([feeds[f"x{i}"] for i in range(len(shapes))], axis)},
                     tmp_path)


def test_concat_dim_is_not_read(tmp_path):
    shapes = [(2, 3, 5, 7), (2, 2, 5, 7)]
    model = one_layer("custom_Concat", "custom_concat_param { concat_dim: 2 }", shapes)
    assert model.blob_shapes["y"] == (2, 5, 5, 7)
    assert any("concat_dim 2 is not read" in w for w in model.warnings)
    feeds = feeds_for(shapes)
    check_everywhere(model, feeds, {"y": np.concatenate([feeds["x0"], feeds["x1"]], 1)}, tmp_path)


def test_concat_dim_note_without_shapes():
    """The note comes from the layer's parameters alone: a net listed with unknown shapes still gives it."""
    text = ('layer { name: "d" type: "Data" top: "a" top: "b" data_param { batch_size: 2 } }\n'
            'layer { name: "l" type: "custom_Concat" bottom: "a" bottom: "b" top: "y" '
            'custom_concat_param { concat_dim: 3 } }')
    model = load_from_text(text, unknown_shapes_ok=True)
    assert model.blob_shapes["y"] is None
    assert any("concat_dim 3 is not read" in w for w in model.warnings)


def test_concat_negative_axis():
    with pytest.raises(CaffeqError, match=r"custom_concat_param.axis must be >= 0 .* got -1"):
        one_layer("custom_Concat", "custom_concat_param { axis: -1 }", [(2, 3, 5, 7), (2, 3, 5, 7)])


# ---- custom_Exp, custom_Log, custom_Power -----------------------------------------------

def exp_ref(x, base, scale, shift):
    x64 = x.astype(np.float64)
    arg = shift + scale * x64
    return (np.exp(arg) if base == -1 else np.power(base, arg)).astype(np.float32)


@pytest.mark.parametrize("params, base, scale, shift", [("", -1, 1.0, 0.0),
                                                        ("base: 2 scale: 0.5 shift: 0.25", 2.0, 0.5, 0.25),
                                                        ("scale: -1.5 shift: 1", -1, -1.5, 1.0)])
def test_exp(params, base, scale, shift, tmp_path):
    model = one_layer("custom_Exp", f"custom_exp_param {{ {params} }}", [(2, 3, 5, 7)])
    feeds = feeds_for([(2, 3, 5, 7)])
    check_everywhere(model, feeds, {"y": exp_ref(feeds["x0"], base, scale, shift)}, tmp_path, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("params, base, scale, shift", [("", -1, 1.0, 0.0),
                                                        ("base: 10 scale: 2 shift: 1", 10.0, 2.0, 1.0),
                                                        ("base: 0.5 scale: 0.5 shift: 3", 0.5, 0.5, 3.0)])
def test_log(params, base, scale, shift, tmp_path):
    model = one_layer("custom_Log", f"custom_log_param {{ {params} }}", [(2, 3, 5, 7)])
    feeds = feeds_for([(2, 3, 5, 7)], low=0.05, high=3.0)
    arg = shift + scale * feeds["x0"].astype(np.float64)
    ref = np.log(arg) / (1.0 if base == -1 else np.log(base))
    check_everywhere(model, feeds, {"y": ref.astype(np.float32)}, tmp_path, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("params, power, scale, shift", [("", 1.0, 1.0, 0.0),
                                                         ("power: 2 scale: 0.5 shift: 1", 2.0, 0.5, 1.0),
                                                         ("power: 0.5 scale: 2 shift: 5", 0.5, 2.0, 5.0)])
def test_power(params, power, scale, shift, tmp_path):
    model = one_layer("custom_Power", f"custom_power_param {{ {params} }}", [(2, 3, 5, 7)])
    feeds = feeds_for([(2, 3, 5, 7)])
    ref = np.power(shift + scale * feeds["x0"].astype(np.float64), power)
    check_everywhere(model, feeds, {"y": ref.astype(np.float32)}, tmp_path, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("type_name, field", [("custom_Exp", "custom_exp_param"), ("custom_Log", "custom_log_param")])
def test_a_non_positive_base_is_refused_naming_the_forks_field(type_name, field):
    with pytest.raises(CaffeqError, match=rf"{field}\.base must be strictly positive") as e:
        one_layer(type_name, f"{field} {{ base: -2 }}", [(2, 3)])
    assert "\n" not in str(e.value)


# ---- the demo nets ----------------------------------------------------------------------

@pytest.mark.parametrize("path", CORPUS_FILES, ids=lambda p: p.name.split("__")[-1])
def test_demo_nets_read_and_run(path):
    res = subprocess.run([sys.executable, "cli.py", "inspect", str(path)], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    model = load(str(path), random_weights=True)
    shapes = {name: model.blob_shapes[name] for name in model.inputs}
    feeds = {name: rng(1).uniform(0.1, 2.0, s).astype(np.float32) for name, s in shapes.items()}
    out = model.run(feeds)
    for name in model.outputs:
        assert np.isfinite(out[name]).all()
    if "custom_Reduction" in path.name:   # the sum over a softmax's 10 classes
        assert out["reduction"].shape == (1, 1)
        np.testing.assert_allclose(out["reduction"], [[1.0]], rtol=1e-5)
    if "custom_Concat" in path.name:   # the operator's 3 + 6 channels, not the plugin's declared 1 + 6
        blobs = model.run(feeds, all_blobs=True)
        assert blobs["out"].shape == (1, 9, 16, 16)
        np.testing.assert_array_equal(blobs["out"], np.concatenate([feeds["data"], blobs["conv1"]], 1))
    if "custom_Upsample" in path.name:
        x = feeds["data"]
        np.testing.assert_array_equal(out["custom_upsample"], x.repeat(2, axis=2).repeat(2, axis=3))
