"""Template placeholders (DeepLab's `num_output: ${NUM_LABELS}`, PWC-Net's `crop_width: $TARGET_WIDTH`):
filled by --define, or from the net Caffe saved in the caffemodel, else one clear error."""
import json

import numpy as np
import pytest
from conftest import rng

from caffeq.__main__ import main as cli_main
from caffeq.errors import CaffeqError, ParseError
from caffeq.io.prototxt import parse_prototxt_text
from caffeq.io.writer import write_caffemodel, write_model_caffemodel
from caffeq.model import load

# a DeepLab config in miniature: the class count and a float come from the run script; the quoted
# ${EXP} and the commented ${NOT_USED} are plain text to Caffe
TEMPLATE = """name: "${EXP}-net"
input: "data"
input_shape { dim: 2 dim: 3 dim: $SIZE dim: 9 }
layer {
  name: "fc8_${EXP}" type: "Convolution" bottom: "data" top: "fc8"
  convolution_param { num_output: ${NUM_LABELS} kernel_size: 3 pad: 1 }   # was ${NOT_USED}
}
layer { name: "scale" type: "Power" bottom: "fc8" top: "out" power_param { scale: ${SCALE} } }
"""
VALUES = {"NUM_LABELS": "5", "SIZE": "7", "SCALE": "0.5"}


def _filled(values):
    text = TEMPLATE
    for name, value in values.items():
        text = text.replace("${%s}" % name, value).replace("$%s" % name, value)
    return text


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_define_fills_placeholders_in_value_position_only(tmp_path):
    model = load(_write(tmp_path, "t.prototxt", TEMPLATE), defines=VALUES, random_weights=True)
    assert model.inputs == {"data": (2, 3, 7, 9)}
    assert model.blob_shapes["fc8"] == (2, 5, 7, 9)
    layers = {lp.name: lp for lp in model.net.layer}
    assert model.net.name == "${EXP}-net" and "fc8_${EXP}" in layers   # quoted: kept
    assert layers["scale"].power_param.scale == 0.5
    assert any("filled the template placeholder NUM_LABELS with 5 (--define, 1 place)" in w for w in model.warnings)


def test_collective_knowledge_placeholders_fill_like_the_others(tmp_path):
    # dividiti/ck-caffe's packages write $#batch_size#$, whose '#' would otherwise open a comment
    text = TEMPLATE.replace("dim: 2 dim: 3", "dim: $#batch_size#$ dim: 3")
    model = load(_write(tmp_path, "ck.prototxt", text), defines={**VALUES, "batch_size": "4"}, random_weights=True)
    assert model.inputs == {"data": (4, 3, 7, 9)}
    with pytest.raises(ParseError, match=r"ck.prototxt:3: \$#batch_size#\$ \(layer 'input', "
                                         r"input_param.shape\[0\].dim\[0\]\) is a template placeholder"):
        load(_write(tmp_path, "ck.prototxt", text), defines=VALUES)


def test_hash_placeholders_fill_as_values_and_stay_comments_elsewhere(tmp_path):
    # cvjena/part_constellation_models' templates: `num_output: ##NUM_CLASSES##`; a line of hashes or a
    # ##WORD## after the comment's own '#' stays a comment
    text = TEMPLATE.replace("num_output: ${NUM_LABELS}", "num_output: ##NUM_CLASSES##") + "##NOTE## ### end\n"
    text = text.replace("# was ${NOT_USED}", "# was ##NOT_USED##")
    model = load(_write(tmp_path, "h.prototxt", text), defines={**VALUES, "NUM_CLASSES": "6"}, random_weights=True)
    assert model.blob_shapes["fc8"] == (2, 6, 7, 9)
    with pytest.raises(ParseError, match=r"h.prototxt:6: ##NUM_CLASSES## \(layer 'fc8_\$\{EXP\}', "
                                         r"convolution_param.num_output\) is a template placeholder"):
        load(_write(tmp_path, "h.prototxt", text), defines=VALUES)


def test_sed_argument_placeholders_are_named_after_the_argument(tmp_path):
    # kumasento/caffe's hsi templates: `num_output: ###@1###`, which `configure` replaces by its argument $1
    text = TEMPLATE.replace("num_output: ${NUM_LABELS}", "num_output: ###@1###")
    model = load(_write(tmp_path, "s.prototxt", text), defines={**VALUES, "ARG1": "6"}, random_weights=True)
    assert model.blob_shapes["fc8"] == (2, 6, 7, 9)
    with pytest.raises(ParseError, match=r"s.prototxt:6: ###@1### \(layer 'fc8_\$\{EXP\}', "
                                         r"convolution_param.num_output\) is a template placeholder"):
        load(_write(tmp_path, "s.prototxt", text), defines=VALUES)


