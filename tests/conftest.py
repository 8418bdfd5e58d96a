import json
import math
import re
import subprocess
import sys
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
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(ours), nan), f"{what}: NaN at other places than Caffe's"
    # equal values (infinities included) and NaN against NaN agree; the rest within the bound
    differ = ~((ours == ref) | nan)
    finite = np.abs(ref[np.isfinite(ref)])
    bound = atol + rtol * (finite.max() if finite.size else 0.0)
    err = np.abs(ours - ref)[differ].max() if differ.any() else 0.0
    assert err <= bound, f"{what}: max |ours - caffe| = {err:.3g} > {bound:.3g}"


def one_error_line(capsys, argv):
    """Run the CLI on argv; it must fail with status 2 and one `caffeq: error: ...` line, returned."""
    from caffeq.__main__ import main
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, err
    assert len(err) == 1 and err[0].startswith("caffeq: error: "), err
    return err[0]


# ---- the command line in a subprocess, as users type it ---------------------------------------

def cli_process(*args, cwd=REPO, timeout=300):
    """`python cli.py ARGS` in a fresh interpreter -> CompletedProcess (text output)."""
    return subprocess.run([sys.executable, str(REPO / "cli.py"), *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, timeout=timeout, check=False)


def ok(res):
    """A CompletedProcess that succeeded without a traceback -> its stdout."""
    assert res.returncode == 0, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr
    return res.stdout


def inspect_corpus_file(path, *args):
    """`cli.py inspect` of a real file (a shipped fixture) -> its stdout; skipped where a file outside the
    fixtures is absent (a collected corpus folder not on this machine); a missing fixture fails."""
    if not Path(path).exists():
        assert "fixtures" not in Path(path).parts, f"missing fixture {path}"
        pytest.skip("the corpus is not on this machine")
    return ok(cli_process("inspect", path, *args))


def one_line_error(res, *needles):
    """A CompletedProcess that failed with status 2 and one `caffeq: error:` line holding every
    needle (warnings aside) -> that line."""
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip() and not ln.startswith("caffeq: warning")]
    assert len(lines) == 1 and lines[0].startswith("caffeq: error: "), res.stderr
    assert "Traceback" not in res.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


@pytest.fixture(params=case_ids())
def case(request):
    return Case(FIXTURES / request.param)


# ---- building a net and running it: torch, onnxruntime, the generated model.py ------------------

def inputs_text(**shapes):
    """Input layers for {name: shape}, one prototxt line each."""
    return "".join(f'layer {{ name: "{n}" type: "Input" top: "{n}" input_param {{ shape {{ '
                   + " ".join(f"dim: {d}" for d in s) + " } } }\n" for n, s in shapes.items())


def net(*layers, inputs):
    """A prototxt with Input layers for `inputs` ({name: shape}) and the given layer texts."""
    return inputs_text(**inputs) + "\n".join(layers)


def pool_net(shape, params, tops=1):
    """A net of one Pooling layer "p" over the input "x" (a second top "mask" with tops=2)."""
    top = ' top: "p"' + (' top: "mask"' if tops == 2 else "")
    return net(f'layer {{ name: "p" type: "Pooling" bottom: "x"{top} pooling_param {{ {params} }} }}',
               inputs={"x": shape})


def repeated(name, values):
    """A repeated prototxt field: "name: v1 name: v2 ..."."""
    return " ".join(f"{name}: {v}" for v in values)


def fast_rcnn_bins(x1, y1, x2, y2, ph, pw, h, w):
    """Fast R-CNN's integer ROI-pooling bins of a roi whose corners are already scaled and rounded:
    (i, j, hstart, hend, wstart, wend) clipped to the h x w map, from float32 bin sizes as its C++."""
    f = np.float32
    bin_h = f(max(y2 - y1 + 1, 1)) / f(ph)
    bin_w = f(max(x2 - x1 + 1, 1)) / f(pw)
    for i in range(ph):
        hs = min(max(math.floor(f(i) * bin_h) + y1, 0), h)
        he = min(max(math.ceil(f(i + 1) * bin_h) + y1, 0), h)
        for j in range(pw):
            ws = min(max(math.floor(f(j) * bin_w) + x1, 0), w)
            we = min(max(math.ceil(f(j + 1) * bin_w) + x1, 0), w)
            yield i, j, hs, he, ws, we


def rng(seed=0):
    return np.random.default_rng(seed)


def onnx_session(model, path, opset=None):
    """Export `model` (unoptimized) to `path` and open it in onnxruntime; skips where it is missing."""
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("caffeq.backends.onnx_backend")
    model.export_onnx(str(path), optimize=False, opset=opset)
    assert_no_pad_reaching_an_average_kernel(str(path))
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def assert_no_pad_reaching_an_average_kernel(path):
    """onnxruntime 1.30 folds a zero Pad into the AveragePool it feeds and then refuses the model when
    a folded pad is not below the kernel (later versions run it); caffeq's exports must load in both."""
    import onnx
    from onnx import numpy_helper
    graph = onnx.load(path).graph
    consts = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    consts.update({n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in graph.node
                   if n.op_type == "Constant" and n.attribute[0].name == "value"})
    pads_of = {n.output[0]: consts.get(n.input[1]) for n in graph.node if n.op_type == "Pad" and len(n.input) > 1}
    for n in graph.node:
        if n.op_type != "AveragePool" or pads_of.get(n.input[0]) is None:
            continue
        kernel = next(list(a.ints) for a in n.attribute if a.name == "kernel_shape")
        pads = pads_of[n.input[0]].reshape(2, -1)[:, 2:]
        assert (pads < np.array(kernel)).all(), f"{n.name}: Pad {pads.tolist()} feeds AveragePool {kernel}"


