"""ConvLSTM: the convolutional LSTM of agethen's ConvLSTM-for-Caffe, as the video saliency forks
vendor it (DengPingFan/DAVSOD `mycaffe-convlstm`, d44e2f3; shenjianbing/PDB-ConvLSTM ships the same
fork as a .rar; wenguanwang/AGS uses the same fields).

The fork's conv_lstm_layer.cpp unrolls a Caffe net over time, as BVLC's RecurrentLayer does:

Bottoms: x (T x N x C_in x H x W), cont (T x N), and with `recurrent_param.expose_hidden` the initial
h_0 and c_0 (1 x N x C x H x W each, in that order).  Tops: h for every step (T x N x C x H x W),
one 1 x N x C x H x W top per `lstm_debug_param.expose` name ("h_t=k" / "c_t=k"), and with
expose_hidden h_T and c_T.  Without expose_hidden the initial states are zero at every Forward (the
fork's LayerSetUp drops the last two layers from the forward range, so the DummyForward copies that
would carry h_T and c_T over never run).

Per step t = 1..T (conv_lstm_layer.cpp FillUnrolledNet, conv_lstm_unit_layer.cu):
    pre   = W_h * (cont_t h_{t-1}) + b_h  +  W_x * x_t  +  [w_i c_{t-1}, w_f c_{t-1}, w_o c_{t-1}, 0]
    i = sigmoid(pre_i), f = cont_t sigmoid(pre_f), o = sigmoid(pre_o), g = tanh(pre_g)
    c_t = f c_{t-1} + i g,  h_t = o tanh(c_t)
`*` is a 2-D convolution (kernel, pad, stride, dilation, group of lstm_conv_param; the gates are
4 blocks of C channels in the order i, f, o, g).  The peephole ("Hadamard") terms are Scale layers
on c_{t-1} (not cont-gated; o's too reads c_{t-1}) with weights of shape
c.shape[axis_hadamard : axis_hadamard + num_axes_hadamard] of the 1 x N x C x H x W cell blob
(default 3, 2: H x W, shared by every channel).  lstm_debug_param.ignore_x drops the W_x term,
disable_hadamard the peephole terms.  Both convolutions must keep H x W (the fork's sums need it).

Blobs, in the order the unrolled net owns them: W_x (4C, C_in/group, kh, kw) [not with ignore_x],
two (1,) blobs of the DummyForward layers on the initial states, W_h (4C, C/group, kh, kw), b_h (4C)
[bias_term], w_i, w_f, w_o [not with disable_hadamard], and two (1,) blobs of the DummyForward
layers on h_T and c_T (dummy_forward.cpp gives each such layer an unused blob; the fork's caffemodels
hold all four).  W_x has no bias (the fork sets bias_term false on it).  The peepholes start at 1
without weights (Scale's default).

ConvLSTMReLU (t2mhanh/caffe_convLSTM_WTA 3b257ec, conv_lstm_relu_unit_layer.cpp) is the same layer with
g = max(pre_g, 0) and h_t = o max(c_t, 0).
"""
from __future__ import annotations

import re

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .conv import conv_out_size
from .recurrent import onnx_lstm_unit
from .registry import Layer, LayerError, need_blobs, register_layer, spatial_params

_EXPOSE = re.compile(r"^([hc])_t=(\d+|T)$")


# ---- the torch computation, shared by forward and model.py ------------------------------------

