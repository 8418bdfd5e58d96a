"""ZhiwenShao's facial action unit nets: JAANet (ZhiwenShao/JAANet 0b8e87e) and ARL (ZhiwenShao/ARL
512c226).  Both repos ship the layers' sources (src/*.cpp, *.cu) and an excerpt of their caffe.proto.

- Division (division_layer.cpp; the .cu calls the CPU code; the same file in both repos;
  division_param width, height, xcoord, ycoord): one (N, C, H, W) bottom, one top per crop; top k is
  bottom[:, :, ycoord[k]:ycoord[k] + height, xcoord[k]:xcoord[k] + width].  The fork checks nothing:
  a crop past the bottom's width reads the next row, one past its height the next channel, and
  fewer coordinates than tops read past the vector; caffeq refuses all three.
- Combination (combination_layer.cpp; the .cu calls the CPU code; combination_param xcoord, ycoord):
  the inverse.  The top is (N, C) of bottom 0 by (ycoord[last] + H_last, xcoord[last] + W_last);
  bottom k, in order, is copied to rows ycoord[k]... and columns xcoord[k]..., a later bottom
  overwriting an earlier one where they overlap.  The fork never clears its top: what no bottom
  covers keeps what the blob held, zeros from Caffe's allocation (nothing else writes that blob),
  and caffeq gives zeros there.  Each bottom is copied with bottom 0's N and C, and a region past
  the top's width would spill into the next row: bottoms of other N or C and regions outside the
  top are refused.
- AUMaskBasedLand (JAANet au_mask_based_land_layer.cpp; the .cu calls the CPU code;
  au_mask_based_land_param img_size, spatial_ratio, spatial_scale, fill_type ["manhattan"],
  fill_coeff [0.075], fill_value [0]): from 49 (x, y) landmarks (bottom (N, >= 92 values)), 13 tops
  (N, 1, S, S), S = round(img_size * spatial_scale): 12 AU attention maps and their maximum.
  ruler = |x22 - x25|; 24 centres (landmark, y shift): 4 and 5 (-ruler/2), 1 and 8 (-ruler/3), 2 and
  7 (+ruler/3), 24 and 29 (+ruler), 21, 26, 43, 45, 31, 37 (three times each), 39 and 41 (+ruler/2),
  34 and 40 (twice).  Centre j fills AU map j // 2 on the square round((c -+ half) * spatial_scale)
  (half = (img_size - 1) / 2 * spatial_ratio, C's round, halves away from zero; each end clamped to
  [0, S - 1], so a square wholly outside still touches the border) with
  max(1 - (|h - cy s| + |w - cx s|) * fill_coeff * 100 / (img_size s), fill_value), s the
  spatial_scale, the last factor in double as the fork's C++; centre 2k + 1 overwrites centre 2k
  where both cover a pixel.  The last top is the pixelwise maximum of every value written, and
  fill_value where none is.  Every map starts at fill_value (Reshape, which Caffe runs before each
  forward, sets it); a fill_type other than "manhattan" writes nothing else.  The fork calls an
  unqualified `abs` on floats: this reads it as the float absolute value (a build whose headers
  left only C's int abs in scope would truncate the ruler and the distances).
- MultiStageMeanfieldAU3 (ARL multi_stage_meanfield_au3.cpp, meanfield_iteration.cpp,
  modified_permutohedral.cpp; CPU only): CRF-RNN's mean-field inference on an AU attention map,
  bottoms (unary, Q0, features: any channel count, the unary's N, H and W), top = the unary's shape,
  blobs spatial weights, bilateral weights, compatibility, each (1, 1, C, C); num_iterations must be
  > 1.  The bilateral kernel compares every feature channel over theta_beta (CRF-RNN's compares
  three colour channels); the rest is CRF-RNN's inference, crf_rnn.py's.  Without weights the fork
  reads the diagonals of blobs 0 and 1 from spatial.par and bilateral.par in its working directory;
  caffeq's start is the default fill.
- AlignDataTransform (JAANet align_data_transform_layer.cpp; the .cu calls the CPU code; no parameters):
  bottoms landmarks (N, 2 L: x0, y0, x1, ...), the data layer's mirror and crop record (N, 4 values:
  mirrored, width, crop y, crop x) and the mirror pairing (1-based landmark numbers, the first L values
  of bottom 2, the same for every item).  Each x becomes x - crop x and each y, y - crop y; where
  mirrored, x becomes width - 1 - x and landmark j takes the values of landmark index[j].  The top is
  the landmarks' 4-axis (num, channels, height, width); its training nets feed it to the losses.
"""

