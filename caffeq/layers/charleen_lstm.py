"""Charleen777/caffecode's grid-LSTM segmentation layers (commit aa51cdd; src/caffe/proto/caffe.proto,
src/caffe/layers/transpose_layer.cpp / .cu, lstm_unit_layer.cpp / .cu, zeros_data_layer.cpp).  Its DeepLab /
FCN nets turn a feature map into one LSTM step per pixel, each pixel's cell fed by its 8 neighbours.

- Transpose with transposetype LSTMINPUT / LSTMOUTPUT / GRIDLSTM / GRIDLSTMSUM (the fork's 0-3, 2-5 here:
  LSTM-CF's Transpose has 0 and 1; transpose_param batch_size [1], local_connected_num [8], height [77]).
  Per the CPU code (the GPU forward of all but LSTMINPUT calls it; LSTMINPUT's cublas transpose, image by
  image, gives the same values):
      LSTMINPUT    bottom (num, C, H, W) by the legacy accessors -> top (num * H * W, C),
                   top[n * S + i, c] = bottom[n, c, i], S = H * W (pixel i = h * W + w);
      LSTMOUTPUT   bottom (M, C, ...) -> top (batch_size, C, height, M / batch_size / height),
                   top[n, c, i] = bottom[n * S + i, c], S = height * that width; the counts must agree;
      GRIDLSTM     bottom (M, C) -> top (M, C) zero-filled; with S = M / batch_size, E = C / 8 and the
                   neighbour offsets d = (-h-1, -h, -h+1, -1, +1, h-1, h, h+1) (h = `height`), for each
                   image n, pixel i and k in 0..7 with 0 < i + d[k] < S (index 0 is never read):
                   top[n, i, k * E + e] = bottom[n, i + d[k], (7 - k) * E + e]  (e < E);
                   offsets are in the flattened pixel index, so +-1 wraps across rows;
      GRIDLSTMSUM  bottom (M, C) -> top (M, C / 8), zero-filled, then for the same neighbours
                   top[i, e] += bottom[i + d[k], k * 8 + e] (the fork strides the blocks by
                   local_connected_num, not E), k = 0..7 in order.
  local_connected_num must be 8 (the fork's CHECK_EQ) for GRIDLSTM / GRIDLSTMSUM.  caffeq refuses, as
  LayerErrors: M not a multiple of batch_size; GRIDLSTMSUM with batch_size > 1 (image n > 0 is written at
  n * S * C, past the top's n * S * C / 8 values); GRIDLSTMSUM where k * 8 + e reaches past a pixel's C
  values (56 + E > C: reads cross into the next pixel's row).
- LstmUnit (lstm_unit_param num_cells, four gate fillers): bottoms x (M, K) and c_prev (M, N), four bias-free
  blobs (1, N, 1, K): input values, input gate, forget gate, output gate.  With g = x W^T per blob, as the
  fork's GPU forward (lstm_unit_layer.cu; its solvers all run in GPU mode, so the nets were trained so):
      i = sig(g_i), f = sig(0 - g_o), o = sig(g_o), u = tanh5(g_u),  c = c_prev * f + i * u,  h = c * o
  (no tanh on c; the forget gate is tied to the output gate's pre-activation, its own blob 2 is loaded and never
  read; the CPU forward would use sig(g_f)), sig(x) = 1 / (1 + exp(-x)), tanh5(x) = (e^2x - 1) / (e^2x + 1)
  for |x| < 5, else +1 for x > 0 and -1 otherwise.  Tops h, c.
- ZerosData (zeros_data_param shape): no bottom; a zero blob of shape[0..1] (2 values) or shape[0..3]
  (more than 2; the fork reads exactly the first four).
"""
import numpy as np
import torch
from onnx import TensorProto, helper
from torch import nn

from ..io.schema import caffe_pb2
from .registry import Layer, LayerError, claim_layers, legacy_nchw, need_blobs, register_layer, torch_sources

_TRANSPOSE = caffe_pb2.TransposeParameter
_KINDS = {_TRANSPOSE.LSTMINPUT: "LSTMINPUT", _TRANSPOSE.LSTMOUTPUT: "LSTMOUTPUT",
          _TRANSPOSE.GRIDLSTM: "GRIDLSTM", _TRANSPOSE.GRIDLSTMSUM: "GRIDLSTMSUM"}


