"""Every reference case made by the real Caffe: shapes and every blob's values."""
import numpy as np
import pytest
from conftest import assert_close, caffe_blob_source


def test_weights_load_with_caffes_shapes(case):
    model = case.load()
    from caffeq.io.caffemodel import read_caffemodel
    cm = read_caffemodel(case.weights)
    for node in model.layers:
        if node.blobs:
            assert len(node.blobs) == len(node.expected_param_shapes)
            for arr, shape in zip(node.blobs, node.expected_param_shapes):
                assert tuple(arr.shape) == tuple(shape)
    assert model.params.keys() <= set(cm.blobs)


def test_inferred_shapes_equal_caffes(case):
    model = case.load()
    ours = model.blob_shapes
    # Tops whose size depends on the data (Filter): shape inference gives Caffe's
    # pre-forward shape; case.json holds the shape after the forward, so compare
    # those with the shapes a real run produces.
    dynamic = {t for n in model.layers if n.spec.data_dependent_shape for t in n.tops}
    ran = model.run(case.inputs, all_blobs=True, exact=True) if dynamic else {}
    for blob, shape in case.meta["blob_shapes"].items():
        src = caffe_blob_source(blob, ours)
        assert src is not None, f"blob {blob} missing"
        got = ran[src].shape if src in dynamic else ours[src]
        assert tuple(got) == tuple(shape), f"{blob}: {got} != Caffe's {shape}"


def test_every_blob_matches_caffe(case):
    model = case.load()
    got = model.run(case.inputs, all_blobs=True, exact=True)   # layer by layer, in Caffe's order
    atol, rtol = case.tolerance
    for blob, ref in case.outputs.items():
        src = caffe_blob_source(blob, got)
        assert src is not None, f"blob {blob} not produced"
        assert_close(got[src], ref, atol, rtol, f"{case.name}/{blob}")


def test_default_run_is_optimized_and_matches_caffe(case):
    """Model.run's default (folded, channels_last) module gives Caffe's outputs within the case's
    tolerance, and stays within 1e-5 relative of the exact layer-by-layer module."""
    model = case.load()
    got = model.run(case.inputs)
    assert model.run_cache[0][3], "the default run should use the optimized module"
    exact = model.run(case.inputs, exact=True)
    atol, rtol = case.tolerance
    assert sorted(got) == sorted(model.outputs)
    for blob in model.outputs:
        assert blob in case.outputs, f"{case.name}: Caffe's outputs lack {blob}"
        assert_close(got[blob], case.outputs[blob], atol, rtol, f"{case.name}/{blob} (optimized)")
        assert_close(got[blob], exact[blob], 1e-6, 1e-5, f"{case.name}/{blob} (optimized vs exact)")


def test_net_outputs_are_caffes(case):
    model = case.load()
    assert sorted(model.outputs) == sorted(case.meta["outputs"])


def test_results_do_not_depend_on_batch_size(case):
    model = case.load()
    inputs = case.inputs
    n = next(iter(inputs.values())).shape[0]
    if n < 2 or not all(v.shape[0] == n for v in inputs.values()) or not model.layers[0].spec.is_data:
        pytest.skip("single-item case")
    if any(node.type in ("BatchReindex", "Filter", "LSTM", "RNN", "DetectionOutput",
                         "Embed", "Parameter") for node in model.layers):
        pytest.skip("items are not independent along axis 0 in this case")
    full = model.run(inputs)
    single = model.run({k: v[:1] for k, v in inputs.items()})
    for k, v in single.items():
        if full[k].ndim and full[k].shape[0] == n and v.shape[0] == 1:
            np.testing.assert_allclose(v[0], full[k][0], rtol=1e-5, atol=1e-5)
