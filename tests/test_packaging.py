"""The compiled schema is current, and the package installs no clashing top-level names."""
import importlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_compiled_proto_is_current(tmp_path):
    """proto/caffe_pb2.py must be what the documented command generates from proto/caffe.proto."""
    grpc_tools = pytest.importorskip("grpc_tools.protoc")
    rc = grpc_tools.main(["protoc", f"-I{REPO / 'proto'}", f"--python_out={tmp_path}",
                          str(REPO / "proto" / "caffe.proto")])
    assert rc == 0
    fresh = (tmp_path / "caffe_pb2.py").read_text()
    committed = (REPO / "proto" / "caffe_pb2.py").read_text()
    assert fresh == committed, ("proto/caffe_pb2.py is stale: run "
                                "python -m grpc_tools.protoc -I proto --python_out=proto proto/caffe.proto")


def test_compiled_proto_accepted_by_runtime():
    # the generated module validates the protobuf runtime version on import
    code = "from caffeq.io.schema import caffe_pb2; print(caffe_pb2.NetParameter.DESCRIPTOR.full_name)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "caffe.NetParameter"


def test_schema_has_fork_and_legacy_messages():
    from caffeq.io.schema import caffe_pb2
    lp = caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name
    for name in ("permute_param", "norm_param", "prior_box_param", "detection_output_param",
                 "interp_param", "shuffle_channel_param", "upsample_param", "roi_pooling_param"):
        assert name in lp
    assert caffe_pb2.BlobProto.DESCRIPTOR.fields_by_name["raw_data"].number == 12
    assert "layers" in caffe_pb2.NetParameter.DESCRIPTOR.fields_by_name
    assert "blobs" in caffe_pb2.V0LayerParameter.DESCRIPTOR.fields_by_name


@pytest.mark.slow
def test_wheel_maps_proto_into_package(tmp_path):
    """No top-level `proto` package or `cli` module lands in site-packages."""
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                          "-q", "-w", str(tmp_path), str(REPO)], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot build a wheel here: {out.stderr[-300:]}")
    wheel = next(tmp_path.glob("caffeq-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.startswith("caffeq-")}
    assert tops == {"caffeq"}, tops
    assert "caffeq/_proto/caffe_pb2.py" in names
    assert "caffeq/_proto/caffe.proto" in names
    # every sub-package of the source tree ships (a missing one breaks `import caffeq` when installed)
    for init in sorted((REPO / "caffeq").rglob("__init__.py")):
        assert init.relative_to(REPO).as_posix() in names, init


def test_setup_cfg_lists_every_subpackage():
    """setup.cfg names its packages (proto/ is mapped in as caffeq._proto): each sub-package of the
    source tree must be listed, or an installed caffeq fails on import."""
    import configparser
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    listed = set(cfg["options"]["packages"].split())
    tree = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "caffeq").rglob("__init__.py")}
    assert tree - listed == set(), f"setup.cfg's packages lack {sorted(tree - listed)}"
    assert listed - tree == {"caffeq._proto"}


def test_cli_shim_and_module_agree():
    a = subprocess.run([sys.executable, "cli.py", "--help"], capture_output=True, text=True, cwd=REPO)
    b = subprocess.run([sys.executable, "-m", "caffeq", "--help"], capture_output=True, text=True, cwd=REPO)
    assert a.returncode == b.returncode == 0
    assert a.stdout.replace("cli.py", "caffeq") == b.stdout.replace("__main__.py", "caffeq")
    assert "inspect" in a.stdout and "run" in a.stdout


def test_public_api():
    caffeq = importlib.import_module("caffeq")
    for name in ("load", "register_layer", "Layer", "Model", "CaffeqError"):
        assert hasattr(caffeq, name)
