"""aayushbansal/PixelNet (227c48e, tools/caffe): RandBI, the hypercolumn sampler of its nets (and, below,
MarrRevisited's RandCat and RandCatConv from aayushbansal/caffe).

RandBI (src/caffe/layers/rand_bi_layer.cpp; the fork has no CUDA code, so a GPU run computes the
same on the CPU) takes feature maps f_1..f_B (num/channels/height/width as Caffe's legacy accessors
read them) and last a `pixels` blob of P rows (image, y, x): the row's first value indexes the image
(truncated to an int), the second the map's height and the third its width (the deploy files'
comment says "id, x, y", the names of the MATLAB demo, whose images are transposed).  The top is
P x (C_1 + ... + C_B): for each pixel, the channels of f_1, then of f_2, and so on.

For map b with rate r = `rand_comp_param.compression_rate[b]` and pad p = (r - 1) / 2 when
`rand_comp_param.pad` (else 0), all in float32 as the fork: t = (x - p) / r; lo = floor(t) and
hi = ceil(t), each raised to 0 when negative; likewise along y.  The value is f[id, c, lo_y, lo_x]
when both axes have lo == hi, the linear mix along the one axis where they differ, else the
bilinear mix, with weights 1 - (t - lo) and t - lo.  The fork mixes as C++ evaluates
`v * (1. - r) + w * r`: the `1. - r` terms in double, the `w * r` products in float32, the sums in
double, rounded to float32 once; caffeq computes the same.  A NaN or infinite t reads row or column 0
(the fork's int conversion gives INT_MIN there on x86, then 0); a finite t past 2^31 (undefined in
C++, INT_MIN on x86) counts as past the map here.

Where the fork aborts (CHECK: an id outside [0, num) of a map, or hi >= the map's height or width),
caffeq's forward raises a DataError naming the pixel; ONNX and model.py cannot stop a run and clamp
the reads to the map instead.  Nothing is random: the pixels are an input (the MATLAB demo feeds every
pixel of a 100-pixel padded crop), so train and test compute the same.
"""
from __future__ import annotations

import numpy as np
import torch

from ..errors import DataError, ExportError
from .misc import eager_checks
from .registry import AT_LEAST, Layer, LayerError, legacy_nchw, need_blobs, register_layer

# ---- torch (model.py copies these) -----------------------------------------------------------


def randbi_axis(pos, pad: float, rate: int):
    """(lo, hi, frac) along one axis: t = (pos - pad) / rate (non-finite t read as 0), lo and hi its
    floor and ceil raised to 0, frac = t - lo; all in pos's dtype."""
    t = (pos - pad) / torch.full_like(pos, float(rate))   # a true division, as the fork's (not by 1 / rate)
    t = torch.where(torch.isfinite(t), t, torch.zeros_like(t))
    lo = torch.floor(t).clamp_min(0)
    hi = torch.ceil(t).clamp_min(0)
    return lo, hi, t - lo


def randbi_blend(a, b, c, d, rx, ry, same_x, same_y):
    """The fork's four cases: a = (lo_y, lo_x), b = (lo_y, hi_x), c = (hi_y, lo_x), d = (hi_y, hi_x);
    `1. - r` in double, `value * r` in the maps' dtype, sums in double, one rounding at the end."""
    ad, bd, rxd, ryd = a.double(), b.double(), rx.double(), ry.double()
    col0 = ad * (1 - ryd) + (c * ry).double()
    col1 = bd * (1 - ryd) + (d * ry).double()
    only_x = ad * (1 - rxd) + (b * rx).double()
    both = col0 * (1 - rxd) + col1 * rxd
    out = torch.where(same_x, torch.where(same_y, ad, col0), torch.where(same_y, only_x, both))
    return out.to(a.dtype)


