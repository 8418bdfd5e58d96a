"""akanazawa/si-convnet (2c6317b: up_layer.cpp, downpool_layer.cpp, tiedconv_layer.cpp, ticonv_layer.cpp,
util/transformation.cpp; its scale-invariant ConvNets, V1 files): UP, DOWNPOOL, TIEDCONV and TICONV.

- Each `transformations` entry is a float32 3 x 3 matrix, R(rotation, degrees) then S(scale), on row
  vectors [row, col, 1].  A H x W map becomes trunc(the extent of its corners (0,0), (H,0), (0,W), (H,W))
  in size, and output pixel (r, c) samples the input at the inverse matrix's image of
  (r - (Hn-1)/2, c - (Wn-1)/2), plus ((H-1)/2, (W-1)/2): a grid about the centres, all in float32.
  Bilinear (interp 1, the default) truncates to the cell and keeps the edge pixel within half a pixel of
  the border; nearest (0) rounds halves away from zero.  Outside the map (border 0, CROP) gives 0;
  border 1 clamps, 2 reflects once.  A layer's first entry sets border and interp for all of them.
- Up: one bottom, one top per entry; an entry of scale 1 and no rotation copies; final_width and
  final_height crop or pad the grid about its centre (the odd pixel on the far side).
- Tiedconv: BVLC's convolution with the same blobs over each bottom, whose sizes may differ.
- Downpool: bottom 0 is the canonical map and the top's shape; bottom i >= 1 is mapped back by its
  entry's inverse, cropped or padded to that shape, and replaces the top where it has data and is
  strictly greater (ties keep the earlier bottom; padding takes no part).  Only MAX exists.
- Ticonv: Up, Tiedconv and Downpool in one layer with the convolution's blobs (weight, bias): the
  maximum over scales of the convolution of the rescaled input, mapped back; no activation inside.
The fork fixes every shape when the net is set up; TRAIN and TEST compute the same.  ONNX: the
sampling grids are constants (Gather, Mul, Add, Where).
"""
import numpy as np
import torch

from .conv import Convolution, _conv_top_shapes, _onnx_conv, _torch_conv_source, conv_out_size, parse_conv
from .registry import Layer, LayerError, four_axes, need_blobs, register_layer, torch_sources


def si_matrix(scale: float, rotation: float, invert: bool):
    """TMatFromProto: the identity, times R(angle) for a rotation, times S(scale) for a scale; invert
    negates the angle and takes float(1 / scale)."""
    f32 = torch.float32
    m = torch.eye(3, dtype=f32)
    if rotation != 0:
        pi_f = torch.tensor(3.14159265358979, dtype=f32)   # the fork's PI_F, a float
        rad = torch.tensor(-rotation if invert else rotation, dtype=f32) * pi_f / 180
        c, s = float(torch.cos(rad)), float(torch.sin(rad))
        r = torch.tensor([[c, s, 0.0], [-s, c, 0.0], [0.0, 0.0, 1.0]], dtype=f32)
        m = torch.stack([sum_rows(m[i], r) for i in range(3)])
    if scale != 1:
        sigma = torch.tensor(1.0 / scale if invert else scale, dtype=f32)
        m = m * torch.stack([sigma, sigma, torch.tensor(1.0, dtype=f32)])[None, :]
    return m


def sum_rows(v, m):
    """The row vector v times m, summed in order (v0 m0 + v1 m1) + v2 m2, each product in float32."""
    return (v[0] * m[0] + v[1] * m[1]) + v[2] * m[2]


def si_size(m, h: int, w: int):
    """GetNewSize: the truncated extent of the corners (0,0), (h,0), (0,w), (h,w) under m."""
    f32 = torch.float32
    corners = [torch.tensor([a, b, 1.0], dtype=f32) for a, b in ((0, 0), (h, 0), (0, w), (h, w))]
    points = torch.stack([sum_rows(p, m) for p in corners])
    return int(points[:, 0].max() - points[:, 0].min()), int(points[:, 1].max() - points[:, 1].min())


