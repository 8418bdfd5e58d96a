"""qingyang-jiandao/jiandao-caffe (f85daa5), the Caffe of the jiandao-ocr text recognisers (a perspective
spatial transformer, then CTC or attention decoding).  Read from its src/caffe/proto/caffe.proto and layers.

- SpatialTransformerPT (st_pt_layer.cpp / .cu, include/caffe/st_pt_layer.hpp; st_param): bottoms the image U
  (N, C, H, W) and theta, whose values per item fill, in order, the entries of the 3 x 3 matrix
  [[t11 t12 t13] [t21 t22 t23] [t31 t32 t33]] that st_param does not fix (theta_1_1 ... theta_3_3, kept as
  float32), so bottom 1 holds 9 minus that many values per item (the fork's CHECK) and N items.  The top is
  (N, C, output_H, output_W): output_H and output_W only when both are set and non-zero (Reshape), else H and W.
  Output pixel (s, t) has the target coordinates gs = s / output_H * 2 - 1, gt = t / output_W * 2 - 1 (double,
  stored as float32); with (a, b, c) = the matrix times (gs, gt, 1), it reads the image at
      x = (a / c + 1) / 2 * H      (a row),      y = (b / c + 1) / 2 * W      (a column),
  from the taps (floor x, floor y), (+1, 0), (0, +1), (+1, +1) added in that order to 0, each weighted
  (1 - |x - m|)(1 - |y - n|) as the kernel writes them; a tap outside the image adds nothing.  That is the GPU
  kernel (SpatialTransformerPTForwardGPU), the one that trains (the CPU backward stops on a CHECK), and the
  only forward that reads the fixed entries: the CPU forward would read theta as 9 values per item whatever
  st_param fixes.  Where c is 0, a / c is infinite (no tap inside: 0) or NaN; a NaN coordinate turns into tap
  index 0 (CUDA's float-to-int conversion) and gives NaN.  to_compute_dU: false leaves the image without a
  gradient (detached here).  The fork's transform_type and sampler_type CHECKs allow "affine" and "bilinear" only.
- Interp with interp_param.scale_factor_h and scale_factor_w (interp_layer.cpp): DeepLab's Interp, whose
  size rules (shrink alone, zoom alone, height and width, shrink and zoom) come first; then, with both scale
  factors set, the output is (H_eff - 1) x scale_factor_h + 1 rows (and likewise columns), computed in
  float32 and truncated to an int; then the second bottom's size.  The resize is interp.py's.
- LSTMNode with lstmnode_param (lstm_node_layer.cpp / .cu; the fork's own message, num_cells, bias_term and
  fillers): updown_captioner.py's LSTMNode step, whose forward the fork shares (gate rows i, f, o, g).
- AttLSTM (attention_lstm_layer.cpp, att_recurrent_layer.cpp / .cu; recurrent_param num_cells, num_output):
  an attention decoder that the fork unrolls into an inner net (its `#if 1` branch; the `#else` one is not
  compiled).  Bottoms x (N, S, C, ...) and y (N, L); blobs, in the inner net's order: W_x (num_cells, K) with K
  = C x the axes after C, the embedding E (num_output, num_cells), W_s (num_cells, num_cells), w_a (1,
  num_cells), the LSTMNode's W (4 num_cells, C + num_cells) and b (4 num_cells), the classifier W_p
  (num_output, num_cells) and b_p (num_output).  h_0 = c_0 = 0; per step t = 1 .. T:
      e = tanh(x W_x^T + h_{t-1} W_s^T)   (N, S, num_cells)      alpha = softmax over S of (e w_a^T)
      context = sum over s (and the axes after C) of alpha_s x_s     (N, C)
      h_t, c_t = LSTMNode([context, E[y_t]], c_{t-1})      out_t = h_t W_p^T + b_p
  At TRAIN (the fork tests phase != TEST), T = L and y_t = y[:, t - 1] (the labels, teacher forcing); top 0 is
  the out_t side by side, (N, T x num_output).  At TEST, T = S, y_1 = y[:, 0], each out_t goes through a softmax
  over the classes and y_{t+1} is its argmax (equal values: the highest index, as Caffe's ArgMax); top 0 is
  those probabilities.
  TEST's inner Reshape of h W_s^T to (num_cells) needs N = 1, and its Concat needs y (N, 1).  The fork's
  Embed takes an index by truncation and replaces y's last axis of 1; an index outside [0, num_output) is
  refused (the fork reads past the table).  The fork gives one output blob: a second top is never shaped (an
  empty blob, (0,) here).
"""
import dataclasses

