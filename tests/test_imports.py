"""jackculpepper/caffe's IMPORT layers (caffeq/io/imports.py): the fork's own LeNet example inlined as its Net::Init
does (names resolved against each import, ${var} replaced), run against the same net written out by hand, and the
refusals."""
import numpy as np
import pytest
from conftest import rng

from caffeq.errors import CaffeqError
from caffeq.io.imports import resolve_import_name
from caffeq.model import load, load_from_text

FIXTURES = __import__("pathlib").Path(__file__).parent / "fixtures" / "imports"
LENET = FIXTURES / "examples" / "mnist" / "lenet_import_train_test.prototxt"


@pytest.mark.parametrize("name, pwd, resolved", [
    ("conv", "", "conv"), ("/data", "", "data"), ("conv", "cp1", "cp1/conv"), ("/data", "cp1/x", "data"),
    ("../cp1/pool", "cp2", "cp1/pool"), ("../../x", "a/b", "x"), ("../x", "a/b", "a/x"), ("", "a", "a"),
    (".", "a", "a"), ("..", "a", "a/.."), ("./x", "a", "a/./x"), ("../x", "", "x"),
])
def test_names_resolve_as_the_forks_resolve_import_name(name, pwd, resolved):
    assert resolve_import_name(name, pwd) == resolved


def _by_hand():
    """The LeNet that the example expands to, written out: cp1/ and cp2/ layers, ip1, relu1, ip2."""
    conv_pool = ('layer {{ name: "{p}/conv" type: "Convolution" bottom: "{b}" top: "{p}/conv" '
                 'convolution_param {{ num_output: {n} kernel_size: 5 stride: 1 }} }}\n'
                 'layer {{ name: "{p}/pool" type: "Pooling" bottom: "{p}/conv" top: "{p}/pool" '
                 'pooling_param {{ pool: MAX kernel_size: 2 stride: 2 }} }}\n')
    return ('input: "data" input_shape { dim: 2 dim: 1 dim: 28 dim: 28 }\n'
            + conv_pool.format(p="cp1", b="data", n=20) + conv_pool.format(p="cp2", b="cp1/pool", n=50)
            + 'layer { name: "ip1" type: "InnerProduct" bottom: "cp2/pool" top: "ip1" '
              'inner_product_param { num_output: 500 } }\n'
              'layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }\n'
              'layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2" '
              'inner_product_param { num_output: 10 } }\n')


def test_the_forks_lenet_example_runs_as_the_net_it_expands_to():
    shapes = {"data": (2, 1, 28, 28), "label": (2,)}
    model = load(LENET, input_shapes=shapes, outputs=["ip2"], random_weights=True)
    assert [n.name for n in model.layers][:5] == ["mnist", "cp1/conv", "cp1/pool", "cp2/conv", "cp2/pool"]
    assert any("inlined 2 imported net file(s)" in w for w in model.warnings)
    assert model.blob_shapes["cp1/conv"] == (2, 20, 24, 24) and model.blob_shapes["cp2/conv"] == (2, 50, 8, 8)
    written = load_from_text(_by_hand(), random_weights=True)
    for node in written.layers:
        if node.blobs:
            node.blobs = [np.array(b) for b in next(n for n in model.layers if n.name == node.name).blobs]
    x = rng(4).standard_normal((2, 1, 28, 28)).astype(np.float32)
    ours = model.run({"data": x, "label": np.zeros(2, np.float32)})["ip2"]
    np.testing.assert_array_equal(ours, written.run({"data": x})["ip2"])
    # the TRAIN net has the other data layer and no Accuracy; the imports are the same
    train = load(LENET, phase="TRAIN", input_shapes=shapes, unknown_shapes_ok=True)
    assert [n.name for n in train.layers][:5] == ["mnist", "cp1/conv", "cp1/pool", "cp2/conv", "cp2/pool"]


def _write(folder, name, text):
    path = folder / name
    path.write_text(text)
    return path


IMPORTER = '''input: "x" input_shape { dim: 1 dim: 2 dim: 3 dim: 4 }
layers { name: "a" type: IMPORT import_param { net: "%s" var { name: "bottom" value: "/x" } } }
'''


@pytest.mark.parametrize("files, message", [
    ({}, r"layer 'a' \(Import\): import_param.net 'part.prototxt' not found \(looked in the working directory, "
         r"beside main.prototxt"),
    ({"part.prototxt": 'layers { name: "inner" type: IMPORT import_param { net: "part.prototxt" } }'},
     r"part.prototxt' imports itself \(through main.prototxt -> part.prototxt\)"),
    ({"part.prototxt": 'layer { name: "r" type: "ReLU" bottom: "${bottom}" top: "r" }'},
     r"part.prototxt: imported by layer 'a' of .*main.prototxt: its layers must be in the importing file's format "
     r"\('layers' blocks\), got 'layer' blocks"),
    ({"part.prototxt": 'layers { name: "r" type: RELU bottom: "${bottom}" top: "r" relu_param { fancy: 1 } }'},
     r"part.prototxt:1:\d+: unknown field 'fancy' in layer 'r'"),
])
def test_an_import_that_cannot_be_read_is_one_clear_error(tmp_path, files, message):
    for name, text in files.items():
        _write(tmp_path, name, text)
    main = _write(tmp_path, "main.prototxt", IMPORTER % "part.prototxt")
    with pytest.raises(CaffeqError, match=message):
        load(main)


