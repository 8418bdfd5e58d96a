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