def test_flownet2_dollar_enclosed_placeholders(tmp_path):
    # FlowNet 2.0's deploy templates (and flownet-tools' copies): `dim: $TARGET_HEIGHT$`; its run script
    # substitutes the whole $NAME$, both dollars
    text = TEMPLATE.replace("dim: $SIZE", "dim: $SIZE$").replace("${NUM_LABELS}", "$NUM_LABELS$")
    model = load(_write(tmp_path, "f.prototxt", text), defines=VALUES, random_weights=True)
    assert model.inputs == {"data": (2, 3, 7, 9)} and model.blob_shapes["fc8"] == (2, 5, 7, 9)
    with pytest.raises(ParseError, match=r"f.prototxt:3: \$SIZE\$ \(layer 'input', "
                                         r"input_param.shape\[0\].dim\[2\]\) is a template placeholder"):
        load(_write(tmp_path, "f.prototxt", text), defines={"NUM_LABELS": 5, "SCALE": 1})


@pytest.mark.parametrize("missing, where", [
    ("NUM_LABELS", r"t.prototxt:6: \$\{NUM_LABELS\} \(layer 'fc8_\$\{EXP\}', convolution_param.num_output\)"),
    ("SIZE", r"t.prototxt:3: \$SIZE \(layer 'input', input_param.shape\[0\].dim\[2\]\)"),   # the header, upgraded
    ("SCALE", r"t.prototxt:8: \$\{SCALE\} \(layer 'scale', power_param.scale\)")])
def test_an_undefined_placeholder_is_one_clear_error(tmp_path, missing, where):
    values = {k: v for k, v in VALUES.items() if k != missing}
    with pytest.raises(ParseError, match=where + r" is a template placeholder that a script fills in before "
                       rf"Caffe reads the file: pass --define {missing}=VALUE, or --weights"):
        load(_write(tmp_path, "t.prototxt", TEMPLATE), defines=values)

BARE_IP = """input: "x"
input_shape { dim: 1 dim: 4 }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y"
  inner_product_param {
    num_output: 3
  }
}
"""


def test_a_placeholder_of_an_unknown_template_language_is_named_in_the_error(tmp_path):
    # Yewwoei/Datathon-lab6's test.prototxt: a lab tool's postfix `${ $ SIZE . }`, which no --define can name
    text = BARE_IP.replace("num_output: 3", "num_output: ${ $ SIZE . }")
    with pytest.raises(ParseError, match=r"u.prototxt:\d+:\d+: .*Couldn't parse integer: \$ \(\$\{ \$ SIZE \. \} is a "
                                         r"template placeholder that a script fills in before Caffe reads the file"):
        load(_write(tmp_path, "u.prototxt", text))


def test_the_caffemodels_saved_net_fills_what_is_not_defined(tmp_path):
    # Caffe saves the filled net with the weights: a template plus its caffemodel reads as the filled net
    filled = _filled(VALUES)
    weights = {"fc8_${EXP}": [rng(1).standard_normal((5, 3, 3, 3)).astype(np.float32),
                              rng(2).standard_normal(5).astype(np.float32)]}
    write_caffemodel(parse_prototxt_text(filled), weights, tmp_path / "m.caffemodel")
    expected = load(_write(tmp_path, "filled.prototxt", filled), tmp_path / "m.caffemodel")
    model = load(_write(tmp_path, "t.prototxt", TEMPLATE), tmp_path / "m.caffemodel", defines={"SIZE": "7"})
    notes = "\n".join(model.warnings)
    assert "filled the template placeholder NUM_LABELS with 5, from the net saved in" in notes
    assert "filled the template placeholder SCALE with 0.5" in notes
    x = rng(3).standard_normal((2, 3, 7, 9)).astype(np.float32)
    np.testing.assert_array_equal(model.run({"data": x})["out"], expected.run({"data": x})["out"])


def test_a_caffemodel_that_does_not_say_leaves_the_error(tmp_path):
    filled = _filled(VALUES).replace('name: "fc8_${EXP}"', 'name: "other"')
    write_caffemodel(parse_prototxt_text(filled), {}, tmp_path / "m.caffemodel")
    with pytest.raises(ParseError, match=r"pass --define NUM_LABELS=VALUE \(the net saved in .*m.caffemodel "
                                         r"does not give it\)"):
        load(_write(tmp_path, "t.prototxt", TEMPLATE), tmp_path / "m.caffemodel", defines={"SIZE": "7"})