def grid_neighbour_rows(spatial: int, height: int):
    """For each of the 8 neighbours k (offsets -h-1, -h, -h+1, -1, +1, h-1, h, h+1): the row of each pixel's
    neighbour in a blob with one zero row put first (row 0), i.e. i + d[k] + 1, or 0 where the fork skips it
    (i + d[k] <= 0 or >= spatial).  A (8, spatial) int64 tensor."""
    offsets = torch.tensor([-height - 1, -height, -height + 1, -1, 1, height - 1, height, height + 1])
    t = torch.arange(spatial).unsqueeze(0) + offsets.unsqueeze(1)
    return torch.where((t > 0) & (t < spatial), t + 1, torch.zeros_like(t))


def charleen_transpose(x, kind: str, top_shape: list[int], batch: int, height: int):
    """Charleen777/caffecode's Transpose of x into top_shape (see the module docstring)."""
    if kind == "LSTMINPUT":
        images = x.shape[0] if x.dim() > 0 else 1
        return x.reshape(images, top_shape[1], -1).transpose(1, 2).reshape(top_shape)
    if kind == "LSTMOUTPUT":
        return x.reshape(batch, -1, top_shape[1]).transpose(1, 2).reshape(top_shape)
    m, c = x.shape[0], x.shape[1]
    spatial = m // batch
    rows = x.reshape(batch, spatial, c)
    padded = torch.cat([rows.new_zeros(batch, 1, c), rows], dim=1)
    picks = grid_neighbour_rows(spatial, height).to(x.device)
    if kind == "GRIDLSTM":
        e = c // 8
        parts = [padded.index_select(1, picks[k])[:, :, (7 - k) * e:(8 - k) * e] for k in range(8)]
        if c > 8 * e:
            parts.append(rows.new_zeros(batch, spatial, c - 8 * e))
        return torch.cat(parts, dim=2).reshape(m, c)
    e = top_shape[1]
    total = rows.new_zeros(batch, spatial, e)
    for k in range(8):
        total = total + padded.index_select(1, picks[k])[:, :, k * 8:k * 8 + e]
    return total.reshape(m, e)


def _is_charleen_transpose(lp):
    return lp.transpose_param.transposetype in _KINDS