import numpy as np
import torch
from torch import nn

from ..errors import DataError
from ..io.schema import caffe_pb2
from .interp import InterpLayer
from .misc import eager_checks
from .norm import onnx_reduce
from .optical_flow import bilinear_taps, pixels_at
from .registry import (
    Layer,
    LayerError,
    claim_layers,
    count,
    four_axes,
    need_blobs,
    positive_field,
    register_layer,
    torch_sources,
)
from .spatial_transformer import onnx_theta_entries, st_full_theta, target_grid
from .updown_captioner import LSTMNode, lstm_node
from .warp_onnx import OnnxImageSampler

# ---- SpatialTransformerPT ------------------------------------------------------------------------

#: st_param's fixed-entry fields of the 3 x 3 matrix, in the order theta's values fill it
PT_THETA_FIELDS = ("theta_1_1", "theta_1_2", "theta_1_3", "theta_2_1", "theta_2_2", "theta_2_3",
                   "theta_3_1", "theta_3_2", "theta_3_3")


def st_pt_transform(image, theta, out_h: int, out_w: int, fixed: list[float | None], image_grad: bool):
    """jiandao-caffe's SpatialTransformerPT forward (its GPU kernel): perspective grid, bilinear taps."""
    if not image_grad:
        image = image.detach()
    n, h, w = image.shape[0], image.shape[2], image.shape[3]
    m = st_full_theta(theta, fixed).to(image.dtype).reshape(n, 9, 1, 1, 1)
    gs = target_grid(out_h, image.device).to(image.dtype).reshape(1, 1, out_h, 1)
    gt = target_grid(out_w, image.device).to(image.dtype).reshape(1, 1, 1, out_w)
    a = m[:, 0] * gs + m[:, 1] * gt + m[:, 2]
    b = m[:, 3] * gs + m[:, 4] * gt + m[:, 5]
    c = m[:, 6] * gs + m[:, 7] * gt + m[:, 8]
    x = (a / c + 1) / 2 * h        # (N, 1, out_h, out_w): rows
    y = (b / c + 1) / 2 * w        # columns
    return bilinear_taps(image, x, y, True)


TORCH_ST_PT = torch_sources(target_grid, st_full_theta, pixels_at, bilinear_taps, st_pt_transform)