import numpy as np
import torch

from .c_numerics import c_round, onnx_c_round
from .crf_rnn import MultiStageMeanfield, meanfield_attrs
from .registry import AT_LEAST, Layer, LayerError, four_axes, legacy_nchw, need_blobs, register_layer

# ---- torch functions (model.py gets the same code) ---------------------------------------

def align_landmarks(land, para, pairs, legacy_shape: list[int]):
    """JAANet's AlignDataTransform: landmarks moved into the crop, mirrored where the record says so."""
    n = land.shape[0]
    pts = land.reshape(n, -1, 2)
    record = para.reshape(n, -1)
    x = pts[:, :, 0] - record[:, 3:4]
    y = pts[:, :, 1] - record[:, 2:3]
    mirrored = record[:, 0:1] != 0
    x = torch.where(mirrored, record[:, 1:2] - 1 - x, x)
    moved = torch.stack([x, y], dim=2)
    order = pairs.reshape(-1)[:pts.shape[1]].long() - 1     # int(index) - 1, read from the first values
    swapped = moved[:, order]
    return torch.where(mirrored[:, :, None], swapped, moved).reshape(legacy_shape)



def au_division(x, ys: list, xs: list, height: int, width: int):
    """Division: one crop of x per (y, x) offset."""
    return tuple(x[:, :, y:y + height, c:c + width] for y, c in zip(ys, xs))


def au_combination(parts: list, ys: list, xs: list, height: int, width: int):
    """Combination: each part copied at its offset into a zero map, later parts on top."""
    first = parts[0]
    top = first.new_zeros((first.shape[0], first.shape[1], height, width))
    for part, y, c in zip(parts, ys, xs):
        top[:, :, y:y + part.shape[2], c:c + part.shape[3]] = part
    return top


# JAANet's 24 AU centres: the landmark, the sign and divisor of the ruler added to its y
AU_MARKS = [4, 5, 1, 8, 2, 7, 24, 29, 21, 26, 43, 45, 31, 37, 31, 37, 31, 37, 39, 41, 34, 40, 34, 40]
AU_SIGNS = [-1, -1, -1, -1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0]
AU_DIVISORS = [2, 2, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 1, 1, 1, 1]


def au_masks(land, marks: list, signs: list, divisors: list, half: float, scale: float,
             size: int, coeff: float, factor: float, fill: float, manhattan: bool):
    """AUMaskBasedLand: 12 AU maps (N, 1, size, size) from landmarks and their maximum."""
    n = land.shape[0]
    pts = land.reshape(n, -1)
    dev, dt = land.device, land.dtype
    if not manhattan:
        blank = torch.full((n, 1, size, size), fill, dtype=dt, device=dev)
        return tuple(blank.clone() for _ in range(13))
    marks_t = torch.tensor(marks, device=dev)
    ruler = (pts[:, 44:45] - pts[:, 50:51]).abs()
    shift = ruler / torch.tensor(divisors, dtype=dt, device=dev) * torch.tensor(signs, dtype=dt, device=dev)
    cx = pts[:, 2 * marks_t].reshape(n, -1, 1, 1)
    cy = (pts[:, 2 * marks_t + 1] + shift).reshape(n, -1, 1, 1)
    last = float(size - 1)
    sw = c_round((cx - half) * scale).clamp(0.0, last)
    ew = c_round((cx + half) * scale).clamp(0.0, last)
    sh = c_round((cy - half) * scale).clamp(0.0, last)
    eh = c_round((cy + half) * scale).clamp(0.0, last)
    grid = torch.arange(size, dtype=dt, device=dev)
    hh = grid.reshape(1, 1, size, 1)
    ww = grid.reshape(1, 1, 1, size)
    inside = (hh >= sh) & (hh <= eh) & (ww >= sw) & (ww <= ew)
    spread = ((hh - cy * scale).abs() + (ww - cx * scale).abs()) * coeff
    value = (1.0 - spread.double() * factor).clamp_min(fill).to(dt)
    blank = torch.full_like(value, fill)
    written = torch.where(inside, value, blank)
    maps = []
    for k in range(12):
        even = written[:, 2 * k:2 * k + 1]
        maps.append(torch.where(inside[:, 2 * k + 1:2 * k + 2], value[:, 2 * k + 1:2 * k + 2], even))
    maps.append(written.amax(1, keepdim=True))
    return tuple(maps)


