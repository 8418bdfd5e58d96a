"""yuqj1991/caffe_train's DetectionCcpdOutput: the reference is the fork's Forward_cpu written as loops
(detection_ccpd_output_layer.cpp): per image and head, a walk over num_k scores from i * num_k in the
bottom's memory that starts from a best of 0 and keeps the first strictly greater score."""
import numpy as np
import pytest
from conftest import check_everywhere, inputs_text, rng

from caffeq.layers import LayerError
from caffeq.model import load_from_text

SIZES = {"num_chinese": 5, "num_english": 4, "num_letter": 6}
HEAD_SIZES = [5, 4, 6, 6, 6, 6, 6]
NAMES = ["chi", "eng", "l1", "l2", "l3", "l4", "l5"]


def ccpd_ref(heads, sizes):
    num = heads[0].shape[0]
    out = np.full((1, 1, num, 7), -1, np.float32)
    for i in range(num):
        for k, (x, n) in enumerate(zip(heads, sizes)):
            flat = x.reshape(-1)
            best, index = np.float32(0), 0
            for j in range(n):
                if best < flat[i * n + j]:
                    best, index = flat[i * n + j], j
            out[0, 0, i, k] = index
    return out


def ccpd_text(shapes, params=None):
    params = params if params is not None else " ".join(f"{k}: {v}" for k, v in SIZES.items())
    bottoms = " ".join(f'bottom: "{n}"' for n in NAMES)
    return inputs_text(**dict(zip(NAMES, shapes))) + (
        f'layer {{ name: "ccpd" type: "DetectionCcpdOutput" {bottoms} top: "plate" lp_det_param {{ {params} }} }}')


def test_plate_characters_follow_the_forks_walk(tmp_path):
    n = 3
    g = rng(41)
    heads = [g.normal(0, 1, (n, s)).astype(np.float32) for s in HEAD_SIZES]
    heads[1][0] = [-1.0, -2.0, -0.5, -3.0]          # no positive score: index 0
    heads[2][1] = [0.2, 0.9, 0.1, 0.9, 0.3, 0.0]     # a tie: the lower index
    heads[3][2] = [np.nan, 0.4, 0.7, np.nan, 0.1, 0.2]   # NaN is never taken
    heads[4] = g.normal(0, 1, (n, 3, 2)).astype(np.float32)   # read through memory, whatever the shape
    model = load_from_text(ccpd_text([h.shape for h in heads]))
    ref = ccpd_ref(heads, HEAD_SIZES)
    assert ref[0, 0, 0, 1] == 0 and ref[0, 0, 1, 2] == 1 and ref[0, 0, 2, 3] == 2
    assert model.blob_shapes["plate"] == (1, 1, n, 7)
    check_everywhere(model, dict(zip(NAMES, heads)), {"plate": ref}, tmp_path)


def test_a_longer_bottom_is_read_at_the_forks_offsets(tmp_path):
    # a Chinese head with 7 scores per image is still read 5 at a time from i * 5, as the pointer walk does
    n = 2
    g = rng(42)
    heads = [g.normal(0, 1, (n, s)).astype(np.float32) for s in [7] + HEAD_SIZES[1:]]
    model = load_from_text(ccpd_text([h.shape for h in heads]))
    check_everywhere(model, dict(zip(NAMES, heads)), {"plate": ccpd_ref(heads, HEAD_SIZES)}, tmp_path)


@pytest.mark.parametrize("shapes, params, match", [
    ([(2, s) for s in HEAD_SIZES], "num_chinese: 5 num_english: 4", "num_letter is required"),
    ([(2, s) for s in HEAD_SIZES], "num_chinese: 5 num_english: 0 num_letter: 6", "num_english must be >= 1"),
    ([(2, s) for s in [4] + HEAD_SIZES[1:]], None, "would read past its end"),
    ([(2, s) for s in HEAD_SIZES[:6]] + [(3, 6)], None, "another num"),
])
def test_bad_plate_heads_are_refused(shapes, params, match):
    with pytest.raises(LayerError, match=match):
        load_from_text(ccpd_text(shapes, params))
