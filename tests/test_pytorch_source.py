"""Standalone PyTorch export (caffeq.backends.pytorch_source): model.py + weights + README.

Numerics.  Every reference case whose layer types all have PyTorch source is
exported twice and run in ONE fresh isolated interpreter per export mode
(`python -I`, caffeq made unimportable, each model imported from its own
folder as `model`):

- exact_batchnorm=True: every output equals caffeq's torch backend
  (Model.run) bit for bit (np.array_equal): the generated code makes the same
  torch calls in the same order as the specs' forward.
- default (plain nn.BatchNorm2d): the same, except in cases holding a
  BatchNorm layer.  nn.BatchNorm2d evaluates F.batch_norm's fused form
  x * (w / sqrt(var + eps)) + (b - mean * w / sqrt(var + eps)) instead of
  Caffe's (x - mean) / sqrt(var + eps) * w + b: different float32 roundings,
  so those cases are compared within 1e-5 relative to the output's magnitude
  (observed differences are a few ulps).  This is the only inexact layer.
- Either way, every output is within the case's tolerance of Caffe's own
  numbers (outputs.npz).
"""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FIXTURES, REPO, Case, assert_close, caffe_blob_source, case_ids

import caffeq
from caffeq.backends.pytorch_source import export_pytorch, identifier, lit
from caffeq.errors import ExportError
from caffeq.model import load_from_text

# layer types the reference cases use that have no PyTorch source: none any more, so any
# refusal of a reference case is a regression
UNSUPPORTED = set()

REQUIRED = ["Input", "Convolution", "ConvolutionDepthwise", "Deconvolution", "InnerProduct", "Pooling",
            "ReLU", "PReLU", "ELU", "Sigmoid", "TanH", "AbsVal", "Power", "Clip", "ReLU6", "Swish",
            "BatchNorm", "Scale", "Bias", "Eltwise", "Concat", "Slice", "Split", "Flatten", "Reshape",
            "Crop", "Softmax", "LRN", "MVN", "Dropout", "Silence", "Permute", "ShuffleChannel", "Interp",
            "Normalize", "ArgMax", "PriorBox", "DetectionOutput", "LSTM", "RNN", "ROIPooling", "PSROIPooling"]

RUNNER = r'''
import importlib, json, os, sys
sys.modules["caffeq"] = None          # "import caffeq" now raises ImportError
import torch
root = sys.argv[1]
for name in json.load(open(os.path.join(root, "cases.json"))):
    folder = os.path.join(root, name)
    os.chdir(folder)
    sys.path.insert(0, folder)
    sys.modules.pop("model", None)
    importlib.invalidate_caches()
    model = importlib.import_module("model")
    assert os.path.dirname(os.path.abspath(model.__file__)) == folder
    net = model.load()
    feed = torch.load("inputs.pt", weights_only=True)
    with torch.no_grad():
        out = net(*feed)
    torch.save(out if isinstance(out, dict) else {"__single__": out}, "outputs.pt")
    sys.path.remove(folder)
loaded = sorted(m for m, v in sys.modules.items() if v is not None and m.split(".")[0] == "caffeq")
print(json.dumps({"caffeq_modules": loaded}))
'''