# ---- Division, Combination -------------------------------------------------------------------

def _coords(p, what, count):
    xs, ys = [int(v) for v in p.xcoord], [int(v) for v in p.ycoord]
    if len(xs) < count or len(ys) < count:
        raise LayerError(f"{what} needs one xcoord and one ycoord per {'top' if what[0] == 'd' else 'bottom'} "
                         f"({count}), got {len(xs)} and {len(ys)}: the fork would read past them")
    return ys[:count], xs[:count]


@register_layer("Division")
class Division(Layer):
    def parse(self, lp):
        need_blobs(lp, "Division", 1, range(1, AT_LEAST), in_place=False)
        p = lp.division_param
        if not lp.HasField("division_param") or p.width < 1 or p.height < 1:
            raise LayerError(f"division_param needs width and height >= 1, got {p.width} x {p.height}")
        ys, xs = _coords(p, "division_param", len(lp.top))
        return {"height": int(p.height), "width": int(p.width), "ys": ys, "xs": xs}

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "Division")
        ch, cw = attrs["height"], attrs["width"]
        for k, (y, x) in enumerate(zip(attrs["ys"], attrs["xs"])):
            if y + ch > h or x + cw > w:
                raise LayerError(f"Division's crop {k} (rows {y}..{y + ch - 1}, columns {x}..{x + cw - 1}) leaves "
                                 f"the {h} x {w} bottom: the fork would read the next row or channel")
        return [(n, c, ch, cw)] * len(attrs["ys"])

    def forward(self, attrs, params, x):
        return au_division(x, attrs["ys"], attrs["xs"], attrs["height"], attrs["width"])

    def onnx(self, ctx, node):
        a = node.attrs
        axes = ctx.i64([2, 3])
        for out, y, x in zip(node.outputs, a["ys"], a["xs"]):
            ctx.add_node("Slice", [node.inputs[0], ctx.i64([y, x]), ctx.i64([y + a["height"], x + a["width"]]),
                                   axes], [out], name=node.name)

    def pytorch_source(self, node, emit):
        a = node.attrs
        x = emit.inputs[0]
        return [f"{x}[:, :, {y}:{y + a['height']}, {c}:{c + a['width']}]" for y, c in zip(a["ys"], a["xs"])]


