"""KevinKecc/caffe-spn (059f95a) SoftProposal: src/caffe/layers/soft_proposal_layer.cpp,
include/caffe/layers/soft_proposal_layer.hpp (a NeuronLayer, CPU only: no .cu, the CPU code runs everywhere);
soft_proposal_param (src/caffe/proto/caffe.proto: SoftProposalParameter factor = 1, tolerance = 2,
maxiteration = 3 (a float), engine = 4; 148 there, 111148 here).

The bottom is read as (N, C, H, W) through num/channels/height/width; the top has its shape.  With S = H W
positions u = (i, j), per sample n:
- D[u, v] = expf(float((i-p)^2 + (j-q)^2) / (-2 factor factor)) (float32), factor [float32(0.15 W)];
- T[u, v] = sqrt(sum over c, channel 0 first, of (x[c, u] - x[c, v])^2) + D[u, v], then each column of T
  divided by its sum (T[:, v] /= sum_u T[u, v]);
- p = b = 1/S everywhere; then up to int(maxiteration) [20] times: b = T p - b; stop when ||b|| < tolerance
  [1e-4]; b = p + b; s = sum(b); stop when s < 0; p = b * (1 / s).  (b keeps the unnormalized sum for the
  next step, so from the second step on it is T p - (the previous unnormalized p), as the fork's gemv has
  it, not T p - p.  T's columns sum to 1, so that sum is 1 up to rounding: the two differ in the last bits
  only, and the s < 0 stop cannot fire for finite x, T being >= 0.)
- top[n, c, u] = x[n, c, u] * p[u].
The fork's first InitTransferMatrix/Norm call in Forward_cpu is recomputed per sample in Generate: no effect.
A negative maxiteration runs no step (p = 1/S); engine does nothing.  factor 0 (NaN everywhere in the fork)
and a NaN or infinite factor or maxiteration are refused.
ONNX: a Scan over the channels sums the squared differences in the fork's order, a Scan of
int(maxiteration) steps runs the iteration with per-sample stop flags.
"""
import math

import numpy as np
import torch

from .registry import Layer, LayerError, legacy_nchw, need_blobs, register_layer, torch_sources

F32 = np.float32


def soft_proposal_distance(height: int, width: int, factor: float, device=None):
    """D: (S, S) float32, expf of the squared grid distance over -2 factor^2 (float32 arithmetic)."""
    idx = torch.arange(height * width, device=device)
    row, col = idx // width, idx % width
    d2 = ((row[:, None] - row[None, :]) ** 2 + (col[:, None] - col[None, :]) ** 2).to(torch.float32)
    f = torch.tensor(factor, dtype=torch.float32, device=device)
    return torch.exp(d2 / (torch.tensor(-2.0, dtype=torch.float32, device=device) * f * f))


def soft_proposal(x, factor: float, tolerance: float, iterations: int):
    """The fork's soft proposal map of x (N, C, H, W), multiplied into x."""
    n, c, h, w = x.shape
    size = h * w
    flat = x.reshape(n, c, size)
    sq = x.new_zeros((n, size, size))
    for k in range(c):      # float sums, channel 0 first, as the fork's loop
        d = flat[:, k, :, None] - flat[:, k, None, :]
        sq = sq + d * d
    transfer = torch.sqrt(sq) + soft_proposal_distance(h, w, factor, x.device)
    transfer = transfer / transfer.sum(dim=1, keepdim=True)
    p = x.new_full((n, size), 1.0 / size)
    buf = p.clone()
    done = torch.zeros(n, dtype=torch.bool, device=x.device)
    for _ in range(iterations):
        diff = torch.matmul(transfer, p[:, :, None])[:, :, 0] - buf
        stop = done | (torch.sqrt((diff * diff).sum(dim=1)) < tolerance)
        nb = p + diff
        s = nb.sum(dim=1)
        stop = stop | (s < 0)
        keep = stop[:, None]
        p = torch.where(keep, p, nb * (1.0 / s)[:, None])
        buf = torch.where(keep, buf, nb)
        done = stop
    return x * p.reshape(n, 1, h, w)


TORCH_SOFT_PROPOSAL = torch_sources(soft_proposal_distance, soft_proposal)


