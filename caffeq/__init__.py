"""caffeq: read, run, quantize and export Caffe models."""
from .errors import CaffeqError
from .layers import Layer, LayerError, register_layer, supported_types
from .model import Model, load
from .quant import quantize
from .backends.onnx_backend import export_onnx

__version__ = "0.1.0"
__all__ = ["CaffeqError", "Layer", "LayerError", "Model", "export_onnx", "load", "quantize", "register_layer", "supported_types"]