def randbi_sample(fmap, ids, y, x, chw: tuple, pad: float, rate: int):
    """(P, C) values of one map (its legacy C, H, W in chw) at the pixels (ids, y, x), reads clamped
    to the map."""
    c, h, w = chw
    num = fmap.shape[0] if fmap.dim() else 1
    rows = fmap.reshape(num, c, h * w).transpose(1, 2).reshape(num * h * w, c)
    y0, y1, ry = randbi_axis(y, pad, rate)
    x0, x1, rx = randbi_axis(x, pad, rate)
    base = ids.clamp(0, num - 1).long() * h

    def at(yy, xx):
        return rows.index_select(0, (base + yy.clamp_max(h - 1).long()) * w + xx.clamp_max(w - 1).long())

    ry, rx = ry.to(fmap.dtype)[:, None], rx.to(fmap.dtype)[:, None]
    return randbi_blend(at(y0, x0), at(y0, x1), at(y1, x0), at(y1, x1), rx, ry,
                        (x0 == x1)[:, None], (y0 == y1)[:, None])


def randbi(pixels, maps: list, sizes: list, pads: list, rates: list):
    """RandBI's top (P, sum C): every map sampled at the pixels' (id, y, x) rows, concatenated."""
    ids = pixels[:, 0]
    ids = torch.where(torch.isnan(ids), torch.zeros_like(ids), ids)
    cols = [randbi_sample(f, ids, pixels[:, 1], pixels[:, 2], chw, pad, rate)
            for f, chw, pad, rate in zip(maps, sizes, pads, rates)]
    return torch.cat(cols, 1)


# ---- the spec -----------------------------------------------------------------------------------


def _first_abort(pixels, maps, sizes, pads, rates):
    """The fork's CHECK that the first bad pixel fails, as one line, or None."""
    if not pixels.shape[0]:
        return None
    ids = pixels[:, 0]
    for b, (f, (_, h, w), pad, rate) in enumerate(zip(maps, sizes, pads, rates)):
        num = f.shape[0] if f.dim() else 1
        bad_id = ~((ids > -1) & (ids < num))            # (int) truncates; NaN fails too
        hi_y = randbi_axis(pixels[:, 1], pad, rate)[1]
        hi_x = randbi_axis(pixels[:, 2], pad, rate)[1]
        bad = bad_id | (hi_y >= h) | (hi_x >= w)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            iv, yv, xv = (float(v) for v in pixels[i])
            where = f"pixel {i} (id {iv:g}, y {yv:g}, x {xv:g})"
            if bool(bad_id[i]):
                return f"{where}: image id {iv:g} is outside [0, {num}) of bottom[{b}]; the fork aborts (CHECK) there"
            return (f"{where} maps to row {int(hi_y[i])}, column {int(hi_x[i])} of bottom[{b}] ({h} x {w}, "
                    f"compression_rate {rate}): past the map, where the fork aborts (CHECK_LT)")
    return None


def map_rates(values, field, layer, maps, which):
    """One stride (>= 1) per feature-map bottom, as ints."""
    rates = [int(v) for v in values]
    if len(rates) != maps:
        raise LayerError(f"{field} is given {len(rates)} times; {layer} needs one per feature-map bottom "
                         f"({maps}{which})")
    for i, v in enumerate(rates):
        if v < 1:
            raise LayerError(f"{field}[{i}] must be >= 1, got {v}")
    return rates


