"""Layers of the MPI data-parallel Caffe forks: Lyp100208/Caffe_action (258cc36) and lxx1991/caffe_mpi
(356aa53), both from yjxiong's MPI branch; GPU builds (several CPU forwards are empty).  With one
process, their gathers are copies.

- Gather (gather_layer.cu): MPI_Gather of each bottom along axis 0 to rank 0; with one process every
  top is its bottom.  Several bottoms give as many tops.
- ConvolutionData (conv_data_layer.cu) and InnerProductAll (inner_product_all_layer.cu): BVLC's
  Convolution and InnerProduct (the latter after a gather), differing in their backward only.
- misaka-10032/caffe's model-parallel MpiFc (an InnerProduct split across workers) and MpiSync (empty).
- BNData: two forks under one name, told apart by their bn_param fields.
  Lyp100208's (bn_data_layer.cu; var_eps [1e-10], moving_average, decay [0.05]): with moving_average,
  y = ((x - mean) / pow(var + var_eps, 0.5)) x scale + shift with blobs scale, shift, mean, variance
  (1, C, 1, 1); without it the TEST forward uses the batch's statistics (not supported here).
  lxx1991's (eps [1e-5], momentum, slope_filler / bias_filler, moving_average): the same formula with eps;
  its TEST forward aborts in the fork (the base layer's buffers are never set up), so this is the form
  its working training path computes with moving_average and frozen rates.  Both are yjxiong's BN (the
  TSN form in segmentation.py) as far as inference goes.
- SLLSTM (Lyp100208, sllstm_layer.cu; recurrent_param num_output H and fillers): bottoms x (T, B, I) and
  an optional marker (T x B values); top (T, B, H); blobs U_h (4H, H), b (4H), W_x (4H, I), the gates in
  the order input, forget, output, candidate.  From a zero state at t = 0: g = x W_x^T + b + h_prev U_h^T,
  where h_prev and c_prev are the previous step's only where its marker is > 0 (no marker: always);
  c = i g~ + f c_prev and h = o tanh~(c), with sigma(x) = 1 / (1 + exp(-x)) and the fork's
  tanh~(x) = 2 sigma(2x) - 1 (caffe::tanh, not the library's).  A static third bottom is not read.
- Reverse with 2 bottoms (Lyp100208, reverse_layer.cu; caffeq's 1-bottom Reverse is sequence.py's):
  bottoms the markers (T, N) and the data (T, N, ...); each stream is cut into runs, a run starting at a
  marker other than 1 (of value -length, which the fork checks) and going on over markers equal to 1;
  each run's frames are written in reverse order.  From a 0 marker on the stream stays unwritten (0).
- Warping, lxx1991's (warping_layer.cu; 2 bottoms, told apart from Garg's 3-bottom Warping): image
  (N, C, H, W) and flow (N, 2, H, W), x then y in pixels; each top pixel samples the image bilinearly at
  (x + fx, y + fy), each of the four corners' indices clamped into the image (so a point outside reads
  the border), the corners added in the order (y0, x0), (y1, x0), (y0, x1), (y1, x1) with the fork's
  float weights (1 - ((h - floor) + dy)) and so on.
"""
import numpy as np
import torch

from .conv import Convolution, InnerProduct
from .mpi_caffe import MPIBroadcast
from .optical_flow import pixels_at
from .registry import AT_LEAST, Layer, LayerError, claim_layers, need_blobs, positive_field, register_layer
from .segmentation import BN, TSN
from .ssd.common import scalar_tensor
from .warp_onnx import OnnxImageSampler


@register_layer("Gather")
class MpiGather(Layer):
    def parse(self, lp):
        need_blobs(lp, "Gather", range(1, AT_LEAST), None)
        if len(lp.top) != len(lp.bottom):
            raise LayerError(f"Gather (the MPI forks' gather) takes one top per bottom, got {len(lp.bottom)} "
                             f"bottom(s) and {len(lp.top)} top(s)")
        return {}

    def infer(self, attrs, in_shapes):
        return [tuple(s) for s in in_shapes]

    def forward(self, attrs, params, *xs):
        return xs[0] if len(xs) == 1 else tuple(xs)

    def onnx(self, ctx, node):
        for x, out in zip(node.inputs, node.outputs):
            ctx.add_node("Identity", [x], [out])

    def pytorch_source(self, node, emit):
        return emit.inputs[0] if len(emit.inputs) == 1 else list(emit.inputs)