@register_layer("SpatialTransformerPT")
class SpatialTransformerPT(Layer):
    def parse(self, lp):
        # the kernel zeroes its top before reading the image: in place it would read zeros
        need_blobs(lp, "SpatialTransformerPT", 2, 1, "image, theta", in_place=False)
        p = lp.st_param
        for field, want in (("transform_type", "affine"), ("sampler_type", "bilinear")):
            if getattr(p, field) != want:
                raise LayerError(f'SpatialTransformerPT: st_param.{field} must be "{want}" (the fork\'s CHECK), '
                                 f'got "{getattr(p, field)}"')
        size = None
        if p.HasField("output_H") and p.HasField("output_W") and p.output_H != 0 and p.output_W != 0:
            size = (positive_field(p.output_H, "st_param.output_H"), positive_field(p.output_W, "st_param.output_W"))
        fixed = tuple(float(np.float32(getattr(p, f))) if p.HasField(f) else None for f in PT_THETA_FIELDS)
        a = {"size": size, "fixed": fixed, "image_grad": bool(p.to_compute_dU)}
        if any(v is not None for v in fixed):
            a["reading_notes"] = ["SpatialTransformerPT with fixed st_param.theta entries: the fork's GPU forward "
                                  "(its CPU forward reads 9 theta values per item whatever st_param fixes)"]
        return a

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "SpatialTransformerPT", "image (bottom 0)")
        theta = tuple(in_shapes[1])
        given, fixed = count(theta, 1), sum(v is not None for v in attrs["fixed"])
        if given + fixed != 9:
            raise LayerError(f"SpatialTransformerPT's theta (bottom 1, {list(theta)}) gives {given} values per item "
                             f"and st_param fixes {fixed} entries: together they must make the 9 of the 3 x 3 matrix")
        if not theta or theta[0] != n:
            raise LayerError(f"SpatialTransformerPT's theta (bottom 1, {list(theta)}) must have the image's {n} items "
                             f"on axis 0")
        attrs["_out"] = attrs["size"] or (h, w)
        return [(n, c) + tuple(attrs["_out"])]

    def macs(self, attrs, in_shapes, out_shapes):
        return count(out_shapes[0]) * 4

    def forward(self, attrs, params, image, theta):
        return st_pt_transform(image, theta, *attrs["_out"], list(attrs["fixed"]), attrs["image_grad"])

    def onnx(self, ctx, node):
        image, theta = node.inputs
        out_h, out_w = node.attrs["_out"]
        fixed = node.attrs["fixed"]
        s = OnnxImageSampler(ctx, node.name, image)
        op, f32, i64 = s.op, s.f32, s.i64
        size = out_h * out_w
        coef = onnx_theta_entries(op, f32, i64, theta, fixed, sum(v is None for v in fixed))
        gs = ctx.const(np.repeat(target_grid(out_h, "cpu").numpy(), out_w).reshape(1, size), node.name + "_gs")
        gt = ctx.const(np.tile(target_grid(out_w, "cpu").numpy(), out_h).reshape(1, size), node.name + "_gt")

        def row(k, hint):   # entries 3k .. 3k + 2 applied to (gs, gt, 1): (N, size)
            return op("Add", [op("Add", [op("Mul", [coef[3 * k], gs], hint + "_gs"),
                                         op("Mul", [coef[3 * k + 1], gt], hint + "_gt")], hint + "_ab"),
                              coef[3 * k + 2]], hint)

        a, b, c = row(0, "a"), row(1, "b"), row(2, "c")

        def source(v, extent, hint):   # (v / c + 1) / 2 * extent, as (N, 1, out_h, out_w)
            v = op("Mul", [op("Div", [op("Add", [op("Div", [v, c], hint + "_p"), f32(1)], hint + "_p1"), f32(2)],
                                  hint + "_half"), f32(extent)], hint)
            return op("Reshape", [v, i64([0, 1, out_h, out_w])], hint + "_map")

        s.cuda_taps(source(a, s.h, "x"), source(b, s.w, "y"), node.outputs[0], (out_h, out_w))

    def pytorch_source(self, node, emit):
        a = node.attrs
        fn = emit.helper(TORCH_ST_PT)
        return (f"{fn}({emit.inputs[0]}, {emit.inputs[1]}, {a['_out'][0]}, {a['_out'][1]}, {list(a['fixed'])!r}, "
                f"{a['image_grad']})")


# ---- Interp with scale_factor_h / scale_factor_w ------------------------------------------------

def _scaled_interp(lp):
    p = lp.interp_param
    return p.HasField("scale_factor_h") or p.HasField("scale_factor_w")


