"""Bad input: one `caffeq: error:` line naming file/layer/field, exit status 2, no traceback, no output file."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from conftest import cli_process, one_line_error
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import caffeq
from caffeq.errors import CaffeqError

REPO = Path(__file__).resolve().parents[1]
CASES = REPO / "tests" / "fixtures" / "caffe"
CONV = CASES / "conv_basic"


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text) if isinstance(text, str) else p.write_bytes(text)
    return p


NET = """name: "t"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 8 dim: 8 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" convolution_param { num_output: 4 kernel_size: 3 } }
"""


def test_syntax_error_names_file_line_column(tmp_path):
    p = write(tmp_path, "bad.prototxt", NET.replace('top: "conv" convolution_param', 'top: "conv" convolution_param {{'))
    one_line_error(cli_process("inspect", p), "bad.prototxt:3:")


def test_unknown_field_names_field_and_layer(tmp_path):
    p = write(tmp_path, "u.prototxt", NET.replace("kernel_size: 3", "kernel_size: 3 kernal_pad: 1"))
    one_line_error(cli_process("inspect", p), "kernal_pad", "conv", "u.prototxt:3")


def test_unknown_field_can_be_ignored_with_warning(tmp_path):
    p = write(tmp_path, "u.prototxt", NET.replace("kernel_size: 3", "kernel_size: 3 kernal_pad: 1"))
    res = cli_process("inspect", p, "--ignore-unknown")
    assert res.returncode == 0, res.stderr
    assert "warning" in res.stderr and "kernal_pad" in res.stderr


def test_unknown_layer_types_all_listed(tmp_path):
    text = NET + ('layer { name: "a" type: "Frobnicate" bottom: "conv" top: "a" }\n'
                  'layer { name: "b" type: "Wobble" bottom: "a" top: "b" }\n')
    line = one_line_error(cli_process("inspect", write(tmp_path, "x.prototxt", text)), "Frobnicate", "Wobble")
    # where to find the supported types (the README's table), not all of them on one line
    assert "supported_types()" in line and "register_layer" in line and "Convolution" not in line



def test_a_layer_without_a_type_is_named(tmp_path):
    text = NET + 'layer { name: "stub" bottom: "conv" top: "stub" }\n'
    one_line_error(cli_process("inspect", write(tmp_path, "x.prototxt", text)), "layer 'stub' has no type")


def test_python_layer_is_never_imported(tmp_path):
    marker = tmp_path / "imported"
    mod = tmp_path / "evil_layer.py"
    mod.write_text(f"open({str(marker)!r}, 'w').write('x')\nclass Evil: pass\n")
    text = NET + ('layer { name: "py" type: "Python" bottom: "conv" top: "py" '
                  'python_param { module: "evil_layer" layer: "Evil" } }\n')
    p = write(tmp_path, "py.prototxt", text)
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    # the listing reads past it with a warning naming it; loading it to run refuses it
    listed = subprocess.run([sys.executable, str(REPO / "cli.py"), "inspect", str(p)], capture_output=True,
                            text=True, cwd=tmp_path, env=env, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert "layer 'py' (Python): a Python layer (module 'evil_layer', class 'Evil')" in listed.stderr
    loading = subprocess.run([sys.executable, "-c", f"import caffeq; caffeq.load({str(p)!r}, random_weights=True)"],
                             capture_output=True, text=True, cwd=REPO, env=env, timeout=60)
    assert loading.returncode != 0 and "caffeq never imports or runs code named by a model file" in loading.stderr
    assert "layer 'py' is a Python layer (module 'evil_layer', class 'Evil')" in loading.stderr
    assert not marker.exists()


def test_undefined_bottom(tmp_path):
    text = NET + 'layer { name: "r" type: "Dropout" bottom: "nothing" top: "r" }\n'
    one_line_error(cli_process("inspect", write(tmp_path, "x.prototxt", text)), "'r'", "nothing")


def test_a_layer_without_its_bottom_is_named(tmp_path):
    # ocean1100/caffe_prototxt's train_val1: a Pooling with a top and no bottom (Caffe refuses it too)
    text = NET + 'layer { name: "p" type: "Pooling" top: "p" pooling_param { pool: AVE kernel_size: 2 } }\n'
    one_line_error(cli_process("inspect", write(tmp_path, "x.prototxt", text)), "'p' (Pooling)", "has no bottom")


def test_a_net_left_empty_says_why(tmp_path):
    # HoiM/triplet-caffe's net.prototxt: a fragment of training layers reading a blob another file makes
    fragment = ('layer { name: "norm" type: "Python" bottom: "fc7_2" top: "n" python_param { module: "l2norm_layer" '
                'layer: "L2NormLayer" } }\n'
                'layer { name: "loss" type: "EuclideanLoss" bottom: "n" bottom: "n" top: "loss" }\n')
    one_line_error(cli_process("inspect", write(tmp_path, "f.prototxt", fragment)), "nothing is left to run at TEST",
                   "'norm', 'loss'", "layer 'norm' reads 'fc7_2', which no layer makes")
    # mogli0528/work_note's image_scale train net: its only data layer is TRAIN's, so at TEST the rest reads a blob
    # nothing makes: the error points at the phase that makes it
    train_data = ('layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 } } '
                  'include { phase: TRAIN } }\n'
                  'layer { name: "shown" type: "Python" bottom: "data" top: "shown" python_param { module: "m" '
                  'layer: "L" } }\n')
    one_line_error(cli_process("inspect", write(tmp_path, "d.prototxt", train_data)), "nothing is left to run at TEST",
                   "layer 'shown' reads 'data', which only layer 'data' makes, at TRAIN: read the net with --phase TRAIN")
    train_only = 'layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 1 } } include { phase: TRAIN } }\n'
    one_line_error(cli_process("inspect", write(tmp_path, "t.prototxt", train_only)),
                   "no layer of the net is in its TEST phase")


def test_negative_and_absurd_dimensions_refused_before_allocating(tmp_path):
    neg = NET.replace("dim: 8 dim: 8", "dim: -8 dim: 8")
    one_line_error(cli_process("inspect", write(tmp_path, "n.prototxt", neg)), "data", "negative")
    huge = NET.replace("dim: 8 dim: 8", "dim: 100000000 dim: 100000000")
    res = cli_process("inspect", write(tmp_path, "h.prototxt", huge))
    one_line_error(res, "absurd")


def test_truncated_caffemodel(tmp_path):
    data = (CONV / "model.caffemodel").read_bytes()
    p = write(tmp_path, "t.caffemodel", data[: len(data) // 2])
    one_line_error(cli_process("inspect", CONV / "model.prototxt", "--weights", p), "t.caffemodel")


def test_random_bytes_caffemodel(tmp_path):
    p = write(tmp_path, "r.caffemodel", np.random.default_rng(0).bytes(5000))
    one_line_error(cli_process("inspect", CONV / "model.prototxt", "--weights", p), "r.caffemodel")


def test_misshaped_weights_name_layer_blob_and_shapes(tmp_path):
    p = write(tmp_path, "m.prototxt", (CONV / "model.prototxt").read_text().replace("num_output: 5", "num_output: 6"))
    line = one_line_error(cli_process("inspect", p, "--weights", CONV / "model.caffemodel"), "'conv'", "blob 0")
    assert "[5, 3, 3, 3]" in line and "[6, 3, 3, 3]" in line


def test_missing_weights_for_layer(tmp_path):
    p = write(tmp_path, "m.prototxt", (CONV / "model.prototxt").read_text().replace('name: "conv"', 'name: "conv_renamed"'))
    one_line_error(cli_process("inspect", p, "--weights", CONV / "model.caffemodel"), "conv_renamed")


def test_debug_shows_traceback(tmp_path):
    p = write(tmp_path, "bad.prototxt", "layer { name: ")
    res = cli_process("--debug", "inspect", p)
    assert res.returncode != 0 and "Traceback" in res.stderr


def test_failed_run_leaves_no_output_file(tmp_path):
    out = tmp_path / "out.npz"
    bad_input = write(tmp_path, "x.npy", b"not numpy")
    one_line_error(cli_process("run", CONV / "model.prototxt", "--weights", CONV / "model.caffemodel",
                              "--input", bad_input, "-o", out), "x.npy")
    assert not out.exists()
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".caffeq-")]


def test_wrong_input_shape_is_one_line(tmp_path):
    x = tmp_path / "x.npy"
    np.save(x, np.zeros((2, 4, 11, 13), np.float32))
    one_line_error(cli_process("run", CONV / "model.prototxt", "--weights", CONV / "model.caffemodel",
                              "--input", x, "-o", tmp_path / "o.npz"), "data")


def test_an_empty_blob_that_torch_cannot_pool_is_one_line(tmp_path):
    """A Slice at the last channel leaves an empty top, which Caffe allows (and its Pooling loops over nothing);
    torch's pooling refuses it: one line naming the layer and the empty bottom, no output file."""
    net = write(tmp_path, "n.prototxt", '''name: "t"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 6 dim: 7 } } }
layer { name: "s" type: "Slice" bottom: "data" top: "a" top: "b" slice_param { axis: 1 slice_point: 3 } }
layer { name: "pool" type: "Pooling" bottom: "b" top: "p" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
''')
    x, out = tmp_path / "x.npy", tmp_path / "o.npz"
    np.save(x, np.zeros((2, 3, 6, 7), np.float32))
    weights = write(tmp_path, "n.caffemodel", b'\n\x01t')     # a NetParameter named "t" with no layers
    line = one_line_error(cli_process("run", net, "--weights", weights, "--input", x, "-o", out), "'pool'", "'b'",
                          "2x0x6x7")
    assert "empty" in line
    assert not out.exists()
    onnx_out = tmp_path / "n.onnx"     # onnxruntime would refuse to load it: no file
    one_line_error(cli_process("convert", net, "--weights", weights, "-o", onnx_out), "'pool'", "'b'", "2x0x6x7")
    assert not onnx_out.exists()