def si_inverse(m):
    """Invert3x3: the adjugate over the determinant, in float32."""
    a = m
    cof = [[a[1, 1] * a[2, 2] - a[1, 2] * a[2, 1], a[0, 2] * a[2, 1] - a[0, 1] * a[2, 2],
            a[0, 1] * a[1, 2] - a[0, 2] * a[1, 1]],
           [a[1, 2] * a[2, 0] - a[1, 0] * a[2, 2], a[0, 0] * a[2, 2] - a[0, 2] * a[2, 0],
            a[0, 2] * a[1, 0] - a[0, 0] * a[1, 2]],
           [a[1, 0] * a[2, 1] - a[1, 1] * a[2, 0], a[0, 1] * a[2, 0] - a[0, 0] * a[2, 1],
            a[0, 0] * a[1, 1] - a[0, 1] * a[1, 0]]]
    det = a[0, 0] * cof[0][0] + a[0, 1] * cof[1][0] + a[0, 2] * cof[2][0]
    return torch.stack([torch.stack(row) for row in cof]) / det


def si_reflect(v, size: int):
    """Reflect: a negative value folded once about 0 (modulo 2 size - 2), then one past the end about it."""
    neg = v < 0
    folded = torch.remainder(torch.trunc(-torch.floor(v)), 2 * size - 2)
    v = torch.where(neg, folded, v)
    return torch.where(v >= size, (2 * size - 2) - v, v)


def si_plan(h: int, w: int, scale: float, rotation: float, invert: bool, interp: int, border: int):
    """GenCoordMat for a h x w map: (indices (4, Hn, Wn), weights (4, Hn, Wn), valid (Hn, Wn)): the four
    neighbours of each output pixel (row0/row1 x col0/col1) and their bilinear weights; nearest uses
    the first with weight 1."""
    f32 = torch.float32
    m = si_matrix(scale, rotation, invert)
    hn, wn = si_size(m, h, w)
    if hn <= 0 or wn <= 0:
        raise ValueError(f"scale {scale} and rotation {rotation} leave nothing of a {h}x{w} map ({hn}x{wn})")
    inv = si_inverse(m)
    cy, cx = torch.tensor(float(hn - 1), dtype=f32) / 2, torch.tensor(float(wn - 1), dtype=f32) / 2
    shift = (-cy * inv[0] + -cx * inv[1]) + inv[2]   # the centring translation times the inverse
    rr = torch.arange(hn, dtype=f32)[:, None].expand(hn, wn)
    cc = torch.arange(wn, dtype=f32)[None, :].expand(hn, wn)
    row = ((rr * inv[0, 0] + cc * inv[1, 0]) + shift[0]) + torch.tensor(float(h - 1), dtype=f32) / 2
    col = ((rr * inv[0, 1] + cc * inv[1, 1]) + shift[1]) + torch.tensor(float(w - 1), dtype=f32) / 2
    valid = torch.ones((hn, wn), dtype=torch.bool)
    if interp == 0:
        # C's round: halves away from zero (exact in double)
        row = torch.sign(row.double()) * torch.floor(row.double().abs() + 0.5)
        col = torch.sign(col.double()) * torch.floor(col.double().abs() + 0.5)
        if border == 0:
            valid = (row >= 0) & (row < h) & (col >= 0) & (col < w)
        elif border == 1:
            row, col = row.clamp(0, h - 1), col.clamp(0, w - 1)
        else:
            row, col = si_reflect(row, h), si_reflect(col, w)
        index = torch.where(valid, row * w + col, torch.zeros_like(row)).long()
        zero = torch.zeros((hn, wn), dtype=f32)
        return (torch.stack([index] * 4), torch.stack([torch.ones((hn, wn), dtype=f32), zero, zero, zero]),
                valid)
    if border == 0:
        valid = ~((row.double() >= h - 0.5) | (row.double() < -0.5) | (col.double() >= w - 0.5) |
                  (col.double() < -0.5))
        row, col = torch.where(valid, row, torch.zeros_like(row)), torch.where(valid, col, torch.zeros_like(col))
    elif border == 1:
        row, col = row.clamp(0, h - 1), col.clamp(0, w - 1)
    else:
        row, col = si_reflect(row, h), si_reflect(col, w)
    r0, c0 = torch.trunc(row), torch.trunc(col)
    r1, c1 = torch.trunc(row + 1).clamp(max=h - 1), torch.trunc(col + 1).clamp(max=w - 1)
    dr = torch.where(r0 == r1, torch.zeros_like(row), row - r0)
    dc = torch.where(c0 == c1, torch.zeros_like(col), col - c0)
    r0, c0, r1, c1 = r0.long(), c0.long(), r1.long(), c1.long()
    index = torch.stack([r0 * w + c0, r0 * w + c1, r1 * w + c0, r1 * w + c1])
    weights = torch.stack([(1 - dc) * (1 - dr), (1 - dr) * dc, (1 - dc) * dr, dr * dc])
    return index, weights, valid