def conv_lstm_steps(x, cont, h, c, w_x, w_h, b_h, peep, conv_x, conv_h, peep_view, expose, relu: bool = False):
    """The fork's ConvLSTM over x (T, N, C_in, H, W) from h, c (N, C, H, W).

    conv_x / conv_h: (stride, pad, dilation, group) of the input / hidden convolutions; w_x None
    with ignore_x, peep [] with disable_hadamard, else (w_i, w_f, w_o) reshaped by peep_view.
    expose: (0 for h / 1 for c, step) pairs.  relu: ConvLSTMReLU's unit (relu where ConvLSTM has
    tanh).  Returns (h for every step, the exposed states, h_T, c_T), the states as (1, N, C, H, W)."""
    act = torch.relu if relu else torch.tanh
    steps, n = x.shape[0], x.shape[1]
    hd = h.shape[1]
    gx = None
    if w_x is not None:
        gx = F.conv2d(x.reshape(steps * n, x.shape[2], x.shape[3], x.shape[4]), w_x, None,
                      conv_x[0], conv_x[1], conv_x[2], conv_x[3])
        gx = gx.reshape(steps, n, gx.shape[1], gx.shape[2], gx.shape[3])
    weights = [w.reshape(peep_view)[0] for w in peep]
    hs, cs, outs = [h], [c], []
    for step in range(steps):
        ct = cont[step].reshape(n, 1, 1, 1)
        pre = F.conv2d(ct * h, w_h, b_h, conv_h[0], conv_h[1], conv_h[2], conv_h[3])
        if gx is not None:
            pre = pre + gx[step]
        pi, pf, po, pg = pre[:, :hd], pre[:, hd:2 * hd], pre[:, 2 * hd:3 * hd], pre[:, 3 * hd:]
        if weights:
            pi, pf, po = pi + c * weights[0], pf + c * weights[1], po + c * weights[2]
        c = ct * torch.sigmoid(pf) * c + torch.sigmoid(pi) * act(pg)
        h = torch.sigmoid(po) * act(c)
        hs.append(h)
        cs.append(c)
        outs.append(h)
    states = [(hs, cs)[which][step if step >= 0 else steps].unsqueeze(0) for which, step in expose]
    return [torch.stack(outs)] + states + [h.unsqueeze(0), c.unsqueeze(0)]