@register_layer("Combination")
class Combination(Layer):
    def parse(self, lp):
        need_blobs(lp, "Combination", range(1, AT_LEAST), 1, in_place=False)
        ys, xs = _coords(lp.combination_param, "combination_param", len(lp.bottom))
        return {"ys": ys, "xs": xs}

    def infer(self, attrs, in_shapes):
        shapes = [four_axes(s, "Combination") for s in in_shapes]
        n, c = shapes[0][:2]
        ys, xs = attrs["ys"], attrs["xs"]
        height, width = ys[-1] + shapes[-1][2], xs[-1] + shapes[-1][3]
        for k, (s, y, x) in enumerate(zip(shapes, ys, xs)):
            if s[:2] != (n, c):
                raise LayerError(f"Combination's bottom {k} {list(s)} must share bottom 0's N and C {[n, c]} "
                                 f"(the fork copies it with bottom 0's)")
            if y + s[2] > height or x + s[3] > width:
                raise LayerError(f"Combination's bottom {k} at row {y}, column {x} ({s[2]} x {s[3]}) leaves the "
                                 f"{height} x {width} top (sized by the last bottom): the fork would write the "
                                 f"next row or channel")
        return [(n, c, height, width)]

    def forward(self, attrs, params, *parts):
        return au_combination(list(parts), attrs["ys"], attrs["xs"], *self._size(attrs, [p.shape for p in parts]))

    @staticmethod
    def _size(attrs, shapes):
        return attrs["ys"][-1] + int(shapes[-1][2]), attrs["xs"][-1] + int(shapes[-1][3])

    def onnx(self, ctx, node):
        shapes = [ctx.shape(t) for t in node.inputs]
        height, width = self._size(node.attrs, shapes)
        top = ctx.const(np.zeros((), np.float32))
        for k, (part, s, y, x) in enumerate(zip(node.inputs, shapes, node.attrs["ys"], node.attrs["xs"])):
            h, w = int(s[2]), int(s[3])
            pads = ctx.i64([0, 0, y, x, 0, 0, height - y - h, width - x - w])
            placed = ctx.add_node("Pad", [part, pads], [ctx.tmp(f"{node.name}_placed")], name=node.name)[0]
            mask = np.zeros((1, 1, height, width), bool)
            mask[..., y:y + h, x:x + w] = True
            out = node.outputs[0] if k == len(shapes) - 1 else ctx.tmp(f"{node.name}_part")
            top = ctx.add_node("Where", [ctx.const(mask), placed, top], [out], name=node.name)[0]

    def pytorch_source(self, node, emit):
        height, width = self._size(node.attrs, [emit.in_shape(i) for i in range(len(emit.inputs))])
        fn = emit.helper(au_combination)
        return (f"{fn}([{', '.join(emit.inputs)}], {emit.lit(node.attrs['ys'])}, {emit.lit(node.attrs['xs'])}, "
                f"{height}, {width})")


# ---- AUMaskBasedLand -------------------------------------------------------------------------