@register_layer("ConvolutionData")
class ConvolutionData(Convolution):
    """Lyp100208's ConvolutionData: BVLC's Convolution in the forward."""


@register_layer("InnerProductAll")
class InnerProductAll(InnerProduct):
    """Lyp100208's InnerProductAll: BVLC's InnerProduct after a gather (one process: the bottom)."""


@register_layer("MpiFc")
class MpiFc(InnerProduct):
    """misaka-10032/caffe's (branch mpi, d1f2ab2) model-parallel MpiFc: each worker computes a slice of the
    outputs and the master joins them, x W^T + b with the layer's whole (num_output, K) weights (its type()
    even answers "InnerProduct"; the fork aborts without MPI workers)."""


@register_layer("MpiSync")
class MpiSync(MPIBroadcast):
    """misaka-10032/caffe's MpiSync: every method empty, used in place: the top is the bottom, as one process's
    MPIBroadcast (it sets no mpi_param, so its root is rank 0)."""


_LXX_FIELDS = ("slope_filler", "bias_filler", "momentum", "eps")


@register_layer("BNData")
class BNData(BN):
    def parse(self, lp):
        need_blobs(lp, "BNData", 1, 1)
        p = lp.bn_param
        lxx = any(p.HasField(f) for f in _LXX_FIELDS)
        if not p.moving_average:
            raise LayerError("BNData without bn_param.moving_average uses the batch's own statistics at TEST, "
                             "which caffeq does not support")
        if lxx:   # lxx1991/caffe_mpi: eps, momentum (the kept share of the history)
            eps, momentum = float(p.eps), float(p.momentum)
        else:     # Lyp100208/Caffe_action: var_eps, decay (the new batch's share)
            eps, momentum = float(p.var_eps), 1.0 - float(p.decay)
        if not eps >= 0:
            raise LayerError(f"BNData's epsilon must be >= 0, got {eps}")
        return {"variant": TSN, "eps": eps, "momentum": momentum, "frozen": False}

    def infer(self, attrs, in_shapes):
        if len(in_shapes[0]) > 4:
            raise LayerError(f"BNData reads num, channels, height and width: at most 4 axes, got {list(in_shapes[0])}")
        return super().infer(attrs, in_shapes)


def clamped_flow_warp(image, flow):
    """lxx1991's Warping: bilinear samples at (x + fx, y + fy), each corner index clamped into the image."""
    h, w = image.shape[2], image.shape[3]
    gy, gx = torch.meshgrid(torch.arange(h, dtype=image.dtype, device=image.device),
                            torch.arange(w, dtype=image.dtype, device=image.device), indexing="ij")
    dx, dy = flow[:, 0:1], flow[:, 1:2]
    y0, x0 = torch.floor(gy + dy), torch.floor(gx + dx)
    y0 = torch.where(torch.isnan(y0), torch.zeros_like(y0), y0)
    x0 = torch.where(torch.isnan(x0), torch.zeros_like(x0), x0)
    below, right = 1 - ((gy - y0) + dy), 1 - ((gx - x0) + dx)       # the weights of rows y0, columns x0
    above, left = 1 - ((y0 + 1 - gy) - dy), 1 - ((x0 + 1 - gx) - dx)   # rows y0 + 1, columns x0 + 1
    rows = [r.clamp(0, h - 1).long() for r in (y0, y0 + 1)]
    cols = [c.clamp(0, w - 1).long() for c in (x0, x0 + 1)]
    out = torch.zeros_like(image)
    for r, c, wy, wx in ((0, 0, below, right), (1, 0, above, right), (0, 1, below, left), (1, 1, above, left)):
        out = out + pixels_at(image, rows[r], cols[c]) * (wy * wx)
    return out