@register_layer("RandBI")
class RandBI(Layer):
    def parse(self, lp):
        need_blobs(lp, "RandBI", range(2, AT_LEAST), 1, roles="feature maps..., pixels")
        p = lp.rand_comp_param
        maps = len(lp.bottom) - 1
        rates = map_rates(p.compression_rate, "rand_comp_param.compression_rate", "RandBI", maps, "")
        pads = [float(np.float32((r - 1.0) / 2)) if p.pad else 0.0 for r in rates]
        return {"rates": rates, "pads": pads, "pad": bool(p.pad), "name": lp.name}

    @staticmethod
    def _sizes(in_shapes):
        pixels = tuple(in_shapes[-1])
        if len(pixels) != 2 or pixels[1] != 3:
            raise LayerError(f"the last bottom (pixels) must be P x 3, rows of (image id, y, x), got {list(pixels)}")
        if pixels[0] < 1:
            raise LayerError("the last bottom (pixels) has no rows; the fork needs at least one")
        return [legacy_nchw(s, "RandBI")[1:] for s in in_shapes[:-1]]

    def infer(self, attrs, in_shapes):
        sizes = self._sizes(in_shapes)
        return [(int(in_shapes[-1][0]), int(sum(c for c, _, _ in sizes)))]

    def forward(self, attrs, params, *bottoms):
        maps, pixels = list(bottoms[:-1]), bottoms[-1]
        sizes = self._sizes([tuple(t.shape) for t in bottoms])
        if eager_checks():
            why = _first_abort(pixels, maps, sizes, attrs["pads"], attrs["rates"])
            if why:
                raise DataError(f"layer '{attrs['name']}' (RandBI): {why}")
        return randbi(pixels, maps, sizes, attrs["pads"], attrs["rates"])

    def pytorch_source(self, node, emit):
        sizes = self._sizes([emit.in_shape(i) for i in range(len(node.inputs))])
        for helper in (randbi_axis, randbi_blend, randbi_sample):
            emit.helper(helper)
        fn = emit.helper(randbi)
        maps = ", ".join(emit.inputs[:-1])
        a = node.attrs
        emit.note(f"{node.name} (RandBI): reads outside a map are clamped to it where the fork aborts")
        return f"{fn}({emit.inputs[-1]}, [{maps}], {emit.lit(sizes)}, {emit.lit(a['pads'])}, {emit.lit(a['rates'])})"

    def onnx(self, ctx, node):
        sizes = self._sizes([ctx.shape(t) for t in node.inputs])
        a = node.attrs
        onnx_randbi(ctx, node.name, node.inputs[:-1], sizes, a["pads"], a["rates"], node.inputs[-1], node.outputs[0])


