"""aharley/segaware's window layers (dc45b8a, caffe/src/caffe/layers/im2dist_layer.cpp, im2parity_layer.cpp,
util/im2dist.cpp / .cu, util/im2parity.cpp / .cu).

Im2dist: the distance between each window's centre embedding and every embedding of the window.

convolution_param gives the window (kernel, pad, stride, dilation; 2-D, channels on axis 1); the top is
(N, kernel_h x kernel_w, H_out, W_out) with Convolution's output size.  For window offset (i, j) at
output (y, x), with the centre at offset (kernel_h / 2, kernel_w / 2):
  sum over channels c of 0.5 (e_c(centre) - e_c(i, j))^2 (im2dist_param.norm L2, the default) or
  |e_c(centre) - e_c(i, j)| (L1), added channel by channel in float32 as the fork's loops;
  0 where the centre lies outside the map, or where the neighbour does (its pad);
  FLT_MAX / 100 at the centre itself with remove_center, and at outside neighbours with remove_bounds.
CPU and GPU forwards agree on this.  ONNX sums the channels with ReduceSum (the same values up to the
order of the float32 additions).

Im2parity: the same windows over a label map, 1 where a neighbour's label equals the centre's, else 0,
labels read as int (truncated); a neighbour outside the map reads label 0.  With im2parity_param
ignore_label, a pair holding it, and a centre outside the map, give ignore_label.  Every channel writes
the same top, so the last channel's labels decide.  Without ignore_label, an outside centre would write
an uninitialized member: such windows (pad reaching past half the kernel) are refused.

Convolution with convolution_param.bottom_is_im2col (base_conv_layer.cpp, conv_layer.cpp): the bottom is
already Im2col's columns (N, C kh kw, H, W), as segaware's nets feed it after weighting them by the
embedding distances; the weights keep their (O, C / group, kh, kw) shape, the top keeps H x W, and each
group's gemm makes it a grouped 1x1 convolution with the weights flattened to (O, C kh kw / group).
"""
import numpy as np
import torch
import torch.nn.functional as F

from .conv import conv_out_size
from .registry import Layer, LayerError, claim_layers, need_blobs, register_layer, spatial_params

#: the fork's "infinite" distance, FLT_MAX / 100 in float32
FAR = float(np.float32(np.finfo(np.float32).max) / np.float32(100))