def si_crop_center(plan, height: int, width: int):
    """CropCenter: the grid cropped or padded about its centre to height x width (ceil of half the
    difference before, so an odd pixel goes to the far side); padding has no data."""
    index, weights, valid = plan
    new_index = torch.zeros((4, height, width), dtype=index.dtype)
    new_weights = torch.zeros((4, height, width), dtype=weights.dtype)
    new_valid = torch.zeros((height, width), dtype=torch.bool)
    spans = []
    for old, new in ((valid.shape[0], height), (valid.shape[1], width)):
        if old < new:
            spans.append((0, (new - old + 1) // 2, old))
        else:
            spans.append(((old - new + 1) // 2, 0, new))
    (oh, nh, mh), (ow, nw, mw) = spans
    new_index[:, nh:nh + mh, nw:nw + mw] = index[:, oh:oh + mh, ow:ow + mw]
    new_weights[:, nh:nh + mh, nw:nw + mw] = weights[:, oh:oh + mh, ow:ow + mw]
    new_valid[nh:nh + mh, nw:nw + mw] = valid[oh:oh + mh, ow:ow + mw]
    return new_index, new_weights, new_valid


def si_sample(x, plan, nearest: bool):
    """Each output pixel from its plan's neighbours: (w00 p00 + w01 p01) + w10 p10 + w11 p11 in float32,
    the first neighbour alone for nearest; 0 where the plan has no data."""
    index, weights, valid = plan
    n, c, h, w = x.shape
    hn, wn = valid.shape
    flat = x.reshape(n, c, h * w)
    index, weights = index.to(x.device), weights.to(x.device, x.dtype)
    picks = [flat[:, :, index[k].reshape(-1)] for k in range(1 if nearest else 4)]
    if nearest:
        values = picks[0]
    else:
        values = ((weights[0].reshape(-1) * picks[0] + weights[1].reshape(-1) * picks[1])
                  + weights[2].reshape(-1) * picks[2]) + weights[3].reshape(-1) * picks[3]
    values = torch.where(valid.to(x.device).reshape(-1), values, torch.zeros((), dtype=x.dtype, device=x.device))
    return values.reshape(n, c, hn, wn)


def si_is_identity(t):
    return t[0] == 1 and t[1] == 0


def si_up_plan(h: int, w: int, t, interp: int, border: int):
    """The plan of one Up entry t = (scale, rotation, final height or None, final width)."""
    plan = si_plan(h, w, t[0], t[1], False, interp, border)
    return plan if t[2] is None else si_crop_center(plan, t[2], t[3])


def si_up(x, transformations, interp: int, border: int):
    """Up: one top per entry; an identity entry is a copy."""
    h, w = x.shape[2], x.shape[3]
    return tuple(x.clone() if si_is_identity(t) else si_sample(x, si_up_plan(h, w, t, interp, border), interp == 0)
                 for t in transformations)


def si_down_plans(shapes, transformations, interp: int, border: int):
    """Downpool's plans: bottom i >= 1 (its h x w) mapped back by its entry's inverse, then cropped or
    padded to bottom 0's size."""
    height, width = shapes[0]
    return [si_crop_center(si_plan(h, w, t[0], t[1], True, interp, border), height, width)
            for (h, w), t in zip(shapes[1:], transformations[1:])]


def si_downpool(xs, transformations, interp: int, border: int):
    """Downpool: bottom 0, replaced where a mapped-back bottom has data and is strictly greater."""
    out = xs[0].clone()
    plans = si_down_plans([tuple(x.shape[2:]) for x in xs], transformations, interp, border)
    for x, plan in zip(xs[1:], plans):
        mapped = si_sample(x, plan, interp == 0)
        out = torch.where(plan[2].to(x.device) & (mapped > out), mapped, out)
    return out


TORCH_SI_CONVNET = torch_sources(si_matrix, sum_rows, si_size, si_inverse, si_reflect, si_plan, si_crop_center,
                                 si_sample, si_is_identity, si_up_plan, si_up, si_down_plans, si_downpool)


def parse_transformations(lp, where):
    """((scale, rotation, final height or None, final width) per entry, interp, border) from the first entry."""
    entries = list(lp.transformations)
    if not entries:
        raise LayerError(f"{where} needs one or more `transformations` entries")
    out = []
    for i, t in enumerate(entries):
        if not (np.isfinite(t.scale) and np.isfinite(t.rotation)):
            raise LayerError(f"transformations[{i}]: scale and rotation must be finite numbers")
        if t.scale <= 0:
            raise LayerError(f"transformations[{i}].scale must be > 0, got {t.scale}")
        final = None
        if t.HasField("final_width"):   # the fork reads final_height whenever final_width is set
            if t.final_width <= 0 or t.final_height <= 0:
                raise LayerError(f"transformations[{i}]: final_width and final_height must both be > 0, got "
                                 f"{t.final_width} x {t.final_height}")
            final = (int(t.final_height), int(t.final_width))
        out.append((float(t.scale), float(t.rotation)) + (final or (None, None)))
    interp, border = int(entries[0].interp), int(entries[0].border)
    if interp not in (0, 1):
        raise LayerError(f"transformations[0].interp must be 0 (nearest) or 1 (bilinear), got {interp}")
    if border not in (0, 1, 2):
        raise LayerError(f"transformations[0].border must be 0 (crop), 1 (clamp) or 2 (reflect), got {border}")
    return {"transformations": out, "interp": interp, "border": border}


def _plan_or_error(fn, *args):
    try:
        return fn(*args)
    except ValueError as e:
        raise LayerError(str(e)) from None


def _check_reflect(attrs, h, w, where):
    if attrs["border"] == 2 and min(h, w) < 2:
        raise LayerError(f"{where}: border 2 (reflect) on a {h}x{w} map divides by zero in the fork")


# ---- ONNX: the constant grids ------------------------------------------------------------------

def onnx_si_sample(ctx, x, plan, nearest, name, out=None):
    """ONNX: x (N, C, H, W) sampled by a constant plan -> (N, C, Hn, Wn)."""
    index, weights, valid = (v.numpy() for v in plan)
    hn, wn = valid.shape
    flat = ctx.op("Reshape", [x, ctx.i64([0, 0, -1])], name + "_flat")
    picks = [ctx.op("Gather", [flat, ctx.i64(index[k].reshape(-1))], f"{name}_p{k}", axis=2)
             for k in range(1 if nearest else 4)]
    if nearest:
        values = picks[0]
    else:
        terms = [ctx.op("Mul", [ctx.f32(weights[k].reshape(-1)), picks[k]], f"{name}_w{k}") for k in range(4)]
        values = terms[0]
        for k in range(1, 4):
            values = ctx.op("Add", [values, terms[k]], f"{name}_s{k}")
    kept = ctx.op("Where", [ctx.const(valid.reshape(-1)), values, ctx.f32(0.0)], name + "_kept")
    shape = ctx.i64([0, 0, hn, wn])
    if out is None:
        return ctx.op("Reshape", [kept, shape], name + "_grid")
    ctx.add_node("Reshape", [kept, shape], [out], name=name)
    return out


def onnx_si_up(ctx, node, x, attrs, outputs):
    _, _, h, w = ctx.shape(x)
    for i, (t, y) in enumerate(zip(attrs["transformations"], outputs)):
        if si_is_identity(t):
            ctx.add_node("Identity", [x], [y], name=f"{node.name}_up{i}")
        else:
            plan = si_up_plan(h, w, t, attrs["interp"], attrs["border"])
            onnx_si_sample(ctx, x, plan, attrs["interp"] == 0, f"{node.name}_up{i}", out=y)


def onnx_si_downpool(ctx, node, xs, attrs, out, shapes=None):
    """shapes: the bottoms' (H, W) where they are this layer's own tensors (Ticonv's scales)."""
    shapes = shapes or [tuple(ctx.shape(x)[2:]) for x in xs]
    plans = si_down_plans(shapes, attrs["transformations"], attrs["interp"], attrs["border"])
    top = xs[0]
    for i, (x, plan) in enumerate(zip(xs[1:], plans), start=1):
        mapped = onnx_si_sample(ctx, x, plan, attrs["interp"] == 0, f"{node.name}_down{i}")
        greater = ctx.op("Greater", [mapped, top], f"{node.name}_gt{i}")
        take = ctx.op("And", [ctx.const(plan[2].numpy()), greater], f"{node.name}_take{i}")
        if i == len(xs) - 1:
            ctx.add_node("Where", [take, mapped, top], [out], name=node.name)
            return
        top = ctx.op("Where", [take, mapped, top], f"{node.name}_max{i}")
    ctx.add_node("Identity", [top], [out], name=node.name)


# ---- model.py ----------------------------------------------------------------------------------

def _emit_up(emit, x, attrs):
    """model.py: a local holding si_up's tops (the helpers are written once, under their own names)."""
    emit.helper(TORCH_SI_CONVNET)
    t = emit.tmp("scales")
    emit.stmt(f"{t} = si_up({x}, {emit.lit(attrs['transformations'])}, {attrs['interp']}, {attrs['border']})")
    return t


def _emit_downpool(emit, xs, attrs):
    emit.helper(TORCH_SI_CONVNET)
    return f"si_downpool([{', '.join(xs)}], {emit.lit(attrs['transformations'])}, {attrs['interp']}, {attrs['border']})"


# ---- the specs ----------------------------------------------------------------------------------

@register_layer("Up")
class Up(Layer):
    def parse(self, lp):
        attrs = parse_transformations(lp, "Up (UP)")
        need_blobs(lp, "Up (UP)", 1, len(attrs["transformations"]))
        return attrs

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "Up (UP)")
        _check_reflect(attrs, h, w, "Up (UP)")
        shapes = []
        for t in attrs["transformations"]:
            if si_is_identity(t):
                shapes.append((n, c, h, w))
            else:
                plan = _plan_or_error(si_up_plan, h, w, t, attrs["interp"], attrs["border"])
                shapes.append((n, c) + tuple(plan[2].shape))
        return shapes

    def forward(self, attrs, params, x):
        tops = si_up(x, attrs["transformations"], attrs["interp"], attrs["border"])
        return tops[0] if len(tops) == 1 else tops

    def onnx(self, ctx, node):
        onnx_si_up(ctx, node, node.inputs[0], node.attrs, node.outputs)

    def pytorch_source(self, node, emit):
        a = node.attrs
        t = _emit_up(emit, emit.inputs[0], a)
        tops = [f"{t}[{i}]" for i in range(len(a["transformations"]))]
        return tops[0] if len(tops) == 1 else tops


@register_layer("Downpool")
class Downpool(Layer):
    def parse(self, lp):
        attrs = parse_transformations(lp, "Downpool (DOWNPOOL)")
        need_blobs(lp, "Downpool (DOWNPOOL)", len(attrs["transformations"]), 1)
        if lp.HasField("pooling_param") and lp.pooling_param.pool != lp.pooling_param.MAX:
            raise LayerError("Downpool (DOWNPOOL) has MAX pooling only (the fork aborts on any other)")
        return attrs

    def infer(self, attrs, in_shapes):
        shapes = [four_axes(s, "Downpool (DOWNPOOL)") for s in in_shapes]
        for s in shapes[1:]:
            if s[:2] != shapes[0][:2]:
                raise LayerError(f"Downpool (DOWNPOOL): every bottom needs bottom 0's num and channels "
                                 f"{list(shapes[0][:2])}, got {list(s)}")
            _check_reflect(attrs, s[2], s[3], "Downpool (DOWNPOOL)")
        _plan_or_error(si_down_plans, [s[2:] for s in shapes], attrs["transformations"], attrs["interp"],
                       attrs["border"])
        return [shapes[0]]

    def forward(self, attrs, params, *xs):
        return si_downpool(xs, attrs["transformations"], attrs["interp"], attrs["border"])

    def onnx(self, ctx, node):
        onnx_si_downpool(ctx, node, node.inputs, node.attrs, node.outputs[0])

    def pytorch_source(self, node, emit):
        return _emit_downpool(emit, emit.inputs, node.attrs)


@register_layer("Tiedconv")
class Tiedconv(Convolution):
    """BVLC's Convolution over several bottoms, whose heights and widths may differ."""

    def infer(self, attrs, in_shapes):
        first = four_axes(in_shapes[0], "Tiedconv (TIEDCONV)")
        for s in in_shapes[1:]:
            if four_axes(s, "Tiedconv (TIEDCONV)")[:2] != first[:2]:
                raise LayerError(f"Tiedconv (TIEDCONV): every bottom needs bottom 0's num and channels "
                                 f"{list(first[:2])}, got {list(s)}")
        return [_conv_top_shapes(attrs, [s], conv_out_size)[0] for s in in_shapes]


@register_layer("Ticonv")
class Ticonv(Convolution):
    """Up, the convolution over each scale with the same blobs, then Downpool: one top."""

    def parse(self, lp):
        need_blobs(lp, "Ticonv (TICONV)", 1, 1)
        return dict(parse_conv(lp), **parse_transformations(lp, "Ticonv (TICONV)"))

    def _scale_shapes(self, attrs, in_shape):
        ups = Up().infer(attrs, [in_shape])
        return ups, [_conv_top_shapes(attrs, [s], conv_out_size)[0] for s in ups]

    def infer(self, attrs, in_shapes):
        _, convs = self._scale_shapes(attrs, in_shapes[0])
        return Downpool().infer(attrs, convs)

    def forward(self, attrs, params, x):
        ups = si_up(x, attrs["transformations"], attrs["interp"], attrs["border"])
        convs = super().forward(attrs, params, *ups)
        convs = convs if isinstance(convs, tuple) else (convs,)
        return si_downpool(convs, attrs["transformations"], attrs["interp"], attrs["border"])

    def macs(self, attrs, in_shapes, out_shapes):
        _, convs = self._scale_shapes(attrs, in_shapes[0])
        return super().macs(attrs, in_shapes, convs)

    def onnx(self, ctx, node):
        count = len(node.attrs["transformations"])
        ups = [ctx.tmp(f"{node.name}_scale{i}") for i in range(count)]
        convs = [ctx.tmp(f"{node.name}_conv{i}") for i in range(count)]
        onnx_si_up(ctx, node, node.inputs[0], node.attrs, ups)
        _onnx_conv(ctx, node, "Conv", inputs=ups, outputs=convs)
        _, shapes = self._scale_shapes(node.attrs, ctx.shape(node.inputs[0]))
        onnx_si_downpool(ctx, node, convs, node.attrs, node.outputs[0], [s[2:] for s in shapes])

    def pytorch_source(self, node, emit):
        a = node.attrs
        t = _emit_up(emit, emit.inputs[0], a)
        calls = _torch_conv_source(node, emit, transposed=False,
                                   inputs=[f"{t}[{i}]" for i in range(len(a["transformations"]))])
        calls = calls if isinstance(calls, list) else [calls]
        return _emit_downpool(emit, calls, a)
