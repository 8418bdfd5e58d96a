"""Graph IR -> torch.fx.GraphModule whose outputs match Caffe's.

Each Caffe layer becomes one submodule (named after the layer) holding its
blobs as parameters (statistics as buffers) and calling its spec's forward.
The fx graph wires them in Caffe's order, so `print(module.code)` reads like
the prototxt.
"""
import contextlib
import operator
import re

import numpy as np
import torch
from torch import fx, nn

from ..errors import CaffeqError, DataError
from ..layers.conv import Convolution
from ..transforms import fold_batchnorm, remove_identities
from .names import identifier


class CaffeLayer(nn.Module):
    """One Caffe layer: its spec's forward over its own blobs."""

    def __init__(self, node, blobs, shared=None, bottom_blobs=()):
        super().__init__()
        self.caffe_name = node.name
        self.caffe_type = node.type
        self.bottom_blobs = list(bottom_blobs)     # Caffe's names, for errors
        self.top_count = len(node.outputs)   # DecoupledNet's ReLU also gives its mask: not an in-place relu_
        self.spec = node.spec
        self.attrs = node.attrs
        names = []
        declared = node.spec.blob_names_for(node.attrs)
        buffers = node.spec.buffer_blobs_for(node.attrs)
        for i, arr in enumerate(blobs or []):
            name = declared[i] if i < len(declared) else f"blob{i}"
            names.append(name)
            if shared and i in shared:
                if isinstance(shared[i], nn.Parameter):
                    setattr(self, name, shared[i])
                else:   # a shared statistics buffer: registered here too, so that .to() moves it
                    self.register_buffer(name, shared[i])
                continue
            tensor = torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))
            if i in buffers:
                self.register_buffer(name, tensor)
            else:
                self.register_parameter(name, nn.Parameter(tensor))
        self.blob_attrs = names
        if not node.inputs:
            # a layer without bottoms (ContinuationIndicator) makes its tops from nothing: this buffer
            # follows the module's .to() and tells the layer where they belong
            self.register_buffer("device_anchor", torch.empty(0), persistent=False)

    def blob_tensors(self):
        return [getattr(self, n) for n in self.blob_attrs]

    def forward(self, *inputs):
        try:
            if self.spec.uses_training_flag:
                out = self.spec.forward(self.attrs, self.blob_tensors(), *inputs, training=self.training)
            else:
                out = self.spec.forward(self.attrs, self.blob_tensors(), *inputs)
        except CaffeqError as e:
            # a check that needs the values (a roi's batch index) knows its type, not its layer's name
            lead = f"layer '{self.caffe_name}'"
            if e.args and isinstance(e.args[0], str) and lead not in e.args[0]:
                text = e.args[0].removeprefix(f"{self.caffe_type}: ")
                e.args = (f"{lead} ({self.caffe_type}): {text}",) + e.args[1:]
            raise
        except RuntimeError as e:
            empty = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.numel() == 0]
            if not empty:
                raise
            # Caffe runs its loops zero times over an empty blob (a Slice that leaves no channels); torch's
            # kernels refuse most empty inputs: say which layer and bottom, not torch's message
            shape = "x".join(str(d) for d in inputs[empty[0]].shape)
            name = self.bottom_blobs[empty[0]] if empty[0] < len(self.bottom_blobs) else empty[0]
            raise DataError(f"layer '{self.caffe_name}' ({self.caffe_type}): its bottom '{name}' is empty ({shape}), "
                            f"which Caffe allows; caffeq cannot run {self.caffe_type} on an empty blob") from e
        if inputs or not hasattr(self, "device_anchor"):
            return out
        dev = self.device_anchor.device
        return tuple(t.to(dev) for t in out) if isinstance(out, (tuple, list)) else out.to(dev)

    def extra_repr(self):
        return f"type={self.caffe_type}"


class CaffeNet(fx.GraphModule):
    """The GraphModule caffeq builds; keeps Caffe's input/output names."""


