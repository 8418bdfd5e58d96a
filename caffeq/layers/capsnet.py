"""chenzhenhua986/CAFFE-CapsNet (cb0e272; its MNIST capsule nets), the layers of its deploy net as a GPU build
computes them (several CPU forwards of the fork are empty or read out of bounds).

- CapsuleReshape (capsule_dim d): a (M, C, ...) bottom's channels in groups of d at each position, group-major
  then spatial: top[b, g P + p, k] = x[b, g d + k, p], (M, C / d P, d).
- Squash (capsule_dim): each run of capsule_dim values s times (1 - e^-r) / r, r = sqrt(float(sum s^2) + 1e-7
  + 1e-7) (the fork's exponential squash, not Sabour's), the scale in double, rounded to float.
- CapsuleTransform: u[b, j, o] = sum_k x[b, j, k] W[j, k, o] + bias[j, o]; blobs W (Nin, Din, Nout Dout) and a
  bias (Nin Nout Dout); top (M, Nin, Nout Dout).
- CapsuleRouting: v[b, i, e] = sum_j W[i, j] u[b, j, i Dout + e], a learned weighted sum (no dynamic routing);
  blob W (Nout, Nin); top (M, Nout, Dout).
- CapsuleLen (num_class K): each of K capsules' sum of squares (the GPU's, no square root), (M, K).
- CapsuleMask (class_num K): the bottom with every capsule but the last zeroed: the fork's argmax never updates
  its running maximum, so the last capsule always wins; no label is read.
- Cap: Sabour's routing by agreement, three rounds whatever routing_num says, from zero logits; the top is the
  last round's unsquashed sum plus a bias (Nout Dout).  The fork never resets its logits, so its later calls
  start from the earlier ones': caffeq computes every call as the fork's first.
- CapsuleRelu (dim, thre): runs of dim values longer than thre set to 0; the fork never copies its bottom to its
  top, so only the in-place form (the nets') is read.
TRAIN and TEST compute the same.  torch, ONNX, model.py.
"""
import math

import numpy as np
import torch
from torch import nn

from .norm import onnx_reduce
from .registry import Layer, LayerError, need_blobs, register_layer, torch_sources