def test_an_import_without_a_file_or_a_var_value_is_refused(tmp_path):
    with pytest.raises(CaffeqError, match=r"layer 'a' \(Import\): import_param.net is required"):
        load(_write(tmp_path, "m.prototxt", 'layers { name: "a" type: IMPORT import_param { } }'))
    _write(tmp_path, "part.prototxt", 'layers { name: "r" type: RELU bottom: "${bottom}" top: "r" }')
    text = IMPORTER.replace('value: "/x"', "") % "part.prototxt"
    with pytest.raises(CaffeqError, match=r"import_param.var\[0\] needs both name and value"):
        load(_write(tmp_path, "m2.prototxt", text))


def test_imported_params_keep_their_names_and_share_weights(tmp_path):
    # cfw_diffnet's shared.prototxt: two imports of one file whose params are named share the filters
    _write(tmp_path, "tower.prototxt", 'layers { name: "ip" type: INNER_PRODUCT bottom: "${bottom}" top: "ip" '
                                       'param: "w" param: "b" inner_product_param { num_output: 3 } }')
    main = _write(tmp_path, "two.prototxt", '''input: "x" input_shape { dim: 2 dim: 4 }
layers { name: "a" type: IMPORT import_param { net: "tower.prototxt" var { name: "bottom" value: "/x" } } }
layers { name: "b" type: IMPORT import_param { net: "tower.prototxt" var { name: "bottom" value: "../x" } } }
''')
    model = load(main, random_weights=True)
    x = rng(2).standard_normal((2, 4)).astype(np.float32)
    out = model.run({"x": x})
    np.testing.assert_array_equal(out["a/ip"], out["b/ip"])
    a, b = (next(n for n in model.layers if n.name == k) for k in ("a/ip", "b/ip"))
    np.testing.assert_allclose(out["a/ip"], x @ a.blobs[0].T + a.blobs[1], rtol=1e-6)
    assert b.shared_from   # b's blobs are a's


def test_imports_of_untrusted_files_are_bounded(tmp_path, monkeypatch):
    import caffeq.io.imports as imports
    # an absolute path that is not there, and a file that is not a net file
    for net, message in ((str(tmp_path / "nowhere.prototxt"), r"nowhere.prototxt' not found"),
                         ("/etc/passwd", r"'/etc/passwd' is not a net file \(.prototxt or .pt\)")):
        with pytest.raises(CaffeqError, match=message):
            load(_write(tmp_path, "m.prototxt", IMPORTER % net))
    # vars whose values grow the text at each replacement
    _write(tmp_path, "part.prototxt", 'layers { name: "r" type: RELU bottom: "${a}" top: "r" }')
    grow = "".join(f'var {{ name: "{v}" value: "${{{w}}}${{{w}}}${{{w}}}${{{w}}}" }} '
                   for v, w in zip("abcdefghijklmnop", "bcdefghijklmnopq"))
    text = IMPORTER.replace('var { name: "bottom" value: "/x" }', grow) % "part.prototxt"
    monkeypatch.setattr(imports, "_MAX_BYTES", 1 << 16)
    with pytest.raises(CaffeqError, match=r"import_param.var '\w' makes the text of .*part.prototxt' longer than"):
        load(_write(tmp_path, "grow.prototxt", text))
    # a chain of distinct files, and a file importing the next one twice
    for i in range(6):
        _write(tmp_path, f"n{i}.prototxt", "".join(f'layers {{ name: "{k}" type: IMPORT import_param {{ '
                                                    f'net: "n{i + 1}.prototxt" }} }}\n' for k in "ab"))
    _write(tmp_path, "n6.prototxt", 'layers { name: "r" type: RELU bottom: "/x" top: "r" }')
    main = _write(tmp_path, "deep.prototxt", IMPORTER % "n0.prototxt")
    monkeypatch.setattr(imports, "_MAX_DEPTH", 4)
    with pytest.raises(CaffeqError, match=r"imports nest more than 4 files deep"):
        load(main)
    monkeypatch.setattr(imports, "_MAX_DEPTH", 32)
    monkeypatch.setattr(imports, "_MAX_LAYERS", 40)
    with pytest.raises(CaffeqError, match=r"deep.prototxt: its imports expand to more than 40 layers"):
        load(main)
    monkeypatch.setattr(imports, "_MAX_LAYERS", 100_000)
    assert len(load(main).layers) == 1 + 2 ** 6   # the Input and 64 ReLUs named a/a/a/a/a/a/r ... b/b/b/b/b/b/r


def test_upgrade_writes_the_imports_inlined(tmp_path, monkeypatch):
    from caffeq.__main__ import main as cli
    monkeypatch.chdir(FIXTURES)
    out = tmp_path / "up.prototxt"
    assert cli(["upgrade", str(LENET.relative_to(FIXTURES)), "-o", str(out)]) in (0, None)
    text = out.read_text()
    assert "Import" not in text and 'name: "cp2/conv"' in text and 'bottom: "cp1/pool"' in text
    model = load(out, input_shapes={"data": (2, 1, 28, 28), "label": (2,)}, outputs=["ip2"])
    assert model.blob_shapes["cp2/pool"] == (2, 50, 4, 4)