def test_the_command_line_takes_define_on_every_model_command(tmp_path, capsys):
    path = str(_write(tmp_path, "t.prototxt", TEMPLATE))
    # inspect lists the template, its shapes unknown from the placeholders on, and says what to pass
    assert cli_main(["inspect", path, "--json", "-"]) == 0
    captured = capsys.readouterr()
    listing = json.JSONDecoder().raw_decode(captured.out)[0]
    assert listing["inputs"] == {"data": None} and listing["unfilled_placeholders"]
    assert "input_param.shape[0].dim[2] is the template placeholder $SIZE: pass --define SIZE=VALUE" in captured.err
    assert "the shapes after it are unknown" in captured.err and "Traceback" not in captured.err
    # a command that computes refuses it in one line
    np.save(tmp_path / "x.npy", np.zeros((2, 3, 7, 9), np.float32))
    write_caffemodel(parse_prototxt_text('name: "other"'), {}, tmp_path / "other.caffemodel")
    assert cli_main(["run", path, "--weights", str(tmp_path / "other.caffemodel"), "-i", str(tmp_path / "x.npy"),
                     "-o", str(tmp_path / "o.npz")]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if not ln.startswith("caffeq: warning")]
    assert len(err) == 1 and "pass --define" in err[0] and not (tmp_path / "o.npz").exists()
    defines = [a for k, v in VALUES.items() for a in ("--define", f"{k}={v}")]
    assert cli_main(["inspect", path, "--json", "-"] + defines) == 0
    report = json.JSONDecoder().raw_decode(capsys.readouterr().out)[0]
    assert report["inputs"] == {"data": [2, 3, 7, 9]}
    assert [lay["output_shapes"] for lay in report["layers"] if lay["name"] == "fc8_${EXP}"] == [{"fc8": [2, 5, 7, 9]}]
    # convert: the caffemodel's saved net gives what --define does not
    trained = load(_write(tmp_path, "filled.prototxt", _filled(VALUES)), random_weights=True)
    write_model_caffemodel(trained, tmp_path / "m.caffemodel")
    out = tmp_path / "t.onnx"
    assert cli_main(["convert", path, "--weights", str(tmp_path / "m.caffemodel"), "--define", "SIZE=7",
                     "-o", str(out)]) == 0
    import onnxruntime as ort
    x = rng(4).standard_normal((2, 3, 7, 9)).astype(np.float32)
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"data": x})[0]
    np.testing.assert_allclose(got, trained.run({"data": x})["out"], rtol=1e-5, atol=1e-5)
    capsys.readouterr()
    assert cli_main(["inspect", path, "--define", "NUM LABELS"]) == 2
    assert "expected NAME=VALUE" in capsys.readouterr().err


# MobileNet-SSD's template/*.prototxt: gen_model.sh replaces the bare words clsNx by N x the class count
BARE = """input: "data"
input_shape { dim: 1 dim: 3 dim: 6 dim: 6 }
layer { name: "conf" type: "Convolution" bottom: "data" top: "conf"
  convolution_param { num_output: cls3x kernel_size: 1 } }
layer { name: "scale" type: "Power" bottom: "conf" top: "out" power_param { scale: SCALE shift: 1 } }
"""


def test_bare_words_where_numbers_go_are_placeholders_too(tmp_path):
    path = _write(tmp_path, "t.prototxt", BARE)
    with pytest.raises(ParseError, match=r"t.prototxt:4: cls3x \(layer 'conf', convolution_param.num_output\) is a "
                                         r"template placeholder .* pass --define cls3x=VALUE"):
        load(path)
    model = load(path, defines={"cls3x": 63, "SCALE": 2}, random_weights=True)
    assert model.blob_shapes["out"] == (1, 63, 6, 6)
    assert {lp.name: lp for lp in model.net.layer}["scale"].power_param.scale == 2
    # from the weights' saved net, the float as well as the integer
    filled = BARE.replace("cls3x", "12").replace("SCALE", "0.25")
    write_caffemodel(parse_prototxt_text(filled), {"conf": [rng(5).standard_normal((12, 3, 1, 1)).astype(np.float32),
                                                            np.zeros(12, np.float32)]}, tmp_path / "m.caffemodel")
    model = load(path, tmp_path / "m.caffemodel")
    expected = load(_write(tmp_path, "filled.prototxt", filled), tmp_path / "m.caffemodel")
    x = rng(6).standard_normal((1, 3, 6, 6)).astype(np.float32)
    np.testing.assert_array_equal(model.run({"data": x})["out"], expected.run({"data": x})["out"])
    # a word where an enum value goes is still the parser's error
    with pytest.raises(ParseError, match="has no value named"):
        load(_write(tmp_path, "e.prototxt", BARE.replace("kernel_size: 1", "kernel_size: 1 engine: FAST")))


