"""The compiled caffe.proto, importable both installed and from a source checkout."""
import importlib.util
import sys
from pathlib import Path

try:
    from caffeq._proto import caffe_pb2
except ImportError:  # running from a checkout that was not pip-installed
    _path = Path(__file__).resolve().parents[2] / "proto" / "caffe_pb2.py"
    _spec = importlib.util.spec_from_file_location("caffeq._proto.caffe_pb2", _path)
    caffe_pb2 = importlib.util.module_from_spec(_spec)
    sys.modules["caffeq._proto.caffe_pb2"] = caffe_pb2
    _spec.loader.exec_module(caffe_pb2)

__all__ = ["caffe_pb2"]
