"""strawberryfg/c2f-3dhm-human-caffe (65da294, caffe_code/src/caffe/layers): the 3-D human pose layers as
caffeq/layers/strawberryfg_3dhuman.py reads them.  The references are numpy loops written here from the fork's
CPU forwards, on batch 2 with depth != height and odd sizes; torch, onnxruntime (where exported) and model.py."""
import math

import numpy as np
import pytest
from conftest import REPO, check_everywhere, cli_process, model_py_outputs, net, onnx_outputs, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

CORPUS = REPO / "tests" / "fixtures" / "realworld"
TESTING = ["strawberryfg__c2f-3dhm-human-caffe__testing__test_d16_statsfalse.prototxt",
           "strawberryfg__c2f-3dhm-human-caffe__testing__test_d32_statsfalse.prototxt",
           "strawberryfg__int-3dhuman-I1__testing__d2=32__test_d32_statsfalse.prototxt",
           "strawberryfg__int-3dhuman-I1__testing__d2=64__test_d64_statsfalse.prototxt"]


def layer(kind, bottoms, params="", tops=("o",)):
    return (f'layer {{ name: "l" type: "{kind}" ' + "".join(f'bottom: "{b}" ' for b in bottoms)
            + "".join(f'top: "{t}" ' for t in tops) + params + " }")


def expf(v):
    """The float exp the fork's `exp(float)` calls (std::exp(float)): rounded to float, inf past its range."""
    with np.errstate(over="ignore"):
        return float(np.float32(math.exp(min(float(v), 700.0))))


def softmax_3dhm_ref(x, joints, depth):
    """The fork's loops: per sample and joint, sum += exp(v) in double over the cube, then exp(v) / sum."""
    ref = np.empty_like(x)
    flat, out = x.reshape(x.shape[0], -1), ref.reshape(x.shape[0], -1)
    size = depth * x.shape[2] * x.shape[2]
    for t in range(x.shape[0]):
        for j in range(joints):
            cube = flat[t, j * size:(j + 1) * size]
            total = 0.0
            for v in cube:
                total += expf(v)
            for i, v in enumerate(cube):
                e = expf(v)
                out[t, j * size + i] = np.float32(math.nan if math.isinf(e) and math.isinf(total) or total == 0
                                                    else e / total)
    return ref


def test_softmax_3dhm(tmp_path):
    x = rng(1).standard_normal((2, 2 * 3, 5, 5)).astype(np.float32)
    model = load_from_text(net(layer("DeepHumanModelSoftmax3DHM", ["x"],
                                     "deep_human_model_softmax_3d_hm_param { joint_num: 2 depth_dims: 3 }"),
                               inputs={"x": x.shape}))
    check_everywhere(model, {"x": x}, {"o": softmax_3dhm_ref(x, 2, 3)}, tmp_path, atol=1e-7)


def test_softmax_3dhm_exp_is_float(tmp_path):
    """No maximum is subtracted and exp is the float one: 100 overflows (its cube: NaN there, 0 elsewhere,
    where a double exp would give 1), a cube all below -104 underflows to 0 / 0 (NaN)."""
    x = rng(10).standard_normal((2, 2 * 3, 5, 5)).astype(np.float32)
    x[0, 1, 2, 3] = 100.0                 # sample 0, joint 0
    x[1, 3:6] -= 120.0                    # sample 1, joint 1
    ref = softmax_3dhm_ref(x, 2, 3)
    assert np.isnan(ref[0, 1, 2, 3]) and (ref[0, :3] == 0).sum() == 3 * 25 - 1 and np.isnan(ref[1, 3:6]).all()
    assert np.isfinite(ref[0, 3:]).all() and np.isfinite(ref[1, :3]).all()
    model = load_from_text(net(layer("DeepHumanModelSoftmax3DHM", ["x"],
                                     "deep_human_model_softmax_3d_hm_param { joint_num: 2 depth_dims: 3 }"),
                               inputs={"x": x.shape}))
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path, atol=1e-7)