@claim_layers("Transpose", _is_charleen_transpose)
class CharleenTranspose(Layer):
    def parse(self, lp):
        need_blobs(lp, "Transpose (Charleen777/caffecode's, transposetype LSTMINPUT / LSTMOUTPUT / GRIDLSTM / "
                   "GRIDLSTMSUM)", 1, 1, in_place=False)
        p = lp.transpose_param
        if len(p.dim) or p.HasField("shape"):
            raise LayerError("transpose_param: dim / shape (other forks' Transposes) do not combine with "
                             f"transposetype {_KINDS[p.transposetype]}")
        kind = _KINDS[p.transposetype]
        if kind != "LSTMINPUT" and p.batch_size < 1:   # LSTMINPUT never reads batch_size or height
            raise LayerError(f"transpose_param.batch_size must be >= 1, got {p.batch_size}")
        if kind == "LSTMOUTPUT" and p.height < 1:
            raise LayerError(f"transpose_param.height must be >= 1, got {p.height}")
        if kind.startswith("GRID") and p.local_connected_num != 8:
            raise LayerError("transpose_param.local_connected_num must be 8 (the fork only supports the "
                             f"8-neighbourhood), got {p.local_connected_num}")
        if kind == "GRIDLSTMSUM" and p.batch_size != 1:
            raise LayerError(f"transpose_param.batch_size {p.batch_size} with GRIDLSTMSUM: the fork writes image n > 0 "
                             "past its top's end; only batch_size 1 is defined")
        return {"kind": kind, "batch": int(p.batch_size), "height": int(p.height)}

    def infer(self, attrs, in_shapes):
        bottom = tuple(in_shapes[0])
        kind, batch, height = attrs["kind"], attrs["batch"], attrs["height"]
        count = int(np.prod(bottom))
        if kind == "LSTMINPUT":
            n, c, h, w = legacy_nchw(bottom, "Charleen777's Transpose (LSTMINPUT)")
            top = (n * h * w, c)
        elif kind == "LSTMOUTPUT":
            if len(bottom) < 2:
                raise LayerError(f"LSTMOUTPUT reads the bottom's shape(0) and shape(1); got {list(bottom)}")
            top = (batch, bottom[1], height, bottom[0] // batch // height)
            if int(np.prod(top)) != count:
                raise LayerError(f"LSTMOUTPUT of {list(bottom)} with batch_size {batch} and height {height} gives "
                                 f"{list(top)}, whose count is not the bottom's (the fork's CHECK_EQ)")
        else:
            m, c, _, _ = legacy_nchw(bottom, f"Charleen777's Transpose ({kind})")
            if m * c != count:
                raise LayerError(f"{kind} reads the bottom as num x channels rows, got {list(bottom)}")
            if m % batch:
                raise LayerError(f"{kind}: the bottom's {m} rows are not a multiple of transpose_param.batch_size "
                                 f"{batch}")
            if c < 8:
                raise LayerError(f"{kind} splits the bottom's channels into 8 neighbour blocks, got {c}")
            if kind == "GRIDLSTM":
                top = (m, c)
            else:
                if 56 + c // 8 > c:
                    raise LayerError(f"GRIDLSTMSUM of {c} channels: the fork reads neighbour k's values from "
                                     f"k * 8 .. k * 8 + {c // 8 - 1}, past a pixel's {c} (needs channels >= 64)")
                top = (m, c // 8)
        return [top]

    def forward(self, attrs, params, x):
        top = list(self.infer(attrs, [tuple(x.shape)])[0])
        return charleen_transpose(x, attrs["kind"], top, attrs["batch"], attrs["height"])

    def onnx(self, ctx, node):
        a = node.attrs
        x = node.inputs[0]
        bottom = tuple(ctx.shape(x))
        top = list(self.infer(a, [bottom])[0])
        out = node.outputs[0]
        if a["kind"] in ("LSTMINPUT", "LSTMOUTPUT"):
            grid = [bottom[0] if bottom else 1, top[1], -1] if a["kind"] == "LSTMINPUT" else [a["batch"], -1, top[1]]
            turned = ctx.op("Transpose", [ctx.op("Reshape", [x, ctx.i64(grid)], "grid", name=node.name)],
                            "turned", perm=[0, 2, 1])
            ctx.add_node("Reshape", [turned, ctx.i64(top)], [out])
            return
        m, c = bottom[0], bottom[1]
        batch = a["batch"]
        spatial = m // batch
        rows = ctx.op("Reshape", [x, ctx.i64([batch, spatial, c])], "rows", name=node.name)
        padded = ctx.op("Pad", [rows, ctx.i64([0, 1, 0, 0, 0, 0])], "padded")
        picks = grid_neighbour_rows(spatial, a["height"]).numpy()
        e = c // 8 if a["kind"] == "GRIDLSTM" else top[1]
        parts = []
        for k in range(8):
            lo = (7 - k) * e if a["kind"] == "GRIDLSTM" else k * 8
            block = ctx.op("Slice", [padded, ctx.i64([lo]), ctx.i64([lo + e]), ctx.i64([2])], f"block{k}")
            parts.append(ctx.op("Gather", [block, ctx.i64(picks[k])], f"nb{k}", axis=1))
        if a["kind"] == "GRIDLSTM":
            if c > 8 * e:
                parts.append(ctx.const(np.zeros((batch, spatial, c - 8 * e), np.float32), node.name + "_rest"))
            joined = ctx.op("Concat", parts, "joined", axis=2)
        else:
            joined = parts[0]
            for k in range(1, 8):
                joined = ctx.op("Add", [joined, parts[k]], f"sum{k}")
        ctx.add_node("Reshape", [joined, ctx.i64(top)], [out])

    def pytorch_source(self, node, emit):
        a = node.attrs
        top = list(emit.out_shape(0))
        emit.helper(TORCH_GRID_ROWS)
        return (f"{emit.helper(TORCH_TRANSPOSE)}({emit.inputs[0]}, {a['kind']!r}, {emit.lit(top)}, {a['batch']}, "
                f"{a['height']})")


TORCH_GRID_ROWS = torch_sources(grid_neighbour_rows)
TORCH_TRANSPOSE = torch_sources(charleen_transpose)


def lstm_unit_tanh(x):
    """The fork's tanh: (e^2x - 1) / (e^2x + 1) for |x| < 5, else 1 for x > 0 and -1 otherwise."""
    e = torch.exp(2 * x)
    ratio = (e - 1) / (e + 1)
    return torch.where(x.abs() < 5, ratio, torch.where(x > 0, torch.ones_like(x), -torch.ones_like(x)))


def lstm_unit(x, c_prev, w_in, w_ig, w_fg, w_og):
    """Charleen777/caffecode's LstmUnit (its GPU forward): tops (h, c) of one step, the four (1, N, 1, K) blobs
    bias-free; the forget gate is sig(0 - x W_o^T), w_fg is never read."""
    rows = x.reshape(x.shape[0], -1)

    def gate(w):
        return rows @ w.reshape(w.shape[1], -1).t()

    def sig(v):
        return 1 / (1 + torch.exp(-v))

    values = lstm_unit_tanh(gate(w_in))
    out = gate(w_og)
    cell = c_prev.reshape(values.shape) * sig(0 - out) + sig(gate(w_ig)) * values
    return cell * sig(out), cell


@register_layer("LstmUnit")
class LstmUnit(Layer):
    blob_names = ("input_weight", "input_gate_weight", "forget_gate_weight", "output_gate_weight")
    weight_axes = {0: 1, 1: 1, 2: 1, 3: 1}

    def parse(self, lp):
        need_blobs(lp, "LstmUnit", 2, 2, "input, previous cell")
        p = lp.lstm_unit_param
        if not p.HasField("num_cells") or p.num_cells < 1:
            raise LayerError("lstm_unit_param.num_cells is required and must be >= 1")
        return {"num_cells": int(p.num_cells)}

    def infer(self, attrs, in_shapes):
        x, c = tuple(in_shapes[0]), tuple(in_shapes[1])
        if len(x) < 2 or int(np.prod(x)) != x[0] * x[1]:
            raise LayerError(f"LstmUnit reads its input as shape(0) x shape(1) rows, got {list(x)}")
        n = attrs["num_cells"]
        if int(np.prod(c)) != x[0] * n:
            raise LayerError(f"LstmUnit's previous cell {list(c)} must hold {x[0]} x num_cells {n} values")
        return [(x[0], n), (x[0], n)]

    def param_shapes(self, attrs, in_shapes):
        return [(1, attrs["num_cells"], 1, in_shapes[0][1])] * 4

    def init_params(self, attrs, shapes, rng):
        k = shapes[0][3]
        return [(rng.standard_normal(s) / np.sqrt(k)).astype(np.float32) for s in shapes]

    def macs(self, attrs, in_shapes, out_shapes):
        return 4 * in_shapes[0][0] * in_shapes[0][1] * attrs["num_cells"]

    def forward(self, attrs, params, x, c_prev):
        return list(lstm_unit(x, c_prev, *params))

    def onnx(self, ctx, node):
        x, c_prev = node.inputs
        m, k = ctx.shape(x)[:2]
        n = node.attrs["num_cells"]
        rows = ctx.op("Reshape", [x, ctx.i64([m, k])], "rows", name=node.name)

        def gate(i, what):
            w = ctx.op("Transpose", [ctx.op("Reshape", [ctx.weight(node, i), ctx.i64([n, k])], what + "_w")],
                       what + "_wt", perm=[1, 0])
            return ctx.op("MatMul", [rows, w], what)

        def sig(v, what):
            one = ctx.const(np.ones((), np.float32), node.name + "_one")
            return ctx.op("Div", [one, ctx.op("Add", [one, ctx.op("Exp", [ctx.op("Neg", [v], what + "_neg")],
                                                                  what + "_exp")], what + "_den")], what)

        g = gate(0, "g_in")
        one = ctx.const(np.ones((), np.float32), node.name + "_1")
        e = ctx.op("Exp", [ctx.op("Add", [g, g], "g2")], "e2")
        ratio = ctx.op("Div", [ctx.op("Sub", [e, one], "num"), ctx.op("Add", [e, one], "den")], "ratio")
        sign = ctx.op("Where", [ctx.op("Greater", [g, ctx.const(np.zeros((), np.float32), node.name + "_0")], "pos"),
                                one, ctx.const(-np.ones((), np.float32), node.name + "_m1")], "sign")
        small = ctx.op("Less", [ctx.op("Abs", [g], "abs"), ctx.const(np.full((), 5, np.float32), node.name + "_5")],
                       "small")
        values = ctx.op("Where", [small, ratio, sign], "values")
        prev = ctx.op("Reshape", [c_prev, ctx.i64([m, n])], "prev")
        out = gate(3, "g_og")   # the GPU forward's forget gate: sig(0 - g_o), blob 2 unread
        tied = ctx.op("Sub", [ctx.const(np.zeros((), np.float32), node.name + "_zero"), out], "g_fg")
        cell_keep = ctx.op("Mul", [prev, sig(tied, "f")], "keep")
        cell_new = ctx.op("Mul", [sig(gate(1, "g_ig"), "i"), values], "new")
        ctx.add_node("Add", [cell_keep, cell_new], [node.outputs[1]])
        ctx.add_node("Mul", [node.outputs[1], sig(out, "o")], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        emit.helper(TORCH_TANH)
        fn = emit.helper(TORCH_LSTM_UNIT)
        weights = []
        for i, (name, shape) in enumerate(zip(self.blob_names, node.expected_param_shapes)):
            attr = emit.extra_attr(name)
            weights.append(emit.module(f"nn.Parameter(torch.zeros({', '.join(map(str, shape))}))", attr=attr))
            emit.param("", i, attr=attr)
        weights = ", ".join(weights)
        return [f"{fn}({emit.inputs[0]}, {emit.inputs[1]}, {weights})[{i}]" for i in range(2)]


TORCH_TANH = torch_sources(lstm_unit_tanh)
TORCH_LSTM_UNIT = torch_sources(lstm_unit)


class ZerosDataModule(nn.Module):
    """ZerosData's zero blob, kept as a buffer so that it follows the module's device."""

    def __init__(self, shape: list[int]):
        super().__init__()
        self.register_buffer("zeros", torch.zeros(shape), persistent=False)

    def forward(self):
        return self.zeros


@register_layer("ZerosData")
class ZerosData(Layer):
    def parse(self, lp):
        need_blobs(lp, "ZerosData", 0, 1)
        shape = [int(d) for d in lp.zeros_data_param.shape]
        if len(shape) < 2 or len(shape) == 3:
            raise LayerError(f"zeros_data_param.shape needs 2 or at least 4 values (the fork reads shape(0), "
                             f"shape(1) and, past 2, shape(2) and shape(3)), got {shape}")
        attrs = {"shape": shape[:2] if len(shape) == 2 else shape[:4]}
        if len(shape) > 4:
            attrs["reading_notes"] = [f"ZerosData reads the first 4 of zeros_data_param.shape {shape} (the fork's "
                                      "Reshape)"]
        return attrs

    def infer(self, attrs, in_shapes):
        return [tuple(attrs["shape"])]

    def forward(self, attrs, params):
        return torch.zeros(attrs["shape"])

    def onnx(self, ctx, node):
        value = helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0])
        ctx.add_node("ConstantOfShape", [ctx.i64(node.attrs["shape"])], [node.outputs[0]], name=node.name,
                     value=value)

    def pytorch_source(self, node, emit):
        shape = emit.lit(node.attrs["shape"])
        return f"{emit.module(f'{emit.helper(TORCH_ZEROS_MODULE)}({shape})')}()"


TORCH_ZEROS_MODULE = torch_sources(ZerosDataModule)

__all__ = ["CharleenTranspose", "LstmUnit", "ZerosData", "charleen_transpose", "grid_neighbour_rows", "lstm_unit"]