def test_a_defined_value_that_is_not_a_number_names_the_define(tmp_path):
    with pytest.raises(ParseError, match=r"t.prototxt:6: --define NUM_LABELS=abc: the field there takes a number, "
                                         r"not 'abc'"):
        load(_write(tmp_path, "t.prototxt", TEMPLATE), defines=dict(VALUES, NUM_LABELS="abc"))



# LiteFlowNet's `folder: $OUTFOLDER`, a train_val's `mean_file: IMAGE_MEAN`: placeholders where text goes
TEXT = """input: "data"
input_shape { dim: 1 dim: 2 dim: 3 dim: 3 }
layer { name: "data" type: "Data" top: "d" top: "label" include { phase: TRAIN }
  transform_param { mean_file: IMAGE_MEAN } data_param { source: "x" batch_size: 2 } }
layer { name: "scale" type: "Power" bottom: "data" top: "out" power_param { scale: $SCALE } }
layer { name: "write" type: "FLOWriter" bottom: "out" writer_param { folder: $OUTFOLDER prefix: "p" } }
"""


def test_placeholders_where_text_goes_keep_their_text_or_take_the_define(tmp_path):
    path = _write(tmp_path, "t.prototxt", TEXT)
    model = load(path, defines={"SCALE": "2"}, phase="TRAIN", input_shapes={"d": (2, 2, 3, 3), "label": (2,)})
    layers = {lp.name: lp for lp in model.net.layer}
    assert layers["write"].writer_param.folder == "$OUTFOLDER" and layers["write"].writer_param.prefix == "p"
    assert layers["data"].transform_param.mean_file == "IMAGE_MEAN"
    notes = "\n".join(model.warnings)
    assert "t.prototxt:6: kept the template placeholder $OUTFOLDER as text" in notes
    assert "t.prototxt:4: kept the template placeholder IMAGE_MEAN as text" in notes
    x = rng(7).standard_normal((1, 2, 3, 3)).astype(np.float32)
    np.testing.assert_array_equal(load(path, defines={"SCALE": "2"}).run({"data": x})["out"], 2 * x)
    # a --define value goes in as the text, slashes, quotes and all
    model = load(path, defines={"SCALE": "2", "OUTFOLDER": '/tmp/a "b"', "IMAGE_MEAN": "m.binaryproto"},
                 phase="TRAIN", input_shapes={"d": (2, 2, 3, 3), "label": (2,)})
    layers = {lp.name: lp for lp in model.net.layer}
    assert layers["write"].writer_param.folder == '/tmp/a "b"'
    assert layers["data"].transform_param.mean_file == "m.binaryproto"
    # a name or path left unquoted reads as that string, with a note; a lost opening quote stays the
    # parser's error
    model = load(_write(tmp_path, "t.prototxt", TEXT.replace("$OUTFOLDER", "/data/out_1")), defines={"SCALE": "2"})
    assert {lp.name: lp for lp in model.net.layer}["write"].writer_param.folder == "/data/out_1"
    assert any("t.prototxt:6: read the unquoted /data/out_1 as a string" in w for w in model.warnings)
    with pytest.raises(ParseError, match=r"t.prototxt:6:\d+: .*Expected string but found: 'out'"):
        load(_write(tmp_path, "t.prototxt", TEXT.replace("$OUTFOLDER", 'out"')), defines={"SCALE": "2"})


# a file written for Python's str.format: `input_dim:{height}`, and its braces doubled
FORMAT = """input: "data"
input_dim: 1
input_dim: 2
input_dim:{height}
input_dim:{width}
layer {{ name: "scale" type: "Power" bottom: "data" top: "out" power_param {{ scale: {scale} }} }}  # {{ kept }}
"""


def test_python_format_templates_read_with_define_or_input_shape(tmp_path):
    path = _write(tmp_path, "t.prototxt", FORMAT)
    with pytest.raises(ParseError, match=r"t.prototxt:4: \{height\} \(layer 'input', input_param.shape\[0\].dim\[2\]\) "
                                         r"is a template placeholder .* pass --define height=VALUE, .* or "
                                         r"--input-shape data=N,C,H,W"):
        load(path, defines={"scale": 3})
    model = load(path, defines={"scale": 3}, input_shapes={"data": (1, 2, 4, 5)})
    assert model.inputs == {"data": (1, 2, 4, 5)}
    notes = "\n".join(model.warnings)
    assert "read as a Python format template" in notes
    assert "(data [1, 2, {height}, {width}])" in notes   # the header's note shows the placeholders as written
    x = rng(8).standard_normal((1, 2, 4, 5)).astype(np.float32)
    np.testing.assert_array_equal(model.run({"data": x})["out"], 3 * x)
    assert load(path, defines={"scale": 3, "height": 6, "width": 2}).inputs == {"data": (1, 2, 6, 2)}