def capsule_reshape(x, d: int):
    m, c = x.shape[0], x.shape[1]
    return x.reshape(m, c // d, d, -1).transpose(2, 3).reshape(m, -1, d)


def exp_squash(x, d: int):
    """s (1 - e^-r) / r per run of d values, r = sqrt(float32 sum of squares + 1e-7 + 1e-7) in double."""
    s = x.reshape(x.shape[0], -1, d)
    q = (s * s).sum(-1, keepdim=True) + 1e-7                  # float32, as the fork's asum + 1e-07
    r = torch.sqrt(q.double() + 1e-7)
    return (s * ((1 - torch.exp(-r)) / r).to(x.dtype)).reshape(x.shape)


def capsule_transform(x, weight, bias):
    """(M, Nin, Nout Dout): each input capsule through its own (Din, Nout Dout) matrix, plus its bias."""
    n_in, d_in, width = weight.shape
    u = torch.matmul(x.reshape(x.shape[0], n_in, 1, d_in), weight).reshape(x.shape[0], n_in, width)
    return u if bias is None else u + bias.reshape(n_in, width)


def capsule_routing(u, weight, d_out: int):
    """(M, Nout, Dout): v[b, i, e] = sum_j W[i, j] u[b, j, i Dout + e]."""
    n_out, n_in = weight.shape
    per_class = u.reshape(u.shape[0], n_in, n_out, d_out).permute(0, 2, 3, 1)      # (M, Nout, Dout, Nin)
    return torch.matmul(per_class, weight.unsqueeze(-1)).squeeze(-1)


def capsule_lengths(x, k: int):
    """(M, K): the sum of squares of each of the K capsules (CapsuleLen's GPU forward)."""
    v = x.reshape(x.shape[0], k, -1)
    return (v * v).sum(-1)


def last_capsule(x, k: int):
    """The bottom with every capsule but the last zeroed (CapsuleMask as the fork runs it)."""
    v = x.reshape(x.shape[0], k, -1)
    keep = torch.zeros(k, 1, dtype=x.dtype, device=x.device)
    keep[-1] = 1
    return (v * keep).reshape(x.shape)


def dynamic_routing(x, weight, bias, n_out: int, d_out: int):
    """Cap's forward on its first call: u = each input capsule through its matrix; three rounds of c = softmax over
    the output capsules of logits b (from 0), s = sum_j c u, v = Sabour's squash of s, b += v . u; then the last
    round's s (unsquashed) plus the bias, (M, Nout, Dout)."""
    n_in, d_in, width = weight.shape
    m = x.shape[0]
    u = torch.matmul(x.reshape(m, n_in, 1, d_in), weight).reshape(m, n_in, n_out, d_out)
    logits = x.new_zeros(m, n_out, n_in)
    s = x.new_zeros(m, n_out, d_out)
    for _ in range(3):
        c = torch.softmax(logits, dim=1)
        s = torch.einsum("bij,bjie->bie", c, u)
        q = (s * s).sum(-1, keepdim=True).double()
        v = s * (q / (1 + q) / torch.sqrt(q + 1e-7)).to(s.dtype)
        logits = logits + torch.einsum("bie,bjie->bij", v, u)
    return s if bias is None else s + bias.reshape(n_out, d_out)


def capsule_relu(x, dim: int, thre: float):
    """Every run of dim values whose length sqrt(sum x^2 + 1e-7) exceeds thre set to 0 (in place in the fork)."""
    runs = x.reshape(-1, dim)
    length = torch.sqrt((runs * runs).sum(-1, keepdim=True).double() + 1e-7).to(x.dtype)
    return torch.where(length > thre, torch.zeros_like(runs), runs).reshape(x.shape)


TORCH_CAPSNET = torch_sources(capsule_reshape, exp_squash, capsule_transform, capsule_routing, capsule_lengths,
                              last_capsule, dynamic_routing, capsule_relu)


def _positive(p, field, where):
    v = int(getattr(p, field))
    if v <= 0:
        raise LayerError(f"{where}.{field} must be > 0, got {v}")
    return v


def _divides(count, d, what, shape):
    if count % d:
        raise LayerError(f"{what} {d} must divide the {count} values per item of {list(shape)} (the fork leaves the "
                         f"rest unwritten)")


class CapsuleBlobs(nn.Module):
    """model.py's holder of a capsule layer's blobs, by name."""

    def __init__(self, names, shapes):
        super().__init__()
        for name, shape in zip(names, shapes):
            setattr(self, name, nn.Parameter(torch.zeros(shape)))


class _Capsules(Layer):
    """A layer whose forward and model.py call one capsnet function on its bottom, its blobs and args(attrs)."""

    def forward(self, attrs, params, x):
        return self.fn(x, *params, *self.args(attrs))

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_CAPSNET)
        blobs = []
        if self.blob_names:
            names = list(self.blob_names_for(node.attrs))
            m = emit.instance(CapsuleBlobs, names, [list(s) for s in node.expected_param_shapes])
            for i, name in enumerate(names):
                emit.param(name, i)
                blobs.append(f"{m}.{name}")
        args = ", ".join([emit.inputs[0]] + blobs + [repr(a) for a in self.args(node.attrs)])
        return f"{self.fn.__name__}({args})"