class CaffeConvLSTM(nn.Module):
    """The fork's ConvLSTM (see conv_lstm_steps): forward(x, cont, h0=None, c0=None) returns
    (h for every step, the exposed states, h_T, c_T)."""

    def __init__(self, c_in, c_out, k_x, k_h, conv_x, conv_h, bias, peep_shape, peep_view, expose, relu=False):
        super().__init__()
        g = 4 * c_out
        self.c_out, self.conv_x, self.conv_h = c_out, conv_x, conv_h
        self.peep_view, self.expose, self.relu = peep_view, expose, relu
        if k_x is not None:
            self.W_x = nn.Parameter(torch.zeros(g, c_in // conv_x[3], k_x[0], k_x[1]))
        else:
            self.register_parameter("W_x", None)
        self.W_h = nn.Parameter(torch.zeros(g, c_out // conv_h[3], k_h[0], k_h[1]))
        if bias:
            self.b_h = nn.Parameter(torch.zeros(g))
        else:
            self.register_parameter("b_h", None)
        self.peep = nn.ParameterList([nn.Parameter(torch.zeros(peep_shape)) for _ in range(3)]
                                     if peep_shape is not None else [])

    def forward(self, x, cont, h0: torch.Tensor | None = None, c0: torch.Tensor | None = None):
        n, hh, ww = x.shape[1], x.shape[3], x.shape[4]
        if h0 is not None and c0 is not None:
            h, c = h0[0], c0[0]
        else:
            h = x.new_zeros(n, self.c_out, hh, ww)
            c = h
        return conv_lstm_steps(x, cont, h, c, self.W_x, self.W_h, self.b_h, list(self.peep),
                               self.conv_x, self.conv_h, self.peep_view, self.expose, self.relu)


# ---- the spec --------------------------------------------------------------------------------

# why the fork's ConvLSTM reads only the repeated fields (another fork's spec passes its own reason)
_HELPER_COPIES = "conv_lstm_helper.hpp copies kernel_size, pad, stride, dilation only"


def _read_conv(p, which, field="lstm_conv_param", why_not_hw=_HELPER_COPIES):
    where = f"{field} ({which})" if field == "lstm_conv_param" else field
    for f in ("kernel_h", "kernel_w", "pad_h", "pad_w", "stride_h", "stride_w"):
        if p.HasField(f):
            raise LayerError(f"{where}: {f} is not read by the fork ({why_not_hw})")
    if len(p.kernel_size) == 0:
        raise LayerError(f"{where} needs kernel_size")
    kernel = spatial_params(p, 2, "kernel_size", 0, allow_hw=False, min_value=1)
    stride = spatial_params(p, 2, "stride", 1, allow_hw=False, min_value=1)
    pad = spatial_params(p, 2, "pad", 0, allow_hw=False)
    dilation = spatial_params(p, 2, "dilation", 1, allow_hw=False, min_value=1)
    if p.group < 1:
        raise LayerError(f"{where}: group must be >= 1, got {p.group}")
    return {"kernel": kernel, "stride": stride, "pad": pad, "dilation": dilation,
            "group": int(p.group), "bias": bool(p.bias_term)}


@register_layer("ConvLSTM")
class ConvLSTM(Layer):
    #: ConvLSTMReLU's unit (relu for tanh)
    relu = False

    def parse(self, lp):
        expose_hidden = bool(lp.recurrent_param.expose_hidden)
        dbg = lp.lstm_debug_param
        expose = []
        for name in dbg.expose:
            m = _EXPOSE.match(name)
            if not m:
                raise LayerError(f"lstm_debug_param.expose '{name}': caffeq reads the states "
                                 f"'h_t=k' and 'c_t=k' only")
            expose.append((0 if m.group(1) == "h" else 1, -1 if m.group(2) == "T" else int(m.group(2))))
        low = 2 + (2 if expose_hidden else 0)
        need_blobs(lp, self.types[0], (low, low + 1), 1 + len(expose) + (2 if expose_hidden else 0),
                   roles="x, cont" + (", h_0, c_0" if expose_hidden else ""))
        if len(lp.bottom) == low + 1:
            raise LayerError(f"{self.types[0]} with a static input (x_static) is not read")
        convs = list(lp.lstm_conv_param)
        if not 1 <= len(convs) <= 2:
            raise LayerError(f"{self.types[0]} takes 1 or 2 lstm_conv_param blocks, got {len(convs)}")
        if len(convs) == 2 and convs[0].num_output != convs[1].num_output:
            raise LayerError("the two lstm_conv_param blocks must have the same num_output, got "
                             f"{convs[0].num_output} and {convs[1].num_output}")
        if convs[0].num_output < 1:
            raise LayerError("lstm_conv_param.num_output must be >= 1")
        # conv_lstm_layer.cpp: the input transform takes block 0 unless its type is "hidden", the
        # hidden transform block 0 unless its type is "input" (then block 1 in both cases)
        x_p = convs[1] if convs[0].type == "hidden" and len(convs) == 2 else convs[0]
        h_p = convs[1] if convs[0].type == "input" and len(convs) == 2 else convs[0]
        ignore_x = bool(dbg.ignore_x)
        hadamard = not dbg.disable_hadamard
        return {"num_output": int(convs[0].num_output), "expose_hidden": expose_hidden,
                "expose": expose, "ignore_x": ignore_x, "hadamard": hadamard,
                "conv_x": None if ignore_x else _read_conv(x_p, "input"),
                "conv_h": _read_conv(h_p, "hidden"),
                "axis_hadamard": int(dbg.axis_hadamard), "num_axes_hadamard": int(dbg.num_axes_hadamard)}

    # -- shapes -------------------------------------------------------------------------------
    def _check(self, attrs, in_shapes):
        x, cont = tuple(in_shapes[0]), tuple(in_shapes[1])
        if len(x) != 5:
            raise LayerError(f"bottom[0] must be T x N x C x H x W, got {list(x)}")
        t, n, c_in, hh, ww = x
        if t < 1:
            raise LayerError(f"bottom[0] must hold at least one time step, got {list(x)}")
        if cont != (t, n):
            raise LayerError(f"bottom[1] (cont) must be T x N = {[t, n]}, got {list(cont)}")
        c = attrs["num_output"]
        for key, cin in (("conv_x", c_in), ("conv_h", c)):
            conv = attrs[key]
            if conv is None:
                continue
            what = "input" if key == "conv_x" else "hidden"
            if cin % conv["group"] or (4 * c) % conv["group"]:
                raise LayerError(f"lstm_conv_param ({what}): group {conv['group']} must divide "
                                 f"{cin} input and {4 * c} output channels")
            out = tuple(conv_out_size(n, conv["kernel"][i], conv["stride"][i], conv["pad"][i], conv["dilation"][i])
                        for i, n in enumerate((hh, ww)))
            if out != (hh, ww):
                raise LayerError(f"lstm_conv_param ({what}) turns {hh} x {ww} into {out[0]} x {out[1]}: "
                                 f"the fork's ConvLSTM needs convolutions that keep H x W")
        state = (1, n, c, hh, ww)
        if attrs["expose_hidden"]:
            for j in (2, 3):
                if tuple(in_shapes[j]) != state:
                    raise LayerError(f"bottom[{j}] (initial {'hc'[j - 2]}) must be {list(state)}, "
                                     f"got {list(in_shapes[j])}")
        for _, step in attrs["expose"]:
            if step > t:
                raise LayerError(f"lstm_debug_param.expose: step {step} is past T = {t}")
        return t, n, c_in, c, hh, ww

    def _peep_shape(self, attrs, state):
        a, k = attrs["axis_hadamard"], attrs["num_axes_hadamard"]
        if a + k > len(state):
            raise LayerError(f"lstm_debug_param: axis_hadamard {a} + num_axes_hadamard {k} > "
                             f"{len(state)} axes of the cell state")
        shape = tuple(state[a:a + k])
        view = (1,) * a + shape + (1,) * (len(state) - a - k)
        return shape, view

    def infer(self, attrs, in_shapes):
        t, n, _, c, hh, ww = self._check(attrs, in_shapes)
        state = (1, n, c, hh, ww)
        if attrs["hadamard"]:
            self._peep_shape(attrs, state)
        return [(t, n, c, hh, ww)] + [state] * (len(attrs["expose"]) + 2 * attrs["expose_hidden"])

    def blob_names_for(self, attrs):
        # the unrolled net's DummyForward layers own one unused (1,) blob each: after the initial
        # states' Input layer, and after the last step
        names = ([] if attrs["ignore_x"] else ["W_x"]) + ["dummy_c0", "dummy_h0", "W_h"]
        if attrs["conv_h"]["bias"]:
            names.append("b_h")
        if attrs["hadamard"]:
            names += ["w_i", "w_f", "w_o"]
        return tuple(names + ["dummy_h", "dummy_c"])

    def weight_axes_for(self, attrs):
        names = self.blob_names_for(attrs)
        return {names.index(w): 0 for w in ("W_x", "W_h") if w in names}

    def init_params(self, attrs, shapes, rng):
        blobs = super().init_params(attrs, shapes, rng)
        for i, name in enumerate(self.blob_names_for(attrs)):
            if name.startswith("w_"):   # the peepholes' Scale layers start at 1
                blobs[i] = np.ones(shapes[i], np.float32)
        return blobs

    def param_shapes(self, attrs, in_shapes):
        _, n, c_in, c, hh, ww = self._check(attrs, in_shapes)
        shapes = []
        if not attrs["ignore_x"]:
            cx = attrs["conv_x"]
            shapes.append((4 * c, c_in // cx["group"]) + cx["kernel"])
        ch = attrs["conv_h"]
        shapes += [(1,), (1,), (4 * c, c // ch["group"]) + ch["kernel"]]
        if ch["bias"]:
            shapes.append((4 * c,))
        if attrs["hadamard"]:
            shapes += [self._peep_shape(attrs, (1, n, c, hh, ww))[0]] * 3
        return shapes + [(1,), (1,)]

    def macs(self, attrs, in_shapes, out_shapes):
        t, n, c_in, c, hh, ww = self._check(attrs, in_shapes)
        per_pixel = 0
        for conv, cin in ((attrs["conv_x"], c_in), (attrs["conv_h"], c)):
            if conv is not None:
                per_pixel += 4 * c * (cin // conv["group"]) * conv["kernel"][0] * conv["kernel"][1]
        return t * n * hh * ww * per_pixel

    # -- running ------------------------------------------------------------------------------
    @staticmethod
    def _conv_args(conv):
        return None if conv is None else (conv["stride"], conv["pad"], conv["dilation"], conv["group"])

    def _split(self, attrs, params):
        named = dict(zip(self.blob_names_for(attrs), params))
        return (named.get("W_x"), named["W_h"], named.get("b_h"),
                [named[w] for w in ("w_i", "w_f", "w_o") if w in named])

    def _view(self, attrs, n, c, hh, ww):
        return self._peep_shape(attrs, (1, n, c, hh, ww))[1] if attrs["hadamard"] else None

    def forward(self, attrs, params, *inputs):
        x, cont = inputs[0], inputs[1]
        w_x, w_h, b_h, peep = self._split(attrs, params)
        n, c, hh, ww = x.shape[1], attrs["num_output"], x.shape[3], x.shape[4]
        if attrs["expose_hidden"]:
            h, c0 = inputs[2][0], inputs[3][0]
        else:
            h = c0 = x.new_zeros(n, c, hh, ww)
        view = self._view(attrs, n, c, hh, ww)
        tops = conv_lstm_steps(x, cont.to(x.dtype), h, c0, w_x, w_h, b_h, peep,
                               self._conv_args(attrs["conv_x"]), self._conv_args(attrs["conv_h"]),
                               view, attrs["expose"], self.relu)
        if not attrs["expose_hidden"]:
            tops = tops[:-2]
        return tops[0] if len(tops) == 1 else tuple(tops)

    def pytorch_source(self, node, emit):
        a = node.attrs
        t, n, c_in, hh, ww = emit.in_shape(0)
        c = a["num_output"]
        peep_shape, view = (self._peep_shape(a, (1, n, c, hh, ww)) if a["hadamard"] else (None, None))
        m = emit.instance(CaffeConvLSTM, c_in, c, None if a["ignore_x"] else a["conv_x"]["kernel"],
                          a["conv_h"]["kernel"], self._conv_args(a["conv_x"]), self._conv_args(a["conv_h"]),
                          a["conv_h"]["bias"], peep_shape, view, [tuple(e) for e in a["expose"]], self.relu,
                          needs=[conv_lstm_steps])
        for i, name in enumerate(self.blob_names_for(a)):
            if not name.startswith("dummy"):   # the DummyForward blobs take no part
                emit.param(name if not name.startswith("w_") else f"peep.{'ifo'.index(name[2])}", i)
        call = [emit.inputs[0], f"{emit.inputs[1]}.to({emit.inputs[0]}.dtype)"]
        if a["expose_hidden"]:
            call += [f"h0={emit.inputs[2]}", f"c0={emit.inputs[3]}"]
        out = emit.tmp("conv_lstm")
        emit.stmt(f"{out} = {m}({', '.join(call)})")
        tops = len(node.outputs)
        return [f"{out}[{i}]" for i in range(tops)] if tops > 1 else f"{out}[0]"

    def onnx(self, ctx, node):
        _onnx_unrolled(ctx, node, self)


# ---- ONNX: the steps unrolled (T is fixed by the net) -----------------------------------------

def _onnx_unrolled(ctx, node, spec):
    a = node.attrs
    name = node.name
    x, cont = node.inputs[0], node.inputs[1]
    t, n, c_in, hh, ww = ctx.shape(x)
    c = a["num_output"]

    def tmp(hint):
        return ctx.tmp(f"{name}_{hint}")

    def conv_attrs(conv):
        pads = list(conv["pad"]) * 2
        return dict(kernel_shape=list(conv["kernel"]), strides=list(conv["stride"]), pads=pads,
                    dilations=list(conv["dilation"]), group=conv["group"])

    index = {name: i for i, name in enumerate(spec.blob_names_for(a))}
    gx = None
    if not a["ignore_x"]:
        x4 = ctx.add_node("Reshape", [x, ctx.i64([-1, c_in, hh, ww])], tmp("x4"))
        gx4 = ctx.add_node("Conv", [x4, ctx.weight(node, index["W_x"])], tmp("gx4"), name=name,
                           **conv_attrs(a["conv_x"]))
        gx = ctx.add_node("Reshape", [gx4, ctx.i64([t, -1, 4 * c, hh, ww])], tmp("gx"))
    w_h = [ctx.weight(node, index["W_h"])] + ([ctx.weight(node, index["b_h"])] if "b_h" in index else [])
    peep = []
    if a["hadamard"]:
        view = spec._peep_shape(a, (1, n, c, hh, ww))[1][1:]
        peep = [ctx.add_node("Reshape", [ctx.weight(node, index[w]), ctx.i64(list(view))], tmp(f"peep{k}"))
                for k, w in enumerate(("w_i", "w_f", "w_o"))]
    state = [-1, c, hh, ww]
    if a["expose_hidden"]:
        h = ctx.add_node("Reshape", [node.inputs[2], ctx.i64(state)], tmp("h0"))
        cc = ctx.add_node("Reshape", [node.inputs[3], ctx.i64(state)], tmp("c0"))
    else:
        shape = ctx.add_node("Shape", [x], tmp("shape"))
        nn_ = ctx.add_node("Gather", [shape, ctx.i64([1])], tmp("n"), axis=0)
        dims = ctx.add_node("Concat", [nn_, ctx.i64([c, hh, ww])], tmp("dims"), axis=0)
        h = ctx.add_node("ConstantOfShape", [dims], tmp("zeros"))
        cc = h
    hs, cs, outs = [h], [cc], []
    for step in range(t):
        s = ctx.i64(step)
        ct = ctx.add_node("Gather", [cont, s], tmp(f"cont{step}"), axis=0)
        ct = ctx.add_node("Reshape", [ct, ctx.i64([-1, 1, 1, 1])], tmp(f"cont{step}_col"))
        hc = ctx.add_node("Mul", [ct, h], tmp(f"h_conted{step}"))
        pre = ctx.add_node("Conv", [hc] + w_h, tmp(f"hidden{step}"), **conv_attrs(a["conv_h"]))
        if gx is not None:
            gxt = ctx.add_node("Gather", [gx, s], tmp(f"gx{step}"), axis=0)
            pre = ctx.add_node("Add", [pre, gxt], tmp(f"pre{step}"))
        g5 = ctx.add_node("Reshape", [pre, ctx.i64([-1, 4, c, hh, ww])], tmp(f"gates{step}"))
        parts = [ctx.add_node("Gather", [g5, ctx.i64(k)], tmp(f"gate{step}_{k}"), axis=1) for k in range(4)]
        if peep:
            for k in range(3):
                term = ctx.add_node("Mul", [cc, peep[k]], tmp(f"peep{step}_{k}"))
                parts[k] = ctx.add_node("Add", [parts[k], term], tmp(f"gate{step}_{k}_peep"))
        h, cc = onnx_lstm_unit(lambda op, ins, hint: ctx.add_node(op, ins, tmp(hint)), parts, ct, cc, str(step),
                               "Relu" if spec.relu else "Tanh")
        hs.append(h)
        cs.append(cc)
        outs.append(ctx.add_node("Reshape", [h, ctx.i64([1, -1, c, hh, ww])], tmp(f"h{step}_5d")))
    if len(outs) == 1:
        ctx.add_node("Identity", outs, [node.outputs[0]])
    else:
        ctx.add_node("Concat", outs, [node.outputs[0]], axis=0)
    states = [(hs, cs)[which][step if step >= 0 else t] for which, step in a["expose"]]
    if a["expose_hidden"]:
        states += [h, cc]
    one = [1, -1, c, hh, ww]
    for out, st in zip(node.outputs[1:], states):
        ctx.add_node("Reshape", [st, ctx.i64(one)], [out])


@register_layer("ConvLSTMReLU")
class ConvLSTMReLU(ConvLSTM):
    """t2mhanh/caffe_convLSTM_WTA's ConvLSTMReLU (3b257ec, conv_lstm_relu_unit_layer.cpp): the same
    unrolled net, blobs and fields, with g = max(pre_g, 0) and h = o max(c, 0)."""
    relu = True
