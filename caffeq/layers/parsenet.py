"""ParseNet's layers (weiliu89/caffe, branch fcn, 36001c2): ParseOutput (parse_output_layer.cpp) and
UnPooling (unpooling_layer.cpp).

ParseOutput: for each image and pixel, the label of the highest channel, the first one on a tie (the
fork starts from channel 0 and moves on only where a later channel is strictly greater), as a float
(N, 1, H, W); with a second top, the maximum too.  (Its ParseEvaluate scorer only scores the net and
is dropped with the other scorers.)

UnPooling (the type ParseNet spells so; claimed from DeconvNet's Unpooling by its out_* fields): each
input position (h, w) covers the output window starting at (h stride - pad, w stride - pad) of the
out_kernel size.  With a second bottom the fork sizes that window itself: kernel = stride =
ceil(H / h) (stride 1 where it covers the axis), pad = floor(((h - 1) stride + kernel - H) / 2).  Output
(h - 1) stride - 2 pad + kernel.  FIXED puts each value at its window's middle (the later position wins);
REP adds value / n(u) at every output u of its window, DIV value / window size / n(u), n(u) being how
many windows cover u.  caffeq builds that map as one (h w, H' W') matrix and multiplies.
"""
import math

import torch

from .registry import Layer, LayerError, cached_constant, claim_layers, need_blobs, register_layer, torch_sources


def parse_output(x):
    """(labels, maxima) of an (N, C, H, W) blob: the first channel holding each pixel's maximum."""
    best = x.max(dim=1, keepdim=True).values
    channels = torch.arange(x.shape[1], device=x.device).reshape(1, -1, 1, 1)
    first = torch.where(x == best, channels, x.shape[1]).min(dim=1, keepdim=True).values
    return first.to(x.dtype), best


@register_layer("ParseOutput")
class ParseOutput(Layer):
    def parse(self, lp):
        need_blobs(lp, "ParseOutput", 1, (1, 2))
        return {"tops": len(lp.top)}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) != 4:
            raise LayerError(f"ParseOutput needs an (N, C, H, W) input, got {list(s)}")
        return [(s[0], 1, s[2], s[3])] * attrs["tops"]

    def forward(self, attrs, params, x):
        labels, maxima = parse_output(x)
        return (labels, maxima) if attrs["tops"] == 2 else labels

    def onnx(self, ctx, node):
        from .norm import onnx_reduce
        x = node.inputs[0]
        channels = int(ctx.shape(x)[1])
        best = onnx_reduce(ctx, "ReduceMax", x, [1], True)
        hit = ctx.op("Equal", [x, best], "is_max")
        index = ctx.const(torch.arange(channels, dtype=torch.float32).reshape(1, -1, 1, 1).numpy())
        candidates = ctx.op("Where", [hit, index, ctx.f32(float(channels))], "candidates")
        ctx.add_node("Identity", [onnx_reduce(ctx, "ReduceMin", candidates, [1], True)], [node.outputs[0]],
                     name=node.name)
        if len(node.outputs) == 2:
            ctx.add_node("Identity", [best], [node.outputs[1]])

    def pytorch_source(self, node, emit):
        call = f"{emit.helper(parse_output)}({emit.inputs[0]})"
        if node.attrs["tops"] == 1:
            return f"{call}[0]"
        result = emit.tmp(node.name + "_out")
        emit.stmt(f"{result} = {call}")
        return [f"{result}[0]", f"{result}[1]"]


# ---- UnPooling ---------------------------------------------------------------------------------

_OUT_FIELDS = ("out_kernel_size", "out_kernel_h", "out_kernel_w", "out_stride", "out_stride_h", "out_stride_w",
               "out_pad", "out_pad_h", "out_pad_w")


