"""A CUDA run emulated on the CPU, to find layers that would mix devices on a GPU without one.

Weights and inputs become DeviceTensor: CPU data whose `.device` says cuda:0. A tensor a layer makes
without a device (torch.zeros(n), torch.tensor(list), torch.from_numpy(a)) stays a plain CPU tensor,
as it would next to real CUDA blobs. An op that mixes the two (a 0-dim CPU tensor aside, which CUDA
accepts), indexes a CPU tensor with device indices, or takes .numpy() of a device tensor is what
PyTorch refuses on a GPU: each is recorded with the caffeq source line that did it.
"""
import traceback
from unittest import mock

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

EMULATED = torch.device("cuda", 0)
# ops that move or copy between devices, or only read a tensor's data
_MOVES = ("to", "copy_", "cpu", "cuda", "tolist", "item")


class DeviceTensor(torch.Tensor):
    """CPU data standing for a tensor on the emulated GPU."""


def _caffeq_line():
    for frame in reversed(traceback.extract_stack()[:-3]):
        if "/caffeq/" in frame.filename:
            return f"{frame.filename.split('/caffeq/')[-1]}:{frame.lineno}: {frame.line}"
    return "(outside caffeq)"


def _wants_device(device):
    """True for a CUDA device, False for the CPU, None where no device is named."""
    if device is None:
        return None
    return torch.device(device).type == "cuda" if isinstance(device, (str, torch.device)) else None


def _tensors(value, found):
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _tensors(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            _tensors(item, found)
    return found


def _place(value, on_device):
    """Tag (or untag) every tensor in value's structure (namedtuples such as torch.sort's kept)."""
    if isinstance(value, torch.Tensor):
        kind = DeviceTensor if on_device else torch.Tensor
        return value if type(value) is kind else value.as_subclass(kind)
    if isinstance(value, list):
        return [_place(v, on_device) for v in value]
    if isinstance(value, tuple):
        items = [_place(v, on_device) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


def _on_device(t):
    return type(t) is DeviceTensor


class EmulatedCuda(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.mixes = []

    def _flag(self, what):
        self.mixes.append(f"{what} at {_caffeq_line()}")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        owner = getattr(getattr(func, "__self__", None), "__name__", "")
        if name == "__get__" and owner in ("device", "is_cuda"):
            on = _on_device(args[0])
            return on if owner == "is_cuda" else (EMULATED if on else torch.device("cpu"))
        if name == "__get__":
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is torch.Tensor.numpy and _on_device(args[0]):
            self._flag(".numpy() of a device tensor")
        if func in (torch.Tensor.cuda, torch.Tensor.cpu):
            return _place(args[0], func is torch.Tensor.cuda)
        wants = _wants_device(kwargs.get("device"))
        if wants:
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to:
            args = list(args)
            for i, a in enumerate(args[1:], 1):
                if isinstance(a, (str, torch.device)):
                    wants, args[i] = _wants_device(a), torch.device("cpu")
                elif isinstance(a, torch.Tensor):     # .to(other): other's device and dtype
                    wants, args[i] = _on_device(a), a.dtype
            args = tuple(args)
            if wants is None:
                wants = _on_device(args[0])
        found = _tensors(list(args), []) + _tensors(list(kwargs.values()), [])
        devices = [t for t in found if _on_device(t)]
        hosts = [t for t in found if not _on_device(t) and t.dim() > 0]
        if devices and hosts and name not in _MOVES:
            if name == "__getitem__":
                if not _on_device(args[0]):
                    self._flag("a CPU tensor indexed by device indices")
            elif name == "__setitem__":
                value = args[2]
                if isinstance(value, torch.Tensor) and value.dim() > 0 and _on_device(value) != _on_device(args[0]):
                    self._flag("a value written into a tensor on the other device")
            else:
                self._flag(f"{name} of device and CPU tensors")
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if func is torch.Tensor.copy_:
            return args[0]
        if wants is None:
            wants = bool(devices) and name not in ("tolist", "item")
            if name.startswith("new_") and args and isinstance(args[0], torch.Tensor):
                wants = _on_device(args[0])
        return _place(out, wants)


def run_on_emulated_cuda(model, inputs, exact=True):
    """Run `model`'s module (the exact layer-by-layer one, or Model.run's default optimized one) with
    every weight, buffer and input on the emulated GPU; returns (outputs, [device mixes found])."""
    from caffeq.backends import torch_backend
    # built as for a GPU: the CPU's oneDNN prepacked convolutions never run there
    with mock.patch.object(torch_backend, "prepack_convolutions", lambda module: None):
        module = torch_backend.to_torch(model, optimize=not exact)
    for layer in module.modules():
        for name in list(layer._parameters):
            if layer._parameters[name] is not None:
                setattr(layer, name, layer._parameters.pop(name).detach().as_subclass(DeviceTensor))
        for name in list(layer._buffers):
            if layer._buffers[name] is not None:
                layer._buffers[name] = layer._buffers[name].as_subclass(DeviceTensor)
    feed = [torch.from_numpy(np.ascontiguousarray(inputs[k], np.float32)).as_subclass(DeviceTensor) for k in inputs]
    mode = EmulatedCuda()
    with torch.inference_mode(), mode:
        out = module(*feed)
    return out, mode.mixes