# siavashBigdeli/DMSP's deploy_DAE_base.prototxt, filled by its MATLAB fprintf (Python's `%` alike): bare
# fields take the arguments in the order of the text, the comment's `% d` one of them, as the format reads it
PRINTF = """input: "data"
input_shape { dim: 1 dim: %d dim: %d dim: %d }   # channels, height, width
layer { name: "cls" type: "Convolution" bottom: "data" top: "cls"
  convolution_param { num_output: %d kernel_size: 1 } }   # 50% done
layer { name: "scale" type: "Power" bottom: "cls" top: "out" power_param { scale: %.2f } }
"""


def test_printf_templates_name_bare_fields_by_their_place(tmp_path):
    path = _write(tmp_path, "p.prototxt", PRINTF)
    # the header's fields are ARG1..ARG3, num_output ARG4; the comment's '% d' is ARG5, so the scale is ARG6
    with pytest.raises(ParseError, match=r"p.prototxt:4: %d \(ARG4\) \(layer 'cls', convolution_param.num_output\) "
                                         r"is a template placeholder .* pass --define ARG4=VALUE"):
        load(path, input_shapes={"data": (1, 2, 3, 4)}, defines={"ARG6": 2})
    model = load(path, defines={"ARG1": 2, "ARG2": 3, "ARG3": 4, "ARG4": 5, "ARG6": 0.5}, random_weights=True)
    assert model.blob_shapes["out"] == (1, 5, 3, 4)
    assert {lp.name: lp for lp in model.net.layer}["scale"].power_param.scale == 0.5
    # unfilled input dimensions leave the shapes unknown (inspect lists the net), or --input-shape gives them
    model = load(path, defines={"ARG4": 5, "ARG6": 2}, unknown_shapes_ok=True)
    assert model.inputs == {"data": None}
    assert any("dim[1] is the template placeholder %d (ARG1): pass --define ARG1=VALUE" in w for w in model.warnings)
    x = rng(9).standard_normal((1, 2, 3, 4)).astype(np.float32)
    model = load(path, defines={"ARG4": 2, "ARG6": 2}, input_shapes={"data": (1, 2, 3, 4)}, random_weights=True)
    weight, bias = model.graph.node("cls").blobs
    want = 2 * (np.einsum("oc,nchw->nohw", weight.reshape(2, 2), x) + bias.reshape(1, 2, 1, 1))
    np.testing.assert_allclose(model.run({"data": x})["out"], want, rtol=1e-5, atol=1e-5)


def test_printf_names_and_argument_counts_follow_the_format(tmp_path):
    # `%*d` takes a width argument first; `%%`, `%r` in a comment and `%ld` count as Python's `%` counts them;
    # Python's `%(NAME)d` is named; a Collective Knowledge placeholder on the same line keeps its own name
    text = """input: "data"
input_shape { dim: 1 dim: %*d dim: %(height)d dim: $#WIDTH#$ }   # 100%% of %r
layer { name: "scale" type: "Power" bottom: "data" top: "out" power_param { scale: %ld } }
"""
    path = _write(tmp_path, "q.prototxt", text)
    model = load(path, defines={"ARG2": 3, "height": 4, "WIDTH": 5, "ARG4": 2})
    assert model.inputs == {"data": (1, 3, 4, 5)}
    assert {lp.name: lp for lp in model.net.layer}["scale"].power_param.scale == 2


# a Jinja-rendered py-faster-rcnn template (atakigawa/py-faster-rcnn's *_template.prototxt): `{{ name }}`
# as values and inside the proposal layer's quoted param_str, which the rendering fills as well
JINJA = """input: "data"
input_shape { dim: 1 dim: 2 dim: 3 dim: 3 }
layer { name: "cls" type: "Convolution" bottom: "data" top: "cls"
  convolution_param { num_output: {{num_output}} kernel_size: 1 } }   # {{ in a comment }}
layer { name: "scale" type: "Power" bottom: "cls" top: "out" power_param { scale: {{ scale }} } }
layer { name: "note" type: "Silence" bottom: "cls" }
"""


