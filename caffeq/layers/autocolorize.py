"""gustavla/autocolorize (79d4ce1; caffe/add_to_caffe.proto, caffe/src/caffe/layers/*_layer.cpp and .cu): the
layers of its sparse hypercolumn training net (train/train_vgg16.prototxt).  Each is read from its C++:

- BgrToMunsell (bgr_to_munsell_layer.cpp/.cu): (N, 3, H, W) B, G, R planes to hue, chroma, value, all float32
  as the fork: v = max(r, g, b), delta = v - min(r, g, b) (std::max / std::min: the first argument unless the
  second is larger / smaller), s = delta / v (0 where v == 0); the hexcone sector (g - b) / delta where r == v,
  else 2 + (b - r) / delta where g == v, else 4 + (r - g) / delta; hue = fmod(sector / 6 + 10, 1) in double,
  stored as float (0 where delta == 0); chroma = s * v.  No blobs.  torch, ONNX, model.py.
- StripDecimals (strip_decimals_layer.cpp/.cu, a NeuronLayer): (float)(int)x, x truncated toward zero.  Out of
  int's range C++ leaves it undefined: caffeq follows the CUDA kernel (the one a GPU build runs), which saturates
  to [-2^31, 2^31 - 1] and reads NaN as 0 (the x86 CPU path gives -2^31 there).  torch, ONNX, model.py.
- UniformToHistogram (uniform_to_histogram_layer.cpp; its .cu runs the CPU code): (N, 1, H, W) values v to a
  (N, bins, H, W) one-hot: bin (int)(v * bins) (the float32 product truncated), bins - 1 where that is past
  the last bin.  A product <= -1, NaN or >= 2^31 makes the fork write its 1 outside the pixel's histogram
  (a negative bin; x86's int conversion of NaN and of large values gives -2^31): caffeq's forward refuses such
  a value (DataError), ONNX and model.py leave that pixel's histogram at zero.  Its loop strides one image per
  H x W values, so a bottom of more than one channel writes past the top: refused.  torch, ONNX, model.py.
- SparseHistogramExtractor (sparse_histogram_extractor_layer.cpp; its .cu runs the CPU code): bottoms
  locations (N, P, 2) of (y, x) and a histogram map (N, bins, H, W); one top (N * P, bins) per
  `sparse_histogram_extractor_param.size`.  The map's summed-area table is built in float32, running sums
  down each column, then along each row, one addition at a time.  Each location, (int) truncated, with
  half = size / 2: y0 = y - half - 1, y1 = y0 + size (likewise x0, x1), each lowered to H - 1 (W - 1) when
  past it; a corner with a negative row or column reads 0; the window sum is ((I[y1, x1] - I[y0, x1]) -
  I[y1, x0]) + I[y0, x0].  Each row is then divided by its sum over the bins (added bin by bin in float32) when
  that is > 0, else set to 1 / bins.  ONNX's CumSum (which onnxruntime adds in order, in float32) gives the
  same sums.  torch, ONNX, model.py.
- SparseHypercolumnExtractor (sparse_hypercolumn_extractor_layer.cpp/.cu): bottoms locations (N, P, 2) of
  float (y, x) and feature maps f_1..f_L (N, C_l, H_l, W_l); top (N * P, C_1 + ... + C_L).  For map l, in
  float32: ly = (y - offset_height[l]) / scale[l], raised to 0, lowered to H_l - 1.0001 (both float32);
  ylo = (int)ly, yhi = ylo + 1, f_yhi = ly - ylo, f_ylo = yhi - ly (likewise x); the value is
  activation_mult[l] * (f_ylo * (f_xlo * f[ylo, xlo] + f_xhi * f[ylo, xhi]) + f_yhi * (f_xlo * f[yhi, xlo] +
  f_xhi * f[yhi, xhi])), each product and sum rounded in that order (the CPU code; nvcc may fuse a multiply
  and add, an ulp apart).  scale, offset_height and offset_width give one value per map (the fork's CHECK_EQs);
  activation_mult is padded with 1.  A zero scale (a division by zero) and maps of one row or column (the
  fork then reads row or column 1, past the map) are refused.  torch, ONNX, model.py.
- ExtendedImageData (extended_image_data_layer.cpp): an image list read by image_data_param; data
  (batch_size, C, crop_size x crop_size; 2 crop_size + 1 with `ucm2`), else new_height x new_width where the
  reader resizes to it; C is 3 (is_color) or 1 for PIXEL images, 1 for MAT arrays and for the default IMAGE
  and NONE types (which load a blank new_height x new_width plane), 80 for COCO_JSON masks; a second top holds
  the labels (batch_size,).  Sizes only the files tell (shortest_side, MAT, COCO_JSON without a crop) come from
  --input-shape.
- SoftmaxKLDLoss (softmax_kld_loss_layer.cpp) only trains: caffeq's training-layer rule drops it with a note
  (its `softmax_kld_loss_param` is read and unused).

None of these layers has blobs; nothing random runs at inference (the fork's sampler is a DummyData uniform
filler, which the user feeds).
"""
from __future__ import annotations