def _import(path, name=None):
    spec = importlib.util.spec_from_file_location(name or f"gen_{abs(hash(str(path)))}", str(path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _feed(model, info, arrays):
    """Tensors for the generated forward's arguments (the graph inputs it kept), in order."""
    by_ident = {identifier(b, set()): b for b in arrays}
    return [torch.from_numpy(np.ascontiguousarray(arrays[by_ident.get(p, p)], dtype=np.float32))
            for p in info["inputs"]]


def _outputs(out, info):
    if not isinstance(out, dict):
        return {info["outputs"][0]: out}
    return {k: v for k, v in out.items()}


def _has_batchnorm(model):
    return any(n.type == "BatchNorm" for n in model.layers)


# ---- the reference cases, run in fresh isolated interpreters ----------------------------------

@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """{mode: {case: (info or ExportError, folder)}} with outputs.pt from an isolated run."""
    results = {}
    for mode, exact in (("default", False), ("exact", True)):
        root = tmp_path_factory.mktemp(f"pytorch_{mode}")
        done = {}
        for name in case_ids():
            case = Case(FIXTURES / name)
            model = case.load()
            folder = root / name
            try:
                info = export_pytorch(model, folder, exact_batchnorm=exact)
            except ExportError as e:
                done[name] = (e, folder)
                continue
            torch.save(_feed(model, info, case.inputs), folder / "inputs.pt")
            done[name] = (info, folder)
        ok = [n for n, (info, _) in done.items() if not isinstance(info, Exception)]
        (root / "cases.json").write_text(json.dumps(ok))
        proc = subprocess.run([sys.executable, "-I", "-c", RUNNER, str(root)], check=False,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        report = json.loads(proc.stdout.strip().splitlines()[-1])
        assert report["caffeq_modules"] == []
        results[mode] = done
    return results


@pytest.mark.parametrize("mode", ["default", "exact"])
@pytest.mark.parametrize("name", case_ids())
def test_reference_case_outputs(exported, name, mode):
    info, folder = exported[mode][name]
    case = Case(FIXTURES / name)
    model = case.load()
    if isinstance(info, ExportError):
        assert set(info.unsupported_types) <= UNSUPPORTED, str(info)
        assert {n.type for n in model.layers} & UNSUPPORTED
        assert not folder.exists(), "a refused export must write nothing"
        pytest.skip(f"unsupported layer types {info.unsupported_types}")
    out = torch.load(folder / "outputs.pt", weights_only=True)
    if "__single__" in out:
        out = {info["outputs"][0]: out["__single__"]}
    ours = {k: v.numpy() for k, v in out.items()}
    assert sorted(ours) == sorted(info["outputs"])
    ref = model.run(case.inputs, all_blobs=True)
    inexact = mode == "default" and _has_batchnorm(model)
    for blob, y in ours.items():
        r = ref[blob]
        assert y.shape == r.shape, blob
        if inexact:  # nn.BatchNorm2d's fused evaluation order (see the module docstring)
            err = np.abs(y.astype(np.float64) - r).max() if r.size else 0.0
            assert err <= 1e-5 * max(1.0, float(np.abs(r).max())), f"{blob}: {err}"
        else:
            assert np.array_equal(y, r, equal_nan=True), \
                f"{name}/{blob}: max diff {np.abs(y.astype(np.float64) - r).max()}"
    atol, rtol = case.tolerance
    caffe = case.outputs
    for blob, y in ours.items():
        names = [b for b in caffe if caffe_blob_source(b, {blob: 1}) == blob]
        assert names, f"{blob} is not among Caffe's blobs"
        for b in names:
            assert_close(y, caffe[b], atol, rtol, f"{name}/{blob}")


def test_refusals_are_only_the_known_unsupported_types(exported):
    refused = {n: info for n, (info, _) in exported["default"].items() if isinstance(info, Exception)}
    for name, err in refused.items():
        types = {n.type for n in Case(FIXTURES / name).load().layers}
        assert set(err.unsupported_types) == types & UNSUPPORTED, (name, str(err))
    # the whole reference set exports
    assert not refused, sorted(refused)


def test_fresh_interpreter_in_the_output_folder(tmp_path):
    """`import model` from the output folder with python -I: no caffeq, only torch (+ safetensors)."""
    case = Case(FIXTURES / "net_lenet")
    model = case.load()
    info = export_pytorch(model, tmp_path / "lenet")
    x = case.inputs["data"]
    np.save(tmp_path / "x.npy", x)
    code = ("import sys; sys.path.insert(0, ''); sys.modules['caffeq'] = None; import numpy as np, torch; "
            "import model; net = model.load(); "
            f"y = net(torch.from_numpy(np.load({str(tmp_path / 'x.npy')!r}))); "
            f"np.save({str(tmp_path / 'y.npy')!r}, y.detach().numpy()); "
            "print(sorted(m for m, v in sys.modules.items() if v is not None and m.startswith('caffeq')))")
    proc = subprocess.run([sys.executable, "-I", "-c", code], cwd=tmp_path / "lenet", check=False,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"
    assert np.array_equal(np.load(tmp_path / "y.npy"), model.run(case.inputs, exact=True)[info["outputs"][0]])


# ---- files, names, docstring ---------------------------------------------------------------

def test_folder_layout_readme_and_ruff(tmp_path):
    case = Case(FIXTURES / "net_resnet_mini")
    info = export_pytorch(case.load(), tmp_path / "out")
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == ["README.md", "model.py", "weights.safetensors"]
    assert info["class_name"] == "NetResnetMini"
    readme = (tmp_path / "out" / "README.md").read_text()
    assert "model.prototxt" in readme and "model.caffemodel" in readme and "from model import load" in readme
    src = (tmp_path / "out" / "model.py").read_text()
    imports = [ln for ln in src.splitlines() if ln.startswith(("import ", "from "))]
    assert imports == ["import os", "from torch import nn"] or \
        set(imports) <= {"import os", "import torch", "import torch.nn.functional as F", "from torch import nn"}
    assert "caffeq" not in "\n".join(imports)
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not os.path.exists(ruff):
        pytest.skip("ruff is not installed")
    proc = subprocess.run([ruff, "check", "--isolated", "--no-cache", str(tmp_path / "out" / "model.py")],
                          check=False, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_generated_file_passes_ruff(exported):
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not os.path.exists(ruff):
        pytest.skip("ruff is not installed")
    files = [str(folder / "model.py") for mode in exported.values() for info, folder in mode.values()
             if not isinstance(info, Exception)]
    proc = subprocess.run([ruff, "check", "--isolated", "--no-cache", *files], check=False, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_docstring_attributes_and_layer_order(tmp_path):
    case = Case(FIXTURES / "net_resnet_mini")
    model = case.load()
    info = export_pytorch(model, tmp_path / "o")
    mod = _import(tmp_path / "o" / "model.py")
    cls = getattr(mod, info["class_name"])
    doc = cls.__doc__
    assert "data: (N, 3, 32, 30)" in doc and "the prototxt declares N = 2" in doc
    assert "none declared in the prototxt" in doc
    assert "prob: (2, 7)" in doc
    net = mod.load()
    # attributes are the Caffe layer names, in Caffe's order (a Scale merged into its BatchNorm)
    scales = {n.name for n in model.layers if n.type == "Scale"}
    caffe_order = [n.name for n in model.layers if not n.spec.is_data and n.name not in scales
                   and n.type not in ("Eltwise",)]
    assert list(net._modules) == caffe_order
    assert isinstance(net.conv1_bn, torch.nn.BatchNorm2d) and net.conv1_bn.affine
    assert type(net.conv1_bn) is torch.nn.BatchNorm2d
    assert isinstance(net.conv1, torch.nn.Conv2d) and isinstance(net.pool1, torch.nn.MaxPool2d)
    assert net.pool1.ceil_mode


PROTO_NAMES = """
name: "odd-names net"
layer { name: "in" type: "Input" top: "data/0" input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } } }
layer { name: "conv1/3x3" type: "Convolution" bottom: "data/0" top: "class" convolution_param { num_output: 4 kernel_size: 3 } }
layer { name: "conv1_3x3" type: "Convolution" bottom: "class" top: "c2" convolution_param { num_output: 4 kernel_size: 1 } }
layer { name: "train" type: "ReLU" bottom: "c2" top: "c2" }
layer { name: "2nd" type: "Convolution" bottom: "c2" top: "self" convolution_param { num_output: 2 kernel_size: 1 } }
layer { name: "forward" type: "Sigmoid" bottom: "self" top: "torch" }
"""


def test_names_are_sanitized_and_collisions_resolved(tmp_path):
    model = load_from_text(PROTO_NAMES, random_weights=True)
    info = export_pytorch(model, tmp_path / "o")
    assert info["class_name"] == "OddNamesNet"
    mod = _import(tmp_path / "o" / "model.py")
    net = mod.load()
    assert list(net._modules) == ["conv1_3x3", "conv1_3x3_2", "train_", "l_2nd", "forward_"]
    net.train()      # a layer named "train" must not shadow nn.Module.train
    assert net.training
    net.eval()
    x = torch.randn(2, 3, 8, 8)
    y = net(x)
    assert np.array_equal(y.detach().numpy(), model.run(x.numpy(), exact=True)["torch"])


def test_escapes_in_names_keep_the_file_valid(tmp_path):
    proto = PROTO_NAMES.replace('name: "odd-names net"', r'name: "net \"\"\" \\ \n end"')
    proto = proto.replace('name: "forward"', r'name: "a \"\"\" b\nc"')
    model = load_from_text(proto, random_weights=True)
    export_pytorch(model, tmp_path / "o")
    _import(tmp_path / "o" / "model.py").load()


def test_single_file_output_and_torch_load_format(tmp_path):
    case = Case(FIXTURES / "conv_basic")
    model = case.load()
    info = export_pytorch(model, tmp_path / "net.py")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["net.py", "net.safetensors"]
    assert info["weights"].endswith("net.safetensors")
    y = _import(tmp_path / "net.py").load()(torch.from_numpy(case.inputs["data"]))
    assert np.array_equal(y.detach().numpy(), model.run(case.inputs, exact=True)["conv"])
    info = export_pytorch(model, tmp_path / "pt", weights_format="pt")
    state = torch.load(tmp_path / "pt" / "weights.pt", weights_only=True)
    assert set(state) == {"conv.weight", "conv.bias"}
    y = _import(tmp_path / "pt" / "model.py").load()(torch.from_numpy(case.inputs["data"]))
    assert np.array_equal(y.detach().numpy(), model.run(case.inputs, exact=True)["conv"])


def test_preprocessing_from_transform_param(tmp_path):
    proto = """
    name: "mem"
    layer { name: "data" type: "MemoryData" top: "data" top: "label"
            transform_param { scale: 0.00390625 mean_value: 104 mean_value: 117 mean_value: 123 crop_size: 6
                              mirror: true }
            memory_data_param { batch_size: 2 channels: 3 height: 8 width: 8 } }
    layer { name: "fc" type: "InnerProduct" bottom: "data" top: "fc" inner_product_param { num_output: 3 } }
    layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }
    """
    model = load_from_text(proto, random_weights=True)
    info = export_pytorch(model, tmp_path / "o")
    assert info["inputs"] == ["data"] and info["outputs"] == ["fc"]   # label fed only the loss
    doc = (tmp_path / "o" / "model.py").read_text()
    assert "data: (N, 3, 6, 6)" in doc
    assert "crop 6x6" in doc and "mean_value [104, 117, 123]" in doc and "scale 0.00390625" in doc
    assert "random horizontal flips" in doc
    assert "Training-only layers left out: loss (SoftmaxWithLoss)" in doc


# ---- refusals and atomicity -------------------------------------------------------------------

NO_SOURCE_LAYER = """
from caffeq.layers.registry import Layer, register_layer


@register_layer("NoTorchSourceA", "NoTorchSourceB")
class NoTorchSource(Layer):
    \"\"\"A user layer with a torch forward but no pytorch_source.\"\"\"

    def forward(self, attrs, params, x):
        return x * 2
"""


@pytest.fixture
def no_source_types():
    """Two layer types (every built-in type has PyTorch source), registered for one test."""
    from caffeq.layers import registry
    names = ("NoTorchSourceA", "NoTorchSourceB")
    assert not any(n in registry._REGISTRY for n in names)
    exec(compile(NO_SOURCE_LAYER, "no_source_layer", "exec"), {"__name__": "no_source_layer"})  # noqa: S102
    yield names
    for n in names:
        registry._REGISTRY.pop(n, None)


def test_unsupported_layers_listed_at_once_and_nothing_written(tmp_path, no_source_types):
    text = _net('layer { name: "a1" type: "NoTorchSourceA" bottom: "data" top: "a1" }'
                'layer { name: "c" type: "Convolution" bottom: "a1" top: "c" convolution_param { num_output: 2 '
                'kernel_size: 1 } }'
                'layer { name: "b1" type: "NoTorchSourceB" bottom: "c" top: "b1" }'
                'layer { name: "a2" type: "NoTorchSourceA" bottom: "b1" top: "a2" }')
    model = load_from_text(text, random_weights=True)
    out = tmp_path / "custom"
    with pytest.raises(ExportError) as e:
        export_pytorch(model, out)
    msg = str(e.value)
    assert "a1" in msg and "b1" in msg and "a2" in msg
    assert e.value.unsupported_types == ["NoTorchSourceA", "NoTorchSourceB"]
    assert e.value.refused == ["a1", "b1", "a2"]
    assert not out.exists()
    # an existing folder is left as it was
    out.mkdir()
    (out / "model.py").write_text("keep me")
    with pytest.raises(ExportError):
        export_pytorch(model, out)
    assert (out / "model.py").read_text() == "keep me" and len(list(out.iterdir())) == 1


def test_refuses_to_overwrite_inputs_and_missing_weights(tmp_path):
    src = tmp_path / "m"
    src.mkdir()
    shutil.copy(FIXTURES / "conv_basic" / "model.prototxt", src / "model.prototxt")
    shutil.copy(FIXTURES / "conv_basic" / "model.caffemodel", src / "weights.safetensors")
    model = caffeq.load(src / "model.prototxt", src / "weights.safetensors")
    before = (src / "weights.safetensors").read_bytes()
    with pytest.raises(ExportError, match="input file"):
        export_pytorch(model, src)
    assert (src / "weights.safetensors").read_bytes() == before
    with pytest.raises(ExportError, match="no weights"):
        export_pytorch(caffeq.load(FIXTURES / "conv_basic" / "model.prototxt"), tmp_path / "x")
    assert not (tmp_path / "x").exists()



@pytest.mark.parametrize("users_file", ["model.py", "README.md", "weights.safetensors"])
def test_a_folder_with_a_users_files_is_refused_and_an_earlier_export_is_replaced(tmp_path, users_file):
    model = Case(FIXTURES / "conv_basic").load()
    out = tmp_path / "o"
    out.mkdir()
    (out / users_file).write_bytes(b"the user's own file")
    with pytest.raises(ExportError, match="not written by caffeq"):
        export_pytorch(model, out)
    assert [p.name for p in out.iterdir()] == [users_file]
    assert (out / users_file).read_bytes() == b"the user's own file"
    # a folder holding an earlier export is replaced in place
    (out / users_file).unlink()
    first = export_pytorch(model, out)
    before = (out / "model.py").read_text()
    second = export_pytorch(model, out)
    assert (out / "model.py").read_text() == before and second["weights"] == first["weights"]


# ---- training, gradients, torch.export / TorchScript ---------------------------------------------

@pytest.mark.parametrize("name", ["net_resnet_mini", "net_mobilenet_block", "net_inception_block",
                                  "legacy_v1_layers", "fork_interp", "lrn_within", "mvn_variance",
                                  "fork_normalize", "scale_axis_numaxes", "pool_ave_pad",
                                  "deconv_group_nobias", "prelu_channel", "eltwise_sum_coeff", "spp_max"])
def test_train_mode_gradients_reach_every_parameter_and_input(tmp_path, name):
    case = Case(FIXTURES / name)
    model = case.load()
    info = export_pytorch(model, tmp_path / "o")
    net = _import(tmp_path / "o" / "model.py").load().train()
    feed = [t.clone().requires_grad_(True) for t in _feed(model, info, case.inputs)]
    out = _outputs(net(*feed), info)
    loss = sum((v.float() * torch.linspace(0.5, 1.5, v.numel()).reshape(v.shape)).sum() for v in out.values())
    loss.backward()
    grads = [p.grad for _, p in net.named_parameters()]
    for pname, p in net.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
    assert not grads or any(g.abs().sum() > 0 for g in grads)
    for t in feed:
        assert t.grad is not None and torch.isfinite(t.grad).all()


def test_batchnorm_fine_tunes_like_pytorch(tmp_path):
    case = Case(FIXTURES / "net_resnet_mini")
    model = case.load()
    export_pytorch(model, tmp_path / "o")
    net = _import(tmp_path / "o" / "model.py").load()
    bn = net.conv1_bn
    node = model.graph.node("conv1_bn")
    s = np.float32(node.blobs[2].reshape(-1)[0])
    f = np.float32(0) if s == 0 else np.float32(1) / s
    # Caffe's stored sums divided by the moving-average factor, in float32 as Caffe does
    assert np.array_equal(bn.running_mean.numpy(), node.blobs[0] * f)
    assert np.array_equal(bn.running_var.numpy(), node.blobs[1] * f)
    scale = model.graph.node("conv1_scale")
    assert np.array_equal(bn.weight.detach().numpy(), scale.blobs[0])
    assert bn.momentum == pytest.approx(1 - node.attrs["moving_average_fraction"], rel=1e-4)
    before = bn.running_mean.clone()
    net.train()
    net(torch.from_numpy(case.inputs["data"]))
    assert not torch.equal(before, bn.running_mean)       # standard PyTorch batch statistics
    assert int(bn.num_batches_tracked) == 1


def test_exact_batchnorm_train_mode_matches_caffeq(tmp_path):
    """exact_batchnorm keeps Caffe's semantics in train mode too (use_global_stats: true freezes)."""
    case = Case(FIXTURES / "net_resnet_mini")
    model = case.load()
    export_pytorch(model, tmp_path / "o", exact_batchnorm=True)
    net = _import(tmp_path / "o" / "model.py").load().train()
    assert isinstance(net.conv1_bn, torch.nn.BatchNorm2d)
    gm = model.to_torch().train()
    x = torch.from_numpy(case.inputs["data"])
    assert torch.equal(net(x), gm(x))


@pytest.mark.parametrize("name,exact", [("net_resnet_mini", False), ("net_resnet_mini", True),
                                        ("net_inception_block", False), ("fork_interp", False),
                                        ("spp_max", False), ("slice_points", False),
                                        ("pool_max_pad_clip", False), ("reshape_dims", False),
                                        ("argmax_flat", False), ("argmax_topk_val", False),
                                        ("fork_priorbox", False)])
def test_torch_export_and_jit_script(tmp_path, name, exact):
    """torch.export (dynamic batch) and torch.jit.script both accept the generated modules."""
    case = Case(FIXTURES / name)
    model = case.load()
    info = export_pytorch(model, tmp_path / "o", exact_batchnorm=exact)
    net = _import(tmp_path / "o" / "model.py").load()
    feed = _feed(model, info, case.inputs)
    with torch.no_grad():
        want = _outputs(net(*feed), info)
    dyn = tuple({0: torch.export.Dim("N", min=1, max=64)} for _ in feed)
    ep = torch.export.export(net, tuple(feed), dynamic_shapes=dyn)
    got = _outputs(ep.module()(*feed), info)
    assert all(torch.equal(got[k], want[k]) for k in want)
    bigger = [torch.cat([t, t, t]) for t in feed]   # another batch size, same program
    got3 = _outputs(ep.module()(*bigger), info)
    for k in want:   # (kernels may block a larger batch differently: equal up to rounding)
        assert got3[k].shape[1:] == want[k].shape[1:]
        torch.testing.assert_close(got3[k][:want[k].shape[0]], want[k], rtol=1e-5, atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # torch.jit.script is deprecated in recent torch
        scripted = torch.jit.script(net)
    got = _outputs(scripted(*feed), info)
    assert all(torch.equal(got[k], want[k]) for k in want)


FORK_SCRIPT_NETS = {   # fork layers whose model.py loops or branches in Python
    "IRNN": ('layer { name: "r" type: "IRNN" bottom: "x" top: "l" top: "u" top: "r" top: "d" }', (1, 2, 4, 3)),
    "GateRecurrent2dnoind": ('layer { name: "p" type: "GateRecurrent2dnoind" bottom: "x" bottom: "x" bottom: "x" '
                             'bottom: "x" top: "o" gaterecurrent2dnoind_param { horizontal: false reverse: true } }',
                             (1, 2, 4, 3)),
    "Threshold below_value": ('layer { name: "t" type: "Threshold" bottom: "x" top: "o" threshold_param '
                              '{ threshold: 0.5 below_value: -1 } }', (1, 3, 4, 5)),
    **{f"Quantization {m}": (f'layer {{ name: "q" type: "Quantization" bottom: "x" top: "o" quantization_param '
                             f'{{ bit_width: 4 range: 0 range: 3 round_method: {m} }} }}', (1, 3, 4, 5))
       for m in ("ROUND", "FLOOR", "CEIL", "TRUNC")},
}


@pytest.mark.parametrize("name", FORK_SCRIPT_NETS)
def test_fork_layers_script(name, tmp_path):
    """torch.jit.script takes these layers' model.py and computes what the eager module does."""
    layer, shape = FORK_SCRIPT_NETS[name]
    model = load_from_text(f'input: "x" input_shape {{ {" ".join(f"dim: {d}" for d in shape)} }}\n{layer}',
                           random_weights=True)
    info = export_pytorch(model, tmp_path / "o")
    net = _import(tmp_path / "o" / "model.py").load()
    x = torch.from_numpy(np.random.default_rng(5).uniform(-3, 3, shape).astype(np.float32))
    with torch.no_grad():
        want = _outputs(net(x), info)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # torch.jit.script is deprecated in recent torch
            scripted = torch.jit.script(net)
        got = _outputs(scripted(x), info)
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want)
    ref = model.run({"x": x.numpy()})
    assert all(np.array_equal(want[k].numpy(), ref[k]) for k in want)


def test_recurrent_modules_script_and_export(tmp_path):
    """LSTM/RNN loop over T in Python: torch.jit.script keeps the loop; torch.export unrolls it for
    the example's T (static shapes)."""
    model = _randomize(load_from_text(ZOO["recurrent"], random_weights=True))
    info = export_pytorch(model, tmp_path / "o")
    net = _import(tmp_path / "o" / "model.py").load()
    rng = np.random.default_rng(3)
    feed = _feed(model, info, {b: rng.standard_normal(s).astype(np.float32) for b, s in model.inputs.items()})
    with torch.no_grad():
        want = _outputs(net(*feed), info)
        ref = model.run({b: t.numpy() for b, t in zip(info["inputs"], feed)}, all_blobs=True)
        assert all(np.array_equal(want[k].numpy(), ref[k]) for k in want)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # torch.jit.script is deprecated in recent torch
            scripted = torch.jit.script(net)
        got = _outputs(scripted(*feed), info)
        assert all(torch.equal(got[k], want[k]) for k in want)
        shorter = [t[:2] if t.dim() >= 2 and t.shape[0] == 4 else t for t in feed]   # T = 2
        got2 = _outputs(scripted(*shorter), info)
        assert all(torch.equal(got2[k], v) for k, v in _outputs(net(*shorter), info).items())
    ep = torch.export.export(net, tuple(feed))
    got = _outputs(ep.module()(*feed), info)
    assert all(torch.equal(got[k], want[k]) for k in want)


# ---- quantized targets ---------------------------------------------------------------------------

def test_fp16_weights_stored_half_and_cast_at_load(tmp_path):
    from safetensors.numpy import load_file
    case = Case(FIXTURES / "net_resnet_mini")
    model = case.load()
    info = export_pytorch(model, tmp_path / "o", to="fp16")
    state = load_file(str(tmp_path / "o" / "weights.safetensors"))
    floats = {k: v for k, v in state.items() if v.dtype.kind == "f"}
    assert floats and all(v.dtype == np.float16 for v in floats.values())
    net = _import(tmp_path / "o" / "model.py").load()
    assert all(p.dtype == torch.float32 for p in net.parameters())
    qmodel = caffeq.quantize(model, "fp16") if hasattr(caffeq, "quantize") else None
    if qmodel is None:
        from caffeq.quant import quantize
        qmodel = quantize(model, "fp16")
    x = torch.from_numpy(case.inputs["data"])
    y = net(x).detach().numpy()
    ref = qmodel.run(case.inputs, exact=True)["prob"]
    assert np.array_equal(y, ref)   # fp16 folds BatchNorm into the convolutions first: exact layers only
    assert np.abs(y - model.run(case.inputs)["prob"]).max() < 1e-2
    assert "fp16 weights" in (tmp_path / "o" / "model.py").read_text()
    assert info["weights_bytes"] < sum(b.nbytes for n in model.layers for b in (n.blobs or []))


def test_binary_weights_are_alpha_sign_and_noted(tmp_path):
    from caffeq.quant import quantize
    case = Case(FIXTURES / "net_inception_block")
    model = case.load()
    export_pytorch(model, tmp_path / "o", to="binary", exact_batchnorm=True)
    qmodel = quantize(model, "binary")
    net = _import(tmp_path / "o" / "model.py").load()
    changed = qmodel.quant_report.changed
    assert changed
    for name in changed:
        w = getattr(net, identifier(name, set())).weight.detach().numpy()
        orig = model.graph.node(name).blobs[0]
        mat = w.reshape(w.shape[0], -1)
        alpha = np.abs(orig.reshape(orig.shape[0], -1)).mean(axis=1)
        assert np.allclose(np.abs(mat), alpha[:, None], rtol=1e-6)            # one magnitude per channel
        assert np.array_equal(np.sign(mat), np.where(orig.reshape(mat.shape) >= 0, 1, -1))
    x = torch.from_numpy(case.inputs["data"])
    assert np.array_equal(net(x).detach().numpy(), qmodel.run(case.inputs, exact=True)["fc"])
    doc = " ".join((tmp_path / "o" / "model.py").read_text().split())
    assert "alpha * sign(W)" in doc and all(n in doc for n in changed)


# ---- layers beyond the reference cases: every helper path, bit for bit ---------------------------

def _net(body, shape=(2, 3, 7, 9), extra_inputs=""):
    dims = " ".join(f"dim: {d}" for d in shape)
    return (f'name: "zoo"\nlayer {{ name: "in" type: "Input" top: "data" input_param {{ shape {{ {dims} }} }} }}\n'
            f"{extra_inputs}{body}")


def _inputs(**shapes):
    return "".join(f'layer {{ name: "{b}" type: "Input" top: "{b}" input_param {{ shape {{ '
                   + " ".join(f"dim: {d}" for d in s) + " } } }\n" for b, s in shapes.items())


ZOO = {
    "pool_big_pad": _net('layer { name: "p" type: "Pooling" bottom: "data" top: "p" '
                         'pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 2 } }'),
    "pool_max_big_pad": _net('layer { name: "p" type: "Pooling" bottom: "data" top: "p" '
                             'pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 2 } }'),
    "pool_stride_over_kernel": _net('layer { name: "p" type: "Pooling" bottom: "data" top: "p" '
                                    'pooling_param { pool: MAX kernel_size: 2 stride: 3 } }'
                                    'layer { name: "q" type: "Pooling" bottom: "data" top: "q" '
                                    'pooling_param { pool: AVE kernel_size: 2 stride: 3 } }'),
    "pool_pad_one_axis": _net('layer { name: "p" type: "Pooling" bottom: "data" top: "p" '
                              'pooling_param { pool: MAX kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 3 '
                              'pad_h: 1 pad_w: 0 } }'
                              'layer { name: "q" type: "Pooling" bottom: "data" top: "q" '
                              'pooling_param { pool: AVE kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 3 '
                              'pad_h: 1 pad_w: 0 } }'),
    "pool_floor": _net('layer { name: "p" type: "Pooling" bottom: "data" top: "p" '
                       'pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 round_mode: FLOOR } }'),
    "pool_stochastic": _net('layer { name: "a" type: "AbsVal" bottom: "data" top: "a" }'
                            'layer { name: "p" type: "Pooling" bottom: "a" top: "p" '
                            'pooling_param { pool: STOCHASTIC kernel_size: 3 stride: 2 } }'),
    "batchnorm_variants": _net(
        'layer { name: "c" type: "Convolution" bottom: "data" top: "c" convolution_param { num_output: 4 kernel_size: 1 } }'
        'layer { name: "bn_lone" type: "BatchNorm" bottom: "c" top: "b1" }'
        'layer { name: "bn_batch" type: "BatchNorm" bottom: "c" top: "b2" batch_norm_param { use_global_stats: false } }'
        'layer { name: "bn_nv" type: "BatchNorm" bottom: "c" top: "b3" batch_norm_param { scale_bias: true } }'
        'layer { name: "bn_s" type: "BatchNorm" bottom: "c" top: "b4" batch_norm_param { eps: 0.001 } }'
        'layer { name: "sc" type: "Scale" bottom: "b4" top: "b4" scale_param { bias_term: false } }'
        'layer { name: "fc" type: "InnerProduct" bottom: "c" top: "fc" inner_product_param { num_output: 5 } }'
        'layer { name: "bn_fc" type: "BatchNorm" bottom: "fc" top: "fc" }'
        'layer { name: "sc_fc" type: "Scale" bottom: "fc" top: "fc" scale_param { bias_term: true } }'),
    "activations": _net(
        'layer { name: "r6" type: "ReLU6" bottom: "data" top: "r6" relu6_param { negative_slope: 0.1 } }'
        'layer { name: "ex" type: "Exp" bottom: "data" top: "ex" exp_param { base: 2 scale: 0.5 shift: 0.25 } }'
        'layer { name: "th" type: "Threshold" bottom: "data" top: "th" threshold_param { threshold: 0.3 } }'
        'layer { name: "pw" type: "Power" bottom: "data" top: "pw" power_param { power: 2 scale: 3 shift: -0.5 } }'
        'layer { name: "pc" type: "Power" bottom: "data" top: "pc" power_param { power: 0 } }'
        'layer { name: "sw" type: "Swish" bottom: "data" top: "sw" swish_param { beta: 1.5 } }'
        'layer { name: "el" type: "ELU" bottom: "data" top: "el" elu_param { alpha: 0.3 } }'
        'layer { name: "lg" type: "Log" bottom: "ex" top: "lg" log_param { base: 10 shift: 1 } }'
        'layer { name: "e" type: "Eltwise" bottom: "data" bottom: "r6" bottom: "sw" top: "e" '
        'eltwise_param { operation: SUM coeff: -1 coeff: 2 coeff: -0.5 } }'),
    "shapes": _net(
        'layer { name: "c" type: "Convolution" bottom: "data" bottom: "data" top: "c1" top: "c2" '
        'convolution_param { num_output: 4 kernel_size: 3 pad: 1 } }'
        'layer { name: "one" type: "Concat" bottom: "c1" top: "one" }'
        'layer { name: "sl" type: "Slice" bottom: "c2" top: "s1" top: "s2" slice_param { axis: 0 slice_point: 1 } }'
        'layer { name: "fl" type: "Flatten" bottom: "s1" top: "fl" flatten_param { axis: 1 end_axis: 2 } }'
        'layer { name: "rs" type: "Reshape" bottom: "s2" top: "rs" reshape_param { shape { dim: 0 dim: -1 dim: 9 } } }'
        'layer { name: "pm" type: "Permute" bottom: "one" top: "pm" permute_param { order: 0 order: 2 order: 3 order: 1 } }'
        'layer { name: "cr" type: "Crop" bottom: "one" bottom: "data" top: "cr" crop_param { axis: 1 offset: 1 offset: 0 offset: 0 } }'
        'layer { name: "sh" type: "ShuffleChannel" bottom: "one" top: "sh" shuffle_channel_param { group: 2 } }'
        'layer { name: "up" type: "Upsample" bottom: "sh" top: "up" upsample_param { scale: 2 } }'
        'layer { name: "mv" type: "MVN" bottom: "fl" top: "mv" }'
        'layer { name: "d" type: "Deconvolution" bottom: "up" top: "d" convolution_param { num_output: 6 '
        'kernel_size: 3 stride: 2 pad: 1 group: 2 dilation: 2 } }'
        'layer { name: "sp" type: "Split" bottom: "d" top: "d1" top: "d2" }'
        'layer { name: "sum" type: "Eltwise" bottom: "d1" bottom: "d2" top: "sum" eltwise_param { operation: MAX } }'),
    "interp_variants": _net(
        'layer { name: "sm" type: "Pooling" bottom: "data" top: "sm" pooling_param { pool: AVE kernel_size: 2 stride: 2 } }'
        'layer { name: "i1" type: "Interp" bottom: "data" top: "i1" interp_param { shrink_factor: 2 } }'
        'layer { name: "i2" type: "Interp" bottom: "sm" bottom: "data" top: "i2" }'
        'layer { name: "i3" type: "Interp" bottom: "data" top: "i3" interp_param { zoom_factor: 3 '
        'interp_type: "nearest_neighbor" pad_beg: -1 pad_end: -1 } }'
        'layer { name: "n1" type: "Normalize" bottom: "i2" top: "n1" norm_param { across_spatial: true '
        'channel_shared: true } }'),
    "scale_bias_axpy": _net(
        'layer { name: "g" type: "Pooling" bottom: "data" top: "g" pooling_param { pool: AVE global_pooling: true } }'
        'layer { name: "gf" type: "Flatten" bottom: "g" top: "gf" }'
        'layer { name: "b" type: "Bias" bottom: "data" bottom: "gf" top: "b" bias_param { axis: 0 } }'
        'layer { name: "b2" type: "Bias" bottom: "data" top: "b2" bias_param { axis: 2 num_axes: 1 } }'
        'layer { name: "s" type: "Scale" bottom: "data" bottom: "gf" top: "s" scale_param { axis: 0 bias_term: true } }'
        'layer { name: "s0" type: "Scale" bottom: "data" top: "s0" scale_param { num_axes: 0 } }'
        'layer { name: "ax" type: "Axpy" bottom: "g" bottom: "b" bottom: "s" top: "ax" }'),
    "shared_params": _net(
        'layer { name: "c1" type: "Convolution" bottom: "data" top: "c1" param { name: "w" } param { name: "b" } '
        'convolution_param { num_output: 3 kernel_size: 3 pad: 1 } }'
        'layer { name: "c2" type: "Convolution" bottom: "c1" top: "c2" param { name: "w" } param { name: "b" } '
        'convolution_param { num_output: 3 kernel_size: 3 pad: 1 } }'),
    # Caffe's PERMISSIVE sharing: a 1x1 convolution's (3, 3, 1, 1) weights are an InnerProduct's (3, 3)
    "shared_params_reshaped": _net(
        'layer { name: "c1" type: "Convolution" bottom: "data" top: "c1" param { name: "w" } '
        'convolution_param { num_output: 3 kernel_size: 1 bias_term: false } }'
        'layer { name: "g" type: "Pooling" bottom: "c1" top: "g" pooling_param { pool: AVE global_pooling: true } }'
        'layer { name: "fc" type: "InnerProduct" bottom: "g" top: "fc" param { name: "w" share_mode: PERMISSIVE } '
        'inner_product_param { num_output: 3 bias_term: false } }'),
    "conv_1d_3d": _net(
        'layer { name: "c1d" type: "Convolution" bottom: "data" top: "c1d" convolution_param { num_output: 2 '
        'kernel_size: 3 stride: 2 pad: 1 } }'
        'layer { name: "fc2" type: "InnerProduct" bottom: "c1d" top: "fc2" inner_product_param { num_output: 3 '
        'axis: 2 } }', shape=(2, 3, 10)),
    # x (T=4, N=2, 3, 2), cont (T, N) (random: non-binary cont scales the state), x_static, h0, c0
    "recurrent": _net(
        'layer { name: "lstm_a" type: "LSTM" bottom: "data" bottom: "cont" top: "h_a" '
        'recurrent_param { num_output: 4 } }'
        'layer { name: "lstm_b" type: "LSTM" bottom: "data" bottom: "cont" bottom: "xs" bottom: "h0" bottom: "c0" '
        'top: "h_b" top: "hT_b" top: "cT_b" recurrent_param { num_output: 3 expose_hidden: true } }'
        'layer { name: "rnn_a" type: "RNN" bottom: "data" bottom: "cont" bottom: "xs" top: "o_a" '
        'recurrent_param { num_output: 5 } }'
        'layer { name: "rnn_b" type: "RNN" bottom: "data" bottom: "cont" bottom: "h0" top: "o_b" top: "hT_o" '
        'recurrent_param { num_output: 3 expose_hidden: true } }', shape=(4, 2, 3, 2),
        extra_inputs=_inputs(cont=(4, 2), xs=(2, 5), h0=(1, 2, 3), c0=(1, 2, 3))),
    "argmax_priorbox": _net(
        'layer { name: "am1" type: "ArgMax" bottom: "data" top: "am1" }'
        'layer { name: "am2" type: "ArgMax" bottom: "data" top: "am2" argmax_param { top_k: 2 out_max_val: true '
        'axis: -1 } }'
        'layer { name: "am3" type: "ArgMax" bottom: "data" top: "am3" argmax_param { top_k: 4 out_max_val: true } }'
        'layer { name: "am4" type: "ArgMax" bottom: "data" top: "am4" argmax_param { top_k: 3 axis: 1 } }'
        'layer { name: "p" type: "Pooling" bottom: "data" top: "p" pooling_param { pool: MAX kernel_size: 2 '
        'stride: 2 } }'
        'layer { name: "pb1" type: "PriorBox" bottom: "p" bottom: "data" top: "pb1" prior_box_param { min_size: 2 '
        'max_size: 5 aspect_ratio: 2 aspect_ratio: 3 flip: true variance: 0.1 variance: 0.1 variance: 0.2 '
        'variance: 0.2 offset: 0.5 } }'
        'layer { name: "pb2" type: "PriorBox" bottom: "p" bottom: "data" top: "pb2" prior_box_param { min_size: 3 '
        'min_size: 5 aspect_ratio: 1.5 clip: true img_size: 20 step: 3.5 offset: 0.25 variance: 0.1 } }'
        'layer { name: "pb3" type: "PriorBox" bottom: "data" bottom: "data" top: "pb3" prior_box_param { '
        'min_size: 4 aspect_ratio: 0.5 flip: false img_h: 9 img_w: 13 step_h: 2 step_w: 1.5 } }'),
    # priors from a PriorBox; loc, conf (softmax over 3 classes) and the per-class loc2 are random
    "ssd_detection": _net(
        'layer { name: "pb" type: "PriorBox" bottom: "data" bottom: "data" top: "pb" prior_box_param { '
        'min_size: 2 max_size: 4 aspect_ratio: 2 flip: true variance: 0.1 variance: 0.1 variance: 0.2 '
        'variance: 0.2 } }'
        'layer { name: "cr" type: "Reshape" bottom: "conf" top: "cr" reshape_param { shape { dim: 0 dim: -1 '
        'dim: 3 } } }'
        'layer { name: "cs" type: "Softmax" bottom: "cr" top: "cs" softmax_param { axis: 2 } }'
        'layer { name: "cf" type: "Flatten" bottom: "cs" top: "cf" }'
        'layer { name: "det1" type: "DetectionOutput" bottom: "loc" bottom: "cf" bottom: "pb" top: "det1" '
        'detection_output_param { num_classes: 3 background_label_id: 0 nms_param { nms_threshold: 0.45 '
        'top_k: 30 } code_type: CENTER_SIZE keep_top_k: 12 confidence_threshold: 0.2 } }'
        'layer { name: "det2" type: "DetectionOutput" bottom: "loc2" bottom: "cf" bottom: "pb" top: "det2" '
        'detection_output_param { num_classes: 3 share_location: false background_label_id: 1 nms_param { '
        'nms_threshold: 0.7 eta: 0.8 } code_type: CORNER confidence_threshold: 0.1 } }'
        'layer { name: "det3" type: "DetectionOutput" bottom: "loc" bottom: "cf" bottom: "pb" top: "det3" '
        'detection_output_param { num_classes: 3 background_label_id: -1 nms_param { nms_threshold: 0.5 } '
        'code_type: CORNER_SIZE variance_encoded_in_target: true clip: true keep_top_k: 5 '
        'confidence_threshold: 0.3 } }'
        'layer { name: "none" type: "DetectionOutput" bottom: "loc" bottom: "cf" bottom: "pb" top: "none" '
        'detection_output_param { num_classes: 3 confidence_threshold: 1 } }'
        'layer { name: "keep" type: "AbsVal" bottom: "data" top: "data_abs" }', shape=(2, 3, 4, 5),
        extra_inputs=_inputs(loc=(2, 80 * 4), conf=(2, 80 * 3), loc2=(2, 80 * 3 * 4))),
    # rois from random numbers: batch index sigmoid * 1.9 (0 or 1), corners |z| * 4 (x2 < x1 too)
    "roi_pooling": _net(
        'layer { name: "sl" type: "Slice" bottom: "rois" top: "ri" top: "rc" slice_param { axis: 1 '
        'slice_point: 1 } }'
        'layer { name: "sg" type: "Sigmoid" bottom: "ri" top: "rs" }'
        'layer { name: "pw" type: "Power" bottom: "rs" top: "rb" power_param { scale: 1.9 } }'
        'layer { name: "ab" type: "AbsVal" bottom: "rc" top: "ra" }'
        'layer { name: "pc" type: "Power" bottom: "ra" top: "rcs" power_param { scale: 4 } }'
        'layer { name: "cat" type: "Concat" bottom: "rb" bottom: "rcs" top: "r" concat_param { axis: 1 } }'
        'layer { name: "roi1" type: "ROIPooling" bottom: "data" bottom: "r" top: "roi1" roi_pooling_param { '
        'pooled_h: 3 pooled_w: 2 spatial_scale: 1 } }'
        'layer { name: "roi2" type: "ROIPooling" bottom: "data" bottom: "r" top: "roi2" roi_pooling_param { '
        'pooled_h: 2 pooled_w: 2 spatial_scale: 0.5 } }'
        'layer { name: "ps" type: "PSROIPooling" bottom: "data" bottom: "r" top: "ps" psroi_pooling_param { '
        'spatial_scale: 0.75 output_dim: 2 group_size: 2 } }'
        'layer { name: "psc" type: "PSROIContextPooling" bottom: "data" bottom: "r" bottom: "r" top: "psc" '
        'psroi_context_pooling_param { spatial_scale: 0.75 output_dim: 2 group_size: 2 } }'
        'layer { name: "keep" type: "AbsVal" bottom: "rois" top: "rois_abs" }', shape=(2, 8, 7, 9),
        extra_inputs=_inputs(rois=(6, 5))),
}


def _randomize(model, seed=0):
    rng = np.random.default_rng(seed)
    for n in model.layers:
        if not n.blobs:
            continue
        blobs = [rng.standard_normal(b.shape).astype(np.float32) for b in n.blobs]
        if n.type == "BatchNorm":
            blobs[1] = np.abs(blobs[1]) + 0.5
            blobs[2] = np.full(blobs[2].shape, 0.5 if len(blobs) == 3 else 1.0, np.float32)
        n.blobs = blobs
    from caffeq.graph_weights import share_params
    share_params(model.graph)
    return model


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "default"])
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_bit_for_bit(tmp_path, name, exact):
    model = _randomize(load_from_text(ZOO[name], random_weights=True))
    info = export_pytorch(model, tmp_path / "o", exact_batchnorm=exact)
    net = _import(tmp_path / "o" / "model.py").load()
    rng = np.random.default_rng(1)
    inputs = {b: rng.standard_normal(s).astype(np.float32) for b, s in model.inputs.items()}
    with torch.no_grad():
        out = _outputs(net(*_feed(model, info, inputs)), info)
    ref = model.run(inputs, all_blobs=True)
    inexact = not exact and _has_batchnorm(model)
    for k, v in out.items():
        v = v.numpy()
        assert v.shape == ref[k].shape, k
        if inexact and k != "b2":   # plain nn.BatchNorm (b2 normalizes with batch statistics: helper)
            assert np.abs(v - ref[k]).max() <= 1e-5 * max(1.0, np.abs(ref[k]).max()), k
        else:
            assert np.array_equal(v, ref[k], equal_nan=True), f"{k}: {np.abs(v - ref[k]).max()}"
    if name == "shared_params":
        assert net.c2.weight is net.c1.weight and net.c2.bias is net.c1.bias
    if name == "shared_params_reshaped":   # the same values, untied (torch has no Parameter of two shapes)
        assert torch.equal(net.fc.weight.reshape(3, 3, 1, 1), net.c1.weight)
        assert "not tied for training" in (tmp_path / "o" / "model.py").read_text()


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_train_mode_gradients(tmp_path, name):
    model = _randomize(load_from_text(ZOO[name], random_weights=True))
    info = export_pytorch(model, tmp_path / "o")
    net = _import(tmp_path / "o" / "model.py").load().train()
    rng = np.random.default_rng(2)
    inputs = {b: rng.standard_normal(s).astype(np.float32) for b, s in model.inputs.items()}
    feed = [t.requires_grad_(True) for t in _feed(model, info, inputs)]
    out = _outputs(net(*feed), info)
    sum(v.sum() for v in out.values() if v.requires_grad).backward()
    for pname, p in net.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
    assert all(t.grad is not None for t in feed)


def test_zoo_files_pass_ruff(tmp_path):
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not os.path.exists(ruff):
        pytest.skip("ruff is not installed")
    files = []
    for name in sorted(ZOO):
        export_pytorch(_randomize(load_from_text(ZOO[name], random_weights=True)), tmp_path / name)
        files.append(str(tmp_path / name / "model.py"))
    proc = subprocess.run([ruff, "check", "--isolated", "--no-cache", *files], check=False, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_priorbox_follows_the_spatial_sizes_at_run_time(tmp_path):
    """The generated PriorBox computes from the bottoms' sizes as forward does, at sizes other than the
    prototxt's too (a feature map with fewer axes counts 1 for the missing ones, as Caffe)."""
    from caffeq.layers.ssd import prior_boxes
    model = load_from_text(ZOO["argmax_priorbox"], random_weights=True)
    export_pytorch(model, tmp_path / "o")
    net = _import(tmp_path / "o" / "model.py").load()
    def hw(shape):
        return shape[2] if len(shape) > 2 else 1, shape[3] if len(shape) > 3 else 1

    sizes = [((1, 3, 5, 6), (1, 3, 11, 14)), ((2, 3, 1, 3), (2, 3, 30, 41)), ((1, 3, 5), (1, 3, 8, 8))]
    for name in ("pb1", "pb2", "pb3"):
        node = model.graph.node(name)
        for feat, img in sizes:
            got = getattr(net, name)(torch.randn(feat), torch.randn(img))
            want = prior_boxes(node.attrs, hw(feat), hw(img))
            assert got.dtype == torch.float32 and np.array_equal(got.numpy(), want), (name, feat, img)
            spec_out = node.spec.forward(node.attrs, [], torch.randn(feat), torch.randn(img))
            assert torch.equal(got, spec_out)


def test_detection_output_ties_and_many_candidates_bit_for_bit(tmp_path):
    """Scores with many ties (SSD's stable order: lower prior first) and over 2048 candidates in a
    class (ssd_nms's row-by-row IoU path), priors on a coarse grid so that NMS suppresses a lot."""
    rng = np.random.default_rng(5)
    P = 2300
    centers = np.round(rng.uniform(0.2, 0.8, (P, 2)) * 5) / 5
    wh = rng.uniform(0.1, 0.4, (P, 2))
    pbox = np.concatenate([centers - wh / 2, centers + wh / 2], 1)
    var = np.tile([0.1, 0.1, 0.2, 0.2], (P, 1))
    feeds = {"loc": rng.normal(0, 1, (2, P * 4)).astype(np.float32),
             "conf": np.round(rng.uniform(0, 1, (2, P * 2)), 1).astype(np.float32),
             "prior": np.stack([pbox.reshape(-1), var.reshape(-1)]).reshape(1, 2, -1).astype(np.float32)}
    text = (_inputs(**{k: v.shape for k, v in feeds.items()}) +
            'layer { name: "d1" type: "DetectionOutput" bottom: "loc" bottom: "conf" bottom: "prior" top: "d1" '
            'detection_output_param { num_classes: 2 nms_param { nms_threshold: 0.45 } code_type: CENTER_SIZE '
            'keep_top_k: 300 confidence_threshold: 0.05 } }'
            'layer { name: "d2" type: "DetectionOutput" bottom: "loc" bottom: "conf" bottom: "prior" top: "d2" '
            'detection_output_param { num_classes: 2 background_label_id: -1 nms_param { nms_threshold: 0.9 '
            'eta: 0.7 top_k: 400 } code_type: CORNER_SIZE } }')
    model = load_from_text(text)
    info = export_pytorch(model, tmp_path / "o")
    net = _import(tmp_path / "o" / "model.py").load()
    with torch.no_grad():
        out = _outputs(net(*_feed(model, info, feeds)), info)
    ref = model.run(feeds, all_blobs=True)
    assert (feeds["conf"].reshape(2, P, 2)[:, :, 1] > 0.05).sum(1).min() > 2048
    for k in ("d1", "d2"):
        assert out[k].shape[2] > 2, k
        assert np.array_equal(out[k].numpy(), ref[k]), k


def test_pooling_drops_the_last_window_on_both_axes_when_any_is_padded():
    """BVLC PoolingLayer::Reshape: `if (pad_h_ || pad_w_)` a last window starting at or past
    the padded end is dropped on both axes (W = 9, kernel 2, stride 3: ceil(7/3) + 1 = 4 -> 3)."""
    model = load_from_text(ZOO["pool_pad_one_axis"], random_weights=True)
    assert model.blob_shapes["p"] == (2, 3, 4, 3) and model.blob_shapes["q"] == (2, 3, 4, 3)


def test_every_required_type_is_supported():
    from caffeq.layers import get_spec
    from caffeq.layers.registry import Layer
    for t in REQUIRED:
        spec = get_spec(t)
        assert spec is not None, t
        if spec.is_data:
            continue
        assert type(spec).pytorch_source is not Layer.pytorch_source, t
    covered = set()
    for text in ZOO.values():
        covered |= {n.type for n in load_from_text(text, random_weights=True).layers}
    for name in case_ids():
        covered |= {n.type for n in Case(FIXTURES / name).load().layers}
    assert set(REQUIRED) <= covered


def test_literals_round_trip():
    for v in (0.1, 1e-5, 0.75, -2.5, 3.0, float(np.float32(0.1)), 1e-45, 123456789.0):
        assert float(np.float32(eval(lit(v)))) == float(np.float32(v))
        assert eval(lit(v, exact=True)) == v
    assert lit(float("inf")) == 'float("inf")'
    assert eval(lit("it's \"q\"")) == "it's \"q\""


# ---- the command line ------------------------------------------------------------------------------

@pytest.mark.slow
def test_cli_convert_format_pytorch(tmp_path):
    case_dir = FIXTURES / "net_lenet"
    out = tmp_path / "lenet_pt"
    proc = subprocess.run([sys.executable, "cli.py", "convert", str(case_dir / "model.prototxt"),
                           "--weights", str(case_dir / "model.caffemodel"), "--format", "pytorch",
                           "-o", str(out) + os.sep], cwd=REPO, check=False, capture_output=True, text=True, timeout=300)
    if "invalid choice: 'pytorch'" in proc.stderr or "unrecognized arguments: --format" in proc.stderr:
        pytest.skip("convert has no --format pytorch yet")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "model.py", "weights.safetensors"]
    case = Case(case_dir)
    net = _import(out / "model.py").load()
    y = net(torch.from_numpy(case.inputs["data"])).detach().numpy()
    assert np.array_equal(y, case.load().run(case.inputs, exact=True)["prob"])
    # -o file.py, binary
    proc = subprocess.run([sys.executable, "cli.py", "convert", str(case_dir / "model.prototxt"),
                           "--weights", str(case_dir / "model.caffemodel"), "--format", "pytorch",
                           "--to", "binary", "--keep", "none", "-o", str(tmp_path / "bin.py")],
                          cwd=REPO, check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "bin.safetensors").exists()
    assert "alpha * sign(W)" in " ".join((tmp_path / "bin.py").read_text().split())
    # unsupported layers (a user layer type without PyTorch source): exit 2, one line, nothing written
    custom = tmp_path / "custom"
    custom.mkdir()
    conv = FIXTURES / "conv_basic"
    (custom / "model.prototxt").write_text((conv / "model.prototxt").read_text() +
                                           'layer { name: "odd" type: "NoTorchSourceA" bottom: "conv" top: "odd" }\n')
    shutil.copy(conv / "model.caffemodel", custom / "model.caffemodel")
    code = NO_SOURCE_LAYER + "\nimport sys\nfrom caffeq.__main__ import main\nsys.exit(main(sys.argv[1:]))\n"
    proc = subprocess.run([sys.executable, "-c", code, "convert", str(custom / "model.prototxt"), "--weights",
                           str(custom / "model.caffemodel"), "--format", "pytorch", "-o", str(tmp_path / "odd")],
                          cwd=REPO, check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.startswith("caffeq: error:") and "NoTorchSourceA" in proc.stderr and "'odd'" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "odd").exists()