@register_layer("AUMaskBasedLand")
class AUMaskBasedLand(Layer):
    def parse(self, lp):
        need_blobs(lp, "AUMaskBasedLand", 1, 13, "landmarks")
        p = lp.au_mask_based_land_param
        if not lp.HasField("au_mask_based_land_param"):
            raise LayerError("AUMaskBasedLand needs au_mask_based_land_param (img_size, spatial_ratio, spatial_scale)")
        f32 = np.float32
        scale = f32(p.spatial_scale)
        scaled = f32(f32(p.img_size) * scale)              # int * float in float, as the fork
        size = int(np.sign(scaled) * np.floor(abs(float(scaled)) + 0.5))
        if size < 1:
            raise LayerError(f"AUMaskBasedLand's maps would be round(img_size * spatial_scale) = {size} pixels "
                             f"wide (img_size {p.img_size}, spatial_scale {p.spatial_scale}): need >= 1")
        half = f32((p.img_size - 1) / 2.0 * float(f32(p.spatial_ratio)))
        return {"size": size, "half": float(half), "scale": float(scale), "coeff": float(f32(p.fill_coeff)),
                "factor": 100.0 / float(scaled), "fill": float(f32(p.fill_value)),
                "manhattan": p.fill_type == "manhattan"}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if not s or s[0] < 1:
            raise LayerError(f"AUMaskBasedLand needs a (N, landmarks...) bottom, got {list(s)}")
        per_item = int(np.prod(s[1:], dtype=np.int64))
        if per_item < 92:
            raise LayerError(f"AUMaskBasedLand reads 49 (x, y) landmarks up to value 91 of each item, the bottom "
                             f"{list(s)} has {per_item}")
        return [(s[0], 1, attrs["size"], attrs["size"])] * 13

    def _args(self, attrs):
        return (AU_MARKS, AU_SIGNS, AU_DIVISORS, attrs["half"], attrs["scale"], attrs["size"], attrs["coeff"],
                attrs["factor"], attrs["fill"], attrs["manhattan"])

    def forward(self, attrs, params, land):
        return au_masks(land, *self._args(attrs))

    def pytorch_source(self, node, emit):
        emit.helper(c_round)
        fn = emit.helper(au_masks)
        args = ", ".join(emit.lit(v) for v in self._args(node.attrs))
        maps = emit.tmp("au_maps")
        emit.stmt(f"{maps} = {fn}({emit.inputs[0]}, {args})")
        return [f"{maps}[{k}]" for k in range(13)]

    def onnx(self, ctx, node):
        a = node.attrs
        name, size = node.name, a["size"]
        outs = node.outputs

        def op(kind, inputs, hint="t", **kw):
            return ctx.add_node(kind, inputs, [ctx.tmp(f"{name}_{hint}")], name=name, **kw)[0]

        if not a["manhattan"]:
            blank = np.full((1, 1, size, size), a["fill"], np.float32)
            shape = op("Concat", [op("Slice", [op("Shape", [node.inputs[0]], "shape"), ctx.i64([0]),
                                               ctx.i64([1])], "n"), ctx.i64([1, size, size])], "shape", axis=0)
            for out in outs:
                ctx.add_node("Expand", [ctx.const(blank), shape], [out], name=name)
            return
        pts = op("Reshape", [node.inputs[0], ctx.i64([0, -1])], "points")
        ruler = op("Abs", [op("Sub", [op("Gather", [pts, ctx.i64([44])], "x22", axis=1),
                                      op("Gather", [pts, ctx.i64([50])], "x25", axis=1)], "dx")], "ruler")
        shift = op("Mul", [op("Div", [ruler, ctx.f32(AU_DIVISORS)], "part"), ctx.f32(AU_SIGNS)], "shift")
        marks = np.array(AU_MARKS, np.int64)
        col = ctx.i64([0, len(AU_MARKS), 1, 1])
        cx = op("Reshape", [op("Gather", [pts, ctx.const(2 * marks)], "xs", axis=1), col], "cx")
        cy = op("Reshape", [op("Add", [op("Gather", [pts, ctx.const(2 * marks + 1)], "ys", axis=1), shift], "ysh"),
                            col], "cy")
        half, scale = ctx.f32(a["half"]), ctx.f32(a["scale"])
        zero, last = ctx.f32(0.0), ctx.f32(float(size - 1))

        def bound(centre, sign):
            edge = op(sign, [centre, half], "edge")
            r = onnx_c_round(ctx, op("Mul", [edge, scale], "scaled"))
            return op("Min", [op("Max", [r, zero], "lo"), last], "bound")

        sw, ew, sh, eh = bound(cx, "Sub"), bound(cx, "Add"), bound(cy, "Sub"), bound(cy, "Add")
        grid = np.arange(size, dtype=np.float32)
        hh, ww = ctx.const(grid.reshape(1, 1, size, 1)), ctx.const(grid.reshape(1, 1, 1, size))
        inside = op("And", [op("And", [op("GreaterOrEqual", [hh, sh], "c"), op("LessOrEqual", [hh, eh], "c")], "rows"),
                            op("And", [op("GreaterOrEqual", [ww, sw], "c"), op("LessOrEqual", [ww, ew], "c")], "cols")],
                    "inside")
        dist = op("Add", [op("Abs", [op("Sub", [hh, op("Mul", [cy, scale], "acy")], "dh")], "adh"),
                          op("Abs", [op("Sub", [ww, op("Mul", [cx, scale], "acx")], "dw")], "adw")], "dist")
        spread = op("Cast", [op("Mul", [dist, ctx.f32(a["coeff"])], "spread")], "spread64", to=11)
        value64 = op("Sub", [ctx.const(np.array(1.0)), op("Mul", [spread, ctx.const(np.array(a["factor"]))], "k")], "v")
        value = op("Cast", [op("Max", [value64, ctx.const(np.array(a["fill"]))], "vmax")], "value", to=1)
        fill = ctx.f32(a["fill"])
        written = op("Where", [inside, value, fill], "written")

        def channel(tensor, j, hint):
            return op("Slice", [tensor, ctx.i64([j]), ctx.i64([j + 1]), ctx.i64([1])], hint)

        for k in range(12):
            ctx.add_node("Where", [channel(inside, 2 * k + 1, "in_odd"), channel(value, 2 * k + 1, "v_odd"),
                                   channel(written, 2 * k, "w_even")], [outs[k]], name=name)
        if ctx.opset < 18:
            ctx.add_node("ReduceMax", [written], [outs[12]], name=name, axes=[1], keepdims=1)
        else:
            ctx.add_node("ReduceMax", [written, ctx.i64([1])], [outs[12]], name=name, keepdims=1)


# ---- MultiStageMeanfieldAU3 ------------------------------------------------------------------

