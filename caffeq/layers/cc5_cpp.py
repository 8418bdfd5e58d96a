"""dlunion/CC5.0's CPP layer (cpp_layer.cpp; cpp_param { type param_str }, 162 there): a user C++ class named
by cpp_param.type runs the layer on the CPU.  caffeq never runs code a model names; it reads the classes of
FWYsimon/CornerNet-Caffe (e076426: ReLU.cpp, Upsample.cpp, CornerPool.cpp), whose CornerNet deploy file is
the public net written with them, and refuses any other class.

- ReLU: x > 0 ? x : 0, NaN included (BVLC's ReLU keeps NaN; this class exists to zero it).
- Upsample: param_str "key:value" pairs (';' or spaces apart, atoi values, a missing key 0); only `scale`
  is used: top (N, C, s H, s W), top[r, c] = bottom[r // s, c // s].  upsample_h / upsample_w are parsed and
  never used by the class.
- TopCornerPoolLayer, BottomCornerPoolLayer, LeftCornerPoolLayer, RightCornerPoolLayer: running maxima along
  one axis, scanned from the bottom, the top, the right and the left edge: each value is the max of itself
  and every value before it in the scan.  As the class's scan, a NaN met after the first value is passed
  over (it takes the running max) and a NaN first value makes the whole row or column NaN.  (Top and
  Bottom compare with >, Left and Right with >=: only the sign of a zero can differ, which is not kept.)
"""
import re

import torch

from .registry import Layer, LayerError, four_axes, need_blobs, register_layer

#: CornerNet-Caffe's corner pools: (axis, scanned from the far end)
CORNER_POOLS = {"TopCornerPoolLayer": (2, True), "BottomCornerPoolLayer": (2, False),
                "LeftCornerPoolLayer": (3, True), "RightCornerPoolLayer": (3, False)}
CLASSES = ("ReLU", "Upsample") + tuple(CORNER_POOLS)


def parse_param_str(text):
    """CornerNet-Caffe's parseParamStr, step by step: {key: atoi(value)}.  A key runs to ' ' or ':'; spaces
    and colons after it are skipped; a value runs to ' ' or ';', or between quotes; a key whose value is
    empty is not kept (and a key at the very end of the text is dropped)."""
    text += "\0"
    pairs, name, p = {}, "", 0

    def skip(pos, chars):
        while text[pos] != "\0" and text[pos] in chars:
            pos += 1
        return pos

    while text[p] != "\0":
        start = p
        p = skip(p, " ")
        key_start = p
        while text[p] != "\0" and text[p] not in " :":
            p += 1
        if text[p] != "\0":
            name = text[key_start:p]
        p = skip(p, " :")
        quoted = text[p] == "'"
        p += quoted
        value_start = p
        while text[p] != "\0" and not (text[p] == "'" if quoted else text[p] in " ;"):
            p += 1
        if p != value_start:
            pairs[name] = text[value_start:p]
            p = skip(min(p + 1, len(text) - 1), " ;'")
        if p == start:      # cannot happen with the class's rules; never loop on a malformed string
            break
    return {key: _atoi(value) for key, value in pairs.items()}


def _atoi(value):
    """C's atoi: leading spaces, an optional sign, then digits; 0 without any."""
    digits = re.match(r"\s*[+-]?\d+", value)
    return int(digits.group()) if digits else 0


# ---- torch (copied into model.py) ------------------------------------------------------------------

def cc5_relu(x):
    """x where x > 0, else 0 (NaN too)."""
    return torch.where(x > 0, x, torch.zeros_like(x))


def nearest_upsample(x, scale: int):
    """top[r, c] = bottom[r // scale, c // scale] on the last two axes."""
    return x.repeat_interleave(scale, dim=2).repeat_interleave(scale, dim=3)


def corner_pool(x, dim: int, reverse: bool):
    """Running max along `dim` (from the far end with reverse); a NaN after the first scanned value takes the
    running max, a NaN first value makes the line NaN."""
    if reverse:
        x = x.flip(dim)
    first = x.narrow(dim, 0, 1)
    running = torch.where(torch.isnan(x), torch.full_like(x, float("-inf")), x).cummax(dim).values
    out = torch.where(torch.isnan(first), first, running)
    return out.flip(dim) if reverse else out


