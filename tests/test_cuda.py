"""CUDA: every reference case matches Caffe on a GPU too (skipped without one).

Run on a GPU machine with: python -m pytest -q -m cuda tests/test_cuda.py
"""
import pytest
import torch
from conftest import assert_close, caffe_blob_source

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_reference_case_on_cuda(case):
    model = case.load()
    got = model.run(case.inputs, device="cuda", all_blobs=True)
    atol, rtol = case.tolerance
    for blob, ref in case.outputs.items():
        src = caffe_blob_source(blob, got)
        assert src is not None, blob
        assert_close(got[src], ref, atol, rtol, f"{case.name}/{blob} on cuda")


@pytest.mark.parametrize("name", ["net_lenet", "net_resnet_mini", "net_mobilenet_block", "net_inception_block",
                                  "batchnorm_scale"])
def test_optimized_fp16_module_on_cuda(name):
    """The default (optimized) module in fp16 on the GPU: BatchNorm/Scale folded, channels_last,
    fp16 weights and arithmetic; its outputs stay within fp16's error of the exact fp32 ones."""
    import numpy as np
    from conftest import FIXTURES, Case

    from caffeq.quant import compute_dtype, quantize
    case = Case(FIXTURES / name)
    model = case.load()
    q = quantize(model, "fp16")
    dtype = compute_dtype("fp16", "cuda")
    assert dtype is torch.float16
    got = q.run(case.inputs, device="cuda", dtype=dtype)
    key, _, gm = q.run_cache
    assert key[3], "the default run should be the optimized module"
    params = list(gm.parameters())
    assert params and all(p.dtype == torch.float16 and p.is_cuda for p in params)
    assert any(p.dim() == 4 and p.is_contiguous(memory_format=torch.channels_last) for p in params) or \
        all(p.dim() != 4 for p in params)
    assert not any(getattr(m, "caffe_type", None) == "BatchNorm" for m in gm.modules())
    ref = model.run(case.inputs, exact=True)
    for out in model.outputs:
        a, b = ref[out].astype(np.float64), got[out].astype(np.float64)
        assert np.isfinite(b).all(), out
        assert np.linalg.norm(b - a) <= 1e-2 * np.linalg.norm(a) + 1e-3, out
        if a.ndim >= 2 and a.shape[1] > 1:
            assert (np.argmax(b, axis=1) == np.argmax(a, axis=1)).mean() >= 0.9, out