@register_layer("MultiStageMeanfieldAU3")
class MultiStageMeanfieldAU3(MultiStageMeanfield):
    """CRF-RNN's inference over AU features instead of an image."""
    guide = "features"
    guide_channels = None   # every channel

    def parse(self, lp):
        need_blobs(lp, "MultiStageMeanfieldAU3", 3, 1, "unary, Q0, features")
        return meanfield_attrs(lp, lp.multi_stage_meanfield_au3_param, "multi_stage_meanfield_au3_param")


@register_layer("AlignDataTransform")
class AlignDataTransform(Layer):
    def parse(self, lp):
        need_blobs(lp, "AlignDataTransform", 3, 1, roles="landmarks, mirror and crop record, mirror pairing")
        return {}

    def infer(self, attrs, in_shapes):
        land, para, pairs = (tuple(s) for s in in_shapes)
        per_item = int(np.prod(land[1:])) if land else 0
        if not land or per_item % 2 or per_item == 0:
            raise LayerError(f"AlignDataTransform needs (x, y) landmarks per item, got {list(land)}")
        if not para or para[0] != land[0] or int(np.prod(para[1:])) < 4:
            raise LayerError(f"AlignDataTransform's second bottom holds 4 values per item (mirrored, width, crop y, "
                             f"crop x), got {list(para)} for {land[0]} items")
        if int(np.prod(pairs)) < per_item // 2:
            raise LayerError(f"AlignDataTransform's third bottom gives the mirror pairing of {per_item // 2} landmarks, "
                             f"got {list(pairs)}")
        shape = legacy_nchw(land, "AlignDataTransform")
        attrs["_legacy"] = list(shape)
        return [shape]

    def forward(self, attrs, params, land, para, pairs):
        return align_landmarks(land, para, pairs, attrs["_legacy"])

    def onnx(self, ctx, node):
        land, para, pairs = node.inputs
        n, count = ctx.shape(land)[0], int(np.prod(ctx.shape(land)[1:])) // 2
        pts = ctx.op("Reshape", [land, ctx.i64([n, count, 2])], "pts", name=node.name)
        record = ctx.op("Reshape", [para, ctx.i64([n, -1])], "record")

        def column(t, k, hint):
            return ctx.op("Slice", [t, ctx.i64([k]), ctx.i64([k + 1]), ctx.i64([1])], hint)

        def coord(k, hint):
            part = ctx.op("Slice", [pts, ctx.i64([k]), ctx.i64([k + 1]), ctx.i64([2])], hint + "3")
            return ctx.op("Squeeze", [part, ctx.i64([2])], hint)
        x = ctx.op("Sub", [coord(0, "x"), column(record, 3, "crop_x")], "x_in")
        y = ctx.op("Sub", [coord(1, "y"), column(record, 2, "crop_y")], "y_in")
        mirrored = ctx.op("Not", [ctx.op("Equal", [column(record, 0, "flag"), ctx.f32(0.0)], "unflipped")], "mirrored")
        flipped = ctx.op("Sub", [ctx.op("Sub", [column(record, 1, "width"), ctx.f32(1.0)], "last"), x], "x_flip")
        x = ctx.op("Where", [mirrored, flipped, x], "x_out")
        moved = ctx.op("Concat", [ctx.op("Unsqueeze", [x, ctx.i64([2])], "x3"),
                                  ctx.op("Unsqueeze", [y, ctx.i64([2])], "y3")], "moved", axis=2)
        order = ctx.op("Slice", [ctx.op("Reshape", [pairs, ctx.i64([-1])], "pairs"), ctx.i64([0]), ctx.i64([count]),
                                 ctx.i64([0])], "order_f")
        order = ctx.op("Sub", [ctx.op("Cast", [order], "order_i", to=7), ctx.i64(1)], "order")
        swapped = ctx.op("Gather", [moved, order], "swapped", axis=1)
        out = ctx.op("Where", [ctx.op("Unsqueeze", [mirrored, ctx.i64([2])], "mirrored3"), swapped, moved], "aligned")
        ctx.add_node("Reshape", [out, ctx.i64(node.attrs["_legacy"])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        return f"{emit.helper(align_landmarks)}({', '.join(emit.inputs)}, {node.attrs['_legacy']})"