@register_layer("CPP")
class CPP(Layer):
    def parse(self, lp):
        p = lp.cpp_param
        kind = str(p.type)
        if kind not in CLASSES:
            raise LayerError(f"cpp_param.type '{kind}' names a C++ class of CC5.0's CPP layer that caffeq does not "
                             f"know (it reads FWYsimon/CornerNet-Caffe's: {', '.join(CLASSES)}) and never runs "
                             f"code a model names")
        need_blobs(lp, f"CPP {kind}", 1, 1)
        attrs = {"kind": kind}
        if kind == "Upsample":
            scale = parse_param_str(p.param_str).get("scale", 0)
            if scale < 1:
                raise LayerError(f"cpp_param.param_str gives Upsample the scale {scale}; the class makes an empty "
                                 f"top below 1")
            attrs["scale"] = scale
        return attrs

    def infer(self, attrs, in_shapes):
        if attrs["kind"] == "ReLU":
            return [tuple(in_shapes[0])]
        n, c, h, w = four_axes(in_shapes[0], f"CPP {attrs['kind']}")
        s = attrs.get("scale", 1)
        return [(n, c, h * s, w * s)]

    def forward(self, attrs, params, x):
        kind = attrs["kind"]
        if kind == "ReLU":
            return cc5_relu(x)
        if kind == "Upsample":
            return nearest_upsample(x, attrs["scale"])
        return corner_pool(x, *CORNER_POOLS[kind])

    def onnx(self, ctx, node):
        kind, x, out, name = node.attrs["kind"], node.inputs[0], node.outputs[0], node.name
        if kind == "ReLU":
            ctx.add_node("Where", [ctx.op("Greater", [x, ctx.f32(0.0)], "positive"), x, ctx.f32(0.0)], [out],
                         name=name)
        elif kind == "Upsample":
            s = float(node.attrs["scale"])
            ctx.add_node("Resize", [x, "", ctx.f32([1.0, 1.0, s, s])], [out], name=name, mode="nearest",
                         coordinate_transformation_mode="asymmetric", nearest_mode="floor")
        else:
            _onnx_corner_pool(ctx, node, *CORNER_POOLS[kind])

    def pytorch_source(self, node, emit):
        kind, x = node.attrs["kind"], emit.inputs[0]
        if kind == "ReLU":
            return f"{emit.helper(cc5_relu)}({x})"
        if kind == "Upsample":
            return f"{emit.helper(nearest_upsample)}({x}, {node.attrs['scale']})"
        dim, reverse = CORNER_POOLS[kind]
        return f"{emit.helper(corner_pool)}({x}, {dim}, {reverse})"


def _onnx_corner_pool(ctx, node, dim, reverse):
    """The running max by doubling steps: max with the line shifted by 1, 2, 4, ... (-inf shifted in)."""
    x, shape = node.inputs[0], ctx.shape(node.inputs[0])
    length = shape[dim]
    nan = ctx.op("IsNaN", [x], "nan")
    y = ctx.op("Where", [nan, ctx.f32(float("-inf")), x], "finite")
    step = 1
    while step < length:
        pads = [0] * 8
        if reverse:   # the line scanned from its far end: shift toward the start
            kept = ctx.op("Slice", [y, ctx.i64([step]), ctx.i64([length]), ctx.i64([dim])], f"kept{step}")
            pads[4 + dim] = step
        else:
            kept = ctx.op("Slice", [y, ctx.i64([0]), ctx.i64([length - step]), ctx.i64([dim])], f"kept{step}")
            pads[dim] = step
        shifted = ctx.op("Pad", [kept, ctx.i64(pads), ctx.f32(float("-inf"))], f"shifted{step}", mode="constant")
        y = ctx.op("Max", [y, shifted], f"max{step}")
        step *= 2
    first = 0 if not reverse else length - 1
    first_nan = ctx.op("Slice", [nan, ctx.i64([first]), ctx.i64([first + 1]), ctx.i64([dim])], "first_nan")
    ctx.add_node("Where", [first_nan, ctx.f32(float("nan")), y], [node.outputs[0]], name=node.name)


__all__ = ["CPP", "cc5_relu", "corner_pool", "nearest_upsample", "parse_param_str"]