def onnx_randbi(ctx, name, maps, sizes, pads, rates, pixels, out):
    """RandBI's sampling as ONNX: the maps (their legacy C, H, W in sizes) at the (P, 3) pixels, into `out`."""
    f32, f64, i64 = 1, 11, 7          # onnx.TensorProto.FLOAT, DOUBLE, INT64

    def const(value, dtype):
        return ctx.const(np.array(value, dtype))

    zero, column = const(0, np.float32), const([-1, 1], np.int64)
    ids, y, x = (ctx.op("Gather", [pixels, const(i, np.int64)], hint, axis=1)
                 for i, hint in enumerate(("ids", "y", "x")))
    ids = ctx.op("Where", [ctx.op("IsNaN", [ids], "id_nan"), zero, ids], "ids_num")

    def axis(pos, pad, rate, size, hint):   # randbi_axis, then the reads clamped to the map
        t = ctx.op("Div",
                   [ctx.op("Sub", [pos, const(pad, np.float32)], hint), const(float(rate), np.float32)], hint)
        odd = ctx.op("Or",
                     [ctx.op("IsNaN", [t], hint + "_nan"), ctx.op("IsInf", [t], hint + "_inf")], hint + "_odd")
        t = ctx.op("Where", [odd, zero, t], hint + "_t")
        lo = ctx.op("Max", [ctx.op("Floor", [t], hint), zero], hint + "_lo")
        hi = ctx.op("Max", [ctx.op("Ceil", [t], hint), zero], hint + "_hi")
        frac = ctx.op("Reshape", [ctx.op("Sub", [t, lo], hint + "_r"), column], hint + "_frac")
        same = ctx.op("Reshape", [ctx.op("Equal", [lo, hi], hint), column], hint + "_same")
        last = const(float(size - 1), np.float32)
        lo, hi = (ctx.op("Cast", [ctx.op("Min", [v, last], hint)], hint + "_i", to=i64) for v in (lo, hi))
        return lo, hi, frac, same

    cols = []
    for b, (fmap, (c, h, w), pad, rate) in enumerate(zip(maps, sizes, pads, rates)):
        per_image = ctx.op("Reshape", [fmap, const([-1, c, h * w], np.int64)], f"m{b}")
        rows = ctx.op("Reshape", [ctx.op("Transpose", [per_image], f"m{b}", perm=[0, 2, 1]),
                                  const([-1, c], np.int64)], f"rows{b}")
        num = ctx.op("Gather", [ctx.op("Shape", [per_image], f"shape{b}"), const(0, np.int64)], f"num{b}", axis=0)
        last = ctx.op("Sub", [ctx.op("Cast", [num], f"num{b}", to=f32), const(1, np.float32)], f"last{b}")
        image = ctx.op("Cast",
                       [ctx.op("Min", [ctx.op("Max", [ids, zero], f"id{b}"), last], f"id{b}")], f"id{b}", to=i64)
        base = ctx.op("Mul", [image, const(h, np.int64)], f"base{b}")
        y0, y1, ry, same_y = axis(y, pad, rate, h, f"y{b}")
        x0, x1, rx, same_x = axis(x, pad, rate, w, f"x{b}")

        def at(yy, xx, hint, b=b, base=base, rows=rows):
            idx = ctx.op("Add",
                         [ctx.op("Mul", [ctx.op("Add", [base, yy], hint), const(w, np.int64)], hint), xx], hint)
            return ctx.op("Gather", [rows, idx], f"{hint}{b}", axis=0)

        v = {k: at(yy, xx, k) for k, (yy, xx) in
             {"a": (y0, x0), "b": (y0, x1), "c": (y1, x0), "d": (y1, x1)}.items()}
        wide = {k: ctx.op("Cast", [t], f"{k}{b}_f64", to=f64) for k, t in (("a", v["a"]), ("b", v["b"]),
                                                                      ("rx", rx), ("ry", ry))}
        one = const(1.0, np.float64)
        keep_y = ctx.op("Sub", [one, wide["ry"]], f"keep_y{b}")
        keep_x = ctx.op("Sub", [one, wide["rx"]], f"keep_x{b}")

        def mix(p, keep, q, r, hint):    # p * (1. - r) in double + (q * r) in float32, summed in double
            part = ctx.op("Cast", [ctx.op("Mul", [q, r], hint)], hint, to=f64)
            return ctx.op("Add", [ctx.op("Mul", [p, keep], hint), part], hint)

        col0 = mix(wide["a"], keep_y, v["c"], ry, f"col0_{b}")
        col1 = mix(wide["b"], keep_y, v["d"], ry, f"col1_{b}")
        only_x = mix(wide["a"], keep_x, v["b"], rx, f"only_x{b}")
        both = ctx.op("Add", [ctx.op("Mul", [col0, keep_x], f"both{b}"),
                              ctx.op("Mul", [col1, wide["rx"]], f"both{b}")], f"both{b}")
        mixed = ctx.op("Where", [same_x, ctx.op("Where", [same_y, wide["a"], col0], f"sx{b}"),
                               ctx.op("Where", [same_y, only_x, both], f"nx{b}")], f"mix{b}")
        cols.append(ctx.op("Cast", [mixed], f"col{b}", to=f32))
    ctx.add_node("Concat", cols, [out], name=name, axis=1)


# ---- RandCat and RandCatConv (aayushbansal/caffe, MarrRevisited) -----------------------------------------

def rand_cat(maps: list, targets, height: int, width: int):
    """RandCat's two tops at TEST (rand_selection false): every cell j of bottom 0's height x width grid of
    every image n, rows n-major.  Map b's row holds flat_b[(n C_b + c) H W + j] for each channel c (bottom 0's
    H and W: a map of another size is read in that layout); the target row flat_t[n 3 H W + c W W + j]
    (W W where H W was meant, as the fork indexes it)."""
    hw = height * width
    num = maps[0].shape[0]
    cols = [m.reshape(-1)[:num * m.shape[1] * hw].reshape(num, m.shape[1], hw).transpose(1, 2)
            .reshape(num * hw, m.shape[1]) for m in maps]
    cell = torch.arange(num * hw, device=targets.device)
    base = torch.div(cell, hw, rounding_mode="floor") * 3 * hw + cell % hw
    flat = targets.reshape(-1)
    return torch.cat(cols, 1), torch.stack([flat[base + c * width * width] for c in range(3)], 1)