@claim_layers("Interp", _scaled_interp)
class JiandaoInterp(InterpLayer):
    def parse(self, lp):
        need_blobs(lp, "Interp", (1, 2), roles="data, size reference")
        p = lp.interp_param
        others = [f for f in ("interp_type", "use_blob_size", "is_seglabel", "interp_ratio") if p.HasField(f)]
        if others:
            raise LayerError(f"interp_param.scale_factor_h/_w (jiandao-caffe's Interp) and {', '.join(others)} come "
                             f"from different forks")
        if p.pad_beg > 0 or p.pad_end > 0:
            raise LayerError("interp_param.pad_beg/pad_end must be <= 0 (the fork only crops)")
        for field in ("zoom_factor", "shrink_factor"):
            if p.HasField(field) and getattr(p, field) < 1:
                raise LayerError(f"interp_param.{field} must be >= 1, got {getattr(p, field)}")
        both = p.HasField("height") and p.HasField("width")
        scale = (float(np.float32(p.scale_factor_h)), float(np.float32(p.scale_factor_w))) \
            if p.HasField("scale_factor_h") and p.HasField("scale_factor_w") else None
        a = {"pad_beg": int(p.pad_beg), "pad_end": int(p.pad_end), "type": "bilinear",
             "zoom": int(p.zoom_factor) if p.HasField("zoom_factor") else None,
             "shrink": int(p.shrink_factor) if p.HasField("shrink_factor") else None,
             "height": int(p.height) if both else None, "width": int(p.width) if both else None,
             "two_bottoms": len(lp.bottom) == 2, "zoom_multiplies": bool(p.zoom_multiplies), "scale": scale}
        if a["zoom"] is None and a["shrink"] is None and not both and scale is None and not a["two_bottoms"]:
            raise LayerError("Interp with only one of interp_param.scale_factor_h / scale_factor_w and nothing else "
                             "setting its size: the fork leaves the output size unset")
        return a

    @staticmethod
    def out_size(a, h, w, ref_hw=None):
        if a.get("scale") is None or a["zoom"] is not None or a["shrink"] is not None or a["height"] is not None:
            return InterpLayer.out_size(a, h, w, ref_hw)
        he, we = h + a["pad_beg"] + a["pad_end"], w + a["pad_beg"] + a["pad_end"]
        if he <= 0 or we <= 0:
            raise LayerError(f"cropping {a['pad_beg']}/{a['pad_end']} leaves nothing of a {h}x{w} input")
        # (int - 1) * float + 1 in float32, assigned to an int: truncated toward zero
        ho, wo = (int(np.float32(np.float32(n - 1) * np.float32(f)) + np.float32(1))
                  for n, f in ((he, a["scale"][0]), (we, a["scale"][1])))
        if ho <= 0 or wo <= 0:
            raise LayerError(f"interp_param.scale_factor_h/_w {a['scale'][0]:g}/{a['scale'][1]:g} give an output "
                             f"of {ho}x{wo} from {he}x{we}: it must be positive")
        return (he, we), (ho, wo)

    def pytorch_source(self, node, emit):
        a = node.attrs
        if a.get("scale") is not None:   # the size the scale factors give, written out as height and width
            s = emit.in_shape(0)
            ref = emit.in_shape(1)[2:] if a["two_bottoms"] else None
            _, (ho, wo) = self.out_size(a, s[2], s[3], ref)
            node = dataclasses.replace(node, attrs=dict(a, zoom=None, shrink=None, height=ho, width=wo, scale=None))
        return super().pytorch_source(node, emit)


# ---- LSTMNode with lstmnode_param ----------------------------------------------------------------

@claim_layers("LSTMNode", lambda lp: lp.HasField("lstmnode_param"))
class JiandaoLSTMNode(LSTMNode):
    def parse(self, lp):
        need_blobs(lp, "LSTMNode", (2, 3), 2, "x, c_prev (, cont)")
        p = lp.lstmnode_param
        return {"cells": positive_field(p.num_cells, "lstmnode_param.num_cells"), "bias_term": bool(p.bias_term)}


# ---- AttLSTM -------------------------------------------------------------------------------------

ATT_BLOBS = ("x_proj", "embed", "hidden_att", "predict_att", "lstm_weight", "lstm_bias", "predict_weight",
             "predict_bias")


def att_lstm_decode(x, y, w_x, embed, w_s, w_a, w_lstm, b_lstm, w_p, b_p, train: bool, steps: int):
    """AttLSTM's unrolled net (see the module docstring): x (N, S, C, ...), y (N, L) -> (N, steps x num_output)."""
    n, seq, chans = x.shape[0], x.shape[1], x.shape[2]
    cells = w_s.shape[0]
    x_proj = x.reshape(n, seq, -1) @ w_x.t()                          # (N, S, cells)
    feats = x.reshape(n, seq, chans, -1)
    h = torch.zeros((n, cells), dtype=x.dtype, device=x.device)
    c = torch.zeros((n, cells), dtype=x.dtype, device=x.device)
    ids = y[:, 0].long()
    outs = []
    for t in range(steps):
        if train:
            ids = y[:, t].long()                                          # static_cast<int>: truncated
        emb = embed[ids]                                                  # (N, cells)
        e = torch.tanh(x_proj + (h @ w_s.t()).unsqueeze(1))
        alpha = torch.softmax((e @ w_a.t()).reshape(n, seq), dim=1)
        context = (feats * alpha.reshape(n, seq, 1, 1)).sum(dim=(1, 3))     # (N, C)
        h, c = lstm_node(torch.cat([context, emb], dim=1), c, w_lstm, b_lstm)
        out = h @ w_p.t() + b_p
        if not train:
            out = torch.softmax(out, dim=1)
            ids = (out.shape[1] - 1) - out.flip(1).argmax(dim=1)          # ties: the highest index, as Caffe's
        outs.append(out)
    return torch.cat(outs, dim=1)


TORCH_ATT_LSTM = torch_sources(lstm_node, att_lstm_decode)


