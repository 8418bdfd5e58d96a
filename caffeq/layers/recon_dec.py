"""YutingZhang/caffe-recon-dec's decoder layers (ace107b; src/caffe/proto/caffe.proto, src/caffe/layers/
depooling_layer.cpp/.cu, pooling_layer.cpp/.cu, safe_inv_layer.cpp/.cu, image_output_layer.cpp, and
src/caffe/util/math_functions.cpp/.cu for zcaffe_*_safeinv).

- Depooling (pooling_param, the fork's PoolMethod and fields): the fork's Pooling run backward, its bottom
  taken as the pooled map's gradient.  The constructor turns MAX into SWITCH.  Top 0 (N, C, Hd, Wd) with
  Hd = (H - 1) * stride + kernel - 2 * pad (Wd likewise); Reshape then sizes the inner Pooling from Hd, Wd
  (ceil, the padded last window clipped) and CHECKs that it gives H, W back (it always does for pad <
  kernel; caffeq checks it all the same).  The optional top 1 is the
  Pooling's backward weights, shaped like top 0: per cell, how much of the windows reach it.  The GPU
  forward (MaxPoolBackward, AvePoolBackward, SumPoolBackward, FixPoolBackward, SoftSwitchPoolBackward),
  which the fork's nets ran, gathers per depooled cell (h, w) over the windows (ph, pw) that cover it:
  - SWITCH (2 bottoms: values, mask shaped like the values; MAX): the window's value and weight 1 go to
    the cell whose index equals the mask value as a float, the plane's h * Wd + w (GLOBAL) or the window's
    (h - hstart) * kernel_w + (w - wstart) (LOCAL, mask_index_type).  A mask value that is not such an
    index of a cell in its window gives nothing (the CPU loop would write wherever it points: not read).
  - AVE: value / pool_size and weight 1 / pool_size to each cell of the window, pool_size counting the
    window up to H + pad; SUM: the value and weight 1.
  - FIX (no pad; fix, or fix_x / fix_y, -1 the centre kernel / 2): the value and weight 1 to the window's
    cell (fix_y, fix_x) when it lies in the map (the CPU loop leaves the weights 0: not read).  caffeq
    reads a fix cell inside the kernel only.
  - SOFT_SWITCH (2 bottoms: values and switches, Reshape CHECKs (N, kh * kw, C, H, W)): the kernel reads
    the switches' memory as (N, C, kh * kw, H, W): value * switch and the switch to the window's cells.
    Refused with pad: SoftSwitchPoolBackward's h and w include the pad and its window start subtracts it,
    so it takes each switch pad rows and columns further on (the next channel's, past the blob at the last).
  STOCHASTIC is NOT_IMPLEMENTED and global_pooling CHECK-refused.  The header's bottom/top count methods
  are misnamed (never called): caffeq takes exactly the bottoms a method reads and 1 or 2 tops.
- SafeInv (NeuronLayer): y = 0 where x == 0, else 1 / x (CPU and GPU alike).
- ImageOutput (image_output_param): saves its one bottom as image files at every forward, no tops.
  caffeq reads it, checks auto_ratio as LayerSetUp does, and writes no files (as the other writers).
"""
import numpy as np
import torch

from .common import Sink
from .registry import Layer, LayerError, cached_constant, four_axes, need_blobs, positive_field, register_layer

MAX, AVE, STOCHASTIC, FIX, SWITCH, SOFT_SWITCH, SUM = 0, 1, 2, 31, 32, 33, 34
METHOD_NAMES = {AVE: "ave", SUM: "sum", FIX: "fix", SWITCH: "switch", SOFT_SWITCH: "soft_switch"}

# ---- Depooling ------------------------------------------------------------------------------------