def build_module(model, all_blobs=False):
    graph = model.graph
    root = nn.Module()
    g = fx.Graph()
    taken = {"self", "torch", "operator"} | set(dir(nn.Module))  # a layer named "train" must not shadow it
    values = {}
    for ssa in graph.inputs:
        ident = identifier(graph.tensors[ssa].blob, taken)
        values[ssa] = g.placeholder(ident)
    modules = {}
    in_shapes = {}      # submodule -> the shape of its single input (Caffe's, at the model's batch)
    for node in graph.nodes:
        if node.spec.is_data:
            continue
        shared = {}
        for i, src in node.shared_from.items():
            owner_mod = modules.get(src[0])
            if owner_mod is not None and src[1] < len(owner_mod.blob_attrs):
                p = getattr(owner_mod, owner_mod.blob_attrs[src[1]])
                if tuple(p.shape) == tuple(node.expected_param_shapes[i]):
                    shared[i] = p
        mod = CaffeLayer(node, node.blobs, shared, [graph.tensors[i].blob for i in node.inputs])
        attr = identifier(node.name, taken)
        root.add_module(attr, mod)
        in_shapes[attr] = graph.tensors[node.inputs[0]].shape if len(node.inputs) == 1 else None
        modules[node.name] = mod
        call = g.call_module(attr, tuple(values[i] for i in node.inputs))
        if len(node.outputs) == 1:
            values[node.outputs[0]] = call
        else:
            for k, ssa in enumerate(node.outputs):
                values[ssa] = g.call_function(operator.getitem, (call, k))
    if all_blobs:
        # a data layer's top that nothing computed reads (an unused label) is not an input of the module
        wanted = [(b, ssa) for b, ssa in graph.final_versions().items() if ssa in values]
    else:
        wanted = [(graph.tensors[ssa].blob, ssa) for ssa in graph.outputs]
    if len(wanted) == 1 and not all_blobs:
        g.output(values[wanted[0][1]])
    else:
        g.output({blob: values[ssa] for blob, ssa in wanted})
    gm = CaffeNet(root, g, class_name=re.sub(r"\W", "_", graph.name or "CaffeNet") or "CaffeNet")
    gm.input_names = [graph.tensors[s].blob for s in graph.inputs]
    gm.output_names = [b for b, _ in wanted]
    gm.input_shapes = {graph.tensors[s].blob: graph.tensors[s].shape for s in graph.inputs}
    gm.layer_input_shapes = in_shapes
    return gm


# layers whose output is a tensor of its own (not a view of an input): a later layer may overwrite it
_FRESH_OUTPUT = ("Convolution", "ConvolutionDepthwise", "DepthwiseConvolution", "Deconvolution", "InnerProduct",
                 "Scale", "Pooling")


def _sole_reader(gm, src, node):
    """True when `src` is a fresh tensor that only `node` reads (so node may write into it)."""
    if not isinstance(src, fx.Node) or list(src.users) != [node]:
        return False
    if src.op == "call_function":
        return src.target in (torch.relu_, torch.Tensor.add_)   # already writes into a fresh tensor
    if src.op != "call_module":
        return False
    mod = gm.get_submodule(src.target)
    if getattr(mod, "caffe_type", None) == "Eltwise":
        return len(src.args) >= 2          # one input: Eltwise returns that input itself
    return getattr(mod, "caffe_type", None) in _FRESH_OUTPUT


def reuse_buffers(gm):
    """Inference only: ReLU and two-input Eltwise SUM write into their first input when nothing
    else reads it.  The arithmetic is the same; each large new tensor would cost an allocation
    whose pages fault on first touch, a sizeable part of a CPU forward."""
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_module":
            continue
        mod = gm.get_submodule(node.target)
        kind = getattr(mod, "caffe_type", None)
        if kind == "ReLU" and mod.top_count == 1 and mod.attrs.get("negative_slope", 0) == 0 and \
                mod.attrs.get("upper") is None and mod.attrs.get("lower") is None and len(node.args) == 1 and \
                _sole_reader(gm, node.args[0], node):
            node.op, node.target = "call_function", torch.relu_
            changed += 1
        elif kind == "Eltwise" and mod.attrs.get("operation") == 1 and len(node.args) == 2 and \
                all(c == 1 for c in mod.attrs.get("coeff", (1, 1))) and node.args[1] is not node.args[0]:
            a, b = node.args
            if not _sole_reader(gm, a, node):
                if not _sole_reader(gm, b, node):
                    continue
                node.args = (b, a)          # a + b == b + a exactly: write into the one only it reads
            node.op, node.target = "call_function", torch.Tensor.add_
            changed += 1
    if changed:
        gm.graph.lint()
        gm.recompile()
        gm.delete_all_unused_submodules()
    return changed