class AttLSTMDecoder(nn.Module):
    """model.py's AttLSTM: its eight blobs and att_lstm_decode."""

    def __init__(self, shapes: list, train: bool, steps: int):
        super().__init__()
        self.blobs = nn.ParameterList([nn.Parameter(torch.zeros(s)) for s in shapes])
        self.train_phase, self.steps = train, steps

    def forward(self, x, y):
        return att_lstm_decode(x, y, *self.blobs, self.train_phase, self.steps)


@register_layer("AttLSTM")
class AttLSTM(Layer):
    blob_names = ATT_BLOBS
    weight_axes = {0: 0, 1: 1, 2: 0, 3: 0, 4: 0, 6: 0}   # the embedding is (num_output, cells) as Embed's

    def parse(self, lp):
        p = lp.recurrent_param
        low = 2 + (2 if p.expose_hidden else 0)   # expose_hidden adds h_0 and c_0 as bottoms, never read
        need_blobs(lp, "AttLSTM", (low, low + 1), (1, 2), "x, y")
        if p.expose_hidden and len(lp.top) == 2:
            raise LayerError("AttLSTM with recurrent_param.expose_hidden and a second top: the fork's GPU forward "
                             "shares h_T into that top, which it never shaped (its ShareData CHECK fails)")
        phase = caffe_pb2.Phase.Name(lp.phase) if lp.HasField("phase") else None
        return {"cells": positive_field(p.num_cells, "recurrent_param.num_cells"),
                "outputs": positive_field(p.num_output, "recurrent_param.num_output"),
                "tops": len(lp.top), "phase": phase}

    def infer(self, attrs, in_shapes):
        x, y = tuple(in_shapes[0]), tuple(in_shapes[1])
        if len(x) < 3:
            raise LayerError(f"AttLSTM's x (bottom 0) needs at least 3 axes (N, S, C): its inner InnerProduct "
                             f"reads axis 2, got {list(x)}")
        if len(y) != 2 or y[0] != x[0]:
            raise LayerError(f"AttLSTM's y (bottom 1) must be 2-axis (N, L) with x's N = {x[0]}, got {list(y)}")
        train = attrs["phase"] != "TEST"   # the fork tests phase_ != TEST
        if not train and (x[0] != 1 or y[1] != 1):
            raise LayerError(f"AttLSTM at TEST needs N = 1 (its inner Reshape of the hidden projection to "
                             f"(num_cells)) and y (1, 1) (its Concat with the embedding), got x {list(x)}, y {list(y)}")
        steps = y[1] if train else x[1]
        if steps < 1:
            raise LayerError(f"AttLSTM runs {steps} steps (y's L at TRAIN, x's S at TEST): its output Concat needs 1")
        attrs["_train"], attrs["_steps"] = train, int(steps)
        return [(x[0], steps * attrs["outputs"])] + [(0,)] * (attrs["tops"] - 1)

    def param_shapes(self, attrs, in_shapes):
        x = tuple(in_shapes[0])
        nc, no = attrs["cells"], attrs["outputs"]
        return [(nc, count(x, 2)), (no, nc), (nc, nc), (1, nc), (4 * nc, x[2] + nc), (4 * nc,), (no, nc), (no,)]

    def macs(self, attrs, in_shapes, out_shapes):
        x = tuple(in_shapes[0])
        n, s, c, k = x[0], x[1], x[2], count(x, 2)
        nc, no = attrs["cells"], attrs["outputs"]
        step = n * (nc * nc + s * nc + s * k + (c + nc) * 4 * nc + nc * no)
        return n * s * k * nc + attrs["_steps"] * step

    def forward(self, attrs, params, x, y, *unread):
        train, steps = attrs["_train"], attrs["_steps"]
        if eager_checks() and y.numel():
            ids = (y if train else y[:, :1]).long()
            bad = (ids < 0) | (ids >= attrs["outputs"])
            if bool(bad.any()):
                raise DataError(f"AttLSTM: index {int(ids[bad][0])} of y is outside [0, {attrs['outputs']}) "
                                f"(recurrent_param.num_output, its Embed's input_dim)")
        top = att_lstm_decode(x, y, *params, train, steps)
        return top if attrs["tops"] == 1 else (top, x.new_zeros((0,)))

    def onnx(self, ctx, node):
        a = node.attrs
        x, y = node.inputs[:2]
        n, seq, chans = ctx.shape(x)[:3]
        k, nc, train = count(ctx.shape(x), 2), a["cells"], a["_train"]
        w_x, w_s, w_a, w_l, w_p = (ctx.weight(node, i, transpose=True) for i in (0, 2, 3, 4, 6))
        x_proj = ctx.op("MatMul", [ctx.op("Reshape", [x, ctx.i64([n, seq, k])], "rows", name=node.name), w_x],
                        "x_proj")
        feats = ctx.op("Reshape", [x, ctx.i64([n, seq, chans, k // chans])], "feats")
        ids = ctx.op("Cast", [y], "ids", to=7)   # INT64, truncated as static_cast<int>
        h = c = ctx.const(np.zeros((n, nc), np.float32), node.name + "_zeros")
        outs, step_ids = [], None
        for t in range(a["_steps"]):
            if train or t == 0:
                step_ids = ctx.op("Reshape", [ctx.op("Slice", [ids, ctx.i64([t]), ctx.i64([t + 1]), ctx.i64([1])],
                                                     f"y{t}"), ctx.i64([n])], f"id{t}")
            emb = ctx.op("Gather", [ctx.weight(node, 1), step_ids], f"emb{t}", axis=0)
            s_proj = ctx.op("Unsqueeze", [ctx.op("MatMul", [h, w_s], f"sproj{t}"), ctx.i64([1])], f"sproj{t}_u")
            e = ctx.op("Tanh", [ctx.op("Add", [x_proj, s_proj], f"sum{t}")], f"e{t}")
            score = ctx.op("Reshape", [ctx.op("MatMul", [e, w_a], f"score{t}"), ctx.i64([n, seq])], f"score{t}_r")
            alpha = ctx.op("Reshape", [ctx.op("Softmax", [score], f"alpha{t}", axis=1), ctx.i64([n, seq, 1, 1])],
                           f"alpha{t}_r")
            context = onnx_reduce(ctx, "ReduceSum", ctx.op("Mul", [feats, alpha], f"weighted{t}"), [1, 3], False)
            joined = ctx.op("Concat", [context, emb], f"cat{t}", axis=1)
            h, c = onnx_lstm_step(ctx, joined, c, w_l, ctx.weight(node, 5), nc, f"t{t}")
            out = ctx.op("Add", [ctx.op("MatMul", [h, w_p], f"pred{t}"), ctx.weight(node, 7)], f"logits{t}")
            if not train:
                out = ctx.op("Softmax", [out], f"prob{t}", axis=1)
                step_ids = ctx.op("ArgMax", [out], f"next{t}", axis=1, keepdims=0, select_last_index=1)
            outs.append(out)
        ctx.add_node("Concat", outs, [node.outputs[0]], axis=1)
        for extra in node.outputs[1:]:
            ctx.add_node("Identity", [ctx.const(np.zeros((0,), np.float32), node.name + "_empty")], [extra])

    def pytorch_source(self, node, emit):
        a = node.attrs
        shapes = [list(s) for s in node.expected_param_shapes]
        m = emit.instance(AttLSTMDecoder, shapes, a["_train"], a["_steps"], needs=(TORCH_ATT_LSTM,))
        for i in range(len(ATT_BLOBS)):
            emit.param(f"blobs.{i}", i)
        call = f"{m}({emit.inputs[0]}, {emit.inputs[1]})"
        if a["tops"] == 1:
            return call
        return [call, f"{emit.inputs[0]}.new_zeros((0,))"]


def onnx_lstm_step(ctx, x, c_prev, w_t, bias, cells, hint):
    """lstm_node in ONNX for (N, K) rows x, (N, cells) c_prev, the transposed weight (K, 4 cells) and the bias:
    -> (h, c) tensor names."""
    gates = ctx.op("Add", [ctx.op("MatMul", [x, w_t], hint + "_xw"), bias], hint + "_gates")

    def block(k, name):
        return ctx.op("Slice", [gates, ctx.i64([k * cells]), ctx.i64([(k + 1) * cells]), ctx.i64([1])],
                      f"{hint}_{name}")
    i, f, o = (ctx.op("Sigmoid", [block(k, name)], f"{hint}_{name}_s") for k, name in enumerate("ifo"))
    g = ctx.op("Tanh", [block(3, "g")], hint + "_g_t")
    c = ctx.op("Add", [ctx.op("Mul", [f, c_prev], hint + "_keep"), ctx.op("Mul", [i, g], hint + "_write")], hint + "_c")
    return ctx.op("Mul", [o, ctx.op("Tanh", [c], hint + "_tc")], hint + "_h"), c