def window_masks(h: int, w: int, kernel: list[int], pad: list[int], stride: list[int], dilation: list[int],
                 device: torch.device):
    """Where each output's window centre lies in the map (1, H_out, W_out), where each window offset's
    neighbour does (K, H_out, W_out), and which offset is the centre (K, 1, 1)."""
    (kh, kw), (ph, pw), (sh, sw), (dh, dw) = kernel, pad, stride, dilation
    oh, ow = conv_out_size(h, kh, sh, ph, dh), conv_out_size(w, kw, sw, pw, dw)
    ys = torch.arange(oh, device=device).reshape(1, oh, 1) * sh - ph
    xs = torch.arange(ow, device=device).reshape(1, 1, ow) * sw - pw
    iy = torch.arange(kh, device=device).repeat_interleave(kw).reshape(-1, 1, 1) * dh
    ix = torch.arange(kw, device=device).repeat(kh).reshape(-1, 1, 1) * dw
    cy, cx = ys + (kh // 2) * dh, xs + (kw // 2) * dw
    ny, nx = ys + iy, xs + ix
    return ((cy >= 0) & (cy < h) & (cx >= 0) & (cx < w), (ny >= 0) & (ny < h) & (nx >= 0) & (nx < w),
            (iy == (kh // 2) * dh) & (ix == (kw // 2) * dw))


def im2dist_masks(h: int, w: int, kernel: list[int], pad: list[int], stride: list[int], dilation: list[int],
                  remove_center: bool, remove_bounds: bool, device: torch.device):
    """(zero, far) masks of shape (K, H_out, W_out): where the fork writes 0 and where FLT_MAX / 100."""
    centre_in, neighbour_in, is_centre = window_masks(h, w, kernel, pad, stride, dilation, device)
    far = centre_in & ((is_centre & remove_center) | (~neighbour_in & remove_bounds))
    zero = ~centre_in | (~neighbour_in & ~far)
    return zero, far


def window_views(x, kernel: list[int], pad: list[int], stride: list[int], dilation: list[int]):
    """(centre, [neighbour at each window offset, row by row]) of the zero-padded x, each (N, C, H_out, W_out)."""
    (kh, kw), (ph, pw), (sh, sw), (dh, dw) = kernel, pad, stride, dilation
    h, w = x.shape[2], x.shape[3]
    oh, ow = conv_out_size(h, kh, sh, ph, dh), conv_out_size(w, kw, sw, pw, dw)
    xp = F.pad(x, (pw, pw, ph, ph))
    views = [xp[:, :, i * dh:i * dh + sh * (oh - 1) + 1:sh, j * dw:j * dw + sw * (ow - 1) + 1:sw]
             for i in range(kh) for j in range(kw)]
    return views[(kh // 2) * kw + kw // 2], views


def im2dist(x, kernel: list[int], pad: list[int], stride: list[int], dilation: list[int], l2: bool,
            remove_center: bool, remove_bounds: bool, far_value: float):
    """segaware's Im2dist of an (N, C, H, W) embedding map: (N, K, H_out, W_out)."""
    c, h, w = x.shape[1:]
    centre, views = window_views(x, kernel, pad, stride, dilation)
    rows = []
    for view in views:
        d = centre - view
        t = d * d * 0.5 if l2 else d.abs()
        acc = t[:, 0]
        for ci in range(1, c):          # channel by channel, as the fork adds them
            acc = acc + t[:, ci]
        rows.append(acc)
    y = torch.stack(rows, 1)
    zero, far = im2dist_masks(h, w, kernel, pad, stride, dilation, remove_center, remove_bounds, x.device)
    y = torch.where(zero, torch.zeros_like(y), y)
    return torch.where(far, torch.full_like(y, far_value), y)


def im2parity(x, kernel: list[int], pad: list[int], stride: list[int], dilation: list[int], ignore: float | None):
    """segaware's Im2parity of an (N, C, H, W) label map (the last channel decides): (N, K, H_out, W_out)."""
    labels = torch.trunc(x[:, -1:])                 # read as int; outside the map, label 0 (the zero pad)
    centre, views = window_views(labels, kernel, pad, stride, dilation)
    rows = []
    for view in views:
        same = (view == centre).to(x.dtype)
        if ignore is not None:
            same = torch.where((view == ignore) | (centre == ignore), torch.full_like(same, ignore), same)
        rows.append(same[:, 0])
    y = torch.stack(rows, 1)
    if ignore is not None:   # a centre outside the map
        centre_in, _, _ = window_masks(x.shape[2], x.shape[3], kernel, pad, stride, dilation, x.device)
        y = torch.where(centre_in, y, torch.full_like(y, ignore))
    return y


def onnx_window_views(ctx, x, h, w, kernel, pad, stride, dilation, name=None):
    """(centre, [neighbours]) as Slice nodes of the zero-padded x (an H x W map), like window_views."""
    (kh, kw), (ph, pw), (sh, sw), (dh, dw) = kernel, pad, stride, dilation
    oh, ow = conv_out_size(h, kh, sh, ph, dh), conv_out_size(w, kw, sw, pw, dw)
    xp = ctx.op("Pad", [x, ctx.i64([0, 0, ph, pw, 0, 0, ph, pw])], "padded", name=name)
    views = [ctx.op("Slice", [xp, ctx.i64([i * dh, j * dw]),
                              ctx.i64([i * dh + sh * (oh - 1) + 1, j * dw + sw * (ow - 1) + 1]),
                              ctx.i64([2, 3]), ctx.i64([sh, sw])], f"win{i}_{j}")
             for i in range(kh) for j in range(kw)]
    return views[(kh // 2) * kw + kw // 2], views


def onnx_im2dist(ctx, x, h, w, kernel, pad, stride, dilation, l2, remove_center, remove_bounds, name=None):
    """Im2dist of x (an H x W map) in ONNX: the distances summed with ReduceSum, then the fork's 0 and far."""
    from .norm import onnx_reduce
    centre, views = onnx_window_views(ctx, x, h, w, kernel, pad, stride, dilation, name=name)
    rows = []
    for k, view in enumerate(views):
        d = ctx.op("Sub", [centre, view], f"d{k}")
        t = ctx.op("Mul", [ctx.op("Mul", [d, d], f"sq{k}"), ctx.f32(0.5)], f"half{k}") if l2 \
            else ctx.op("Abs", [d], f"abs{k}")
        rows.append(onnx_reduce(ctx, "ReduceSum", t, [1], True))
    y = ctx.op("Concat", rows, "dists", axis=1)
    zero, far = im2dist_masks(h, w, kernel, pad, stride, dilation, remove_center, remove_bounds, torch.device("cpu"))
    y = ctx.op("Where", [ctx.const(zero.numpy()[None]), ctx.f32(0.0), y], "zeroed")
    return ctx.op("Where", [ctx.const(far.numpy()[None]), ctx.f32(FAR), y], "dist")


class _WindowLayer(Layer):
    """Convolution's window over a 2-D map, one top channel per window offset."""

    def window_attrs(self, lp):
        need_blobs(lp, lp.type, 1, 1, in_place=False)
        p = lp.convolution_param
        if p.axis != 1:
            raise LayerError(f"{lp.type} runs with channels on axis 1, got convolution_param.axis {p.axis}")
        return {"kernel": list(spatial_params(p, 2, "kernel_size", None, min_value=1, pair_required=False)),
                "stride": list(spatial_params(p, 2, "stride", 1, min_value=1, pair_required=False)),
                "pad": list(spatial_params(p, 2, "pad", 0, min_value=0, pair_required=False)),
                "dilation": list(spatial_params(p, 2, "dilation", 1, allow_hw=False, min_value=1)),
                "type": lp.type}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) != 4:
            raise LayerError(f"{attrs['type']} runs on 2-D maps (N, C, H, W), got {list(s)}")
        out = [conv_out_size(s[2 + a], attrs["kernel"][a], attrs["stride"][a], attrs["pad"][a], attrs["dilation"][a])
               for a in range(2)]
        if min(out) < 1:
            raise LayerError(f"{attrs['type']}'s window does not fit the {s[2]}x{s[3]} map")
        return [(s[0], attrs["kernel"][0] * attrs["kernel"][1], out[0], out[1])]

    @staticmethod
    def geometry(a):
        return a["kernel"], a["pad"], a["stride"], a["dilation"]

    def onnx_windows(self, ctx, node, x):
        """(centre, [neighbours]) of x (sized as the layer's bottom), as onnx_window_views gives them."""
        _, _, h, w = ctx.shape(node.inputs[0])
        return onnx_window_views(ctx, x, h, w, *self.geometry(node.attrs), name=node.name)


@register_layer("Im2dist")
class Im2dist(_WindowLayer):
    def parse(self, lp):
        q = lp.im2dist_param
        return {**self.window_attrs(lp), "l2": int(q.norm) == 2, "remove_center": bool(q.remove_center),
                "remove_bounds": bool(q.remove_bounds)}

    def _args(self, a):
        return (*self.geometry(a), a["l2"], a["remove_center"], a["remove_bounds"])

    def forward(self, attrs, params, x):
        return im2dist(x, *self._args(attrs), FAR)

    def onnx(self, ctx, node):
        a = node.attrs
        _, _, h, w = ctx.shape(node.inputs[0])
        y = onnx_im2dist(ctx, node.inputs[0], h, w, *self.geometry(a), a["l2"], a["remove_center"],
                         a["remove_bounds"], name=node.name)
        ctx.add_node("Identity", [y], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        emit.uses("F")
        for helper in (conv_out_size, window_masks, im2dist_masks, window_views):
            emit.helper(helper)
        args = ", ".join(repr(v) for v in self._args(node.attrs))
        return f"{emit.helper(im2dist)}({emit.inputs[0]}, {args}, {FAR!r})"


@register_layer("Im2parity")
class Im2parity(_WindowLayer):
    def parse(self, lp):
        q = lp.im2parity_param
        return {**self.window_attrs(lp),
                "ignore": float(q.ignore_label) if q.HasField("ignore_label") else None}

    def infer(self, attrs, in_shapes):
        tops = super().infer(attrs, in_shapes)
        s = in_shapes[0]
        centre_in, _, _ = window_masks(s[2], s[3], *self.geometry(attrs), torch.device("cpu"))
        if attrs["ignore"] is None and not bool(centre_in.all()):
            raise LayerError("Im2parity without im2parity_param.ignore_label: windows whose centre lies outside "
                             "the map (the pad) would get the fork's uninitialized ignore label; set ignore_label")
        return tops

    def forward(self, attrs, params, x):
        return im2parity(x, *self.geometry(attrs), attrs["ignore"])

    def onnx(self, ctx, node):
        a = node.attrs
        x = node.inputs[0]
        c = ctx.shape(x)[1]
        last = ctx.op("Slice", [x, ctx.i64([c - 1]), ctx.i64([c]), ctx.i64([1])], "last", name=node.name)
        # Floor of |v| with v's sign is C's truncation (labels are whole numbers in practice)
        labels = ctx.trunc(last, "labels")
        centre, views = self.onnx_windows(ctx, node, labels)
        rows = []
        for k, view in enumerate(views):
            same = ctx.op("Cast", [ctx.op("Equal", [view, centre], f"eq{k}")], f"same{k}", to=1)
            if a["ignore"] is not None:
                ign = ctx.f32(a["ignore"])
                hit = ctx.op("Or", [ctx.op("Equal", [view, ign], f"vi{k}"), ctx.op("Equal", [centre, ign], f"ci{k}")],
                             f"ign{k}")
                same = ctx.op("Where", [hit, ign, same], f"kept{k}")
            rows.append(same)
        y = ctx.op("Concat", rows, "parity", axis=1)
        if a["ignore"] is None:
            ctx.add_node("Identity", [y], [node.outputs[0]])
            return
        _, _, h, w = ctx.shape(x)
        centre_in, _, _ = window_masks(h, w, *self.geometry(a), torch.device("cpu"))
        ctx.add_node("Where", [ctx.const(centre_in.numpy()[None]), y, ctx.f32(a["ignore"])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        emit.uses("F")
        for helper in (conv_out_size, window_masks, window_views):
            emit.helper(helper)
        args = ", ".join(repr(v) for v in (*self.geometry(node.attrs), node.attrs["ignore"]))
        return f"{emit.helper(im2parity)}({emit.inputs[0]}, {args})"


def im2col_bottom_conv(x, weight, bias, groups: int):
    """segaware's Convolution on an im2col bottom: a grouped 1x1 convolution with the flattened weights."""
    return F.conv2d(x, weight.reshape(weight.shape[0], -1, 1, 1), bias, groups=groups)


@claim_layers("Convolution", lambda lp: lp.convolution_param.bottom_is_im2col)
class Im2colBottomConvolution(Layer):
    blob_names = ("weight", "bias")
    weight_axes = {0: 0}

    def parse(self, lp):
        need_blobs(lp, "Convolution", 1, 1)
        p = lp.convolution_param
        if p.axis != 1 or p.num_output < 1 or p.group < 1:
            raise LayerError("Convolution with bottom_is_im2col needs channels on axis 1, num_output and group >= 1")
        kernel = spatial_params(p, 2, "kernel_size", None, min_value=1, pair_required=False)
        return {"num_output": int(p.num_output), "group": int(p.group), "bias_term": bool(p.bias_term),
                "kernel": list(kernel)}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        k = attrs["kernel"][0] * attrs["kernel"][1]
        if len(s) != 4 or s[1] % (k * attrs["group"]) or attrs["num_output"] % attrs["group"]:
            raise LayerError(f"Convolution with bottom_is_im2col takes im2col columns (N, C x {k}, H, W) whose "
                             f"channels group {attrs['group']} divides (and num_output too), got {list(s)}")
        return [(s[0], attrs["num_output"], s[2], s[3])]

    def param_shapes(self, attrs, in_shapes):
        c = in_shapes[0][1] // (attrs["kernel"][0] * attrs["kernel"][1] * attrs["group"])
        weight = (attrs["num_output"], c) + tuple(attrs["kernel"])
        return [weight, (attrs["num_output"],)] if attrs["bias_term"] else [weight]

    def macs(self, attrs, in_shapes, out_shapes):
        s = in_shapes[0]
        return s[0] * s[2] * s[3] * attrs["num_output"] * (s[1] // attrs["group"])

    def forward(self, attrs, params, x):
        return im2col_bottom_conv(x, params[0], params[1] if attrs["bias_term"] else None, attrs["group"])

    def onnx(self, ctx, node):
        a = node.attrs
        w = ctx.op("Reshape", [ctx.weight(node, 0), ctx.i64([a["num_output"], -1, 1, 1])], "w1x1", name=node.name)
        ins = [node.inputs[0], w] + ([ctx.weight(node, 1)] if a["bias_term"] else [])
        ctx.add_node("Conv", ins, [node.outputs[0]], group=a["group"], kernel_shape=[1, 1])

    def pytorch_source(self, node, emit):
        a = node.attrs
        emit.uses("F")
        m = emit.module("torch.nn.ParameterDict()")
        emit.init(f"{m}['weight'] = torch.nn.Parameter(torch.zeros{tuple(node.blobs[0].shape)!r})")
        emit.param("weight", 0)
        bias = "None"
        if a["bias_term"]:
            emit.init(f"{m}['bias'] = torch.nn.Parameter(torch.zeros({a['num_output']}))")
            emit.param("bias", 1)
            bias = f"{m}['bias']"
        return f"{emit.helper(im2col_bottom_conv)}({emit.inputs[0]}, {m}['weight'], {bias}, {a['group']})"