import numpy as np
import torch

from ..errors import DataError
from ..io.schema import caffe_pb2
from .data import describe_transform, transform_attrs
from .fork_data import ForkDataLayer
from .misc import eager_checks
from .mscnn_proposals import f32_max, f32_min
from .registry import (
    AT_LEAST,
    Layer,
    LayerError,
    four_axes,
    need_blobs,
    positive_field,
    register_layer,
    torch_sources,
)

# ---- torch (model.py copies these) -----------------------------------------------------------------------


def bgr_to_munsell(x):
    """(N, 3, H, W) B, G, R planes -> hue, chroma, value planes, as the fork's forward."""
    b, g, r = x[:, 0], x[:, 1], x[:, 2]
    v = f32_max(r, f32_max(g, b))
    delta = v - f32_min(r, f32_min(g, b))
    zero = torch.zeros_like(v)
    s = torch.where(v == 0, zero, delta / v)
    sector = torch.where(r == v, ((g - b) / delta).double(),
                         torch.where(g == v, 2.0 + ((b - r) / delta).double(), 4.0 + ((r - g) / delta).double()))
    sector = sector.to(x.dtype)
    h = torch.fmod(sector.double() / 6.0 + 10.0, 1.0).to(x.dtype)
    h = torch.where(delta == 0, zero, h)
    return torch.stack([h, s * v, v], 1)


def strip_decimals(x):
    """(float)(int)x as the fork's CUDA kernel converts: toward zero, saturated, NaN as 0 (+0.0, never -0.0)."""
    t = torch.trunc(x).clamp(-2147483648.0, 2147483647.0) + 0.0
    return torch.where(torch.isnan(x), torch.zeros_like(x), t)


def uniform_bins(x, bins: int):
    """(bin index as a float, whether the fork writes it inside the pixel's histogram) of each value."""
    scaled = x * bins
    ok = (scaled > -1.0) & (scaled < 2147483648.0)
    idx = torch.trunc(torch.where(ok, scaled, torch.zeros_like(scaled))).clamp(max=float(bins - 1))
    return idx, ok


def uniform_to_histogram(x, bins: int):
    """(N, 1, H, W) values -> (N, bins, H, W) one-hot histograms (all 0 where the fork writes elsewhere)."""
    idx, ok = uniform_bins(x, bins)
    levels = torch.arange(bins, dtype=x.dtype, device=x.device).view(1, bins, 1, 1)
    return ((idx == levels) & ok).to(x.dtype)


def running_sum(x, dim: int):
    """Running sums along `dim`, each one addition in x's dtype, in order (as a C loop adds)."""
    parts = list(x.unbind(dim))
    for i in range(1, len(parts)):
        parts[i] = parts[i - 1] + parts[i]
    return torch.stack(parts, dim)


def sparse_histograms(locations, hist, sizes: list):
    """SparseHistogramExtractor: one (N * P, bins) top per window size."""
    locations = locations.reshape(locations.shape[0], locations.shape[1], 2)   # trailing axes of 1
    n, bins, h, w = hist.shape
    p = locations.shape[1]
    table = running_sum(running_sum(hist, 2), 3).reshape(n, bins, h * w)
    y = torch.trunc(locations[:, :, 0]).long()
    x = torch.trunc(locations[:, :, 1]).long()

    def corner(yy, xx):
        idx = (yy.clamp(min=0) * w + xx.clamp(min=0))[:, None, :].expand(n, bins, p)
        vals = torch.gather(table, 2, idx)
        keep = ((yy >= 0) & (xx >= 0))[:, None, :]
        return torch.where(keep, vals, torch.zeros_like(vals))

    tops = []
    for size in sizes:
        y0 = y - size // 2 - 1
        x0 = x - size // 2 - 1
        y1, x1 = (y0 + size).clamp(max=h - 1), (x0 + size).clamp(max=w - 1)
        y0, x0 = y0.clamp(max=h - 1), x0.clamp(max=w - 1)
        v = (((corner(y1, x1) - corner(y0, x1)) - corner(y1, x0)) + corner(y0, x0)).transpose(1, 2)
        total = v[:, :, 0]
        for c in range(1, bins):
            total = total + v[:, :, c]
        total = total[:, :, None]
        uniform = torch.full_like(v, 1.0 / bins)
        tops.append(torch.where(total > 0, v / total, uniform).reshape(n * p, bins))
    return tops


