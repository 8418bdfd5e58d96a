"""Quantized blobs, the quantizer base class and the registry of targets.

A quantizer is a small named object: `quantize(array, axis, groups) ->
QuantizedBlob`.  The QuantizedBlob holds the codes at their precision plus
the per-output-channel scale; `dequantize()` gives the float32 array that
every backend (torch, ONNX, the Caffe writer) runs, so all of them agree.

Output channels.  A weight's output channels lie along `axis`; with
`groups > 1` (grouped Deconvolution, weights C_in x C_out/group x k...)
output channel o = g * (C_out/group) + j is the set of slices
[rows of group g, column j].  `channel_matrix` turns any of these layouts
into a (channels, elements-per-channel) matrix and `from_channel_matrix`
back.
"""
import math
from dataclasses import dataclass

import numpy as np

from ..errors import CaffeqError


class QuantizeError(CaffeqError):
    """A bad target, layer name or quantization request."""


# ---- output-channel layouts ----------------------------------------------------

def num_channels(shape, axis, groups=1):
    if axis is None:
        return 1
    return int(shape[axis]) * (int(groups) if groups > 1 else 1)


def channel_matrix(arr, axis, groups=1):
    """View/copy of `arr` as (output channels, elements per channel)."""
    arr = np.asarray(arr)
    if axis is None:
        return arr.reshape(1, -1)
    if groups > 1:
        if axis != 1:
            raise ValueError("grouped layouts put output channels on axis 1")
        cin, cpg = arr.shape[0], arr.shape[1]
        if cin % groups:
            raise ValueError(f"axis 0 size {cin} not divisible by {groups} groups")
        rest = int(math.prod(arr.shape[2:]))
        m = arr.reshape(groups, cin // groups, cpg, rest).transpose(0, 2, 1, 3)
        return m.reshape(groups * cpg, (cin // groups) * rest)
    return np.moveaxis(arr, axis, 0).reshape(arr.shape[axis], -1)


def from_channel_matrix(mat, shape, axis, groups=1):
    """Inverse of channel_matrix: (channels, elements) back to `shape`."""
    shape = tuple(int(d) for d in shape)
    if axis is None:
        return mat.reshape(shape)
    if groups > 1:
        cin, cpg = shape[0], shape[1]
        rest = int(math.prod(shape[2:]))
        m = mat.reshape(groups, cpg, cin // groups, rest).transpose(0, 2, 1, 3)
        return np.ascontiguousarray(m).reshape(shape)
    moved = (shape[axis],) + shape[:axis] + shape[axis + 1:]
    return np.ascontiguousarray(np.moveaxis(mat.reshape(moved), 0, axis))


def broadcast_scale(scale, shape, axis, groups=1):
    """Per-channel `scale` shaped to broadcast against an array of `shape`.

    For groups == 1 the result has shape[axis] entries on `axis` and 1 elsewhere;
    for grouped layouts it is (C_in, C_out/group, 1, ...).
    """
    scale = np.asarray(scale, np.float32)
    shape = tuple(shape)
    if axis is None:
        return scale.reshape((1,) * len(shape))
    if groups > 1:
        cin, cpg = shape[0], shape[1]
        full = np.broadcast_to(scale.reshape(groups, 1, cpg), (groups, cin // groups, cpg))
        return np.ascontiguousarray(full).reshape((cin, cpg) + (1,) * (len(shape) - 2))
    b = [1] * len(shape)
    b[axis] = shape[axis]
    return scale.reshape(b)


# ---- the quantized blob ----------------------------------------------------------

SCHEMES = ("fp16", "int8", "binary")


@dataclass
class QuantizedBlob:
    """One weight blob at reduced precision.

    scheme: "fp16" | "int8" | "binary"
    axis:   output-channel axis (None for fp16, which has no scale)
    scale:  float32 per output channel (binary: alpha; int8: step) or None
    codes:  fp16 array / int8 array / int8 array of +1 and -1, same shape as the blob
    groups: > 1 for grouped Deconvolution (see the module docstring)
    """
    scheme: str
    axis: object
    scale: object
    codes: np.ndarray
    groups: int = 1

    @property
    def shape(self):
        return tuple(self.codes.shape)

    @property
    def size(self):
        return int(self.codes.size)

    def scale_broadcast(self):
        return broadcast_scale(self.scale, self.shape, self.axis, self.groups)

    def dequantize(self):
        """The float32 array that all backends run (bit-identical wherever computed)."""
        if self.scheme == "fp16":
            return self.codes.astype(np.float32)
        # int8 codes and +/-1 signs are exact in float32; one rounding in the product
        return (self.codes.astype(np.float32) * self.scale_broadcast()).astype(np.float32, copy=False)

    def compact_nbytes(self):
        """Bytes at this precision (as the .caffeq container stores them)."""
        n = self.size
        if self.scheme == "fp16":
            return 2 * n
        c = 0 if self.scale is None else int(np.asarray(self.scale).size)
        if self.scheme == "int8":
            return n + 4 * c
        return (n + 7) // 8 + 4 * c

    def reshaped(self, shape):
        """The same blob under another shape with the same element order (shared params)."""
        shape = tuple(shape)
        if shape == self.shape:
            return self
        if self.axis is None:
            return QuantizedBlob(self.scheme, None, self.scale, self.codes.reshape(shape), 1)
        if self.groups == 1 and self.axis == 0 and len(shape) and shape[0] == self.shape[0]:
            return QuantizedBlob(self.scheme, 0, self.scale, self.codes.reshape(shape), 1)
        return None

# ---- quantizers --------------------------------------------------------------------

class Quantizer:
    """Base class: a name, a bit width and `quantize(array, axis, groups) -> QuantizedBlob`."""
    name = ""
    bits = 32
    #: True when only blobs listed in a spec's weight_axes are touched
    weights_only = True
    #: when keep is None: keep the first and last weighted layers in fp32
    default_keep_ends = False

    def quantize(self, array, axis=None, groups=1):
        raise NotImplementedError

    def __repr__(self):
        return f"<{type(self).__name__} {self.name!r}>"


class Float32(Quantizer):
    """The identity target: weights stay as they are."""
    name = "fp32"
    bits = 32

    def quantize(self, array, axis=None, groups=1):
        return None


_QUANTIZERS = {}


def register_quantizer(cls):
    _QUANTIZERS[cls.name] = cls
    return cls


register_quantizer(Float32)

ALIASES = {"float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16",
           "bin": "binary", "bwn": "binary"}


def get_quantizer(target):
    """Resolve "fp32" | "fp16" | "int8" | "binary" (or a Quantizer) to a quantizer object."""
    if isinstance(target, Quantizer):
        return target
    if isinstance(target, type) and issubclass(target, Quantizer):
        return target()
    key = str(target).strip().lower()
    key = ALIASES.get(key, key)
    if key not in _QUANTIZERS:
        raise QuantizeError(f"unknown quantization target {target!r}; "
                            f"choose one of {', '.join(available_targets())}")
    return _QUANTIZERS[key]()


def available_targets():
    order = ["fp32", "fp16", "int8", "binary"]
    return [t for t in order if t in _QUANTIZERS] + sorted(t for t in _QUANTIZERS if t not in order)