@claim_layers("Warping", lambda lp: len(lp.bottom) == 2)
class ClampedWarping(Layer):
    def parse(self, lp):
        need_blobs(lp, "Warping", 2, 1, "image, flow")
        return {}

    def infer(self, attrs, in_shapes):
        image, flow = tuple(in_shapes[0]), tuple(in_shapes[1])
        if len(image) != 4 or len(flow) != 4 or flow[1] != 2 or (flow[0],) + flow[2:] != (image[0],) + image[2:]:
            raise LayerError(f"Warping (lxx1991's) takes an image (N, C, H, W) and a flow (N, 2, H, W) of its N, H "
                             f"and W, got {list(image)} and {list(flow)}")
        return [image]

    def forward(self, attrs, params, image, flow):
        return clamped_flow_warp(image, flow)

    def onnx(self, ctx, node):
        image, flow = node.inputs
        s = OnnxImageSampler(ctx, node.name, image)
        op, f32 = s.op, s.f32
        h, w = s.h, s.w
        gx, gy = s.pixel_grid()
        dx, dy = s.channel(flow, 0, "dx"), s.channel(flow, 1, "dy")

        def floor_of(g, d, hint):
            t = op("Floor", [op("Add", [g, d], hint + "_p")], hint + "_f")
            return op("Where", [op("IsNaN", [t], hint + "_nan"), f32(0), t], hint)
        y0, x0 = floor_of(gy, dy, "y0"), floor_of(gx, dx, "x0")
        y1, x1 = op("Add", [y0, f32(1)], "y1"), op("Add", [x0, f32(1)], "x1")
        below = op("Sub", [f32(1), op("Add", [op("Sub", [gy, y0], "gy0"), dy], "fy")], "below")
        right = op("Sub", [f32(1), op("Add", [op("Sub", [gx, x0], "gx0"), dx], "fx")], "right")
        above = op("Sub", [f32(1), op("Sub", [op("Sub", [y1, gy], "y1g"), dy], "gy1")], "above")
        left = op("Sub", [f32(1), op("Sub", [op("Sub", [x1, gx], "x1g"), dx], "gx1")], "left")

        def clamp(t, top, hint):
            return op("Min", [op("Max", [t, f32(0)], hint + "_lo"), f32(float(top))], hint)
        rows = [clamp(y0, h - 1, "r0"), clamp(y1, h - 1, "r1")]
        cols = [clamp(x0, w - 1, "c0"), clamp(x1, w - 1, "c1")]
        total = None
        for k, (r, c, wy, wx) in enumerate(((0, 0, below, right), (1, 0, above, right), (0, 1, below, left),
                                            (1, 1, above, left))):
            term = op("Mul", [s.pixels(rows[r], cols[c], f"v{k}"), op("Mul", [wy, wx], f"w{k}")], f"t{k}")
            total = term if total is None else op("Add", [total, term], f"s{k}")
        ctx.add_node("Identity", [total], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        emit.helper(pixels_at)
        return f"{emit.helper(clamped_flow_warp)}({emit.inputs[0]}, {emit.inputs[1]})"


# ---- SLLSTM ----------------------------------------------------------------------------------

def fork_sigmoid(x):
    return 1 / (1 + torch.exp(-x))


def sllstm(x, cont, u_h, b, w_x):
    """Lyp100208's SLLSTM over x (T, B, I) with the markers cont (T, B) or None: h (T, B, H)."""
    steps, batch = x.shape[0], x.shape[1]
    hidden = u_h.shape[1]
    gates = x.reshape(steps * batch, -1) @ w_x.t() + b
    gates = gates.reshape(steps, batch, 4 * hidden)
    h = c = x.new_zeros(batch, hidden)
    outs = []
    for t in range(steps):
        if t > 0 and cont is not None:
            keep = (cont[t] > 0).to(x.dtype).reshape(batch, 1)
            h, c = h * keep, c * keep
        g = gates[t] + h @ u_h.t()
        i, f, o = (fork_sigmoid(g[:, k * hidden:(k + 1) * hidden]) for k in range(3))
        cand = 2 * fork_sigmoid(2 * g[:, 3 * hidden:]) - 1
        c = i * cand + f * c
        h = o * (2 * fork_sigmoid(2 * c) - 1)
        outs.append(h)
    return torch.stack(outs)


@register_layer("SLLSTM")
class SLLSTM(Layer):
    blob_names = ("U_h", "b", "W_x")
    weight_axes = {0: 0, 2: 0}

    def parse(self, lp):
        need_blobs(lp, "SLLSTM", (1, 2, 3), 1, "x, markers")
        if len(lp.bottom) == 3:
            raise LayerError("SLLSTM with a static input (its third bottom) is not read")
        return {"hidden": positive_field(lp.recurrent_param.num_output, "recurrent_param.num_output"),
                "marked": len(lp.bottom) == 2}

    def infer(self, attrs, in_shapes):
        x = tuple(in_shapes[0])
        if len(x) < 3 or any(d != 1 for d in x[3:]):
            raise LayerError(f"SLLSTM takes x (T, B, I) (the fork's gemms read axis 2 only), got {list(x)}")
        if attrs["marked"] and int(np.prod(in_shapes[1])) != x[0] * x[1]:
            raise LayerError(f"SLLSTM's markers must hold T x B = {x[0] * x[1]} values, got {list(in_shapes[1])}")
        return [(x[0], x[1], attrs["hidden"]) + x[3:]]

    def param_shapes(self, attrs, in_shapes):
        hidden, inputs = attrs["hidden"], in_shapes[0][2]
        return [(4 * hidden, hidden), (4 * hidden,), (4 * hidden, inputs)]

    def macs(self, attrs, in_shapes, out_shapes):
        t, b, i = in_shapes[0][:3]
        return t * b * 4 * attrs["hidden"] * (i + attrs["hidden"])

    def forward(self, attrs, params, x, cont=None):
        shape = x.shape
        steps, batch = shape[0], shape[1]
        marks = None if cont is None else cont.reshape(steps, batch)
        h = sllstm(x.reshape(steps, batch, shape[2]), marks, *params)
        return h.reshape((steps, batch, attrs["hidden"]) + tuple(shape[3:]))

    def onnx(self, ctx, node):
        x = node.inputs[0]
        shape = ctx.shape(x)
        steps, batch, inputs = shape[0], shape[1], shape[2]
        hidden = node.attrs["hidden"]
        op, f32 = ctx.op, ctx.f32
        u_t = op("Transpose", [ctx.weight(node, 0)], "uht")
        w_t = op("Transpose", [ctx.weight(node, 2)], "wxt")
        gates = op("Add", [op("MatMul", [op("Reshape", [x, ctx.i64([steps, batch, inputs])], "x3"), w_t], "xw"),
                           ctx.weight(node, 1)], "gates")
        marks = op("Reshape", [node.inputs[1], ctx.i64([steps, batch, 1])], "marks") if node.attrs["marked"] else None

        def sigmoid(t, hint):   # 1 / (1 + exp(-t)), as the fork writes it
            return op("Div", [f32(1.0), op("Add", [f32(1.0), op("Exp", [op("Neg", [t], hint + "_n")], hint + "_e")],
                                           hint + "_d")], hint)

        def tanh_(t, hint):
            return op("Sub", [op("Mul", [f32(2.0), sigmoid(op("Mul", [f32(2.0), t], hint + "_2"), hint + "_s")],
                                 hint + "_m"), f32(1.0)], hint)
        h = c = op("ConstantOfShape", [ctx.i64([batch, hidden])], "zero", value=scalar_tensor(0.0))
        outs = []
        for t in range(steps):
            if t > 0 and marks is not None:
                keep = op("Cast", [op("Greater", [op("Gather", [marks, ctx.i64(t)], f"m{t}", axis=0), f32(0.0)],
                                      f"k{t}")], f"keep{t}", to=1)
                h, c = op("Mul", [h, keep], f"hk{t}"), op("Mul", [c, keep], f"ck{t}")
            g = op("Add", [op("Gather", [gates, ctx.i64(t)], f"g{t}", axis=0), op("MatMul", [h, u_t], f"hu{t}")],
                   f"pre{t}")
            i, f, o, cand = (op("Slice", [g, ctx.i64([k * hidden]), ctx.i64([(k + 1) * hidden]), ctx.i64([1])],
                                f"gate{t}_{k}") for k in range(4))
            c = op("Add", [op("Mul", [sigmoid(i, f"i{t}"), tanh_(cand, f"cand{t}")], f"ig{t}"),
                           op("Mul", [sigmoid(f, f"f{t}"), c], f"fc{t}")], f"c{t}")
            h = op("Mul", [sigmoid(o, f"o{t}"), tanh_(c, f"tc{t}")], f"h{t}")
            outs.append(op("Unsqueeze", [h, ctx.i64([0])], f"h{t}_"))
        out = outs[0] if len(outs) == 1 else op("Concat", outs, "hs", axis=0)
        ctx.add_node("Reshape", [out, ctx.i64(list(ctx.shape(node.outputs[0])))], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        m = emit.blob_parameters(self.blob_names)
        emit.helper(fork_sigmoid)
        fn = emit.helper(sllstm)
        x = emit.inputs[0]
        steps, batch, inputs = emit.in_shape(0)[:3]
        marks = f"{emit.inputs[1]}.reshape({steps}, {batch})" if node.attrs["marked"] else "None"
        weights = ", ".join(f"{m}['{n}']" for n in self.blob_names)
        return (f"{fn}({x}.reshape({steps}, {batch}, {inputs}), {marks}, {weights})"
                f".reshape({tuple(emit.out_shape(0))!r})")


# ---- Reverse with markers ---------------------------------------------------------------------------

def marked_runs(cont):
    """For markers (T, N): each position's run start and end (exclusive), and whether it is written (before
    the stream's first 0 marker); runs start at t = 0 and wherever a marker is not 1."""
    steps = cont.shape[0]
    starts, ends = [], [None] * steps
    start = torch.zeros(cont.shape[1], dtype=torch.int64, device=cont.device)
    for t in range(steps):
        start = torch.where(cont[t] != 1, torch.full_like(start, t), start) if t else start
        starts.append(start)
    end = torch.full_like(start, steps)
    for t in range(steps - 1, -1, -1):
        ends[t] = end
        if t:
            end = torch.where(cont[t] != 1, torch.full_like(end, t), end)
        else:
            end = torch.zeros_like(end)
    written = torch.cumsum((cont == 0).to(torch.int64), 0) == 0
    return torch.stack(starts), torch.stack(ends), written


def marked_reverse(cont, data):
    """Lyp100208's 2-bottom Reverse: each marked run of data (T, N, ...) in reverse time order."""
    steps, streams = data.shape[0], data.shape[1]
    marks = cont.reshape(steps, streams)
    start, end, written = marked_runs(marks)
    at_start = written & (start == torch.arange(steps, device=data.device).reshape(steps, 1))
    lengths = torch.trunc(-marks)   # the fork's int of -marker
    if bool(((lengths != (end - start).to(marks.dtype)) & at_start).any()):
        raise ValueError("a run's first marker is not minus its length (the fork's CHECK_EQ in reverse_layer)")
    source = start + end - 1 - torch.arange(steps, device=data.device).reshape(steps, 1)
    index = source.reshape((steps, streams) + (1,) * (data.dim() - 2)).expand(data.shape)
    picked = torch.gather(data, 0, index)
    keep = written.reshape((steps, streams) + (1,) * (data.dim() - 2))
    return torch.where(keep, picked, torch.zeros_like(picked))


@claim_layers("Reverse", lambda lp: len(lp.bottom) == 2)
class MarkedReverse(Layer):
    onnx_refusal = ("the 2-bottom Reverse finds its runs in the markers' values, which the export does "
                    "not follow")

    def parse(self, lp):
        need_blobs(lp, "Reverse", 2, 1, "markers, data", in_place=False)
        return {"name": lp.name}

    def infer(self, attrs, in_shapes):
        marks, data = tuple(in_shapes[0]), tuple(in_shapes[1])
        if len(marks) < 2 or len(data) < 2 or data[:2] != marks[:2] or int(np.prod(marks[2:])) != 1:
            raise LayerError(f"Reverse (Lyp100208's) takes the markers (T, N) then the data (T, N, ...), got "
                             f"{list(marks)} and {list(data)}")
        return [data]

    def forward(self, attrs, params, cont, data):
        try:
            return marked_reverse(cont, data)
        except ValueError as e:
            raise LayerError(f"layer '{attrs['name']}' (Reverse): {e}") from None

    def pytorch_source(self, node, emit):
        emit.helper(marked_runs)
        return f"{emit.helper(marked_reverse)}({emit.inputs[0]}, {emit.inputs[1]})"