def hypercolumn_axis(pos, offset: float, scale: float, last: float):
    """(lo, hi as indexes, f_lo, f_hi) along one axis of a map, in pos's dtype."""
    t = (pos - offset) / torch.full_like(pos, scale)
    t = t.clamp(min=0.0, max=last)
    lo = torch.trunc(t)
    return lo.long(), lo.long() + 1, (lo + 1.0) - t, t - lo


def sparse_hypercolumns(locations, maps: list, scales: list, offsets_h: list, offsets_w: list,
                        mults: list, lasts: list):
    """SparseHypercolumnExtractor: (N * P, sum C) bilinear samples of every map at the locations."""
    locations = locations.reshape(locations.shape[0], locations.shape[1], 2)   # trailing axes of 1
    n, p = locations.shape[0], locations.shape[1]
    y, x = locations[:, :, 0], locations[:, :, 1]
    cols = []
    for f, scale, oh, ow, mult, (last_h, last_w) in zip(maps, scales, offsets_h, offsets_w, mults, lasts):
        c, h, w = f.shape[1], f.shape[2], f.shape[3]
        flat = f.reshape(n, c, h * w)
        ylo, yhi, fylo, fyhi = hypercolumn_axis(y, oh, scale, last_h)
        xlo, xhi, fxlo, fxhi = hypercolumn_axis(x, ow, scale, last_w)

        def at(yy, xx, flat=flat, c=c, w=w):
            return torch.gather(flat, 2, (yy * w + xx)[:, None, :].expand(n, c, p))

        fylo, fyhi, fxlo, fxhi = fylo[:, None], fyhi[:, None], fxlo[:, None], fxhi[:, None]
        v = fylo * (fxlo * at(ylo, xlo) + fxhi * at(ylo, xhi)) + fyhi * (fxlo * at(yhi, xlo) + fxhi * at(yhi, xhi))
        cols.append((v * mult).transpose(1, 2))
    return torch.cat(cols, 2).reshape(n * p, -1)


# ---- ONNX --------------------------------------------------------------------------------------------------

_F32, _F64, _I64 = 1, 11, 7          # onnx.TensorProto.FLOAT, DOUBLE, INT64


def _onnx_std(ctx, kind, a, b, hint):
    """std::max (kind "Less": b where a < b) or std::min (kind "Greater": b where a > b)."""
    return ctx.op("Where", [ctx.op(kind, [a, b], hint), b, a], hint)


def _plane(ctx, x, k, hint):
    return ctx.op("Slice", [x, ctx.i64([k]), ctx.i64([k + 1]), ctx.i64([1])], hint)


def _last_axis(ctx, x, k, hint):
    """x[:, :, k] of an (N, P, 2) tensor (trailing axes of 1 dropped first), (N, P)."""
    shape = ctx.shape(x)
    if len(shape) > 3:
        x = ctx.op("Reshape", [x, ctx.i64(list(shape[:3]))], hint + "_rows")
    return ctx.op("Gather", [x, ctx.i64(k)], hint, axis=2)


# ---- the specs ---------------------------------------------------------------------------------------------


def _three_channels(shape, what, channels):
    n, c, h, w = four_axes(shape, what)
    if c != channels:
        raise LayerError(f"{what} reads {channels} channel{'s' if channels > 1 else ''} a pixel (its loop strides "
                         f"{channels} plane{'s' if channels > 1 else ''} an image), got {list(shape)}")
    return n, c, h, w