@register_layer("CapsuleReshape")
class CapsuleReshape(_Capsules):
    fn = staticmethod(capsule_reshape)

    def parse(self, lp):
        need_blobs(lp, "CapsuleReshape", 1, 1, in_place=False)
        return {"d": _positive(lp.capsule_reshape_param, "capsule_dim", "capsule_reshape_param")}

    def args(self, attrs):
        return [attrs["d"]]

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) < 2:
            raise LayerError(f"CapsuleReshape needs (M, C, ...), got {list(s)}")
        _divides(s[1], attrs["d"], "capsule_reshape_param.capsule_dim", s)
        return [(s[0], math.prod(s[1:]) // attrs["d"], attrs["d"])]

    def onnx(self, ctx, node):
        s, d = ctx.shape(node.inputs[0]), node.attrs["d"]
        grouped = ctx.op("Reshape", [node.inputs[0], ctx.i64([-1, s[1] // d, d, math.prod(s[2:])])], "groups")
        moved = ctx.op("Transpose", [grouped], "moved", perm=[0, 1, 3, 2])
        ctx.add_node("Reshape", [moved, ctx.i64([-1, math.prod(s[1:]) // d, d])], [node.outputs[0]], name=node.name)


@register_layer("Squash")
class Squash(_Capsules):
    fn = staticmethod(exp_squash)

    def parse(self, lp):
        need_blobs(lp, "Squash", 1, 1)
        return {"d": _positive(lp.squash_param, "capsule_dim", "squash_param")}

    def args(self, attrs):
        return [attrs["d"]]

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        _divides(math.prod(s[1:]), attrs["d"], "squash_param.capsule_dim", s)
        return [s]

    def onnx(self, ctx, node):
        s, d = ctx.shape(node.inputs[0]), node.attrs["d"]
        caps = ctx.op("Reshape", [node.inputs[0], ctx.i64([-1, math.prod(s[1:]) // d, d])], "caps")
        q = ctx.op("Add", [onnx_reduce(ctx, "ReduceSum", ctx.op("Mul", [caps, caps], "sq"), [2], True), ctx.f32(1e-7)],
                   "q")
        r = ctx.op("Sqrt", [ctx.op("Add", [ctx.op("Cast", [q], "q64", to=11), ctx.const(np.array(1e-7))], "q2")], "r")
        one = ctx.const(np.array(1.0))
        scale = ctx.op("Div", [ctx.op("Sub", [one, ctx.op("Exp", [ctx.op("Neg", [r], "nr")], "e")], "num"), r], "scale")
        v = ctx.op("Mul", [caps, ctx.op("Cast", [scale], "scale32", to=1)], "v")
        ctx.add_node("Reshape", [v, ctx.i64([-1] + list(s[1:]))], [node.outputs[0]], name=node.name)


@register_layer("CapsuleTransform")
class CapsuleTransform(_Capsules):
    fn = staticmethod(capsule_transform)
    blob_names = ("weight", "bias")
    field = "capsule_transform_param"

    def blob_names_for(self, attrs):
        return self.blob_names if attrs["bias_term"] else ("weight",)

    def parse(self, lp):
        need_blobs(lp, lp.type, 1, 1)
        p = getattr(lp, self.field)
        return {"d_in": _positive(p, "input_capsule_dim", self.field),
                "d_out": _positive(p, "output_capsule_dim", self.field),
                "n_out": _positive(p, "output_capsule_num", self.field), "bias_term": bool(p.bias_term)}

    def args(self, attrs):
        return [] if attrs["bias_term"] else [None]   # no bias blob

    def _n_in(self, attrs, s):
        _divides(math.prod(s[1:]), attrs["d_in"], f"{self.field}.input_capsule_dim", s)
        return math.prod(s[1:]) // attrs["d_in"]

    def bias_shape(self, n_in, width):
        return (n_in * width,)   # one bias per input capsule and output value

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        return [(s[0], self._n_in(attrs, s), attrs["n_out"] * attrs["d_out"])]

    def param_shapes(self, attrs, in_shapes):
        n_in, width = self._n_in(attrs, tuple(in_shapes[0])), attrs["n_out"] * attrs["d_out"]
        return [(n_in, attrs["d_in"], width)] + ([self.bias_shape(n_in, width)] if attrs["bias_term"] else [])

    def macs(self, attrs, in_shapes, out_shapes):
        return math.prod(out_shapes[0]) * attrs["d_in"]

    def onnx(self, ctx, node):
        a = node.attrs
        n_in, width = node.expected_param_shapes[0][0], a["n_out"] * a["d_out"]
        caps = ctx.op("Reshape", [node.inputs[0], ctx.i64([-1, n_in, 1, a["d_in"]])], "caps")
        u = ctx.op("Reshape", [ctx.op("MatMul", [caps, ctx.weight(node, 0)], "u"), ctx.i64([-1, n_in, width])], "u3")
        if not a["bias_term"]:
            ctx.add_node("Identity", [u], [node.outputs[0]], name=node.name)
            return
        bias = ctx.op("Reshape", [ctx.weight(node, 1), ctx.i64([n_in, width])], "bias")
        ctx.add_node("Add", [u, bias], [node.outputs[0]], name=node.name)


@register_layer("CapsuleRouting")
class CapsuleRouting(_Capsules):
    fn = staticmethod(capsule_routing)
    blob_names = ("weight",)

    def parse(self, lp):
        need_blobs(lp, "CapsuleRouting", 1, 1)
        p = lp.capsule_routing_param
        return {k: _positive(p, f, "capsule_routing_param") for k, f in
                (("n_in", "input_capsule_num"), ("d_out", "output_capsule_dim"), ("n_out", "output_capsule_num"))}

    def args(self, attrs):
        return [attrs["d_out"]]

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if math.prod(s[1:]) != attrs["n_in"] * attrs["n_out"] * attrs["d_out"]:
            raise LayerError(f"CapsuleRouting reads (M, input_capsule_num {attrs['n_in']}, output_capsule_num x dim "
                             f"{attrs['n_out'] * attrs['d_out']}), got {list(s)}")
        return [(s[0], attrs["n_out"], attrs["d_out"])]

    def param_shapes(self, attrs, in_shapes):
        return [(attrs["n_out"], attrs["n_in"])]

    def onnx(self, ctx, node):
        a = node.attrs
        u = ctx.op("Reshape", [node.inputs[0], ctx.i64([-1, a["n_in"], a["n_out"], a["d_out"]])], "u")
        per_class = ctx.op("Transpose", [u], "per_class", perm=[0, 2, 3, 1])
        w = ctx.op("Unsqueeze", [ctx.weight(node, 0), ctx.i64([2])], "w")
        ctx.add_node("Squeeze", [ctx.op("MatMul", [per_class, w], "v"), ctx.i64([3])], [node.outputs[0]],
                     name=node.name)


class _PerClass(_Capsules):
    field = ""

    def parse(self, lp):
        need_blobs(lp, lp.type, 1, 1)
        name, what = self.field
        return {"k": _positive(getattr(lp, name), what, name), "type": lp.type}

    def args(self, attrs):
        return [attrs["k"]]

    def _check(self, attrs, s):
        _divides(math.prod(s[1:]), attrs["k"], f"{self.field[0]}.{self.field[1]}", s)


@register_layer("CapsuleLen")
class CapsuleLen(_PerClass):
    fn = staticmethod(capsule_lengths)
    field = ("capsule_len_param", "num_class")

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        self._check(attrs, s)
        return [(s[0], attrs["k"])]

    def onnx(self, ctx, node):
        caps = ctx.op("Reshape", [node.inputs[0], ctx.i64([0, node.attrs["k"], -1])], "caps")
        onnx_reduce(ctx, "ReduceSum", ctx.op("Mul", [caps, caps], "sq"), [2], False, out=node.outputs[0])


@register_layer("CapsuleMask")
class CapsuleMask(_PerClass):
    fn = staticmethod(last_capsule)
    field = ("capsule_mask_param", "class_num")

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        self._check(attrs, s)
        return [s]

    def onnx(self, ctx, node):
        s, k = ctx.shape(node.inputs[0]), node.attrs["k"]
        caps = ctx.op("Reshape", [node.inputs[0], ctx.i64([0, k, -1])], "caps")
        keep = np.zeros((k, 1), np.float32)
        keep[-1] = 1
        ctx.add_node("Reshape", [ctx.op("Mul", [caps, ctx.const(keep)], "kept"), ctx.i64([-1] + list(s[1:]))],
                     [node.outputs[0]], name=node.name)


@register_layer("Cap")
class Cap(CapsuleTransform):
    """CapsuleTransform's blobs (its bias one per output value), then routing by agreement."""
    fn = staticmethod(dynamic_routing)
    field = "cap_param"

    def parse(self, lp):
        attrs = super().parse(lp)
        if lp.cap_param.routing_num != 3:
            attrs["reading_notes"] = [f"cap_param.routing_num {lp.cap_param.routing_num} is not read: the fork "
                                      f"routes three times"]
        return attrs

    def args(self, attrs):
        return super().args(attrs) + [attrs["n_out"], attrs["d_out"]]

    def bias_shape(self, n_in, width):
        return (width,)

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        self._n_in(attrs, s)
        return [(s[0], attrs["n_out"], attrs["d_out"])]

    def macs(self, attrs, in_shapes, out_shapes):
        # the transform, then three rounds of a weighted sum and an agreement over every (j, i, e)
        capsules = math.prod(in_shapes[0]) // attrs["d_in"]
        return capsules * attrs["n_out"] * attrs["d_out"] * (attrs["d_in"] + 6)

    def onnx(self, ctx, node):
        a = node.attrs
        n_in, d_in, width = node.expected_param_shapes[0]
        caps = ctx.op("Reshape", [node.inputs[0], ctx.i64([-1, n_in, 1, d_in])], "caps")
        u = ctx.op("Reshape", [ctx.op("MatMul", [caps, ctx.weight(node, 0)], "u"),
                               ctx.i64([-1, n_in, a["n_out"], a["d_out"]])], "u4")
        per_class = ctx.op("Transpose", [u], "per_class", perm=[0, 2, 1, 3])              # (M, Nout, Nin, Dout)
        logits = ctx.op("Mul", [onnx_reduce(ctx, "ReduceSum", per_class, [3], False), ctx.f32(0.0)], "logits0")
        s = None
        for k in range(3):
            c = ctx.op("Softmax", [logits], f"c{k}", axis=1)
            s = ctx.op("Squeeze", [ctx.op("MatMul", [ctx.op("Unsqueeze", [c, ctx.i64([2])], f"c{k}_4"), per_class],
                                          f"s{k}"), ctx.i64([2])], f"s{k}_3")
            q = ctx.op("Cast", [onnx_reduce(ctx, "ReduceSum", ctx.op("Mul", [s, s], f"sq{k}"), [2], True)], f"q{k}", to=11)
            one, eps = ctx.const(np.array(1.0)), ctx.const(np.array(1e-7))
            scale = ctx.op("Div", [ctx.op("Div", [q, ctx.op("Add", [one, q], f"q1_{k}")], f"ratio{k}"),
                                   ctx.op("Sqrt", [ctx.op("Add", [q, eps], f"qe{k}")], f"root{k}")], f"scale{k}")
            v = ctx.op("Mul", [s, ctx.op("Cast", [scale], f"scale{k}_32", to=1)], f"v{k}")
            agree = ctx.op("MatMul", [per_class, ctx.op("Unsqueeze", [v, ctx.i64([3])], f"v{k}_4")], f"agree{k}")
            logits = ctx.op("Add", [logits, ctx.op("Squeeze", [agree, ctx.i64([3])], f"agree{k}_3")], f"logits{k + 1}")
        if not a["bias_term"]:
            ctx.add_node("Identity", [s], [node.outputs[0]], name=node.name)
            return
        bias = ctx.op("Reshape", [ctx.weight(node, 1), ctx.i64([a["n_out"], a["d_out"]])], "bias")
        ctx.add_node("Add", [s, bias], [node.outputs[0]], name=node.name)


@register_layer("CapsuleRelu")
class CapsuleRelu(_Capsules):
    fn = staticmethod(capsule_relu)

    def parse(self, lp):
        need_blobs(lp, "CapsuleRelu", 1, 1)
        if lp.top[0] != lp.bottom[0]:
            raise LayerError("CapsuleRelu works in place only: the fork never copies its bottom into another top")
        p = lp.capsule_relu_param
        return {"dim": _positive(p, "dim", "capsule_relu_param"), "thre": float(np.float32(p.thre))}

    def args(self, attrs):
        return [attrs["dim"], attrs["thre"]]

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        _divides(math.prod(s), attrs["dim"], "capsule_relu_param.dim", s)
        return [s]

    def onnx(self, ctx, node):
        a = node.attrs
        s = ctx.shape(node.inputs[0])
        runs = ctx.op("Reshape", [node.inputs[0], ctx.i64([-1, a["dim"]])], "runs")
        q = ctx.op("Cast", [onnx_reduce(ctx, "ReduceSum", ctx.op("Mul", [runs, runs], "sq"), [1], True)], "q64", to=11)
        length = ctx.op("Cast", [ctx.op("Sqrt", [ctx.op("Add", [q, ctx.const(np.array(1e-7))], "q")], "len")],
                        "len32", to=1)
        kept = ctx.op("Where", [ctx.op("Greater", [length, ctx.f32(a["thre"])], "long"), ctx.f32(0.0), runs], "kept")
        ctx.add_node("Reshape", [kept, ctx.i64([-1] + list(s[1:]))], [node.outputs[0]], name=node.name)