def test_a_check_on_the_values_names_its_layer(tmp_path):
    """A check that only the run can make (a roi's batch index past the batch) names the layer, once."""
    net = write(tmp_path, "n.prototxt", '''name: "t"
input: "x" input_shape { dim: 2 dim: 3 dim: 8 dim: 9 }
input: "rois" input_shape { dim: 2 dim: 5 }
layer { name: "roi_pool5" type: "ROIPooling" bottom: "x" bottom: "rois" top: "p"
        roi_pooling_param { pooled_h: 2 pooled_w: 2 spatial_scale: 1 } }
''')
    feeds, out = tmp_path / "in.npz", tmp_path / "o.npz"
    np.savez(feeds, x=np.zeros((2, 3, 8, 9), np.float32),
             rois=np.array([[0, 1, 1, 4, 4], [5, 0, 0, 3, 3]], np.float32))
    weights = write(tmp_path, "n.caffemodel", b'\n\x01t')
    line = one_line_error(cli_process("run", net, "--weights", weights, "--input", feeds, "-o", out),
                          "layer 'roi_pool5' (ROIPooling): roi batch index 5")
    assert line.count("ROIPooling") == 1
    assert not out.exists()


# PSPNet's pyramid in miniature: a fixed pooling grid joined with a fixed-size Interp fits one input size
FIXED_SIZE = """name: "t"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: SIDE dim: SIDE } } }
layer { name: "pool" type: "Pooling" bottom: "data" top: "pool" pooling_param { pool: AVE kernel_size: 4 stride: 4 } }
layer { name: "interp" type: "Interp" bottom: "pool" top: "interp" interp_param { height: 56 width: 56 } }
layer { name: "cat" type: "Concat" bottom: "pool" bottom: "interp" top: "cat" }
"""