@register_layer("BgrToMunsell")
class BgrToMunsell(Layer):
    def parse(self, lp):
        need_blobs(lp, "BgrToMunsell", 1, 1)
        return {}

    def infer(self, attrs, in_shapes):
        _three_channels(in_shapes[0], "BgrToMunsell", 3)
        return [tuple(in_shapes[0])]

    def forward(self, attrs, params, x):
        return bgr_to_munsell(x)

    def pytorch_source(self, node, emit):
        emit.helper(torch_sources(f32_max, f32_min))
        return f"{emit.helper(bgr_to_munsell)}({emit.inputs[0]})"

    def onnx(self, ctx, node):
        x = node.inputs[0]
        b, g, r = (_plane(ctx, x, k, n) for k, n in enumerate("bgr"))
        v = _onnx_std(ctx, "Less", r, _onnx_std(ctx, "Less", g, b, "max_gb"), "v")
        delta = ctx.op("Sub", [v, _onnx_std(ctx, "Greater", r, _onnx_std(ctx, "Greater", g, b, "min_gb"), "min")],
                       "delta")
        zero = ctx.f32(0.0)
        s = ctx.op("Where", [ctx.op("Equal", [v, zero], "v0"), zero, ctx.op("Div", [delta, v], "s_div")], "s")

        def part(p, q, base, hint):
            wide = ctx.op("Cast", [ctx.op("Div", [ctx.op("Sub", [p, q], hint), delta], hint)], hint, to=_F64)
            return ctx.op("Add", [wide, ctx.const(np.array(base, np.float64))], hint) if base else wide

        sector = ctx.op("Where", [ctx.op("Equal", [r, v], "r_max"), part(g, b, 0.0, "sec_r"),
                                  ctx.op("Where", [ctx.op("Equal", [g, v], "g_max"), part(b, r, 2.0, "sec_g"),
                                                   part(r, g, 4.0, "sec_b")], "sec_gb")], "sector")
        sector = ctx.op("Cast", [ctx.op("Cast", [sector], "sector32", to=_F32)], "sector64", to=_F64)
        turn = ctx.op("Add", [ctx.op("Div", [sector, ctx.const(np.array(6.0, np.float64))], "sixth"),
                              ctx.const(np.array(10.0, np.float64))], "turn")
        h = ctx.op("Cast", [ctx.op("Mod", [turn, ctx.const(np.array(1.0, np.float64))], "fmod", fmod=1)], "h", to=_F32)
        h = ctx.op("Where", [ctx.op("Equal", [delta, zero], "grey"), zero, h], "hue")
        ctx.add_node("Concat", [h, ctx.op("Mul", [s, v], "chroma"), v], [node.outputs[0]], name=node.name, axis=1)


@register_layer("StripDecimals")
class StripDecimals(Layer):
    def parse(self, lp):
        need_blobs(lp, "StripDecimals", 1, 1)
        return {}

    def forward(self, attrs, params, x):
        return strip_decimals(x)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(strip_decimals)}({emit.inputs[0]})"

    def onnx(self, ctx, node):
        x = node.inputs[0]
        t = ctx.op("Clip", [ctx.trunc(x), ctx.f32(-2147483648.0), ctx.f32(2147483647.0)], "sat")
        t = ctx.op("Add", [t, ctx.f32(0.0)], "plus_zero")
        ctx.add_node("Where", [ctx.op("IsNaN", [x], "nan"), ctx.f32(0.0), t], [node.outputs[0]], name=node.name)


@register_layer("UniformToHistogram")
class UniformToHistogram(Layer):
    def parse(self, lp):
        need_blobs(lp, "UniformToHistogram", 1, 1, in_place=False)
        bins = positive_field(lp.uniform_to_histogram_param.bins, "uniform_to_histogram_param.bins")
        return {"bins": bins, "name": lp.name}

    def infer(self, attrs, in_shapes):
        n, _, h, w = _three_channels(in_shapes[0], "UniformToHistogram", 1)
        return [(n, attrs["bins"], h, w)]

    def forward(self, attrs, params, x):
        if eager_checks():
            _, ok = uniform_bins(x, attrs["bins"])
            if not bool(ok.all()):
                i = int((~ok).flatten().nonzero()[0, 0])
                value = float(x.flatten()[i])
                raise DataError(f"layer '{attrs['name']}' (UniformToHistogram): value {value:g} (flat index {i}) "
                                f"times bins {attrs['bins']} is <= -1 or not an int: the fork writes its 1 outside "
                                f"the pixel's histogram there")
        return uniform_to_histogram(x, attrs["bins"])

    def pytorch_source(self, node, emit):
        emit.helper(uniform_bins)
        emit.note(f"{node.name} (UniformToHistogram): a value whose bin the fork writes outside the pixel's "
                  f"histogram gives an all-zero histogram here")
        return f"{emit.helper(uniform_to_histogram)}({emit.inputs[0]}, {node.attrs['bins']})"

    def onnx(self, ctx, node):
        bins = node.attrs["bins"]
        scaled = ctx.op("Mul", [node.inputs[0], ctx.f32(float(bins))], "scaled")
        ok = ctx.op("And", [ctx.op("Greater", [scaled, ctx.f32(-1.0)], "above"),
                            ctx.op("Less", [scaled, ctx.f32(2147483648.0)], "below")], "ok")
        safe = ctx.op("Where", [ok, scaled, ctx.f32(0.0)], "safe")
        idx = ctx.op("Min", [ctx.trunc(safe), ctx.f32(float(bins - 1))], "bin")
        levels = ctx.const(np.arange(bins, dtype=np.float32).reshape(1, bins, 1, 1))
        hot = ctx.op("And", [ctx.op("Equal", [idx, levels], "hot"), ok], "hot_ok")
        ctx.add_node("Cast", [hot], [node.outputs[0]], name=node.name, to=_F32)