def unpool_matrix(method: int, size: list[int], kernel: list[int], stride: list[int], pad: list[int],
                  out: list[int]):
    """The (h w, H' W') float32 map of ParseNet's UnPooling (FillMask and Forward_cpu's loops); method
    0 FIXED, 1 DIV, 2 REP."""
    fixed, div = method == 0, method == 1
    h, w = size
    oh, ow = out
    count = torch.zeros(oh, ow, dtype=torch.float64)
    windows = []
    for y in range(h):
        for x in range(w):
            y0, x0 = y * stride[0] - pad[0], x * stride[1] - pad[1]
            if fixed:
                mid_y = min(max((y0 + y0 + kernel[0] - 1) // 2, 0), oh - 1)
                mid_x = min(max((x0 + x0 + kernel[1] - 1) // 2, 0), ow - 1)
                windows.append((mid_y, mid_y + 1, mid_x, mid_x + 1, 1.0))
                continue
            y1, x1 = min(y0 + kernel[0], oh + pad[0]), min(x0 + kernel[1], ow + pad[1])
            area = float((y1 - y0) * (x1 - x0))
            y0, x0, y1, x1 = max(y0, 0), max(x0, 0), min(y1, oh), min(x1, ow)
            count[y0:y1, x0:x1] += 1
            windows.append((y0, y1, x0, x1, area if div else 1.0))
    weights = torch.zeros(h * w, oh, ow, dtype=torch.float64)
    if fixed:
        for i, (y0, _, x0, _, _) in enumerate(windows):
            weights[:, y0, x0] = 0.0   # a later position overwrites an earlier one
            weights[i, y0, x0] = 1.0
    else:
        for i, (y0, y1, x0, x1, area) in enumerate(windows):
            weights[i, y0:y1, x0:x1] = 1.0 / area / count[y0:y1, x0:x1]
    return weights.reshape(h * w, oh * ow).to(torch.float32)


def parsenet_unpool(x, weights, out_h: int, out_w: int):
    """x (N, C, h, w) through the map of unpool_matrix -> (N, C, out_h, out_w)."""
    n, c = x.shape[:2]
    y = x.reshape(n * c, -1) @ weights.to(device=x.device, dtype=x.dtype)
    return y.reshape(n, c, out_h, out_w)


def _parsenet_unpooling(lp):
    p = lp.unpooling_param
    return any(f in p.DESCRIPTOR.fields_by_name and p.HasField(f) for f in _OUT_FIELDS)


def _pair(p, one, h, w):
    return [int(getattr(p, one))] * 2 if not p.HasField(h) else [int(getattr(p, h)), int(getattr(p, w))]


@claim_layers("Unpooling", _parsenet_unpooling)
class ParseNetUnpooling(Layer):
    def parse(self, lp):
        need_blobs(lp, "UnPooling", (1, 2), 1, "data, size reference")
        p = lp.unpooling_param
        if p.HasField("out_kernel_size") == (p.HasField("out_kernel_h") and p.HasField("out_kernel_w")):
            raise LayerError("unpooling_param: out_kernel_size, or both out_kernel_h and out_kernel_w")
        a = {"method": int(p.unpool), "sized": len(lp.bottom) == 2}
        if not a["sized"]:
            a["kernel"] = _pair(p, "out_kernel_size", "out_kernel_h", "out_kernel_w")
            a["stride"] = _pair(p, "out_stride", "out_stride_h", "out_stride_w")
            a["pad"] = _pair(p, "out_pad", "out_pad_h", "out_pad_w")
            if min(a["kernel"]) < 1 or min(a["stride"]) < 1:
                raise LayerError(f"unpooling_param: out kernel {a['kernel']} and stride {a['stride']} must be >= 1")
        return a

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) != 4:
            raise LayerError(f"UnPooling needs an (N, C, H, W) input, got {list(s)}")
        if attrs["sized"]:
            big = tuple(in_shapes[1])
            kernel = [math.ceil(big[a] / s[a]) for a in (2, 3)]
            stride = [1 if k == big[a] else k for k, a in zip(kernel, (2, 3))]
            pad = [math.floor(((s[a] - 1) * st + k - big[a]) / 2) for k, st, a in zip(kernel, stride, (2, 3))]
        else:
            kernel, stride, pad = attrs["kernel"], attrs["stride"], attrs["pad"]
        if any(pd and pd >= k for pd, k in zip(pad, kernel)):
            raise LayerError(f"unpooling_param: out pad {pad} must be smaller than the out kernel {kernel}")
        out = [(n - 1) * st - 2 * pd + k for n, st, pd, k in zip(s[2:], stride, pad, kernel)]
        if min(out) < 1:
            raise LayerError(f"UnPooling output would be empty for input {list(s)}")
        if s[2] * s[3] * out[0] * out[1] > 1 << 26:
            raise LayerError(f"UnPooling from {list(s[2:])} to {out}: the map would be too large")
        attrs["_geometry"] = ([int(s[2]), int(s[3])], kernel, stride, pad, out)
        return [s[:2] + tuple(out)]

    @staticmethod
    def _weights(attrs, device=None, dtype=None):
        geometry = tuple(tuple(int(v) for v in part) for part in attrs["_geometry"])
        return cached_constant(unpool_matrix, attrs["method"], *geometry, device=device, dtype=dtype)

    def forward(self, attrs, params, x, reference=None):
        out = attrs["_geometry"][-1]
        return parsenet_unpool(x, self._weights(attrs, x.device, x.dtype), out[0], out[1])

    def onnx(self, ctx, node):
        x = node.inputs[0]
        n, c = (int(d) for d in ctx.shape(x)[:2])
        (h, w), out = node.attrs["_geometry"][0], node.attrs["_geometry"][-1]
        rows = ctx.op("Reshape", [x, ctx.i64([n * c, h * w])], "rows")
        y = ctx.op("MatMul", [rows, ctx.const(self._weights(node.attrs).cpu().numpy())], "spread")
        ctx.add_node("Reshape", [y, ctx.i64([n, c, out[0], out[1]])], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        size, kernel, stride, pad, out = node.attrs["_geometry"]
        fn = emit.helper(TORCH_PARSENET_UNPOOL)
        weights = f"unpool_matrix({node.attrs['method']}, {size}, {kernel}, {stride}, {pad}, {out})"
        return f"{fn}({emit.inputs[0]}, {weights}, {out[0]}, {out[1]})"


TORCH_PARSENET_UNPOOL = torch_sources(unpool_matrix, parsenet_unpool)