def test_jinja_placeholders_and_defined_names_inside_quotes(tmp_path):
    path = _write(tmp_path, "t.prototxt", JINJA)
    with pytest.raises(ParseError, match=r"t.prototxt:4: \{\{num_output\}\} \(layer 'cls', "
                                         r"convolution_param.num_output\) is a template placeholder"):
        load(path, defines={"scale": 2})
    model = load(path, defines={"num_output": 4, "scale": 2}, random_weights=True)
    assert model.blob_shapes["out"] == (1, 4, 3, 3)
    assert {lp.name: lp for lp in model.net.layer}["scale"].power_param.scale == 2
    # a quoted placeholder takes the value --define gives it (escaped for its quotes), else stays
    text = TEMPLATE.replace('name: "${EXP}-net"', 'name: "${EXP}-net {{ TAG }} $SIZE"')
    model = load(_write(tmp_path, "q.prototxt", text), defines=dict(VALUES, EXP='a"b'))
    assert model.net.name == 'a"b-net {{ TAG }} 7'
    assert "fc8_a\"b" in {lp.name for lp in model.net.layer}


# zhengshou/AutoLoc's train.tpl.prototxt: `num_output: <num_bbox_pred_regout>`, and <NAME> in a param_str;
# text format's angle-bracket messages (`convolution_param < ... >`) stay what they are
ANGLE = """input: "data"
input_shape { dim: 1 dim: 2 dim: 3 dim: 3 }
layer { name: "pred" type: "Convolution" bottom: "data" top: "pred"
  convolution_param < num_output: <num_regout> kernel_size: 1 > }
layer { name: "scale" type: "Power" bottom: "pred" top: "out" power_param: < scale: <margin> > }
"""


def test_angle_bracket_and_cmake_placeholders(tmp_path):
    path = _write(tmp_path, "a.tpl.prototxt", ANGLE)
    with pytest.raises(ParseError, match=r"a.tpl.prototxt:4: <num_regout> \(layer 'pred', "
                                         r"convolution_param.num_output\) is a template placeholder"):
        load(path, defines={"margin": 2})
    model = load(path, defines={"num_regout": 4, "margin": 0.5}, random_weights=True)
    assert model.blob_shapes["out"] == (1, 4, 3, 3)
    assert {lp.name: lp for lp in model.net.layer}["scale"].power_param.scale == 0.5

    # CMake's configure_file placeholders (aleneum/temporal-segment-networks' tsn_*_train.prototxt.in)
    path = _write(tmp_path, "c.prototxt.in", ANGLE.replace("<num_regout>", "@NUM_REGOUT@"))
    with pytest.raises(ParseError, match=r"c.prototxt.in:4: @NUM_REGOUT@ \(layer 'pred', "
                                         r"convolution_param.num_output\) is a template placeholder"):
        load(path, defines={"margin": 2})
    assert load(path, defines={"NUM_REGOUT": 2, "margin": 1}, random_weights=True).blob_shapes["out"] == (1, 2, 3, 3)


def test_a_placeholder_in_a_field_skipped_as_unknown_needs_no_value(tmp_path):
    # LiteFlowNet2's `weight_filler { type: "diagonal" diag_val: $SCALE_WIDTH }`: a fork's filler field,
    # which only training reads, is skipped at TEST, and its placeholder with it
    text = TEMPLATE.replace("kernel_size: 3 pad: 1", 'kernel_size: 3 pad: 1 weight_filler { type: "diagonal" '
                                                     "diag_val: $SCALE_WIDTH }")
    model = load(_write(tmp_path, "t.prototxt", text), defines=VALUES, random_weights=True)
    assert model.blob_shapes["fc8"] == (2, 5, 7, 9)
    assert any("t.prototxt:6: the template placeholder $SCALE_WIDTH is in a field skipped as unknown" in w
               for w in model.warnings)



def test_an_unknown_field_whose_value_is_a_placeholder_is_skipped_with_a_warning(tmp_path):
    # fusionseg's *_stream_template.prototxt: `mat_write_param { root_folder: ${OUTPUT_DIR} }`, whose demo.py
    # writes that whole line (`prefix: "..."`): the field name before the placeholder never reaches Caffe
    text = TEMPLATE + ('layer { name: "save" type: "MatWrite" bottom: "fc8" mat_write_param {\n'
                       "  root_folder: ${OUTPUT_DIR}\n  period: 1 } }\n")
    path = _write(tmp_path, "t.prototxt", text)
    model = load(path, defines=VALUES, random_weights=True)
    assert model.blob_shapes["fc8"] == (2, 5, 7, 9)
    assert any("ignored unknown field 'root_folder' in layer 'save': its value is a template placeholder" in w
               for w in model.warnings)
    # an unknown field with a plain value still stops the read
    with pytest.raises(ParseError, match="unknown field 'root_folder' in layer 'save'"):
        load(_write(tmp_path, "u.prototxt", text.replace("${OUTPUT_DIR}", "7")), defines=VALUES)