class PackedConv2d(nn.Module):
    """A 2-D Caffe Convolution whose weight oneDNN reordered once (eager torch reorders it on every
    call), optionally with the ReLU after it fused.  CPU, float32, inference only; the same
    arithmetic as F.conv2d up to oneDNN's choice of algorithm.  One difference: oneDNN's fused ReLU
    gives 0 for a NaN sum where Caffe's ReLU (and exact=True) keeps NaN; only NaN inputs or weights
    meet it, and leaving the ReLU unfused would cost every net a pass."""

    def __init__(self, weight, bias, stride, padding, dilation, groups, input_shape, relu=False):
        super().__init__()
        self.stride, self.padding, self.dilation, self.groups = list(stride), list(padding), list(dilation), groups
        self.packed = torch._C._nn.mkldnn_reorder_conv2d_weight(
            weight.detach().contiguous().to_mkldnn(), self.padding, self.stride, self.dilation, groups,
            list(input_shape))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.relu = relu

    def forward(self, x, residual=None):
        """conv(x), then + residual (a ResNet's Eltwise SUM: conv + r == r + conv exactly), then the ReLU."""
        if residual is None:
            return torch.ops.mkldnn._convolution_pointwise(x, self.packed, self.bias, self.padding, self.stride,
                                                           self.dilation, self.groups,
                                                           "relu" if self.relu else "none", [], "")
        return torch.ops.mkldnn._convolution_pointwise.binary(
            x, residual, self.packed, self.bias, self.padding, self.stride, self.dilation, self.groups, "add",
            1.0, "relu" if self.relu else None, [], "" if self.relu else None)


def _packable(mod, shape):
    a = mod.attrs
    # (synopsys-caffe per-side padding, edge_pads, is F.pad + conv: left to the layer's forward; a fork's spec
    # that claims Convolution layers, e.g. one that binarizes the weights first, keeps its own forward)
    return (mod.caffe_type == "Convolution" and type(mod.spec) is Convolution and a.get("_axis") == 1 and len(a.get("kernel", ())) == 2 and
            a.get("edge_pads") is None and not a.get("orn") and a.get("first_conv") is None and not a.get("fuse") and
            shape is not None and len(shape) == 4 and mod.blob_tensors()[0].dtype == torch.float32 and
            mod.blob_tensors()[0].device.type == "cpu")