def _pair(p, one, h, w, default, what):
    """pooling_param's value given once (`one`) or as `h` and `w`, as LayerSetUp's CHECKs accept them."""
    given_one, given_h, given_w = len(getattr(p, one)) > 0, p.HasField(h), p.HasField(w)
    if len(getattr(p, one)) > 1:
        raise LayerError(f"pooling_param.{one}: Depooling takes one value, got {list(getattr(p, one))}")
    if given_one and (given_h or given_w):
        raise LayerError(f"pooling_param: {what} is {one} OR {h} and {w}, not both")
    if given_h != given_w:
        raise LayerError(f"pooling_param: {h} and {w} go together")
    if given_h:
        return int(getattr(p, h)), int(getattr(p, w))
    if given_one:
        return int(getattr(p, one)[0]), int(getattr(p, one)[0])
    if default is None:
        raise LayerError("pooling_param.kernel_size (or kernel_h and kernel_w) is required")
    return default, default


def depool_geometry(attrs, h: int, w: int):
    """(Hd, Wd) of Depooling's top for an H x W bottom, after the fork's Reshape checks."""
    (kh, kw), (sh, sw), (ph, pw) = attrs["kernel"], attrs["stride"], attrs["pad"]
    out = []
    for axis, n, k, s, p in (("height", h, kh, sh, ph), ("width", w, kw, sw, pw)):
        depooled = (n - 1) * s + k - 2 * p
        if depooled < 1:
            raise LayerError(f"Depooling's top {axis} ({n} - 1) * {s} + {k} - 2 * {p} = {depooled} is empty")
        pooled = -(-(depooled + 2 * p - k) // s) + 1
        if p and (pooled - 1) * s >= depooled + p:
            pooled -= 1
        if pooled != n:   # Reshape's CHECK_EQ "mismatched shape between pooling and depooling"
            raise LayerError(f"Depooling: pooling its {depooled}-cell {axis} gives {pooled}, not the bottom's {n}")
        out.append(depooled)
    return tuple(out)


def depool_window_starts(n_pooled: int, stride: int, pad: int, device=None):
    return torch.arange(n_pooled, device=device) * stride - pad


def depool_switch_hits(mask, kernel, stride, pad, out_hw, local: bool):
    """(N, C, kh * kw, H, W) booleans: which cell of each window a SWITCH mask names (none for a value that
    names no cell of its window)."""
    kh, kw = kernel
    hd, wd = out_hw
    mi = torch.floor(mask)
    integral = mask == mi
    if local:
        valid = integral & (mi >= 0) & (mi < kh * kw)
        cell = torch.where(valid, mi, torch.zeros_like(mi)).long()
    else:
        valid = integral & (mi >= 0) & (mi < hd * wd)
        index = torch.where(valid, mi, torch.zeros_like(mi)).long()
        hs = depool_window_starts(mask.shape[2], stride[0], pad[0], mask.device).view(-1, 1)
        ws = depool_window_starts(mask.shape[3], stride[1], pad[1], mask.device)
        dy = torch.div(index, wd, rounding_mode="floor") - hs
        dx = index % wd - ws
        valid = valid & (dy >= 0) & (dy < kh) & (dx >= 0) & (dx < kw)
        cell = dy * kw + dx
    cells = torch.arange(kh * kw, device=mask.device).view(1, 1, -1, 1, 1)
    return valid.unsqueeze(2) & (cell.unsqueeze(2) == cells)


def depool_pool_sizes(shape_hw, kernel, stride, pad, out_hw, device=None):
    """AVE's pool_size per window (H, W): the window counted up to the padded map's end."""
    sizes = []
    for axis in range(2):
        start = depool_window_starts(shape_hw[axis], stride[axis], pad[axis], device)
        end = torch.clamp(start + kernel[axis], max=out_hw[axis] + pad[axis])
        sizes.append(end - start)
    return sizes[0].view(-1, 1) * sizes[1].view(1, -1)


def depool_columns(x, extra, method: str, kernel, stride, pad, out_hw, local: bool, fix_cell: int):
    """What each window gives each of its kh * kw cells, (N, C, kh * kw, H, W), and their weights."""
    n, c, h, w = x.shape
    kk = kernel[0] * kernel[1]
    if method == "switch":
        hits = depool_switch_hits(extra, kernel, stride, pad, out_hw, local)
        values = torch.where(hits, x.unsqueeze(2), torch.zeros_like(x).unsqueeze(2))
        return values, hits.to(x.dtype)
    if method == "soft_switch":
        switches = extra.reshape(n, c, kk, h, w)
        return x.unsqueeze(2) * switches, switches
    if method == "ave":
        sizes = depool_pool_sizes((h, w), kernel, stride, pad, out_hw, x.device).to(x.dtype)
        values = (x / sizes).unsqueeze(2).expand(n, c, kk, h, w)
        return values, (1.0 / sizes).expand(n, c, kk, h, w)
    if method == "sum":
        return x.unsqueeze(2).expand(n, c, kk, h, w), torch.ones_like(x).unsqueeze(2).expand(n, c, kk, h, w)
    hits = (torch.arange(kk, device=x.device) == fix_cell).view(1, 1, kk, 1, 1)
    values = torch.where(hits, x.unsqueeze(2), torch.zeros_like(x).unsqueeze(2))
    return values, hits.to(x.dtype).expand(n, c, kk, h, w)


def depool_axis_windows(n_out: int, n_pooled: int, k: int, s: int, p: int):
    """Along one axis, the windows that cover each depooled cell, in the GPU kernel's order: (window index,
    offset in the window, valid), each (ceil(k / s), n_out)."""
    y = torch.arange(n_out)
    first = torch.where(y + p < k, torch.zeros_like(y), torch.div(y + p - k, s, rounding_mode="floor") + 1)
    end = torch.clamp(torch.div(y + p, s, rounding_mode="floor") + 1, max=n_pooled)
    window = first + torch.arange(-(-k // s)).view(-1, 1)
    return window, y + p - window * s, window < end


def depool_gather_table(h: int, w: int, kernel, stride, pad, out_hw):
    """(J, Hd * Wd) int64: per depooled cell, its j-th covering window's column (flattened (kh * kw, H, W)
    index) in the kernel's order (rows, then columns), or kh * kw * H * W (a zero) past its last."""
    kh, kw = kernel
    wy, dy, vy = (t.view(-1, 1, out_hw[0], 1) for t in depool_axis_windows(out_hw[0], h, kh, stride[0], pad[0]))
    wx, dx, vx = (t.view(1, -1, 1, out_hw[1]) for t in depool_axis_windows(out_hw[1], w, kw, stride[1], pad[1]))
    column = ((dy * kw + dx) * h + wy) * w + wx
    table = torch.where(vy & vx, column, torch.full_like(column, kh * kw * h * w))
    return table.reshape(-1, out_hw[0] * out_hw[1])


def depool_spread(cols, table, out_hw):
    """Each depooled cell's sum of its windows' columns, added in the table's order from 0."""
    n, c = cols.shape[:2]
    flat = torch.cat([cols.reshape(n, c, -1), torch.zeros_like(cols[:, :, 0, 0, :1])], dim=2)
    total = torch.zeros((n, c, table.shape[1]), dtype=cols.dtype, device=cols.device)
    for row in table:
        total = total + flat[:, :, row]
    return total.reshape(n, c, out_hw[0], out_hw[1])


def caffe_depool(x, extra, table, method: str, kernel, stride, pad, out_hw, local: bool, fix_cell: int):
    """caffe-recon-dec's Depooling: (top, backward weights), each (N, C, Hd, Wd)."""
    values, weights = depool_columns(x, extra, method, kernel, stride, pad, out_hw, local, fix_cell)
    table = table.to(x.device)
    return depool_spread(values, table, out_hw), depool_spread(weights, table, out_hw)


@register_layer("Depooling")
class Depooling(Layer):
    def parse(self, lp):
        p = lp.pooling_param
        pool = int(p.pool)
        if pool == MAX:   # the constructor's rewrite
            pool = SWITCH
        if pool == STOCHASTIC:
            raise LayerError("Depooling: pooling_param.pool STOCHASTIC is NOT_IMPLEMENTED in the fork")
        if pool not in METHOD_NAMES:
            raise LayerError(f"Depooling: pooling_param.pool {pool} is not one of the fork's methods")
        if p.global_pooling:
            raise LayerError("Depooling does not support pooling_param.global_pooling (the fork's CHECK)")
        bottoms = 2 if pool in (SWITCH, SOFT_SWITCH) else 1
        roles = "values, mask" if pool == SWITCH else "values, switches" if pool == SOFT_SWITCH else "values"
        need_blobs(lp, "Depooling", bottoms, (1, 2), roles, in_place=False)
        kernel = _pair(p, "kernel_size", "kernel_h", "kernel_w", None, "Filter size")
        for k in kernel:
            positive_field(k, "pooling_param.kernel_size")
        pad = _pair(p, "pad", "pad_h", "pad_w", 0, "pad")
        stride = _pair(p, "stride", "stride_h", "stride_w", 1, "Stride")
        for s in stride:
            positive_field(s, "pooling_param.stride")
        if any(pad) and pool == SOFT_SWITCH:   # the GPU kernel's shifted switch index (see the docstring)
            raise LayerError("Depooling: SOFT_SWITCH with pooling_param.pad is not supported (the fork's GPU kernel "
                             "reads each switch pad cells past its own, past the end of the switches)")
        if any(pad) and pool == FIX:
            raise LayerError("Depooling: pooling_param.pad is refused for FIX (the fork's CHECK)")
        if any(a >= k for a, k in zip(pad, kernel)):
            raise LayerError(f"Depooling: pooling_param.pad {list(pad)} must be smaller than the kernel {list(kernel)}")
        fix_fields = [f for f in ("fix", "fix_x", "fix_y") if p.HasField(f)]
        fix_cell = 0
        if pool == FIX:
            fy, fx = (p.fix_y, p.fix_x) if p.HasField("fix_y") else (p.fix, p.fix)
            fy, fx = (kernel[0] // 2 if fy < 0 else fy), (kernel[1] // 2 if fx < 0 else fx)
            if fy >= kernel[0] or fx >= kernel[1]:
                raise LayerError(f"Depooling: pooling_param fix cell ({fy}, {fx}) outside the {kernel[0]}x{kernel[1]}"
                                 " window is not supported")
            fix_cell = fy * kernel[1] + fx
        elif fix_fields:
            raise LayerError(f"Depooling: pooling_param.{fix_fields[0]} only works with FIX (the fork's CHECK)")
        return {"method": METHOD_NAMES[pool], "kernel": kernel, "stride": stride, "pad": pad,
                "local": p.mask_index_type == 1, "fix_cell": fix_cell, "weights_top": len(lp.top) == 2}

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "Depooling", "values bottom")
        if attrs["method"] == "switch" and tuple(in_shapes[1]) != (n, c, h, w):
            raise LayerError(f"Depooling's mask bottom {list(in_shapes[1])} must be shaped like its values "
                             f"{[n, c, h, w]} (the fork's 'wrong size of switch input')")
        if attrs["method"] == "soft_switch":
            want = (n, attrs["kernel"][0] * attrs["kernel"][1], c, h, w)
            if tuple(in_shapes[1]) != want:
                raise LayerError(f"Depooling's switches bottom {list(in_shapes[1])} must be {list(want)} "
                                 "(the fork's 'wrong size of soft switch input')")
        top = (n, c) + depool_geometry(attrs, h, w)
        return [top] * (2 if attrs["weights_top"] else 1)

    def _args(self, attrs, out_hw):
        return (attrs["method"], list(attrs["kernel"]), list(attrs["stride"]), list(attrs["pad"]), list(out_hw),
                attrs["local"], attrs["fix_cell"])

    @staticmethod
    def _table_args(attrs, h, w, out_hw):
        return h, w, tuple(attrs["kernel"]), tuple(attrs["stride"]), tuple(attrs["pad"]), tuple(out_hw)

    def forward(self, attrs, params, x, *extra):
        h, w = x.shape[2:]
        out_hw = depool_geometry(attrs, h, w)
        table = cached_constant(depool_gather_table, *self._table_args(attrs, h, w, out_hw), device=x.device)
        top, weights = caffe_depool(x, extra[0] if extra else None, table, *self._args(attrs, out_hw))
        return (top, weights) if attrs["weights_top"] else top

    def onnx(self, ctx, node):
        a = node.attrs
        x = node.inputs[0]
        n, c, h, w = ctx.shape(x)
        out_hw = depool_geometry(a, h, w)
        kk = a["kernel"][0] * a["kernel"][1]
        x5 = ctx.op("Reshape", [x, ctx.i64([n, c, 1, h, w])], "x5")
        full = ctx.i64([n, c, kk, h, w])
        zero = ctx.f32(0.0)
        if a["method"] == "switch":
            hits = _onnx_switch_hits(ctx, node.inputs[1], a, (n, c, h, w), out_hw)
            values = ctx.op("Where", [hits, x5, zero], "values")
            weights = ctx.op("Cast", [hits], "weights", to=1)
        elif a["method"] == "soft_switch":
            weights = ctx.op("Reshape", [node.inputs[1], full], "switches")
            values = ctx.op("Mul", [x5, weights], "values")
        elif a["method"] == "fix":
            hits = ctx.const((np.arange(kk) == a["fix_cell"]).reshape(1, 1, kk, 1, 1))
            values = ctx.op("Where", [hits, x5, zero], "values")
            weights = ctx.op("Expand", [ctx.op("Cast", [hits], "hit_weights", to=1), full], "weights")
        else:
            if a["method"] == "ave":
                sizes = depool_pool_sizes((h, w), a["kernel"], a["stride"], a["pad"], out_hw).numpy()
                x5 = ctx.op("Div", [x5, ctx.const(sizes.astype(np.float32))], "shares")
                each = ctx.const((np.float32(1.0) / sizes.astype(np.float32)))
            else:
                each = ctx.f32(1.0)
            values = ctx.op("Expand", [x5, full], "values")
            weights = ctx.op("Expand", [each, full], "weights")
        table = depool_gather_table(*self._table_args(a, h, w, out_hw)).numpy()
        outs = [_onnx_spread(ctx, values, table, (n, c) + out_hw, "top")]
        if a["weights_top"]:
            outs.append(_onnx_spread(ctx, weights, table, (n, c) + out_hw, "bw"))
        for got, out in zip(outs, node.outputs):
            ctx.add_node("Identity", [got], [out], name=f"{node.name}/{out}")

    def pytorch_source(self, node, emit):
        for fn in (depool_window_starts, depool_switch_hits, depool_pool_sizes, depool_columns,
                   depool_axis_windows, depool_spread):
            emit.helper(fn)
        extra = emit.inputs[1] if len(emit.inputs) > 1 else "None"
        h, w = emit.in_shape(0)[2:]
        out_hw = emit.out_shape(0)[2:]
        table = f"{emit.helper(depool_gather_table)}{self._table_args(node.attrs, h, w, out_hw)!r}"
        args = ", ".join(repr(a) for a in self._args(node.attrs, out_hw))
        call = f"{emit.helper(caffe_depool)}({emit.inputs[0]}, {extra}, {table}, {args})"
        if node.attrs["weights_top"]:
            return [f"{call}[0]", f"{call}[1]"]
        return f"{call}[0]"


def _onnx_switch_hits(ctx, mask, a, shape, out_hw):
    """depool_switch_hits in ONNX: (N, C, kh * kw, H, W) booleans."""
    n, c, h, w = shape
    (kh, kw), kk = a["kernel"], a["kernel"][0] * a["kernel"][1]
    zero = ctx.f32(0.0)
    mi = ctx.op("Floor", [mask], "mask_floor")
    valid = ctx.op("And", [ctx.op("Equal", [mask, mi], "integral"),
                           ctx.op("Not", [ctx.op("Less", [mi, zero], "negative")], "nonnegative")], "valid0")
    limit = kk if a["local"] else out_hw[0] * out_hw[1]
    valid = ctx.op("And", [valid, ctx.op("Less", [mi, ctx.f32(float(limit))], "below")], "valid1")
    index = ctx.op("Cast", [ctx.op("Where", [valid, mi, zero], "safe_index")], "index", to=7)
    if a["local"]:
        cell = index
    else:
        hs = depool_window_starts(h, a["stride"][0], a["pad"][0]).numpy().reshape(-1, 1)
        ws = depool_window_starts(w, a["stride"][1], a["pad"][1]).numpy()
        dy = ctx.op("Sub", [ctx.op("Div", [index, ctx.i64(out_hw[1])], "row"), ctx.const(hs)], "dy")
        dx = ctx.op("Sub", [ctx.op("Mod", [index, ctx.i64(out_hw[1])], "col"), ctx.const(ws)], "dx")
        for d, k, hint in ((dy, kh, "y"), (dx, kw, "x")):
            inside = ctx.op("And", [ctx.op("Not", [ctx.op("Less", [d, ctx.i64(0)], f"before_{hint}")], f"from_{hint}"),
                                    ctx.op("Less", [d, ctx.i64(k)], f"upto_{hint}")], f"inside_{hint}")
            valid = ctx.op("And", [valid, inside], f"valid_{hint}")
        cell = ctx.op("Add", [ctx.op("Mul", [dy, ctx.i64(kw)], "dy_kw"), dx], "cell")
    shape5 = ctx.i64([n, c, 1, h, w])
    same = ctx.op("Equal", [ctx.op("Reshape", [cell, shape5], "cell5"), ctx.i64(np.arange(kk).reshape(1, 1, kk, 1, 1))],
                  "same_cell")
    return ctx.op("And", [ctx.op("Reshape", [valid, shape5], "valid5"), same], "hits")


def _onnx_spread(ctx, cols, table, out_shape, hint):
    """depool_spread in ONNX: one Gather and Add per row of the table, in its order."""
    n, c, hd, wd = out_shape
    flat = ctx.op("Reshape", [cols, ctx.i64([n, c, -1])], f"{hint}_flat")
    zeros = ctx.op("Expand", [ctx.f32(0.0), ctx.i64([n, c, 1])], f"{hint}_zeros")
    flat = ctx.op("Concat", [flat, zeros], f"{hint}_padded", axis=2)
    total = ctx.f32(0.0)   # broadcast by the first Add, as the kernel starts from 0
    for j, row in enumerate(table):
        total = ctx.op("Add", [total, ctx.op("Gather", [flat, ctx.const(row)], f"{hint}_take{j}", axis=2)],
                       f"{hint}_sum{j}")
    return ctx.op("Reshape", [total, ctx.i64([n, c, hd, wd])], f"{hint}_map")


# ---- SafeInv --------------------------------------------------------------------------------------


def caffe_safe_inv(x):
    """1 / x, and 0 where x is 0."""
    return torch.where(x == 0, torch.zeros_like(x), 1.0 / x)


@register_layer("SafeInv")
class SafeInv(Layer):
    bottoms, tops = 1, 1

    def forward(self, attrs, params, x):
        return caffe_safe_inv(x)

    def onnx(self, ctx, node):
        x = node.inputs[0]
        inv = ctx.op("Div", [ctx.f32(1.0), x], "inv")
        ctx.add_node("Where", [ctx.op("Equal", [x, ctx.f32(0.0)], "zero"), ctx.f32(0.0), inv], [node.outputs[0]],
                     name=node.name)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(caffe_safe_inv)}({emit.inputs[0]})"


# ---- ImageOutput ----------------------------------------------------------------------------------


@register_layer("ImageOutput")
class ImageOutput(Sink):
    """caffe-recon-dec's image writer: each forward saves its bottom (scaled, or AutoSCALEd per item) as
    image files under output_prefix; no tops, nothing to compute, and caffeq writes no files."""

    def parse(self, lp):
        need_blobs(lp, "ImageOutput", 1, 0)
        q = lp.image_output_param
        if q.normalization == 2 and not 0.0 < np.float32(q.auto_ratio) <= 1.0:
            raise LayerError(f"ImageOutput: image_output_param.auto_ratio must be > 0 and <= 1, got {q.auto_ratio:g}")
        return {}