# atakigawa/py-faster-rcnn's *_template.prototxt: a Jinja placeholder inside the proposal layer's param_str
PARAM_STR = """input: "data"
input_shape { dim: 1 dim: 18 dim: 4 dim: 5 }
input: "deltas"
input_shape { dim: 1 dim: 36 dim: 4 dim: 5 }
input: "im_info"
input_shape { dim: 1 dim: 3 }
layer { name: "proposal" type: "Python" bottom: "data" bottom: "deltas" bottom: "im_info" top: "rois"
  python_param { module: "rpn.proposal_layer" layer: "ProposalLayer"
                 param_str: "'feat_stride': {{shrink_scale}}" } }
layer { name: "scaled" type: "Power" bottom: "rois" top: "out" power_param { scale: 2 } }
"""


def test_a_placeholder_in_a_param_str_is_listed_refused_or_defined(tmp_path):
    path = _write(tmp_path, "p.prototxt", PARAM_STR)
    refusal = (r"p.prototxt: layer 'proposal': python_param.param_str holds the template placeholder "
               r"\{\{shrink_scale\}\}, which a script fills in before Caffe reads the file: "
               r"pass --define shrink_scale=VALUE")
    with pytest.raises(ParseError, match=refusal):
        load(path)
    listed = load(path, unknown_shapes_ok=True)
    assert listed.blob_shapes["rois"] is None and listed.blob_shapes["out"] is None
    assert len(listed.unfilled_placeholders) == 1 and "--define shrink_scale=VALUE" in listed.unfilled_placeholders[0]
    with pytest.raises(ParseError, match=refusal):
        listed.run({"data": np.zeros((1, 18, 4, 5), np.float32)})
    model = load(path, defines={"shrink_scale": 16})
    assert model.blob_shapes["rois"] == (9 * 4 * 5, 5)   # at most one row per anchor of the 4x5 map
    assert {lp.name: lp for lp in model.net.layer}["proposal"].python_param.param_str == "'feat_stride': 16"


def test_a_missing_value_is_not_taken_for_a_placeholder(tmp_path):
    # gtlim/Ahra's train_val: `num_output:` with its value commented out, then `weight_filler {`
    text = """input: "data"
input_shape { dim: 1 dim: 3 dim: 4 dim: 4 }
layer { name: "fc" type: "InnerProduct" bottom: "data" top: "fc"
  inner_product_param {
    num_output:   # was 4096
    weight_filler { type: "gaussian" } } }
"""
    with pytest.raises(ParseError) as e:
        load(_write(tmp_path, "t.prototxt", text))
    assert str(e.value).endswith("t.prototxt:6:5: a value is missing before 'weight_filler' (the field before "
                                 "it has none)")


# developmentseed/skynet-train's SegNet templates: a word alone on its line that a script replaces by layers
ALONE = """name: "segnet"
INPUT
layer { name: "scale" type: "Power" bottom: "data" top: "out" power_param { scale: 2 } }
"""


def test_a_word_alone_where_fields_go_is_a_placeholder_for_text(tmp_path):
    path = _write(tmp_path, "t.prototxt", ALONE)
    with pytest.raises(ParseError, match=r"t.prototxt:2: 'INPUT' stands alone where fields go: a template "
                                         r"placeholder .* or pass --define INPUT=TEXT$"):
        load(path)
    model = load(path, defines={"INPUT": 'input: "data" input_shape { dim: 1 dim: 2 dim: 3 dim: 4 }'})
    assert model.inputs == {"data": (1, 2, 3, 4)} and model.blob_shapes["out"] == (1, 2, 3, 4)
    assert any("filled the template placeholder INPUT" in w for w in model.warnings)


def test_unquoted_blob_names_read_as_strings(tmp_path):
    # ocean1100/caffe_prototxt writes `top: pool1`: a repeated string field, read as written
    text = ('input: "data"\ninput_shape { dim: 1 dim: 1 dim: 4 dim: 4 }\n'
            'layer { name: "pool1" type: "Pooling" bottom: data top: pool1 pooling_param { pool: MAX kernel_size: 2 } }\n')
    model = load(_write(tmp_path, "u.prototxt", text))
    assert model.blob_shapes["pool1"] == (1, 1, 3, 3)
    assert sum("read the unquoted" in w for w in model.warnings) == 2


# DIGITS's standard networks leave the output InnerProduct's num_output out; DIGITS sets it to the
# number of labels before Caffe reads the file (digits/model/tasks/caffe_train.py)
DIGITS_ORIGINAL = """input: "data"
input_shape { dim: 2 dim: 3 dim: 4 dim: 4 }
layer { name: "fc7" type: "InnerProduct" bottom: "data" top: "fc7" inner_product_param { num_output: 6 } }
layer { name: "fc8" type: "InnerProduct" bottom: "fc7" top: "fc8"
  inner_product_param { weight_filler { type: "gaussian" std: 0.01 } } }
"""


