"""caffeq: read, run, quantize and export Caffe models."""
from .backends.onnx_backend import export_onnx
from .backends.pytorch_source import export_pytorch
from .errors import CaffeqError
from .evaluate import evaluate
from .layers import Layer, LayerError, register_layer, supported_types
from .model import Model, load
from .quant import quantize
from .version import __version__  # noqa: F401  (caffeq.__version__)

__all__ = ["CaffeqError", "Layer", "LayerError", "Model", "evaluate", "export_onnx", "export_pytorch", "load", "quantize",
           "register_layer", "supported_types"]
