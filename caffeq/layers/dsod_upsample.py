"""Tiny-DSOD's Upsample (lyxok1/Tiny-DSOD and its copies, e.g. kanatmg/Tiny-DSOD-plate 0b61451,
upsample_layer.cpp/.cu): two bottoms, no upsample_param; bottom 1 resized bilinearly to bottom 0's
height and width (the top is shaped like bottom 0, its channels read from bottom 1).

Per axis, with r = float(out) / in (float32): b = (i + 1) / r - 1, t = (int)b (towards zero),
low = max(t, 0), high = min(t + 1, in - 1), w_low = t < 0 ? 0 : 1 - (b - t), w_high = t + 1 > in - 1 ?
0 : 1 - w_low (so a first sample left of 0 extrapolates: w_low > 1, w_high < 0).  Each output is
0 + (wxl wyl) v(yl, xl) + (wxh wyl) v(yl, xh) + (wxl wyh) v(yh, xl) + (wxh wyh) v(yh, xh), in float32 as
the kernels.  Upsample (vision_forks) reads a two-bottom, parameterless layer this way where its
second bottom is smaller than the first, which SegNet's mask reading refuses.
"""
import torch


def dsod_axis(out_size: int, in_size: int):
    """(low, high) int64 indexes and (w_low, w_high) float32 weights of one axis, as the fork."""
    f32 = torch.float32
    ratio = torch.tensor(float(out_size), dtype=f32) / torch.tensor(float(in_size), dtype=f32)
    b = (torch.arange(1, out_size + 1, dtype=f32) / ratio) - torch.tensor(1.0, dtype=f32)
    t = b.to(torch.int64)                      # C's (int) cast truncates towards zero
    low = t.clamp(min=0)
    high = (t + 1).clamp(max=in_size - 1)
    zero, one = torch.zeros((), dtype=f32), torch.ones((), dtype=f32)
    w_low = torch.where(t < 0, zero, one - (b - t.to(f32)))
    w_high = torch.where(t + 1 > in_size - 1, zero, one - w_low)
    return low, high, w_low, w_high


def dsod_upsample(x, out_h: int, out_w: int):
    """bottom 1 (N, C, h, w) resized to (N, C, out_h, out_w) by Tiny-DSOD's weights."""
    yl, yh, wyl, wyh = (t.to(x.device) for t in dsod_axis(out_h, x.shape[2]))
    xl, xh, wxl, wxh = (t.to(x.device) for t in dsod_axis(out_w, x.shape[3]))
    rows_low, rows_high = x[:, :, yl, :], x[:, :, yh, :]
    terms = [(wxl[None, :] * wyl[:, None], rows_low[..., xl]), (wxh[None, :] * wyl[:, None], rows_low[..., xh]),
             (wxl[None, :] * wyh[:, None], rows_high[..., xl]), (wxh[None, :] * wyh[:, None], rows_high[..., xh])]
    y = None
    for weight, values in terms:
        term = weight.to(x.dtype) * values
        y = term if y is None else y + term
    return y


def onnx_dsod_upsample(ctx, node, x, out, in_hw, out_h: int, out_w: int):
    """The same as Gathers of the rows and columns, constant weights, and Adds in the kernel's order."""
    h, w = in_hw
    yl, yh, wyl, wyh = dsod_axis(out_h, h)
    xl, xh, wxl, wxh = dsod_axis(out_w, w)
    rows = {"low": ctx.op("Gather", [x, ctx.i64(yl.tolist())], "rows_low", axis=2),
            "high": ctx.op("Gather", [x, ctx.i64(yh.tolist())], "rows_high", axis=2)}
    y = None
    for k, (row, wy, cols, wx) in enumerate((("low", wyl, xl, wxl), ("low", wyl, xh, wxh),
                                             ("high", wyh, xl, wxl), ("high", wyh, xh, wxh))):
        values = ctx.op("Gather", [rows[row], ctx.i64(cols.tolist())], f"values{k}", axis=3)
        weight = (wx[None, :] * wy[:, None]).numpy()[None, None]
        term = ctx.op("Mul", [ctx.const(weight), values], f"term{k}")
        y = term if y is None else ctx.op("Add", [y, term], f"sum{k}")
    ctx.add_node("Identity", [y], [out], name=node.name)