@pytest.mark.parametrize("kind, axes", [("X", (1, 2)), ("Y", (1, 3)), ("Z", (2, 3))])
def test_integral_xyz(tmp_path, kind, axes):
    x = rng(2).random((2, 3, 5, 7)).astype(np.float32)
    ref = np.zeros((2, {"X": 7, "Y": 5, "Z": 3}[kind]), np.float32)
    for t in range(2):
        for z in range(3):
            for y in range(5):
                for xx in range(7):
                    ref[t, {"X": xx, "Y": y, "Z": z}[kind]] += x[t, z, y, xx]
    model = load_from_text(net(layer(f"DeepHumanModelIntegral{kind}", ["x"]), inputs={"x": x.shape}))
    np.testing.assert_array_equal(model.run({"x": x})["o"], ref)
    np.testing.assert_array_equal(model_py_outputs(model, {"x": x}, tmp_path)["o"], ref)
    # onnxruntime's ReduceSum adds in its own order: float rounding of 21 terms apart
    got = onnx_outputs(model, {"x": x}, tmp_path, 13)["o"]
    np.testing.assert_allclose(got, ref, rtol=21 * 2 ** -24, atol=0)


def test_integral_vector(tmp_path):
    x = rng(3).random((2, 7)).astype(np.float32)
    lb, ub = np.float32(0.1), np.float32(0.9)
    ref = np.zeros((2, 1), np.float32)
    for t in range(2):
        acc = np.float32(0)
        for c in range(7):
            acc = np.float32(float(acc) + ((float(ub) - float(lb)) / 7 * (c + 0.5) + float(lb)) * float(x[t, c]))
        ref[t, 0] = acc
    model = load_from_text(net(layer("DeepHumanModelIntegralVector", ["x"],
                                     "deep_human_model_integral_vector_param { dim_lb: 0.1 dim_ub: 0.9 }"),
                               inputs={"x": x.shape}))
    np.testing.assert_array_equal(model.run({"x": x})["o"], ref)
    np.testing.assert_array_equal(model_py_outputs(model, {"x": x}, tmp_path)["o"], ref)
    # ONNX sums the double products, then rounds once: the fork rounds after each of the 7 terms
    got = onnx_outputs(model, {"x": x}, tmp_path, 13)["o"]
    np.testing.assert_allclose(got, ref, rtol=7 * 2 ** -24, atol=0)


def scan_ref(values):
    best, at = 0.0, -1
    for i, v in enumerate(values):
        if float(v) - best > 1e-6:
            best, at = float(v), i
    return at