@register_layer("SoftProposal")
class SoftProposal(Layer):
    def parse(self, lp):
        need_blobs(lp, "SoftProposal", 1, 1)
        p = lp.soft_proposal_param
        factor = None
        if p.HasField("factor"):
            factor = float(F32(p.factor))
            if factor == 0 or not math.isfinite(factor):
                raise LayerError(f"soft_proposal_param.factor must be finite and not 0 (the fork's distances "
                                 f"are NaN otherwise), got {factor}")
        tolerance = float(F32(p.tolerance)) if p.HasField("tolerance") else float(F32(1e-4))
        iterations = float(p.maxiteration) if p.HasField("maxiteration") else 20.0
        if not math.isfinite(iterations) or abs(iterations) >= 2 ** 31:
            raise LayerError(f"soft_proposal_param.maxiteration must be a finite int-sized number, got {iterations}")
        return {"factor": factor, "tolerance": tolerance, "iterations": max(0, int(iterations))}

    def infer(self, attrs, in_shapes):
        legacy_nchw(in_shapes[0], "SoftProposal")
        return [tuple(in_shapes[0])]

    @staticmethod
    def _factor(attrs, width):
        # LayerSetUp: factor_ = width_ * 0.15 (double) stored in a float
        return attrs["factor"] if attrs["factor"] is not None else float(F32(width * 0.15))

    def forward(self, attrs, params, x):
        n, c, h, w = legacy_nchw(tuple(x.shape), "SoftProposal")
        y = soft_proposal(x.reshape(n, c, h, w), self._factor(attrs, w), attrs["tolerance"], attrs["iterations"])
        return y.reshape(x.shape)

    def macs(self, attrs, in_shapes, out_shapes):
        n, c, h, w = legacy_nchw(in_shapes[0], "SoftProposal")
        return n * (h * w) ** 2 * (c + attrs["iterations"])

    def onnx(self, ctx, node):
        from onnx import TensorProto, helper
        a = node.attrs
        x, top = node.inputs[0], node.outputs[0]
        n, c, h, w = legacy_nchw(ctx.shape(x), "SoftProposal")
        size = h * w
        flat = ctx.op("Reshape", [x, ctx.i64([0, c, size])], "flat", name=node.name)
        batch = ctx.op("Slice", [ctx.op("Shape", [x], "shape"), ctx.i64([0]), ctx.i64([1])], "batch")
        zeros = ctx.op("ConstantOfShape", [ctx.op("Concat", [batch, ctx.i64([size, size])], "sq_shape", axis=0)],
                       "sq0", value=helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0]))

        def value(name, elem=TensorProto.FLOAT):
            return helper.make_tensor_value_info(name, elem, None)

        # Scan over the channels: sq += (x_c[:, :, None] - x_c[:, None, :])^2
        body = []
        state, xc = ctx.tmp(f"{node.name}_sq_in"), ctx.tmp(f"{node.name}_xc")
        col = ctx.body_op(body, "Reshape", [xc, ctx.body_const(body, np.array([0, size, 1], np.int64), "col")],
                          "xc_col")
        row = ctx.body_op(body, "Reshape", [xc, ctx.body_const(body, np.array([0, 1, size], np.int64), "row")],
                          "xc_row")
        d = ctx.body_op(body, "Sub", [col, row], "d")
        new_state = ctx.body_op(body, "Add", [state, ctx.body_op(body, "Mul", [d, d], "d2")], "sq_out")
        graph = helper.make_graph(body, f"{node.name}_channel_step", [value(state), value(xc)], [value(new_state)])
        sq = ctx.add_node("Scan", [zeros, flat], [ctx.tmp(f"{node.name}_sq")], name=f"{node.name}/channels",
                          body=graph, num_scan_inputs=1, scan_input_axes=[1])[0]
        dist = soft_proposal_distance(h, w, self._factor(a, w)).numpy()
        transfer = ctx.op("Add", [ctx.op("Sqrt", [sq], "norm"), ctx.const(dist, f"{node.name}_distance")], "t")
        transfer = ctx.op("Div", [transfer, ctx.op("ReduceSum", [transfer, ctx.i64([1])], "colsum", keepdims=1)],
                          "transfer")
        avg = helper.make_tensor("avg", TensorProto.FLOAT, [1], [float(F32(1.0 / size))])
        p = ctx.op("ConstantOfShape", [ctx.op("Concat", [batch, ctx.i64([size])], "p_shape", axis=0)], "p0",
                   value=avg)
        if a["iterations"]:
            done = ctx.op("ConstantOfShape", [batch], "done0",
                          value=helper.make_tensor("false", TensorProto.BOOL, [1], [False]))
            body = []
            p_in, b_in, done_in, t_in, tick = (ctx.tmp(f"{node.name}_{s}")
                                               for s in ("p_in", "b_in", "done_in", "t_in", "tick"))

            def b(kind, inputs, hint, **kw):
                return ctx.body_op(body, kind, inputs, hint, **kw)
            axis1 = ctx.body_const(body, np.array([1], np.int64), "axis1")
            tp = b("MatMul", [t_in, b("Reshape", [p_in, ctx.body_const(body, np.array([0, size, 1], np.int64),
                                                                         "p_col")], "p_col")], "tp")
            diff = b("Sub", [b("Reshape", [tp, ctx.body_const(body, np.array([0, size], np.int64), "p_row")],
                               "tp_row"), b_in], "diff")
            norm = b("Sqrt", [b("ReduceSum", [b("Mul", [diff, diff], "diff2"), axis1], "sumsq", keepdims=0)],
                     "norm_diff")
            tol = ctx.body_const(body, F32(a["tolerance"]), "tolerance")
            nb = b("Add", [p_in, diff], "nb")
            s = b("ReduceSum", [nb, axis1], "sum_over", keepdims=0)
            stop = b("Or", [done_in, b("Or", [b("Less", [norm, tol], "converged"),
                                              b("Less", [s, ctx.body_const(body, F32(0.0), "zero")], "negative")],
                                       "stops")], "done_out")
            keep = b("Unsqueeze", [stop, axis1], "keep")
            inv = b("Unsqueeze", [b("Div", [ctx.body_const(body, F32(1.0), "one"), s], "inv"), axis1], "inv_col")
            p_out = b("Where", [keep, p_in, b("Mul", [nb, inv], "p_new")], "p_out")
            b_out = b("Where", [keep, b_in, nb], "b_out")
            t_out = b("Identity", [t_in], "t_out")
            graph = helper.make_graph(
                body, f"{node.name}_step",
                [value(p_in), value(b_in), value(done_in, TensorProto.BOOL), value(t_in), value(tick)],
                [value(p_out), value(b_out), value(stop, TensorProto.BOOL), value(t_out)])
            ticks = ctx.const(np.zeros(a["iterations"], np.float32), f"{node.name}_ticks")
            p = ctx.add_node("Scan", [p, p, done, transfer, ticks],
                             [ctx.tmp(f"{node.name}_{s}") for s in ("p", "b", "done", "t_last")],
                             name=f"{node.name}/iterations", body=graph, num_scan_inputs=1)[0]
        mask = ctx.op("Reshape", [p, ctx.i64([0, 1, h, w])], "proposal")
        y = ctx.op("Mul", [ctx.op("Reshape", [x, ctx.i64([0, c, h, w])], "x4"), mask], "coupled")
        ctx.add_node("Reshape", [y, ctx.i64([0, *ctx.shape(x)[1:]])], [top])

    def pytorch_source(self, node, emit):
        a = node.attrs
        n, c, h, w = legacy_nchw(emit.in_shape(0), "SoftProposal")
        fn = emit.helper(TORCH_SOFT_PROPOSAL)
        x = emit.inputs[0]
        rest = ", ".join(str(d) for d in emit.in_shape(0)[1:])
        return (f"{fn}({x}.reshape({x}.shape[0], {c}, {h}, {w}), {emit.lit(self._factor(a, w), exact=True)}, "
                f"{emit.lit(a['tolerance'], exact=True)}, {a['iterations']}).reshape({x}.shape[0], {rest})")


__all__ = ["SoftProposal", "soft_proposal", "soft_proposal_distance"]