def test_a_declared_placeholder_size_that_does_not_fit_names_the_size_that_does(tmp_path):
    p = write(tmp_path, "t.prototxt", FIXED_SIZE.replace("SIDE", "100"))
    one_line_error(cli_process("inspect", p), "layer 'cat' (Concat)", "the file declares data 1x3x100x100, and the "
                   "net fits 224x224: pass --input-shape data=1,3,224,224")
    model = caffeq.load(p, input_shapes={"data": (1, 3, 224, 224)})
    assert model.blob_shapes["cat"] == (1, 6, 56, 56)
    # a size nets are trained at is no placeholder: no guess (a converted net means other layers)
    line = one_line_error(cli_process("inspect", write(tmp_path, "u.prototxt", FIXED_SIZE.replace("SIDE", "416"))),
                          "layer 'cat' (Concat)")
    assert "--input-shape" not in line


def test_run_refuses_to_overwrite_its_input(tmp_path):
    x = tmp_path / "x.npz"
    np.savez(x, data=np.zeros((2, 3, 11, 13), np.float32))
    before = x.read_bytes()
    one_line_error(cli_process("run", CONV / "model.prototxt", "--weights", CONV / "model.caffemodel",
                              "--input", x, "-o", x), "overwrite")
    assert x.read_bytes() == before


