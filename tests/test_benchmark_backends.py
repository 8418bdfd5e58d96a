"""benchmarks/backends.py's ArgMax tie check: indices that differ only between near-equal scores are ties,
a flip past a clear winner stays a difference."""
import sys

import numpy as np
from conftest import REPO, net

from caffeq.model import load_from_text

sys.path.insert(0, str(REPO / "benchmarks"))
from backends import _argmax_ties  # noqa: E402


def _case(x, flip_to):
    model = load_from_text(net('layer { name: "am" type: "ArgMax" bottom: "x" top: "am" argmax_param { axis: 1 } }',
                               inputs={"x": x.shape}))
    ref = model.run({"x": x}, exact=True)["am"]
    got = ref.copy()
    got[0, 0, 1, 2] = flip_to
    outputs = [{"backend": "onnx", "blob": "am", "type": "ArgMax", "rel": 1.0, "_got": got}]
    _argmax_ties(model, {"x": x}, outputs, 1e-3)
    return outputs[0]


def test_a_flip_between_near_equal_scores_is_a_tie():
    x = np.random.default_rng(0).random((2, 4, 3, 5)).astype(np.float32)
    x[0, :, 1, 2] = [0.1, 0.9, 0.9 - 1e-7, 0.3]
    out = _case(x, 2)
    assert out["ties"] and out["differing_indices"] == 1


def test_a_flip_past_a_clear_winner_is_not():
    x = np.random.default_rng(0).random((2, 4, 3, 5)).astype(np.float32)
    x[0, :, 1, 2] = [0.1, 0.9, 0.5, 0.3]
    out = _case(x, 2)
    assert not out["ties"] and out["differing_indices"] == 1
