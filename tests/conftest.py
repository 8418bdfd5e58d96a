import json
import re
from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).parent / "fixtures" / "caffe"
REPO = Path(__file__).resolve().parents[1]


def case_dirs():
    return sorted(p.parent for p in FIXTURES.glob("*/case.json") if (p.parent / "model.prototxt").exists())


def case_ids():
    return [p.name for p in case_dirs()]


class Case:
    def __init__(self, path):
        self.path = Path(path)
        self.name = self.path.name
        self.meta = json.loads((self.path / "case.json").read_text())
        self.prototxt = str(self.path / "model.prototxt")
        self.weights = str(self.path / "model.caffemodel")

    @property
    def inputs(self):
        with np.load(self.path / "inputs.npz") as z:
            return {k: z[k] for k in z.files}

    @property
    def outputs(self):
        with np.load(self.path / "outputs.npz") as z:
            return {k: z[k] for k in z.files}

    @property
    def tolerance(self):
        t = self.meta["tolerance"]
        return t["atol"], t["rtol"]

    def load(self, **kw):
        import caffeq
        return caffeq.load(self.prototxt, self.weights, **kw)


_SPLIT = re.compile(r"^(.*)_\d+_split_\d+$")


def caffe_blob_source(name, known):
    """Map a Caffe-inserted split blob name (`blob_layer_0_split_1`) to its source blob."""
    if name in known:
        return name
    m = _SPLIT.match(name)
    if not m:
        return None
    stem = m.group(1)  # blob_layer
    cands = [b for b in known if stem.startswith(b + "_")]
    return max(cands, key=len) if cands else None


def assert_close(ours, ref, atol, rtol, what=""):
    ours = np.asarray(ours, np.float64)
    ref = np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape} != Caffe's {ref.shape}"
    bound = atol + rtol * (np.abs(ref).max() if ref.size else 0.0)
    err = np.abs(ours - ref).max() if ref.size else 0.0
    assert err <= bound, f"{what}: max |ours - caffe| = {err:.3g} > {bound:.3g}"


def one_error_line(capsys, argv):
    """Run the CLI on argv; it must fail with status 2 and one `caffeq: error: ...` line, returned."""
    from caffeq.__main__ import main
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, err
    assert len(err) == 1 and err[0].startswith("caffeq: error: "), err
    return err[0]


@pytest.fixture(params=case_ids())
def case(request):
    return Case(FIXTURES / request.param)