# ---- fuzzing: mutated real files only ever raise CaffeqError -----------------------

_FUZZ_CASES = ["conv_basic", "net_lenet", "legacy_v1_layers", "batchnorm_scale", "pool_ave_pad"]


def _load_quietly(prototxt, weights):
    try:
        m = caffeq.load(prototxt, weights)
    except CaffeqError:
        return
    assert m.graph is not None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(_FUZZ_CASES), data=st.data())
def test_fuzz_mutated_caffemodel(tmp_path, case, data):
    raw = bytearray((CASES / case / "model.caffemodel").read_bytes())
    kind = data.draw(st.sampled_from(["flip", "truncate", "splice"]))
    if kind == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] = data.draw(st.integers(0, 255))
    elif kind == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    else:
        i = data.draw(st.integers(0, len(raw)))
        raw[i:i] = data.draw(st.binary(min_size=1, max_size=32))
    p = tmp_path / "fuzz.caffemodel"
    p.write_bytes(bytes(raw))
    _load_quietly(str(CASES / case / "model.prototxt"), str(p))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(_FUZZ_CASES), data=st.data())
def test_fuzz_mutated_prototxt(tmp_path, case, data):
    text = (CASES / case / "model.prototxt").read_text()
    kind = data.draw(st.sampled_from(["delete", "insert", "digits"]))
    if kind == "delete":
        i = data.draw(st.integers(0, len(text)))
        text = text[:i] + text[i + data.draw(st.integers(1, 20)):]
    elif kind == "insert":
        i = data.draw(st.integers(0, len(text)))
        text = text[:i] + data.draw(st.sampled_from(["{", "}", '"', "-1", "0", " 99999999999", "x:", "\\"])) + text[i:]
    else:  # rewrite one number: negative, zero or huge dimensions and parameters
        import re
        nums = [m.start() for m in re.finditer(r"\d+", text)]
        if nums:
            i = data.draw(st.sampled_from(nums))
            j = i
            while j < len(text) and text[j].isdigit():
                j += 1
            text = text[:i] + data.draw(st.sampled_from(["0", "-3", "4000000000", "65536", "7"])) + text[j:]
    p = tmp_path / "fuzz.prototxt"
    p.write_text(text)
    _load_quietly(str(p), str(CASES / case / "model.caffemodel"))