def _locations(shape, what, num):
    # the fork checks shape(2) == 2 and reads n * P * 2 + p * 2: trailing axes of 1 (mix-and-match's
    # (N, P, 2, 1)) read the same
    if len(shape) < 3 or shape[2] != 2 or any(d != 1 for d in shape[3:]):
        raise LayerError(f"{what}'s first bottom (locations) must be (N, P, 2), rows of (y, x), got {list(shape)}")
    if shape[0] != num:
        raise LayerError(f"{what}: the locations hold {shape[0]} images, the maps {num}; the fork indexes both "
                         f"by one image count")
    return int(shape[0]), int(shape[1])


@register_layer("SparseHistogramExtractor")
class SparseHistogramExtractor(Layer):
    def parse(self, lp):
        need_blobs(lp, "SparseHistogramExtractor", 2, None, roles="locations, histograms")
        sizes = [int(s) for s in lp.sparse_histogram_extractor_param.size]
        if len(sizes) != len(lp.top):
            raise LayerError(f"SparseHistogramExtractor makes one top per sparse_histogram_extractor_param.size: "
                             f"{len(sizes)} size(s), {len(lp.top)} top(s) (the fork's CHECK_EQ)")
        return {"sizes": sizes}

    def infer(self, attrs, in_shapes):
        n, bins, _, _ = four_axes(in_shapes[1], "SparseHistogramExtractor", "histogram bottom")
        n, p = _locations(in_shapes[0], "SparseHistogramExtractor", n)
        return [(n * p, bins)] * len(attrs["sizes"])

    def forward(self, attrs, params, locations, hist):
        tops = sparse_histograms(locations, hist, attrs["sizes"])
        return tops[0] if len(tops) == 1 else tuple(tops)

    def pytorch_source(self, node, emit):
        emit.helper(running_sum)
        fn = emit.helper(sparse_histograms)
        call = f"{fn}({emit.inputs[0]}, {emit.inputs[1]}, {emit.lit(node.attrs['sizes'])})"
        if len(node.outputs) == 1:
            return f"{call}[0]"
        return [f"{call}[{i}]" for i in range(len(node.outputs))]

    def onnx(self, ctx, node):
        locations, hist = node.inputs
        n, bins, h, w = ctx.shape(hist)
        p = ctx.shape(locations)[1]
        table = ctx.op("CumSum", [ctx.op("CumSum", [hist, ctx.i64(2)], "down"), ctx.i64(3)], "table")
        table = ctx.op("Reshape", [table, ctx.i64([n, bins, h * w])], "table_flat")
        y, x = (ctx.op("Cast", [_last_axis(ctx, locations, k, a)], a + "_int", to=_I64) for k, a in enumerate("yx"))
        zero = ctx.i64(0)

        def corner(yy, xx, hint):
            idx = ctx.op("Add", [ctx.op("Mul", [ctx.op("Max", [yy, zero], hint), ctx.i64(w)], hint),
                                 ctx.op("Max", [xx, zero], hint)], hint)
            idx = ctx.op("Expand", [ctx.op("Unsqueeze", [idx, ctx.i64([1])], hint), ctx.i64([n, bins, p])], hint)
            vals = ctx.op("GatherElements", [table, idx], hint, axis=2)
            keep = ctx.op("And", [ctx.op("GreaterOrEqual", [yy, zero], hint),
                                  ctx.op("GreaterOrEqual", [xx, zero], hint)], hint)
            keep = ctx.op("Unsqueeze", [keep, ctx.i64([1])], hint + "_keep")
            return ctx.op("Where", [keep, vals, ctx.f32(0.0)], hint)

        for k, (size, out) in enumerate(zip(node.attrs["sizes"], node.outputs)):
            y0 = ctx.op("Sub", [y, ctx.i64(size // 2 + 1)], f"y0_{k}")
            x0 = ctx.op("Sub", [x, ctx.i64(size // 2 + 1)], f"x0_{k}")
            y1 = ctx.op("Min", [ctx.op("Add", [y0, ctx.i64(size)], f"y1_{k}"), ctx.i64(h - 1)], f"y1_{k}")
            x1 = ctx.op("Min", [ctx.op("Add", [x0, ctx.i64(size)], f"x1_{k}"), ctx.i64(w - 1)], f"x1_{k}")
            y0 = ctx.op("Min", [y0, ctx.i64(h - 1)], f"y0_{k}")
            x0 = ctx.op("Min", [x0, ctx.i64(w - 1)], f"x0_{k}")
            v = ctx.op("Sub", [corner(y1, x1, f"c11_{k}"), corner(y0, x1, f"c01_{k}")], f"win_{k}")
            v = ctx.op("Add", [ctx.op("Sub", [v, corner(y1, x0, f"c10_{k}")], f"win_{k}"),
                               corner(y0, x0, f"c00_{k}")], f"win_{k}")
            v = ctx.op("Transpose", [v], f"rows_{k}", perm=[0, 2, 1])
            total = ctx.op("Slice", [ctx.op("CumSum", [v, ctx.i64(2)], f"sum_{k}"), ctx.i64([bins - 1]),
                                     ctx.i64([bins]), ctx.i64([2])], f"total_{k}")
            norm = ctx.op("Where", [ctx.op("Greater", [total, ctx.f32(0.0)], f"pos_{k}"),
                                    ctx.op("Div", [v, total], f"div_{k}"),
                                    ctx.f32(float(np.float32(1.0 / bins)))], f"norm_{k}")
            ctx.add_node("Reshape", [norm, ctx.i64([n * p, bins])], [out], name=f"{node.name}/{k}")


@register_layer("SparseHypercolumnExtractor")
class SparseHypercolumnExtractor(Layer):
    def parse(self, lp):
        need_blobs(lp, "SparseHypercolumnExtractor", range(2, AT_LEAST), 1, roles="locations, feature maps...")
        p = lp.sparse_hypercolumn_extractor_param
        maps = len(lp.bottom) - 1
        f32 = [[float(np.float32(v)) for v in values]
               for values in (p.scale, p.offset_height, p.offset_width, p.activation_mult)]
        scales, offsets_h, offsets_w, mults = f32
        for field, values in (("scale", scales), ("offset_height", offsets_h), ("offset_width", offsets_w)):
            if len(values) != maps:
                raise LayerError(f"sparse_hypercolumn_extractor_param.{field} is given {len(values)} times; the fork "
                                 f"needs one per feature-map bottom ({maps}; its CHECK_EQ in Reshape)")
        if len(mults) > maps:
            raise LayerError(f"sparse_hypercolumn_extractor_param.activation_mult is given {len(mults)} times, more "
                             f"than the {maps} feature-map bottoms (the fork's CHECK_EQ)")
        if 0.0 in scales:
            raise LayerError(f"sparse_hypercolumn_extractor_param.scale[{scales.index(0.0)}] is 0: the fork divides "
                             f"the locations by it")
        return {"scales": scales, "offsets_h": offsets_h, "offsets_w": offsets_w,
                "mults": mults + [1.0] * (maps - len(mults))}

    @staticmethod
    def _lasts(in_shapes):
        """Per map, H - 1.0001 and W - 1.0001 in float32, the fork's upper bounds."""
        n = None
        lasts = []
        for i, shape in enumerate(in_shapes[1:]):
            num, _, h, w = four_axes(shape, "SparseHypercolumnExtractor", f"bottom {i + 1}")
            if n is not None and num != n:
                raise LayerError(f"SparseHypercolumnExtractor: bottom {i + 1} holds {num} images, bottom 1 {n} "
                                 f"(the fork's CHECK_EQ)")
            n = num
            if h < 2 or w < 2:
                raise LayerError(f"SparseHypercolumnExtractor: bottom {i + 1} is {h} x {w}; the fork samples "
                                 f"row and column lo + 1, past a map of one row or column")
            lasts.append(tuple(float(np.float32(d) - np.float32(1.0001)) for d in (h, w)))
        _locations(in_shapes[0], "SparseHypercolumnExtractor", n)
        return lasts

    def infer(self, attrs, in_shapes):
        self._lasts(in_shapes)
        n, p = in_shapes[0][0], in_shapes[0][1]
        return [(n * p, sum(int(s[1]) for s in in_shapes[1:]))]

    def _args(self, attrs, in_shapes):
        a = attrs
        return a["scales"], a["offsets_h"], a["offsets_w"], a["mults"], self._lasts(in_shapes)

    def forward(self, attrs, params, locations, *maps):
        args = self._args(attrs, [tuple(locations.shape)] + [tuple(m.shape) for m in maps])
        return sparse_hypercolumns(locations, list(maps), *args)

    def pytorch_source(self, node, emit):
        args = self._args(node.attrs, [emit.in_shape(i) for i in range(len(node.inputs))])
        emit.helper(hypercolumn_axis)
        fn = emit.helper(sparse_hypercolumns)
        return f"{fn}({emit.inputs[0]}, [{', '.join(emit.inputs[1:])}], {', '.join(emit.lit(list(v)) for v in args)})"

    def onnx(self, ctx, node):
        shapes = [ctx.shape(t) for t in node.inputs]
        scales, offsets_h, offsets_w, mults, lasts = self._args(node.attrs, shapes)
        n, p = shapes[0][0], shapes[0][1]
        y, x = (_last_axis(ctx, node.inputs[0], k, a) for k, a in enumerate("yx"))

        def axis(pos, offset, scale, last, hint):
            t = ctx.op("Div", [ctx.op("Sub", [pos, ctx.f32(offset)], hint), ctx.f32(scale)], hint)
            t = ctx.op("Min", [ctx.op("Max", [t, ctx.f32(0.0)], hint), ctx.f32(last)], hint)
            lo = ctx.op("Cast", [t], hint + "_lo", to=_I64)            # t >= 0: the cast truncates, as (int)
            lo_f = ctx.op("Cast", [lo], hint + "_lo_f", to=_F32)
            hi = ctx.op("Add", [lo, ctx.i64(1)], hint + "_hi")
            f_lo = ctx.op("Sub", [ctx.op("Add", [lo_f, ctx.f32(1.0)], hint), t], hint + "_flo")
            f_hi = ctx.op("Sub", [t, lo_f], hint + "_fhi")
            return lo, hi, (ctx.op("Unsqueeze", [f, ctx.i64([1])], hint) for f in (f_lo, f_hi))

        cols = []
        for m, (fmap, shape, scale, oh, ow, mult, (last_h, last_w)) in enumerate(
                zip(node.inputs[1:], shapes[1:], scales, offsets_h, offsets_w, mults, lasts)):
            c, h, w = shape[1], shape[2], shape[3]
            flat = ctx.op("Reshape", [fmap, ctx.i64([n, c, h * w])], f"flat{m}")
            ylo, yhi, (fylo, fyhi) = axis(y, oh, scale, last_h, f"y{m}")
            xlo, xhi, (fxlo, fxhi) = axis(x, ow, scale, last_w, f"x{m}")

            def at(yy, xx, hint, flat=flat, c=c, w=w):
                idx = ctx.op("Add", [ctx.op("Mul", [yy, ctx.i64(w)], hint), xx], hint)
                idx = ctx.op("Expand", [ctx.op("Unsqueeze", [idx, ctx.i64([1])], hint), ctx.i64([n, c, p])], hint)
                return ctx.op("GatherElements", [flat, idx], hint, axis=2)

            def lerp(f0, a, f1, b, hint):
                return ctx.op("Add", [ctx.op("Mul", [f0, a], hint), ctx.op("Mul", [f1, b], hint)], hint)

            top = lerp(fxlo, at(ylo, xlo, f"a{m}"), fxhi, at(ylo, xhi, f"b{m}"), f"top{m}")
            bottom = lerp(fxlo, at(yhi, xlo, f"c{m}"), fxhi, at(yhi, xhi, f"d{m}"), f"bottom{m}")
            v = ctx.op("Mul", [lerp(fylo, top, fyhi, bottom, f"mix{m}"), ctx.f32(mult)], f"mult{m}")
            cols.append(ctx.op("Transpose", [v], f"col{m}", perm=[0, 2, 1]))
        joined = ctx.op("Concat", cols, "joined", axis=2) if len(cols) > 1 else cols[0]
        ctx.add_node("Reshape", [joined, ctx.i64([n * p, -1])], [node.outputs[0]], name=node.name)


_IMAGE_TYPE = caffe_pb2.ExtendedImageDataParameter


@register_layer("ExtendedImageData")
class ExtendedImageData(ForkDataLayer):
    def parse(self, lp):
        need_blobs(lp, "ExtendedImageData (tops data[, label])", 0, (1, 2))
        p, e = lp.image_data_param, lp.extended_image_data_param
        t = transform_attrs(lp)
        if t["mean_file"]:
            raise LayerError("ExtendedImageData does not support transform_param.mean_file (the fork's CHECK)")
        if bool(p.new_height) != bool(p.new_width):
            raise LayerError("image_data_param: new_height and new_width must be set together (the fork's CHECK)")
        if e.shortest_side and p.new_height:
            raise LayerError("extended_image_data_param.shortest_side needs image_data_param.new_height and "
                             "new_width unset (the fork's CHECK)")
        kind = int(e.image_type)
        crop = t["crop_size"] * 2 + 1 if e.ucm2 else t["crop_size"]
        new = (int(p.new_height), int(p.new_width)) if p.new_height else None
        if kind == _IMAGE_TYPE.PIXEL:
            channels = 3 if p.is_color else 1
            hw = (crop, crop) if crop else (new if not e.shortest_side else None)
        elif kind in (_IMAGE_TYPE.MAT, _IMAGE_TYPE.COCO_JSON):
            if new:
                raise LayerError(f"image_data_param.new_height / new_width are not supported for image_type "
                                 f"{_IMAGE_TYPE.ImageType.Name(kind)} (the fork's CHECK)")
            channels = 1 if kind == _IMAGE_TYPE.MAT else 80
            hw = (crop, crop) if crop else None
        else:    # IMAGE (the default) and NONE: a blank new_height x new_width plane
            if not crop and not new:
                raise LayerError(f"image_type {_IMAGE_TYPE.ImageType.Name(kind)} loads a blank new_height x "
                                 f"new_width plane: with neither those nor crop_size it is empty, which the "
                                 f"fork's CHECK(cv_cropped_img.data) refuses")
            channels = 1
            hw = (crop, crop) if crop else new
        return {"type": lp.type, "tops": list(lp.top), "num_tops": len(lp.top), "transform": t,
                "source": p.source, "batch_size": positive_field(p.batch_size, "image_data_param.batch_size"),
                "channels": channels, "hw": hw, "image_type": _IMAGE_TYPE.ImageType.Name(kind),
                "new_size": new, "shortest_side": (int(e.shortest_side), int(e.shortest_side_max)),
                "fill_value": float(e.fill_value), "ucm2": bool(e.ucm2),
                "color_perturbation": bool(e.color_perturbation)}

    def guessed_label_tops(self, attrs, given):
        return ()     # the fork's labels are (batch_size,), as Caffe's

    def preprocessing(self, attrs):
        kind = attrs["image_type"]
        lines = [f"image_type {kind}: " + {
            "PIXEL": "images read with OpenCV (0-255, BGR colour or gray)",
            "MAT": "a MAT file's 2-D array (extended_image_data_param.key)",
            "COCO_JSON": "80 COCO RLE masks of a JSON file"}.get(kind, "a blank (all 0) plane, no file read")]
        if attrs["new_size"]:
            lines.append("resized to {}x{} (height x width)".format(*attrs["new_size"]))
        low, high = attrs["shortest_side"]
        if low:
            lines.append(f"shorter side resized to {low}, aspect kept" if not high or high <= low
                         else f"shorter side resized to a random size in [{low}, {high}], aspect kept")
        if attrs["transform"]["crop_size"]:
            lines.append(f"padded to the crop with fill_value {attrs['fill_value']:g} (mean_value with 3 values)"
                         + ("; UCM maps: a 2 crop + 1 window at even offsets" if attrs["ucm2"] else ""))
        if attrs["color_perturbation"]:
            lines.append("random PCA colour perturbation added to each channel (color_perturbation)")
        return lines + describe_transform(attrs["transform"])