@pytest.mark.parametrize("transpose", [False, True])
def test_digits_output_layer_takes_its_num_output_from_the_weights(tmp_path, transpose):
    text = DIGITS_ORIGINAL.replace('std: 0.01 }', 'std: 0.01 } transpose: true' if transpose else 'std: 0.01 }')
    w7, b7 = rng(1).standard_normal((6, 48)).astype(np.float32), rng(2).standard_normal(6).astype(np.float32)
    w8, b8 = rng(3).standard_normal((5, 6)).astype(np.float32), rng(4).standard_normal(5).astype(np.float32)
    weights = {"fc7": [w7, b7], "fc8": [w8.T.copy() if transpose else w8, b8]}
    write_caffemodel(parse_prototxt_text(text.replace("weight_filler", "num_output: 5 weight_filler")), weights,
                     tmp_path / "m.caffemodel")
    model = load(_write(tmp_path, "original.prototxt", text), tmp_path / "m.caffemodel")
    assert any("fc8': inner_product_param.num_output is not set: DIGITS" in w and "5, from the weights" in w
               for w in model.warnings)
    x = rng(5).standard_normal((2, 3, 4, 4)).astype(np.float32)
    h = x.reshape(2, -1).astype(np.float64) @ w7.T + b7
    np.testing.assert_allclose(model.run({"data": x})["fc8"], h @ w8.T + b8, rtol=1e-5, atol=1e-5)


def test_digits_output_layer_without_weights_is_listed_unsized_and_refused_by_commands(tmp_path, capsys):
    path = _write(tmp_path, "original.prototxt", DIGITS_ORIGINAL)
    assert cli_main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "unknown until the values a script or tool fills in are given: fc8" in out and "pass --weights" in out
    with pytest.raises(CaffeqError, match=r"layer 'fc8' \(InnerProduct\): inner_product_param.num_output is "
                                          r"required \(DIGITS writes its output layer without it"):
        load(path, random_weights=True)


# DeepDetect's templates (templates/caffe/enet/enet.prototxt) write the class layer's num_output as 0; its
# update_protofile_classes (src/backends/caffe/caffelib.cc) sets it to the number of classes
DEEPDETECT_TEMPLATE = """input: "data"
input_shape { dim: 2 dim: 4 dim: 3 dim: 5 }
layer { name: "score" type: "Convolution" bottom: "data" top: "score" convolution_param { num_output: 0 kernel_size: 1 } }
layer { name: "up" type: "Deconvolution" bottom: "score" top: "up"
  convolution_param { num_output: 0 group: 3 kernel_size: 2 stride: 2 bias_term: false } }
"""


def test_deepdetect_zero_num_output_takes_the_weights_count(tmp_path):
    w1, b1 = rng(1).standard_normal((3, 4, 1, 1)).astype(np.float32), rng(2).standard_normal(3).astype(np.float32)
    w2 = rng(3).standard_normal((3, 2, 2, 2)).astype(np.float32)      # (C, num_output / group, kh, kw): 6 outputs
    filled = DEEPDETECT_TEMPLATE.replace("num_output: 0 kernel_size: 1", "num_output: 3 kernel_size: 1"
                                         ).replace("num_output: 0 group: 3", "num_output: 6 group: 3")
    write_caffemodel(parse_prototxt_text(filled), {"score": [w1, b1], "up": [w2]}, tmp_path / "m.caffemodel")
    model = load(_write(tmp_path, "enet.prototxt", DEEPDETECT_TEMPLATE), tmp_path / "m.caffemodel")
    assert model.blob_shapes["up"] == (2, 6, 6, 10)
    assert sum("num_output is 0: DeepDetect's templates" in w and "from the weights" in w for w in model.warnings) == 2
    x = rng(4).standard_normal((2, 4, 3, 5)).astype(np.float32)
    want = load(_write(tmp_path, "filled.prototxt", filled), tmp_path / "m.caffemodel").run({"data": x})["up"]
    np.testing.assert_array_equal(model.run({"data": x})["up"], want)


def test_deepdetect_zero_num_output_without_weights_is_listed_unsized_and_refused(tmp_path, capsys):
    path = _write(tmp_path, "enet.prototxt", DEEPDETECT_TEMPLATE)
    assert cli_main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "unknown until the values a script or tool fills in are given: score" in out and "pass --weights" in out
    with pytest.raises(CaffeqError, match=r"layer 'score' \(Convolution\): convolution_param.num_output must be "
                                          r"positive, got 0 \(DeepDetect's templates"):
        load(path, random_weights=True)