def prepack_convolutions(gm):
    """CPU inference: 2-D convolutions get oneDNN-packed weights (PackedConv2d), and a ReLU that
    alone reads a convolution's output is fused into it.  Returns the number packed."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_convolution_pointwise")):
        return 0
    shapes = getattr(gm, "layer_input_shapes", {})
    packed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_module":
            continue
        mod = gm.get_submodule(node.target)
        if getattr(mod, "caffe_type", None) != "Convolution":
            continue
        shape = shapes.get(node.target)
        if not _packable(mod, shape):
            continue
        a = mod.attrs
        blobs = mod.blob_tensors()
        users = list(node.users)
        fuse = (len(users) == 1 and users[0].op == "call_function" and users[0].target is torch.relu_)
        try:
            new = PackedConv2d(blobs[0], blobs[1] if a.get("bias_term") else None, a["stride"], a["pad"],
                               a["dilation"], a["group"], shape, relu=fuse)
        except RuntimeError:
            continue     # this build's oneDNN cannot pack it: the layer stays as it was
        setattr(gm, node.target, new)
        packed += 1
        if fuse:
            relu = users[0]
            relu.replace_all_uses_with(node)
            gm.graph.erase_node(relu)
    if packed:
        _fuse_residual_sums(gm)
        gm.graph.lint()
        gm.recompile()
        gm.delete_all_unused_submodules()
    return packed


def _fuse_residual_sums(gm):
    """A packed convolution read only by an Eltwise SUM (add_, see reuse_buffers) takes the other
    input as its residual, and the ReLU that alone reads the sum: oneDNN adds in the convolution's
    epilogue, the tensor is not read twice more.  Same arithmetic: conv + r, then max(0, .)."""
    for add in list(gm.graph.nodes):
        if add.op != "call_function" or add.target is not torch.Tensor.add_ or len(add.args) != 2:
            continue
        conv = next((a for a in add.args if isinstance(a, fx.Node) and a.op == "call_module"
                     and isinstance(gm.get_submodule(a.target), PackedConv2d)
                     and not gm.get_submodule(a.target).relu and list(a.users) == [add]
                     and len(a.args) == 1), None)
        if conv is None:
            continue
        residual = add.args[1] if add.args[0] is conv else add.args[0]
        if not isinstance(residual, fx.Node) or residual is conv:
            continue
        users = list(add.users)
        relu = users[0] if len(users) == 1 and users[0].op == "call_function" and \
            users[0].target is torch.relu_ else None
        gm.get_submodule(conv.target).relu = relu is not None
        with gm.graph.inserting_before(add):
            fused = gm.graph.call_module(conv.target, (conv.args[0], residual))
        (relu or add).replace_all_uses_with(fused)
        if relu is not None:
            gm.graph.erase_node(relu)
        gm.graph.erase_node(add)
        gm.graph.erase_node(conv)


def resolve_device(device):
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DataError("--device cuda: no CUDA device is available (use --device auto or cpu)")
    return dev


@contextlib.contextmanager
def caffe_fp32(device):
    """IEEE float32 convolutions and matrix products on CUDA while caffeq runs a net, as Caffe's
    cuDNN and cuBLAS calls compute them: PyTorch lets cuDNN use TF32 by default, which on Ampere and
    later GPUs rounds inputs to 10-bit mantissas (errors near 1e-3 of the output's scale). The flags
    touch float32 arithmetic only (fp16 runs are unchanged); the user's settings come back afterwards."""
    if torch.device(device).type != "cuda":
        yield
        return
    cudnn, matmul = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = cudnn, matmul


def _channels_last(gm):
    """The 4-D weights in channels_last (Module.to(memory_format=...) would also take the 5-D ones of
    an N-D convolution, for which channels_last does not exist)."""
    with torch.no_grad():
        for t in list(gm.parameters()) + list(gm.buffers()):
            if t.dim() == 4:
                t.data = t.data.contiguous(memory_format=torch.channels_last)


def to_torch(model, device="cpu", dtype=None, all_blobs=False, optimize=False, compile=False):
    if any(n.has_params and n.blobs is None for n in model.graph.nodes):
        missing = [n.name for n in model.graph.nodes if n.has_params and n.blobs is None]
        raise DataError(f"{model.prototxt}: no weights for layers {', '.join(missing[:5])}"
                        f"{', ...' if len(missing) > 5 else ''}; give the caffemodel (--weights; in Python, "
                        f"load(..., weights) or random_weights=True to try the net untrained)")
    if optimize:
        model = fold_batchnorm(remove_identities(model))
    gm = build_module(model, all_blobs=all_blobs)
    gm.to(resolve_device(device))
    if dtype is not None:
        gm.to(dtype)
    if optimize:
        _channels_last(gm)
        reuse_buffers(gm)
        if not compile and not all_blobs and next((p.device.type for p in gm.parameters()), "cpu") == "cpu":
            prepack_convolutions(gm)
    gm.eval()
    if compile:
        # inductor with freezing prepacks convolution weights once (eager oneDNN
        # reorders them on every call, which dominates at batch 1); inference only
        return torch.compile(gm, options={"freezing": True})
    return gm


def _as_input_dict(model, inputs):
    names = list(model.inputs)
    if isinstance(inputs, dict) or hasattr(inputs, "files"):
        missing = [n for n in names if n not in inputs]
        if missing:
            raise DataError(f"inputs lack blob(s) {missing}; the net's inputs are {names}")
        return {n: np.asarray(inputs[n]) for n in names}
    if len(names) != 1:
        raise DataError(f"the net has {len(names)} inputs {names}; pass them by name (.npz)")
    return {names[0]: np.asarray(inputs)}


def check_inputs(model, arrays):
    for name, arr in arrays.items():
        want = model.inputs[name]
        if arr.ndim != len(want) or tuple(arr.shape[1:]) != tuple(want[1:]):
            raise DataError(f"input '{name}' has shape {list(arr.shape)}; the net expects "
                            f"{['N'] + list(want[1:])}")


def _weights_fingerprint(model):
    """Identity of every node and weight array: a cached module is stale once any is replaced."""
    return tuple((id(n), tuple(id(b) for b in (n.blobs or ()))) for n in model.graph.nodes)


def cached_module(model, device="cpu", dtype=None, all_blobs=False, exact=False, compile=False):
    """The module `Model.run` uses, built once per set of options and kept on the model.

    Optimized (folded, channels_last) unless every blob is asked for or exact=True.
    """
    optimize = not (all_blobs or exact)
    dev = resolve_device(device)
    key = (str(dev), dtype, bool(all_blobs), optimize, bool(compile))
    fingerprint = _weights_fingerprint(model)
    hit = model.run_cache
    if hit is not None and hit[0] == key and hit[1] == fingerprint:
        return hit[2]
    model.run_cache = None   # one module at a time: free the old weights first
    gm = to_torch(model, device=dev, dtype=dtype, all_blobs=all_blobs, optimize=optimize, compile=compile)
    model.run_cache = (key, fingerprint, gm)
    return gm


def run_numpy(model, inputs, device="cpu", all_blobs=False, batch_size=None, dtype=None, module=None,
              exact=False, compile=False):
    arrays = _as_input_dict(model, inputs)
    check_inputs(model, arrays)
    gm = module if module is not None else cached_module(model, device=device, dtype=dtype,
                                                         all_blobs=all_blobs, exact=exact, compile=compile)
    channels_last = module is None and not (all_blobs or exact)
    dev = next((p.device for p in gm.parameters()), resolve_device(device))
    tdtype = dtype or torch.float32
    first = next(iter(arrays.values()), None)
    n = first.shape[0] if first is not None and first.ndim else 1   # a scalar input: one run
    step = batch_size or n or 1
    if any(node.spec.data_dependent_shape for node in model.graph.nodes):
        step = n or 1  # rows of e.g. DetectionOutput carry batch indexes: chunks cannot be concatenated
    chunks = []
    with torch.inference_mode(), caffe_fp32(dev):
        for start in range(0, max(n, 1), step):
            # without batch_size, feed whole arrays: inputs need not share dim 0 (BatchReindex indices)
            # (np.require, not ascontiguousarray: a 0-axis input stays a scalar)
            feed = [torch.from_numpy(np.require(arrays[k][start:start + step] if batch_size and arrays[k].ndim
                                                else arrays[k], np.float32, "C"))
                    .to(dev, tdtype) for k in arrays]
            if channels_last:
                # the optimized module's weights are channels_last: feed its layout, no reorder
                feed = [t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t for t in feed]
            out = gm(*feed)
            if not isinstance(out, dict):
                out = {gm.output_names[0]: out}
            chunks.append({k: v.float().contiguous().cpu().numpy() for k, v in out.items()})
    if len(chunks) == 1:
        return chunks[0]
    merged = {}
    for k in chunks[0]:
        parts = [c[k] for c in chunks]
        if all(p.ndim and p.shape[0] == min(step, n - i * step) for i, p in enumerate(parts)):
            merged[k] = np.concatenate(parts)
        else:
            merged[k] = parts[-1]
    return merged
