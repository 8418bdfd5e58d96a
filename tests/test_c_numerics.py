"""c_round, C's round() (halves away from zero) that the ROI, lattice, quantizing and AU forks call: torch and
ONNX against Python's own arithmetic, at the values where the easy forms go wrong."""
import types

import c_reference
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from caffeq.backends.onnx_backend import OnnxContext
from caffeq.layers.c_numerics import c_round, onnx_c_round


def hard_values(dtype):
    """Halves, their neighbours (0.49999997 rounds up in floor(v + 0.5)), negatives, zero signs, large and
    non-finite values."""
    halves = np.array([0.5, 1.5, 2.5, 3.5, 1e6 + 0.5, 2.0 ** 22 + 0.5], dtype)
    near = np.concatenate([np.nextafter(halves, dtype(0)), np.nextafter(halves, dtype(np.inf))])
    other = np.array([0.0, 0.3, 0.7, 7.0, 2.0 ** 24, 2.0 ** 53, np.inf, np.nan], dtype)
    values = np.concatenate([halves, near, other])
    return np.concatenate([values, -values]).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_torch_c_round_matches_c(dtype):
    values = hard_values(dtype)
    got = c_round(torch.from_numpy(values)).numpy()
    want = np.array([c_reference.c_round(v) for v in values], dtype)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, want)
    # -0.3 rounds to -0.0, as C's does
    assert np.array_equal(np.signbit(got), np.signbit(want))
    # torch.round rounds halves to even: the reason c_round exists
    assert torch.round(torch.tensor(2.5, dtype=torch.float64)).item() == 2.0 and c_round(torch.tensor(2.5)).item() == 3.0


def run_onnx_c_round(values, in_double):
    ctx = OnnxContext(types.SimpleNamespace(tensors={}), opset=17)
    out = onnx_c_round(ctx, "x", in_double=in_double)
    out_type = onnx.TensorProto.DOUBLE if in_double else onnx.TensorProto.FLOAT
    graph = onnx.helper.make_graph(
        ctx.nodes, "c_round", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [len(values)])],
        [onnx.helper.make_tensor_value_info(out, out_type, [len(values)])],
        [onnx.numpy_helper.from_array(init.array, name) for name, init in ctx.initializers.items()])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": values})[0]


@pytest.mark.parametrize("in_double", [False, True])
def test_onnx_c_round_matches_torch(in_double):
    values = hard_values(np.float32)
    finite = values[np.isfinite(values)]
    got = run_onnx_c_round(finite, in_double)
    assert got.dtype == (np.float64 if in_double else np.float32)
    want = c_round(torch.from_numpy(finite.astype(np.float64) if in_double else finite)).numpy()
    np.testing.assert_array_equal(got, want)
