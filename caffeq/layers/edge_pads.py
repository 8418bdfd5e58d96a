"""synopsys-caffe's per-side padding for 2-D Convolution and Pooling
(foss-for-synopsys-dwc-arc-processors/synopsys-caffe 977ba36a, base_conv_layer.cpp, im2col.cpp,
pooling_layer.cpp):

- pad_l / pad_r / pad_t / pad_b: explicit padding of each side (convolution: may be negative,
  which crops); any nonzero one replaces pad / pad_h / pad_w and pad_type.
- pad_type: 1: TensorFlow "SAME": output ceil(in / stride); the padding before is
  max(kernel - (stride if in % stride == 0 else in % stride), 0) // 2 (the fork uses the kernel
  size, not the dilated extent) and the rest of the window goes after.

The layers pad with F.pad (zeros) before running with no padding of their own.
"""
from ..errors import ExportError
from .registry import LayerError

SAME = "same"
_SIDES = ("pad_t", "pad_b", "pad_l", "pad_r")


def read_edge_pads(p, nsp, message):
    """None (Caffe's symmetric pad), SAME, or (top, bottom, left, right) from a Convolution- or
    PoolingParameter `p` with `nsp` spatial axes; raises LayerError as the fork's CHECKs do."""
    declared = p.DESCRIPTOR.fields_by_name
    if "pad_type" not in declared:
        return None
    sides = tuple(int(getattr(p, f)) for f in _SIDES)
    pad_type = int(p.pad_type)
    if pad_type not in (0, 1):
        raise LayerError(f"{message}.pad_type must be 0 (Caffe) or 1 (SAME), got {pad_type}")
    if not any(sides) and pad_type == 0:
        return None
    symmetric = (p.HasField("pad") if isinstance(p.pad, int) else len(p.pad)) \
        or p.HasField("pad_h") or p.HasField("pad_w")
    what = "pad_l/r/t/b" if any(sides) else "pad_type"
    if symmetric:
        raise LayerError(f"{message}: give either pad / pad_h / pad_w or {what}, not both")
    if any(sides) and p.HasField("pad_type"):
        raise LayerError(f"{message}: give either pad_type or pad_l/r/t/b, not both")
    if nsp != 2:
        raise LayerError(f"{message}.{what} only work for 2-D data")
    return sides if any(sides) else SAME


def same_pads(size, kernel, stride, dilation=1):
    """(before, after) for one axis of SAME padding: the output is ceil(size / stride).
    A negative remainder after is clamped to 0: those rows would never be read."""
    out = -(-size // stride)
    along = max(kernel - (stride if size % stride == 0 else size % stride), 0)
    before = along // 2
    after = (out - 1) * stride + dilation * (kernel - 1) + 1 - size - before
    return before, max(after, 0)


def resolve_edge_pads(mode, hw, kernel, stride, dilation=(1, 1)):
    """[left, right, top, bottom] (F.pad's order) for input spatial size hw, or None."""
    if mode is None:
        return None
    if mode == SAME:
        (t, b), (l, r) = (same_pads(n, k, s, d) for n, k, s, d in zip(hw, kernel, stride, dilation))
        return [l, r, t, b]
    t, b, l, r = mode
    return [l, r, t, b]


def onnx_pads(pads, what):
    """ONNX's pads attribute [top, left, bottom, right] from [left, right, top, bottom]."""
    l, r, t, b = pads
    if min(pads) < 0:
        raise ExportError(f"{what}: negative pad_l/r/t/b (a crop) has no ONNX Conv form here")
    return [t, l, b, r]