def onnx_outputs(model, feeds, tmp_path, opset=None):
    """{ONNX output name: array} for `feeds` ({input blob: array})."""
    sess = onnx_session(model, tmp_path / f"m{opset}.onnx", opset)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, {k: feeds[k] for k in model.inputs})))


def onnx_run_by_blob(sess, model, feeds):
    """Run an onnxruntime session whose inputs are named by ONNX tensor, fed by Caffe blob name."""
    return sess.run(None, {i.name: feeds[model.graph.tensors[i.name].blob] for i in sess.get_inputs()})


def load_model_py(model, folder):
    """Export the standalone model.py into `folder`, import it, and return (its loaded net, export info)."""
    import importlib.util

    from caffeq.backends.pytorch_source import export_pytorch
    info = export_pytorch(model, folder)
    spec = importlib.util.spec_from_file_location(f"gen_{abs(hash(str(folder)))}", str(folder / "model.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.load(), info


def model_py_outputs(model, feeds, tmp_path):
    """The generated model.py, run on `feeds`: {top: array}."""
    import torch

    from caffeq.backends.pytorch_source import identifier
    net_, info = load_model_py(model, tmp_path / "py")
    by_ident = {identifier(b, set()): b for b in feeds}
    with torch.no_grad():
        out = net_(*[torch.from_numpy(feeds[by_ident.get(p, p)]) for p in info["inputs"]])
    if not isinstance(out, dict):
        out = {info["outputs"][0]: out}
    return {k: v.numpy() for k, v in out.items()}


def check_everywhere(model, feeds, refs, tmp_path, atol=0.0, rtol=0.0, opsets=(13, None), **run_options):
    """refs ({top: array}) against caffeq's forward (model.run(feeds, **run_options)), onnxruntime at
    each opset and the generated model.py."""
    ours = model.run(feeds, **run_options)
    for k, ref in refs.items():
        assert_close(ours[k], ref, atol, rtol, f"torch {k}")
    for opset in opsets:
        got = onnx_outputs(model, feeds, tmp_path, opset)
        for k, ref in refs.items():
            assert_close(got[k], ref, atol, rtol, f"onnx opset {opset} {k}")
    got = model_py_outputs(model, feeds, tmp_path)
    for k, ref in refs.items():
        assert_close(got[k], ref, atol, rtol, f"model.py {k}")


def node_of(model, name):
    """The graph node of the layer `name`."""
    return next(n for n in model.layers if n.name == name)


def backend_outputs(model, feeds, tmp_path, top="o"):
    """{backend: the top} from torch, onnxruntime and model.py."""
    return {"torch": model.run(feeds)[top], "onnx": onnx_outputs(model, feeds, tmp_path)[top],
            "model.py": model_py_outputs(model, feeds, tmp_path)[top]}


def conv_ref(x, w, b, stride, pad, group=1):
    """Caffe's grouped im2col convolution in float64 (exact for the dyadic values some tests use):
    x (N, C, H, W), w (O, C / group, kh, kw), b (O,) or None, stride and pad (h, w)."""
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad[0], pad[0]), (pad[1], pad[1])))
    oh, ow = (h + 2 * pad[0] - kh) // stride[0] + 1, (wd + 2 * pad[1] - kw) // stride[1] + 1
    out = np.zeros((n, o, oh, ow))
    per_group = o // group
    for oc in range(o):
        g = oc // per_group
        for y in range(oh):
            for z in range(ow):
                patch = xp[:, g * cg:(g + 1) * cg, y * stride[0]:y * stride[0] + kh, z * stride[1]:z * stride[1] + kw]
                out[:, oc, y, z] = (patch * w[oc].astype(np.float64)).sum(axis=(1, 2, 3))
        if b is not None:
            out[:, oc] += b[oc]
    return out


def bvlc_pool3d_ref(x, kernel, stride, pad, ave):
    """BVLC's pooling over (N, C, L, H, W), as superxuang/caffe_3d_faster_rcnn's and P3D's
    pooling3d_layer.cpp compute it: Reshape's ceil sizes (one fewer where padded and the last window starts at
    or past n + p), Forward_cpu's MAX (from -FLT_MAX, cells inside the input) and AVE (the sum of the
    cells inside over the window clipped to n + p)."""
    n, c = x.shape[:2]
    sizes = x.shape[2:]
    out = []
    for size, k, s, p in zip(sizes, kernel, stride, pad):
        o = int(math.ceil((size + 2 * p - k) / s)) + 1
        if p and (o - 1) * s >= size + p:
            o -= 1
        out.append(o)
    y = np.zeros((n, c) + tuple(out), np.float64)
    for idx in np.ndindex(*out):
        lo, hi, div = [], [], 1
        for i, size, k, s, p in zip(idx, sizes, kernel, stride, pad):
            start = i * s - p
            if ave:
                end = min(start + k, size + p)
                div *= end - start
                lo.append(max(start, 0))
                hi.append(min(end, size))
            else:
                lo.append(max(start, 0))
                hi.append(min(start + k, size))
        cells = x[:, :, lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]].astype(np.float64)
        if ave:
            y[(slice(None), slice(None)) + idx] = cells.sum(axis=(2, 3, 4)) / div
        else:
            y[(slice(None), slice(None)) + idx] = np.maximum(cells.max(axis=(2, 3, 4)), -float(np.finfo(np.float32).max))
    return y
