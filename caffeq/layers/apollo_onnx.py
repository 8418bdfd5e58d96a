"""ONNX for Apollo's perception layers (caffeq/layers/apollo.py): the same steps as the torch
functions there, in the same float32 (and, where the kernels use double, float64) order."""
import numpy as np

from .norm import onnx_reduce

# ---- DFMBPSROIAlign as ONNX ops: dfmb_psroi_align step for step, the samples gathered from the flat map --

def emit_dfmb_psroi_align(ctx, node):
    a = node.attrs
    name = node.name
    n, channels, height, width = ctx.shape(node.inputs[0])
    r = ctx.shape(node.inputs[1])[0]
    dim, ph_n, pw_n, spp = a["output_dim"], a["pooled_height"], a["pooled_width"], a["sample_per_part"]
    gh_n, gw_n = a["group_height"], a["group_width"]
    f32 = lambda v: ctx.const(np.array(v, np.float32))   # noqa: E731
    i64 = lambda v: ctx.const(np.array(v, np.int64))     # noqa: E731

    def op(kind, inputs, hint, **kw):
        return ctx.add_node(kind, inputs, [ctx.tmp(f"{name}_{hint}")], **kw)[0]

    def trunc(v, hint):   # C's float-to-int conversion, kept as a float
        return op("Where", [op("Less", [v, f32(0.0)], hint + "_neg"), op("Ceil", [v], hint + "_up"),
                            op("Floor", [v], hint + "_down")], hint)

    rois = op("Reshape", [node.inputs[1], i64([r, -1])], "rois")
    col = [op("Reshape", [op("Gather", [rois, i64(k)], f"c{k}", axis=1), i64([r, 1, 1, 1])], f"roi{k}")
           for k in range(5)]
    b = trunc(col[0], "b")
    live = op("And", [op("GreaterOrEqual", [b, f32(0.0)], "b_ge0"), op("Less", [b, f32(float(n))], "b_ltn")], "live")
    one, pad, hb, ha = f32(1.0), f32(a["pad_ratio"]), f32(a["heat_map_b"]), f32(a["heat_map_a"])
    pad_w = op("Mul", [op("Add", [op("Sub", [col[3], col[1]], "w0"), one], "w1"), pad], "pad_w")
    pad_h = op("Mul", [op("Add", [op("Sub", [col[4], col[2]], "h0"), one], "h1"), pad], "pad_h")
    start_w = op("Div", [op("Sub", [op("Sub", [col[1], pad_w], "sw0"), hb], "sw1"), ha], "start_w")
    start_h = op("Div", [op("Sub", [op("Sub", [col[2], pad_h], "sh0"), hb], "sh1"), ha], "start_h")
    end_w = op("Div", [op("Sub", [op("Add", [col[3], pad_w], "ew0"), hb], "ew1"), ha], "end_w")
    end_h = op("Div", [op("Sub", [op("Add", [col[4], pad_h], "eh0"), hb], "eh1"), ha], "end_h")
    roi_w = op("Max", [op("Sub", [end_w, start_w], "rw0"), f32(0.1)], "roi_w")
    roi_h = op("Max", [op("Sub", [end_h, start_h], "rh0"), f32(0.1)], "roi_h")
    bin_w, bin_h = op("Div", [roi_w, f32(float(pw_n))], "bin_w"), op("Div", [roi_h, f32(float(ph_n))], "bin_h")
    sub_w, sub_h = op("Div", [bin_w, f32(float(spp))], "sub_w"), op("Div", [bin_h, f32(float(spp))], "sub_h")
    ph = np.arange(ph_n, dtype=np.float32)
    pw = np.arange(pw_n, dtype=np.float32)
    hstart = op("Add", [op("Mul", [f32(ph.reshape(1, 1, ph_n, 1)), bin_h], "hs0"), start_h], "hs1")
    wstart = op("Add", [op("Mul", [f32(pw.reshape(1, 1, 1, pw_n)), bin_w], "ws0"), start_w], "ws1")
    if len(node.inputs) == 3:
        classes = ctx.shape(node.inputs[2])[1] // 2
        part_h = np.trunc(ph / np.float32(ph_n) * np.float32(a["part_height"])).astype(np.int64)
        part_w = np.trunc(pw / np.float32(pw_n) * np.float32(a["part_width"])).astype(np.int64)
        cls = np.arange(dim) // (dim // classes)
        at = lambda k: ((((cls * 2 + k)[:, None, None] * a["part_height"] + part_h[None, :, None])   # noqa: E731
                         * a["part_width"]) + part_w[None, None, :])
        t = op("Reshape", [op("Slice", [node.inputs[2], i64([0]), i64([r]), i64([0])], "t_r"), i64([r, -1])], "t")
        std = f32(a["trans_std"])
        trans_x = op("Mul", [op("Gather", [t, i64(at(0))], "tx0", axis=1), std], "trans_x")
        trans_y = op("Mul", [op("Gather", [t, i64(at(1))], "ty0", axis=1), std], "trans_y")
        hstart = op("Add", [hstart, op("Mul", [trans_y, roi_h], "ty_r")], "hs2")
        wstart = op("Add", [wstart, op("Mul", [trans_x, roi_w], "tx_r")], "ws2")
    shape = i64([r, dim, ph_n, pw_n, 1, 1])
    hstart = op("Reshape", [op("Expand", [trunc(hstart, "hst"), i64([r, dim, ph_n, pw_n])], "hse"), shape], "hstart")
    wstart = op("Reshape", [op("Expand", [trunc(wstart, "wst"), i64([r, dim, ph_n, pw_n])], "wse"), shape], "wstart")
    off = np.arange(spp, dtype=np.float64) + 0.5
    as6 = i64([r, 1, 1, 1, 1, 1])
    dbl = lambda v, hint: op("Cast", [v], hint, to=11)   # noqa: E731  DOUBLE
    hs = op("Cast", [op("Add", [dbl(hstart, "hs_d"), op("Mul", [ctx.const(off.reshape(spp, 1)),
                                                               op("Reshape", [dbl(sub_h, "sh_d"), as6], "sh6")],
                                                         "hoff")], "hs_sum")], "hs", to=1)
    ws = op("Cast", [op("Add", [dbl(wstart, "ws_d"), op("Mul", [ctx.const(off.reshape(1, spp)),
                                                               op("Reshape", [dbl(sub_w, "sw_d"), as6], "sw6")],
                                                         "woff")], "ws_sum")], "ws", to=1)
    full = i64([r, dim, ph_n, pw_n, spp, spp])
    hs, ws = op("Expand", [hs, full], "hs_all"), op("Expand", [ws, full], "ws_all")
    outside = op("Or", [op("Or", [op("LessOrEqual", [ws, f32(-1.0)], "w_lo"),
                                  op("GreaterOrEqual", [ws, f32(float(width))], "w_hi")], "w_out"),
                        op("Or", [op("LessOrEqual", [hs, f32(-1.0)], "h_lo"),
                                  op("GreaterOrEqual", [hs, f32(float(height))], "h_hi")], "h_out")], "outside")
    gh = np.clip(np.floor(ph * np.float32(gh_n) / np.float32(ph_n)).astype(np.int64), 0, gh_n - 1)
    gw = np.clip(np.floor(pw * np.float32(gw_n) / np.float32(pw_n)).astype(np.int64), 0, gw_n - 1)
    chan = (np.arange(dim)[:, None, None] * gh_n + gh[None, :, None]) * gw_n + gw[None, None, :]
    b_idx = op("Cast", [op("Clip", [b, f32(0.0), f32(float(n - 1))], "b_clip")], "b_i", to=7)
    base = op("Mul", [op("Add", [op("Mul", [b_idx, i64(channels)], "b_c"), i64(chan[None])], "bc"),
                      i64(height * width)], "base0")
    base = op("Reshape", [base, shape], "base")
    flat = op("Reshape", [node.inputs[0], i64([-1])], "flat")
    x1, y1, x2, y2 = op("Floor", [ws], "x1"), op("Floor", [hs], "y1"), op("Ceil", [ws], "x2"), op("Ceil", [hs], "y2")
    dx, dy = op("Sub", [ws, x1], "dx"), op("Sub", [hs, y1], "dy")
    zero = f32(0.0)

    def corner(xc, yc, hint):
        ok = op("And", [op("And", [op("GreaterOrEqual", [xc, zero], hint + "_x0"),
                                   op("Less", [xc, f32(float(width))], hint + "_xw")], hint + "_x"),
                        op("And", [op("GreaterOrEqual", [yc, zero], hint + "_y0"),
                                   op("Less", [yc, f32(float(height))], hint + "_yh")], hint + "_y")], hint + "_ok")
        pos = op("Add", [op("Mul", [op("Clip", [yc, zero, f32(float(height - 1))], hint + "_yc"), f32(float(width))],
                            hint + "_row"),
                         op("Clip", [xc, zero, f32(float(width - 1))], hint + "_xc")], hint + "_pos")
        idx = op("Add", [base, op("Cast", [pos], hint + "_posi", to=7)], hint + "_idx")
        return op("Where", [ok, op("Gather", [flat, idx], hint + "_v", axis=0), zero], hint)

    ux, uy = op("Sub", [one, dx], "ux"), op("Sub", [one, dy], "uy")
    terms = [op("Mul", [op("Mul", [wx, wy], f"w{k}"), corner(cx, cy, f"c{k}")], f"t{k}")
             for k, (wx, wy, cx, cy) in enumerate(((ux, uy, x1, y1), (ux, dy, x1, y2), (dx, uy, x2, y1),
                                                   (dx, dy, x2, y2)))]
    value = op("Add", [op("Add", [op("Add", [terms[0], terms[1]], "s01"), terms[2]], "s012"), terms[3]], "value")
    value = op("Where", [outside, zero, value], "taken")
    total = onnx_reduce(ctx, "ReduceSum", value, [4, 5], False, ctx.tmp(name + "_total"))
    count = onnx_reduce(ctx, "ReduceSum", op("Cast", [op("Not", [outside], "inside")], "inside_f", to=1), [4, 5],
                        False, ctx.tmp(name + "_count"))
    mean = op("Div", [total, op("Max", [count, one], "count1")], "mean")
    mean = op("Where", [op("Equal", [count, zero], "none"), zero, mean], "pooled")
    ctx.add_node("Where", [live, mean, zero], [node.outputs[0]], name=name)