def test_argmax_hm(tmp_path):
    x = rng(4).random((2, 3, 5, 5)).astype(np.float32)
    x[0, 1] = -1.0                       # never moves: (0.5, 0.5)
    x[1, 2, 0, 0], x[1, 2, 0, 1] = 2.0, 2.0000005   # a rise within 1e-6 does not move
    ref = np.zeros((2, 6), np.float32)
    for t in range(2):
        for c in range(3):
            at = scan_ref(x[t, c].ravel())
            ref[t, 2 * c:2 * c + 2] = (0.5, 0.5) if at < 0 else ((at % 5 + 0.5) / 5, (at // 5 + 0.5) / 5)
    assert ref[1, 4] == np.float32(0.1)
    model = load_from_text(net(layer("DeepHumanModelArgmaxHM", ["x"]), inputs={"x": x.shape}))
    np.testing.assert_array_equal(model.run({"x": x})["o"], ref)
    np.testing.assert_array_equal(model_py_outputs(model, {"x": x}, tmp_path)["o"], ref)


def test_argmax_xyz(tmp_path):
    j, d, m = 2, 3, 4
    x = rng(5).random((2, j * d, m, m)).astype(np.float32)
    x[1, :d] = 0.0
    params = ("deep_human_model_h36m_cha_gen_joint_fr_xyz_heatmap_param { depth_dims: 3 map_size: 4 x_lb: 0.0 "
              "x_ub: 1.0 y_lb: -1.0 y_ub: 1.0 z_lb: 0.5 z_ub: 2.0 joint_num: 2 }")
    ref = np.zeros((2, 3 * j), np.float32)
    box = [(0.0, 1.0), (-1.0, 1.0), (0.5, 2.0)]
    for t in range(2):
        for jj in range(j):
            at = scan_ref(x[t].ravel()[jj * d * m * m:(jj + 1) * d * m * m])
            cells = (at % m, at // m % m, at // (m * m))
            for k, (cell, n) in enumerate(zip(cells, (m, m, d))):
                lb, ub = box[k]
                ref[t, 3 * jj + k] = 0.5 * (ub - lb) + lb if at < 0 else (cell + 0.5) / n * (ub - lb) + lb
    model = load_from_text(net(layer("DeepHumanModelH36MChaGenJointFrXYZHeatmap", ["x"], params),
                               inputs={"x": x.shape}))
    np.testing.assert_array_equal(model.run({"x": x})["o"], ref)
    np.testing.assert_array_equal(model_py_outputs(model, {"x": x}, tmp_path)["o"], ref)


def test_normalization_response_v0(tmp_path):
    x = rng(6).random((2, 4, 5, 5)).astype(np.float32) * 0.01
    x[1, 2] = 0.0                        # an empty channel: channels 0-2 of sample 1 become uniform
    thr = np.float32(0.003)
    # above the threshold but within 1e-6 of it: left out of the sum, still divided by it
    x[0, 1, 0, 0] = thr + np.float32(5e-7)
    ref = np.zeros_like(x)
    for t in range(2):
        for c in range(4):
            v = x[t, c]
            total = sum(float(a) for a in v.ravel() if float(np.float32(a - thr)) > 1e-6)
            if abs(total) < 1e-6:
                ref[t] = np.float32(1.0 / 5 / 5)
            else:
                ref[t, c] = np.where(v > thr, v.astype(np.float64) / total, 0.0).astype(np.float32)
    assert ref[0, 1, 0, 0] > 0 and float(np.float32(x[0, 1, 0, 0] - thr)) <= 1e-6
    model = load_from_text(net(layer("DeepHumanModelNormalizationResponseV0", ["x"],
                                     "normalization_response_param { hm_threshold: 0.003 }"), inputs={"x": x.shape}))
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path, atol=1e-7)


def test_coordinate_regression(tmp_path):
    x = rng(7).random((2, 3, 5, 5)).astype(np.float32)
    ref = np.zeros((2, 6), np.float32)
    for t in range(2):
        for c in range(3):
            px = py = 0.0
            for row in range(5):
                for col in range(5):
                    px += float(x[t, c, row, col]) * (col / 5)
                    py += float(x[t, c, row, col]) * (row / 5)
            ref[t, 2 * c:2 * c + 2] = (px, py)
    model = load_from_text(net(layer("DeepHumanModelNumericalCoordinateRegression", ["x"]), inputs={"x": x.shape}))
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path, atol=1e-6)


def test_mul_rgb(tmp_path):
    x = rng(8).random((2, 3, 5, 5)).astype(np.float32)
    ref = x * np.float32(256.0)
    model = load_from_text(net(layer("MulRGB", ["x"], "mul_rgb_param { mul_factor: 256.0 }"), inputs={"x": x.shape}))
    check_everywhere(model, {"x": x}, {"o": ref}, tmp_path)


def test_bad_shapes_are_one_line():
    with pytest.raises(CaffeqError, match="joint_num x depth_dims"):
        load_from_text(net(layer("DeepHumanModelSoftmax3DHM", ["x"],
                                 "deep_human_model_softmax_3d_hm_param { joint_num: 2 depth_dims: 4 }"),
                           inputs={"x": (2, 6, 5, 5)}))
    with pytest.raises(CaffeqError, match="width 7"):
        load_from_text(net(layer("DeepHumanModelArgmaxHM", ["x"]), inputs={"x": (2, 3, 5, 7)}))


def test_ground_truth_layers_refuse_to_run():
    text = net(layer("DeepHumanModelConvertDepth", ["a", "b"], "convert_depth_param { joint_num: 3 }"),
               inputs={"a": (2, 3), "b": (2, 9)})
    model = load_from_text(text)
    with pytest.raises(CaffeqError, match="true root joint"):
        model.run({"a": np.zeros((2, 3), np.float32), "b": np.zeros((2, 9), np.float32)})


@pytest.mark.parametrize("name", TESTING)
def test_corpus_testing_files_read(name):
    path = CORPUS / name
    res = cli_process("inspect", str(path))
    assert res.returncode == 0, res.stderr
    assert "inputs image 1x3x256x256" in res.stdout
    assert "pred_joint_2d_s2_int" in res.stdout and "pred_depth_s2_max" in res.stdout


def test_corpus_runs_end_to_end():
    path = CORPUS / TESTING[0]
    model = load_from_text(path.read_text(), random_weights=True)
    image = rng(9).standard_normal((1, 3, 256, 256)).astype(np.float32)
    out = model.run({"image": image, "crop_gt_joint_2d_scale": np.zeros((1, 32), np.float32)})
    assert out["pred_joint_2d_s2_int"].shape == (1, 32) and out["pred_depth_s2_int"].shape == (1, 16)
    # random weights give heatmaps whose float exp overflows in Softmax3DHM (inf / inf, as the fork would):
    # the argmax outputs are always inside the box
    assert ((out["pred_joint_2d_s2_max"] > 0) & (out["pred_joint_2d_s2_max"] < 1)).all()
