"""What a new user's review of the command line and the README found, each kept fixed: the README's
Python example runs, a prototxt that ends inside a block or a string says where it opened, `| head`
ends quietly, mistyped values get a "did you mean", one option name means one thing in every
command, and the README's examples write nothing into tracked folders.
"""
import fnmatch
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import net, rng
from test_cli import cli, one_error  # the one in-process CLI runner and its one-line-error check

import caffeq
from caffeq.__main__ import COMMANDS, build_parser
from caffeq.model import load_from_text

REPO = Path(__file__).resolve().parents[1]
DIGITS = REPO / "examples" / "digits"
DEPLOY, TRAIN_VAL = DIGITS / "deploy.prototxt", DIGITS / "train_val.prototxt"
PNG_FLAGS = ["--data", DIGITS / "test_list.txt", "--mean-file", DIGITS / "mean.binaryproto", "--scale", "0.00390625"]
README = (REPO / "README.md").read_text()


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


# ---- 1. the README's "Your own layers" example, as written ----------------------------------------

def _own_layer_snippet():
    section = README[README.index("### Your own layers"):]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_readme_own_layer_example_runs_as_written(tmp_path):
    from caffeq.layers import registry
    snippet = _own_layer_snippet()
    type_name = re.search(r'register_layer\("([^"]+)"\)', snippet).group(1)
    assert type_name not in caffeq.supported_types(), f"{type_name} is built in: the example would fail"
    try:
        exec(compile(snippet, "README.md (Your own layers)", "exec"), {})
        model = load_from_text(net(f'layer {{ name: "hs" type: "{type_name}" bottom: "x" top: "y" }}',
                                          inputs={"x": (2, 3, 5, 4)}))
        x = (rng().standard_normal((2, 3, 5, 4)) * 4).astype(np.float32)
        ref = torch.nn.functional.hardswish(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(model.run({"x": x})["y"], ref, rtol=1e-6, atol=1e-6)
        ort = pytest.importorskip("onnxruntime")     # its onnx() method writes a graph onnxruntime runs
        model.export_onnx(str(tmp_path / "hs.onnx"), optimize=False)
        got = ort.InferenceSession(str(tmp_path / "hs.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    finally:
        registry._REGISTRY.pop(type_name, None)


# ---- 2. a file that ends inside a block or a string ---------------------------------------------

def test_unclosed_layer_names_where_it_opened(here, capsys):
    lines = DEPLOY.read_text().splitlines(keepends=True)
    row = next(i for i, ln in enumerate(lines) if 'name: "conv1"' in ln)
    lines[row] = lines[row].rstrip().removesuffix("}").rstrip() + "\n"     # drop the `}` closing conv1
    (here / "open.prototxt").write_text("".join(lines))
    line = one_error(capsys, "inspect", "open.prototxt")
    assert line == (f"caffeq: error: open.prototxt:{row + 1}: layer 'conv1' opened here is not closed: "
                    f"the file ends before its '}}'")
    # across lines, the layer's name read where it stands
    (here / "cut.prototxt").write_text('name: "n"\nlayer {\n  name: "data"\n  type: "Input"\n'
                                       '  input_param { shape { dim: 1 dim: 3 } }\n')
    assert one_error(capsys, "inspect", "cut.prototxt").endswith(
        "cut.prototxt:2: layer 'data' opened here is not closed: the file ends before its '}'")


def test_unterminated_string_names_its_opening_quote(here, capsys):
    text = DEPLOY.read_text()
    (here / "q.prototxt").write_text(text.replace('top: "conv1"', 'top: "conv1', 1))
    row = next(i for i, ln in enumerate(text.splitlines()) if 'top: "conv1"' in ln)
    col = text.splitlines()[row].index('top: "conv1"') + len("top: ") + 1
    line = one_error(capsys, "inspect", "q.prototxt")
    assert line.startswith(f"caffeq: error: q.prototxt:{row + 1}:{col}: unterminated string"), line
    (here / "q2.prototxt").write_text('layer {\n  name: "data"\n  type: "Input\n  top: "data"\n}\n')
    assert "q2.prototxt:3:9: unterminated string" in one_error(capsys, "inspect", "q2.prototxt")



_TRICKY = ('name: "n"   # a comment with { and " and \'\n'
           'layer {\n'
           '  name: "data"\n'
           '  type: "Input"\n'
           '  top: "data"\n'
           '  input_param { shape { dim: 1 dim: 3 dim: 4 dim: 4 } }\n'
           '}\n'
           'layer {\n'
           '  name: "r{#"   # a brace and a hash in a string\n'
           '  type: "ReLU"\n'
           '  bottom: \'data\'\n'
           '  top: "r \\"}\\" \'{x"\n'
           '  relu_param { negative_slope: 0.1 ENGINE }\n'
           '}\n')


def test_a_stray_word_is_named_where_it_stands(here, capsys):
    # Nortinwell/VGG-depthwise-SSD's VGG_reduce_300: `}z` closes a layer; protobuf reports the next line's `layer {`
    lines = DEPLOY.read_text().splitlines(keepends=True)
    row = next(i for i, ln in enumerate(lines) if 'name: "conv1"' in ln)
    lines[row] = lines[row].rstrip() + "z\n"     # conv1's layer is one line: `...} } }z`
    (here / "stray.prototxt").write_text("".join(lines))
    assert one_error(capsys, "inspect", "stray.prototxt") == (
        f"caffeq: error: stray.prototxt:{row + 1}:{len(lines[row]) - 1}: 'z' stands where a field name goes but is followed by neither "
        f"':' nor '{{' (a stray word?)")

def test_unclosed_scan_reads_comments_quotes_and_escapes(here, capsys):
    """Braces and '#' in strings, escaped quotes and comments holding braces and quotes are read as
    protobuf reads them: a balanced file with another error keeps that error, an open one is named."""
    (here / "other.prototxt").write_text(_TRICKY)
    line = one_error(capsys, "inspect", "other.prototxt")
    assert "other.prototxt:13:" in line and "not closed" not in line and "unterminated" not in line, line
    fixed = _TRICKY.replace(" ENGINE", "")
    (here / "open.prototxt").write_text(fixed[:fixed.rindex("}")])
    assert one_error(capsys, "inspect", "open.prototxt") == (
        "caffeq: error: open.prototxt:8: layer 'r{#' opened here is not closed: the file ends before its '}'")
    (here / "quote.prototxt").write_text(fixed.replace('top: "data"', 'top: "da\\"ta'))
    assert "quote.prototxt:5:8: unterminated string" in one_error(capsys, "inspect", "quote.prototxt")


def test_unclosed_scan_names_the_last_layer_of_a_long_file():
    # its speed on a 5 MB file is measured by hand (about 1.5 s), not by a timed test
    from caffeq.io.prototxt import _unclosed
    layer = ('layer {{\n  name: "c{0}"  # {{ "\n  type: "Convolution"\n  bottom: "x{0}"\n  top: "x{1}"\n'
             '  convolution_param {{ num_output: 8 kernel_size: 3 weight_filler {{ type: "msra" }} }}\n}}\n')
    text = "".join(layer.format(i, i + 1) for i in range(3000))
    assert _unclosed("big.prototxt", text) is None
    assert _unclosed("big.prototxt", text[:-2]) == ("big.prototxt:20994: layer 'c2999' opened here is not closed: "
                                                    "the file ends before its '}'")


# ---- 3. a reader that stops early ------------------------------------------------------------------

@pytest.mark.parametrize("args", [["inspect", TRAIN_VAL, "--json"], ["inspect", DEPLOY]])
def test_closed_pipe_ends_quietly(args):
    read_end, write_end = os.pipe()
    os.close(read_end)            # the reader is gone before the first write (`| head` that has finished)
    try:
        res = subprocess.run([sys.executable, str(REPO / "cli.py"), *map(str, args)], stdout=write_end,
                             stderr=subprocess.PIPE, text=True, cwd=REPO, timeout=300, check=False)
    finally:
        os.close(write_end)
    assert res.returncode in (0, 141), res.stderr
    assert "Traceback" not in res.stderr and "BrokenPipe" not in res.stderr and "Exception ignored" not in res.stderr



def _with_closed(stream_name, *args, script=None):
    """Run the CLI (or `script`) with the reader of stdout or stderr gone, the other one read."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    cmd = [sys.executable, "-c", script, *map(str, args)] if script else \
        [sys.executable, str(REPO / "cli.py"), *map(str, args)]
    streams = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, stream_name: write_end} if stream_name else \
        {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    try:
        return subprocess.run(cmd, text=True, cwd=REPO, timeout=300, check=False, **streams)
    finally:
        os.close(write_end)


def test_closed_stderr_reader_ends_quietly_too():
    # `--json -`: the table goes to stderr, whose reader is gone; the JSON goes on to stdout or not, quietly
    res = _with_closed("stderr", "inspect", DEPLOY, "--json", "-")
    assert res.returncode in (0, 141) and "Traceback" not in res.stdout


def test_closed_pipe_with_debug_shows_the_traceback():
    res = _with_closed("stdout", "inspect", DEPLOY, "--debug")
    assert res.returncode == 1 and "BrokenPipeError" in res.stderr and "Traceback" in res.stderr


_BREAKS_ANOTHER_PIPE = """import sys
import caffeq.commands.inspect as inspect_command
def run(args):
    print("partial output")
    raise BrokenPipeError(32, "a worker's pipe")
inspect_command.run = run
from caffeq.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_broken_pipe_that_is_not_a_gone_reader_is_not_hidden():
    # stdout and stderr are read to the end: the BrokenPipeError is a real failure, shown as one
    res = _with_closed(None, "inspect", DEPLOY, script=_BREAKS_ANOTHER_PIPE)
    assert res.returncode == 1 and "BrokenPipeError: [Errno 32] a worker's pipe" in res.stderr, res.stderr
    assert res.stdout == "partial output\n"
    # the same error while stdout's reader is gone ends quietly
    res = _with_closed("stdout", "inspect", DEPLOY, script=_BREAKS_ANOTHER_PIPE)
    assert res.returncode == 141 and res.stderr == "", res.stderr


# ---- 4. "did you mean" for mistyped values ---------------------------------------------------------

@pytest.mark.parametrize("args, needles, absent", [
    (["convert", DEPLOY, "--onnx-batch", "dynamc"], ("caffeq: error: convert:", "did you mean dynamic?"), ()),
    (["convert", DEPLOY, "--to", "int8", "--calibrate", DIGITS / "train_lmdb", "--calibrate-method", "minmx"],
     ("--calibrate-method", "did you mean minmax?"), ("['",)),
    (["eval", DEPLOY, "--workers", "autoo"], ("--workers", "auto", "did you mean auto?"), ()),
    (["run", DEPLOY, "-i", "x.npy", "-o", "o.npz", "--no-progress"],
     ("--no-progress is an option of", "eval", "not of run"), ("--probe",)),
])
def test_mistyped_values_get_a_suggestion(here, capsys, args, needles, absent):
    line = one_error(capsys, *args)
    for n in needles:
        assert n in line, (n, line)
    for n in absent:
        assert n not in line, (n, line)
    assert os.listdir(here) == []


def test_no_progress_means_the_same_in_every_command_that_takes_it():
    parser, _ = build_parser()
    takers = [name for name in COMMANDS if "--no-progress" in parser.subcommands[name]._option_string_actions]
    assert "convert" in takers      # its --budget measures like `sensitivity`, with the same bars
    helps = {parser.subcommands[name]._option_string_actions["--no-progress"].help for name in takers}
    assert len(helps) == 1
    assert parser.parse_args(["convert", "m.prototxt", "--no-progress"]).no_progress


def test_unknown_layer_type_suggestion_ignores_letter_case(here, capsys):
    (here / "t.prototxt").write_text('layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 '
                                     'dim: 1 dim: 4 dim: 4 } } }\nlayer { name: "r" type: "Relux" bottom: "data" '
                                     'top: "r" }\n')
    assert "did you mean ReLU?" in one_error(capsys, "inspect", "t.prototxt")


# ---- 5. -o/--output is the output file, and nothing is abbreviated -----------------------------

def test_eval_output_is_refused_with_json_named(capsys):
    for flag in ("--output", "-o"):
        line = one_error(capsys, "eval", TRAIN_VAL, flag, "res.json")
        assert "eval" in line and "--json FILE" in line, line


def test_no_command_takes_an_abbreviated_option(here, capsys):
    parser, _ = build_parser()
    assert not parser.allow_abbrev
    assert all(not p.allow_abbrev for p in parser.subcommands.values())
    np.save("x.npy", np.zeros((1, 1, 16, 16), np.float32))
    assert "--outp" in one_error(capsys, "eval", TRAIN_VAL, "--outp", "ip2")
    assert "--out" in one_error(capsys, "run", DEPLOY, "-i", "x.npy", "--out", "o.npz")
    assert sorted(os.listdir(here)) == ["x.npy"]


# ---- 6. --keep: one meaning, one refusal ------------------------------------------------------------

def test_keep_without_a_quantized_target_is_refused_by_every_command(here, capsys):
    np.save("x.npy", np.zeros((1, 1, 16, 16), np.float32))
    lines = [one_error(capsys, "eval", TRAIN_VAL, "--keep", "conv1", "--limit", "8"),
             one_error(capsys, "run", DEPLOY, "--keep", "conv1", "-i", "x.npy", "-o", "o.npz"),
             one_error(capsys, "convert", DEPLOY, "--keep", "conv1", "-o", "o.onnx")]
    for line in lines:
        assert "--keep chooses the layers kept fp32 when quantizing" in line and "--to" in line, line
    assert sorted(os.listdir(here)) == ["x.npy"]


def test_keep_has_one_help_naming_every_quantized_target():
    parser, _ = build_parser()
    helps = {name: parser.subcommands[name]._option_string_actions["--keep"].help for name in ("run", "convert", "eval")}
    assert len(set(helps.values())) == 1, helps
    assert all(t in helps["run"] for t in ("fp16", "int8", "binary"))


# ---- 7, 8, 10. what eval and sensitivity say ----------------------------------------------------

def test_eval_of_a_binary_caffeq_says_why_there_is_no_fp32_row(here, capsys):
    assert cli(capsys, "convert", DEPLOY, "--to", "binary", "-o", "d.caffeq")[0] == 0
    rc, out, err = cli(capsys, "eval", "d.caffeq", *PNG_FLAGS, "--limit", "8", "--workers", "0",
                       "--to", "fp32,binary", "--no-progress")
    assert rc == 0, err
    rows = [ln.split()[0] for ln in out.splitlines() if ln.startswith(("fp32 ", "binary "))]
    assert rows == ["binary"]
    note = [ln for ln in out.splitlines() if ln.startswith("note:") and "fp32" in ln]
    assert len(note) == 1 and "d.caffeq holds binary weights and no fp32 reference" in note[0], out
    assert "no fp32 ones" not in out      # conv1 and ip2 are kept fp32 in it (binary's default)


def test_eval_and_sensitivity_say_which_json_file_they_wrote(here, capsys):
    rc, out, err = cli(capsys, "eval", DEPLOY, *PNG_FLAGS, "--limit", "8", "--workers", "1", "--json", "e.json")
    assert rc == 0, err
    assert out.splitlines()[-1] == "wrote e.json" and (here / "e.json").is_file()
    assert ", 1 worker," in out and "1 workers" not in out
    rc, out, err = cli(capsys, "sensitivity", TRAIN_VAL, "--limit", "16", "--workers", "0", "--no-cumulative",
                       "--json", "s.json")
    assert rc == 0, err
    assert out.splitlines()[-1] == "wrote s.json" and (here / "s.json").is_file()


def test_run_refuses_an_output_that_is_not_npz(here, capsys):
    np.save("x.npy", np.zeros((1, 1, 16, 16), np.float32))
    line = one_error(capsys, "run", DEPLOY, "-i", "x.npy", "-o", "out.txt")
    assert "out.txt" in line and ".npz" in line
    assert sorted(os.listdir(here)) == ["x.npy"]
    parser, _ = build_parser()
    assert ".npz" in parser.subcommands["run"]._option_string_actions["-o"].help
    run_row = next(ln for ln in README.splitlines() if ln.startswith("| `run MODEL.prototxt"))
    assert "another extension is refused" in run_row


# ---- 9. the README's examples write only ignored files ---------------------------------------------

def _readme_commands():
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.DOTALL):
        for line in block.replace("\\\n", " ").strip().splitlines():
            commands += [part.strip() for part in line.split("&&") if part.strip().startswith("python cli.py ")]
    return commands


def _written_paths(command):
    """The files and folders a README command writes, from its arguments (defaults included)."""
    argv = shlex.split(command)[2:]
    flags = {"-o", "--output", "--plot", "--json", "--weights-out"}
    paths = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in flags and not argv[i + 1].startswith("-")]
    if argv[0] == "convert" and not any(a in ("-o", "--output") for a in argv):
        stem = Path(argv[1]).stem
        to = argv[argv.index("--to") + 1] if "--to" in argv else "fp32"
        paths.append(f"{stem}_pytorch/" if "--format" in argv else f"{stem}.{to}.onnx")
    if argv[0] == "finetune" and not any(a in ("-o", "--output") for a in argv):
        paths.append(f"{Path(argv[1]).stem}.binary.finetuned.onnx")
    for p in list(paths):
        if p.endswith(".caffemodel"):          # the prototxt written beside it
            paths.append(p[:-len(".caffemodel")] + ".prototxt")
    return paths


def _ignored(path, patterns):
    for pat in patterns:
        anchored, pat = pat.startswith("/"), pat.lstrip("/")
        if pat.endswith("/"):
            if path.rstrip("/") == pat.rstrip("/") or path.startswith(pat):
                return True
        elif fnmatch.fnmatch(path if anchored else os.path.basename(path), pat):
            return True
    return False


def test_readme_examples_write_only_ignored_files_outside_tracked_folders():
    patterns = [ln.strip() for ln in (REPO / ".gitignore").read_text().splitlines()
                if ln.strip() and not ln.startswith(("#", "!"))]
    written = [(c, p) for c in _readme_commands() for p in _written_paths(c)]
    assert any(p == "sensitivity_digits.png" for _, p in written)
    for command, path in written:
        assert not path.startswith(("docs/", "examples/", "caffeq/", "tests/")), (command, path)
        assert _ignored(path, patterns), f"add {path} (written by `{command}`) to .gitignore"
    # the committed chart stays, and the README still shows it
    assert (REPO / "docs" / "sensitivity_digits.png").is_file() and "(docs/sensitivity_digits.png)" in README