@register_layer("RandCat")
class RandCat(Layer):
    """MarrRevisited's dense hypercolumns (aayushbansal/caffe 3222608, rand_cat_layer.cpp; CPU only, so a GPU
    build runs the CPU forward).  Bottoms: feature maps, then a mask of valid pixels, then a 3-channel target.
    With rand_selection false every pixel of bottom 0's grid is a row, H x W per image, fixed at set-up (the
    mask is not read); see rand_cat for what each row holds.  Tops: (rows, sum of the maps' channels) and
    (rows, 3).  rand_selection true (the default) draws num_output valid pixels per image with
    std::random_shuffle seeded from the clock at every forward: read and sized, not run."""

    def parse(self, lp):
        need_blobs(lp, "RandCat", range(3, AT_LEAST), 2, roles="feature maps..., mask, targets")
        p = lp.rand_cat_param
        notes = []
        hard_coded = {"num_blobs": len(lp.bottom) - 2, "start_id": 0, "end_id": len(lp.bottom) - 3}
        given = {f: getattr(p, f) for f in hard_coded if p.HasField(f)}
        if given:
            notes.append(f"rand_cat_param.{', '.join(given)} read as the fork's layer reads them: not at all (it "
                         f"takes every bottom but the last two, {hard_coded['num_blobs']} here)")
        return {"random": bool(p.rand_selection), "num_output": int(p.num_output), "name": lp.name,
                "reading_notes": notes}

    @staticmethod
    def _grid(in_shapes):
        return legacy_nchw(in_shapes[0], "RandCat")[2:]

    def infer(self, attrs, in_shapes):
        maps = [legacy_nchw(s, "RandCat") for s in in_shapes[:-2]]
        num, h, w = maps[0][0], maps[0][2], maps[0][3]
        rows = num * (attrs["num_output"] if attrs["random"] else h * w)
        return [(rows, int(sum(m[1] for m in maps))), (rows, 3)]

    def cannot_run(self, attrs, in_shapes):
        if attrs["random"]:
            return ("rand_selection: true draws the pixels with std::random_shuffle seeded from the clock at every "
                    "forward; caffeq does not draw them (set rand_selection: false to take every pixel)")
        maps = [legacy_nchw(s, "RandCat") for s in in_shapes[:-2]]
        num, _, h, w = maps[0]
        for b, m in enumerate(maps):
            if m[0] < num or m[2] * m[3] < h * w:
                return (f"bottom {b} {list(in_shapes[b])} is smaller than bottom 0's {num} x {h} x {w} grid, which "
                        f"the fork reads it as (past its end)")
        last = (num - 1) * 3 * h * w + 2 * w * w + h * w
        if last > int(np.prod(in_shapes[-1])):
            return (f"the targets {list(in_shapes[-1])} hold fewer than the {last} values the fork's reads reach "
                    f"(n 3 H W + c W W + j on bottom 0's {h} x {w} grid: past the end)")
        return None

    def forward(self, attrs, params, *bottoms):
        self.refuse_if_cannot_run(attrs["name"], attrs, [tuple(t.shape) for t in bottoms])
        h, w = self._grid([tuple(bottoms[0].shape)])
        return rand_cat(list(bottoms[:-2]), bottoms[-1], h, w)

    def pytorch_source(self, node, emit):
        shapes = [emit.in_shape(i) for i in range(len(node.inputs))]
        self.refuse_if_cannot_run(node.name, node.attrs, shapes, ExportError)
        h, w = self._grid(shapes)
        fn = emit.helper(rand_cat)
        t = emit.tmp("hypercolumns")
        emit.stmt(f"{t} = {fn}([{', '.join(emit.inputs[:-2])}], {emit.inputs[-1]}, {h}, {w})")
        return [f"{t}[0]", f"{t}[1]"]

    def onnx(self, ctx, node):
        shapes = [ctx.shape(t) for t in node.inputs]
        self.refuse_if_cannot_run(node.name, node.attrs, shapes, ExportError)
        h, w = self._grid(shapes)
        hw = h * w
        num = legacy_nchw(shapes[0], "RandCat")[0]
        cols = []
        for b, x in enumerate(node.inputs[:-2]):
            c = legacy_nchw(shapes[b], "RandCat")[1]
            flat = ctx.op("Reshape", [x, ctx.i64([-1])], f"map{b}")
            grid = ctx.op("Reshape", [ctx.op("Slice", [flat, ctx.i64([0]), ctx.i64([num * c * hw])], f"map{b}"),
                                      ctx.i64([num, c, hw])], f"map{b}")
            cols.append(ctx.op("Reshape", [ctx.op("Transpose", [grid], f"map{b}", perm=[0, 2, 1]),
                                           ctx.i64([num * hw, c])], f"map{b}_rows"))
        ctx.add_node("Concat", cols, [node.outputs[0]], name=node.name, axis=1)
        cell = np.arange(num * hw, dtype=np.int64)
        index = (cell // hw * 3 * hw + cell % hw)[:, None] + np.arange(3, dtype=np.int64)[None, :] * (w * w)
        flat = ctx.op("Reshape", [node.inputs[-1], ctx.i64([-1])], "targets")
        ctx.add_node("Gather", [flat, ctx.const(index)], [node.outputs[1]], name=node.name + "_targets", axis=0)


def mask_pixels(mask, num: int, rows: int, height: int, width: int):
    """RandCatConv's pixel rows (id, y, x): the cells of bottom 0's height x width grid whose value in image
    0's mask truncates to 1, in raster order, listed once per image (every image reads image 0's mask),
    and the first rows x num of that list."""
    flat = mask.reshape(-1)[:height * width]
    marked = torch.nonzero((flat >= 1) & (flat < 2)).reshape(-1)
    ys = torch.div(marked, width, rounding_mode="floor").to(mask.dtype)
    xs = (marked % width).to(mask.dtype)
    ids = torch.arange(num, device=mask.device).repeat_interleave(len(marked)).to(mask.dtype)
    return torch.stack([ids, ys.repeat(num), xs.repeat(num)], 1)[:rows * num]


def mask_targets(targets, pixels, height: int, width: int):
    """The second top (P, 3): the 3-channel targets at each pixel, read as the fork indexes them
    (n * 3 W H + channel * W W + y W + x, bottom 0's W and H: W W where W H was meant), clamped to the blob."""
    flat = targets.reshape(-1)
    ids, ys, xs = (pixels[:, k].long() for k in range(3))
    cols = [flat[(ids * 3 * width * height + c * width * width + ys * width + xs).clamp(0, flat.numel() - 1)]
            for c in range(3)]
    return torch.stack(cols, 1)


def rand_cat_conv(maps: list, mask, targets, sizes: list, pads: list, rates: list, rows: int):
    """RandCatConv's two tops at TEST (rand_selection false): the hypercolumns (RandBI's sampling) and the targets."""
    _, h, w = sizes[0]
    num = maps[0].shape[0]
    pixels = mask_pixels(mask, num, rows, h, w)
    return randbi(pixels, maps, sizes, pads, rates), mask_targets(targets, pixels, h, w)


@register_layer("RandCatConv")
class RandCatConv(Layer):
    """MarrRevisited's sparse hypercolumns (aayushbansal/caffe 3222608, rand_cat_conv_layer.cpp; no CUDA code,
    so a GPU build runs the CPU forward).  Bottoms: feature maps, then a mask, then a 3-channel target.  With
    rand_selection false the rows are the pixels the mask marks (see mask_pixels); their count is fixed when
    the net is set up, (H - 2 pad_factor) x (W - 2 pad_factor) per image of bottom 0.  Each map is sampled
    as RandBI samples it, with pad (pooling_factor - 1) / 2 and rate pooling_factor.  Tops: (rows, sum of
    channels) and (rows, 3), the targets at the same pixels.  rand_selection true draws the pixels with
    rand() seeded from the clock at every forward: read and sized, not run.  caffeq's forward refuses a mask
    of too few pixels (the fork reads past its list); ONNX and model.py cannot stop a run and give fewer rows."""

    def parse(self, lp):
        need_blobs(lp, "RandCatConv", range(3, AT_LEAST), 2, roles="feature maps..., mask, targets")
        p = lp.rand_cat_conv_param
        maps = len(lp.bottom) - 2
        rates = map_rates(p.pooling_factor, "rand_cat_conv_param.pooling_factor", "RandCatConv", maps,
                          ": all but the last two")
        return {"rates": rates, "pads": [float(np.float32((r - 1.0) / 2)) for r in rates],
                "random": bool(p.rand_selection), "num_output": int(p.num_output), "pad_factor": int(p.pad_factor),
                "name": lp.name}

    def _rows(self, attrs, sizes):
        if attrs["random"]:
            return attrs["num_output"]
        _, h, w = sizes[0]
        rows = (h - 2 * attrs["pad_factor"]) * (w - 2 * attrs["pad_factor"])
        if h - 2 * attrs["pad_factor"] <= 0 or w - 2 * attrs["pad_factor"] <= 0:
            raise LayerError(f"rand_cat_conv_param.pad_factor {attrs['pad_factor']} leaves no pixels of bottom 0's "
                             f"{h} x {w} grid")
        return rows

    def infer(self, attrs, in_shapes):
        sizes = [legacy_nchw(s, "RandCatConv")[1:] for s in in_shapes[:-2]]
        rows = self._rows(attrs, sizes) * legacy_nchw(in_shapes[0], "RandCatConv")[0]
        return [(rows, int(sum(c for c, _, _ in sizes))), (rows, 3)]

    def cannot_run(self, attrs, in_shapes):
        if attrs["random"]:
            return ("rand_selection: true picks the pixels with rand() seeded from the clock at every forward; "
                    "caffeq does not draw them (set rand_selection: false and a mask of the pixels to sample)")
        return None

    def _args(self, attrs, in_shapes):
        sizes = [legacy_nchw(s, "RandCatConv")[1:] for s in in_shapes[:-2]]
        return sizes, attrs["pads"], attrs["rates"], self._rows(attrs, sizes)

    def forward(self, attrs, params, *bottoms):
        shapes = [tuple(t.shape) for t in bottoms]
        self.refuse_if_cannot_run(attrs["name"], attrs, shapes)
        sizes, pads, rates, rows = self._args(attrs, shapes)
        maps, mask, targets = list(bottoms[:-2]), bottoms[-2], bottoms[-1]
        if eager_checks():
            _, h, w = sizes[0]
            num = maps[0].shape[0]
            pixels = mask_pixels(mask, num, rows, h, w)
            if pixels.shape[0] < rows * num:
                marked = pixels.shape[0] // max(num, 1)
                raise DataError(f"layer '{attrs['name']}' (RandCatConv): the mask marks {marked} pixels (values "
                                f"from 1 to < 2) of bottom 0's {h} x {w} grid, and the layer takes {rows} per image "
                                f"(pad_factor {attrs['pad_factor']}); the fork reads past its list there")
            why = _first_abort(pixels, maps, sizes, pads, rates)
            if why:   # RandCatConv checks the column only; a row past the map reads the next channel
                why = why.replace("where the fork aborts (CHECK_LT)", "where the fork aborts (a column) or reads "
                                  "outside the map (a row)")
                raise DataError(f"layer '{attrs['name']}' (RandCatConv): {why}")
        return rand_cat_conv(maps, mask, targets, sizes, pads, rates, rows)

    def pytorch_source(self, node, emit):
        shapes = [emit.in_shape(i) for i in range(len(node.inputs))]
        self.refuse_if_cannot_run(node.name, node.attrs, shapes, ExportError)
        sizes, pads, rates, rows = self._args(node.attrs, shapes)
        for helper in (randbi_axis, randbi_blend, randbi_sample, randbi, mask_pixels, mask_targets):
            emit.helper(helper)
        fn = emit.helper(rand_cat_conv)
        emit.note(f"{node.name} (RandCatConv): reads outside a map are clamped to it where the fork aborts")
        t = emit.tmp("hypercolumns")
        emit.stmt(f"{t} = {fn}([{', '.join(emit.inputs[:-2])}], {emit.inputs[-2]}, {emit.inputs[-1]}, "
                  f"{emit.lit(sizes)}, {emit.lit(pads)}, {emit.lit(rates)}, {rows})")
        return [f"{t}[0]", f"{t}[1]"]

    def onnx(self, ctx, node):
        shapes = [ctx.shape(t) for t in node.inputs]
        self.refuse_if_cannot_run(node.name, node.attrs, shapes, ExportError)
        sizes, pads, rates, rows = self._args(node.attrs, shapes)
        i64, f32 = 7, 1
        _, h, w = sizes[0]
        # the marked cells of image 0's mask, in raster order (NonZero's order)
        flat = ctx.op("Slice", [ctx.op("Reshape", [node.inputs[-2], ctx.i64([-1])], "mask"), ctx.i64([0]),
                                ctx.i64([h * w])], "mask_grid")
        marked = ctx.op("And", [ctx.op("GreaterOrEqual", [flat, ctx.f32(1.0)], "ge1"),
                                ctx.op("Less", [flat, ctx.f32(2.0)], "lt2")], "marked")
        cells = ctx.op("Reshape", [ctx.op("NonZero", [marked], "cells"), ctx.i64([-1])], "cell")
        count = ctx.op("Shape", [cells], "count")
        num = ctx.op("Slice", [ctx.op("Shape", [node.inputs[0]], "shape0"), ctx.i64([0]), ctx.i64([1])], "num")
        every = ctx.op("Tile", [cells, num], "every")                 # the list once per image
        total = ctx.op("Mul", [count, num], "total")
        ids = ctx.op("Div", [ctx.op("Range", [ctx.i64(0), ctx.op("Squeeze", [total, ctx.i64([0])], "n"),
                                              ctx.i64(1)], "index"),
                             ctx.op("Squeeze", [count, ctx.i64([0])], "k")], "ids")
        ys = ctx.op("Div", [every, ctx.i64(w)], "ys")
        xs = ctx.op("Mod", [every, ctx.i64(w)], "xs")
        columns = [ctx.op("Unsqueeze", [ctx.op("Cast", [v], hint, to=f32), ctx.i64([1])], hint + "_col")
                   for v, hint in ((ids, "id"), (ys, "y"), (xs, "x"))]
        listed = ctx.op("Concat", columns, "listed", axis=1)
        pixels = ctx.op("Slice", [listed, ctx.i64([0]), ctx.op("Mul", [ctx.i64([rows]), num], "rows")], "pixels")
        onnx_randbi(ctx, node.name, node.inputs[:-2], sizes, pads, rates, pixels, node.outputs[0])
        # the targets: n * 3 W H + channel * W W + y W + x, clamped to the blob
        whole = ctx.op("Reshape", [node.inputs[-1], ctx.i64([-1])], "targets")
        last = ctx.op("Sub", [ctx.op("Shape", [whole], "size"), ctx.i64([1])], "last")
        at = [ctx.op("Cast", [ctx.op("Gather", [pixels, ctx.i64(k)], f"p{k}", axis=1)], f"p{k}", to=i64)
              for k in range(3)]
        base = ctx.op("Add", [ctx.op("Mul", [at[0], ctx.i64(3 * w * h)], "image"),
                              ctx.op("Add", [ctx.op("Mul", [at[1], ctx.i64(w)], "row"), at[2]], "cell")], "base")
        cols = []
        for c in range(3):
            index = ctx.op("Min", [ctx.op("Max", [ctx.op("Add", [base, ctx.i64(c * w * w)], f"t{c}"), ctx.i64(0)],
                                          f"t{c}"), last], f"t{c}")
            cols.append(ctx.op("Unsqueeze", [ctx.op("Gather", [whole, index], f"t{c}"), ctx.i64([1])], f"t{c}"))
        ctx.add_node("Concat", cols, [node.outputs[1]], name=node.name + "_targets", axis=1)
