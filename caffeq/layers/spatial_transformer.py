"""SpatialTransformer: Jaderberg et al.'s spatial transformer as daerduoCarey/SpatialTransformerLayer
(cf2a461; src/caffe/layers/st_layer.cpp and st_layer.cu as of 4791d99, `st_param`) writes it for Caffe, a layer
copied unchanged into many forks (rremani/py-faster-rcnn-st, the nets of alenaliu/PPR-FCN), and the
same fork's PowerFile (at the end of this module).

Bottom 0 is the image U (N, C, H, W), bottom 1 the localisation net's theta: per item its values
fill, in order, the entries of the 2 x 3 matrix [[t11, t12, t13], [t21, t22, t23]] that st_param
does not fix (theta_1_1 ... theta_2_3), so bottom 1 holds 6 minus that many values per item.
The top is (N, C, output_H, output_W), output_H and output_W defaulting to the image's H and W.

Output pixel (s, t) has the target coordinates (gs, gt) = (s / output_H * 2 - 1, t / output_W * 2 - 1)
(computed in double, stored as float: the grid covers [-1, 1) without reaching 1) and reads the
image at
    x = (t11 gs + t12 gt + t13 + 1) / 2 * H      (a row),
    y = (t21 gs + t22 gt + t23 + 1) / 2 * W      (a column),
from the taps (floor x, floor y), (floor x + 1, floor y), (floor x, floor y + 1), (floor x + 1,
floor y + 1), in that order, with weights (1 - |x - m|)(1 - |y - n|) written as the kernel writes
them; a tap outside the image adds nothing (zero padding).  These are the GPU kernel's semantics
(SpatialTransformerForwardGPU): the fork's Forward_cpu stops on a CHECK, and would ignore the
fixed entries.  With to_compute_dU: false the fork's backward writes no gradient for the image, only
for theta: caffeq detaches the image.  ONNX gathers the four taps (GatherElements), at any opset.

The other transform types come from a second fork of the layer, the one mikuhatsune/e2e_face
(11d506e, caffe_modification/: spatial_transformer_layer.cu and caffe.proto, where st_param holds
output_H, output_W, transform_type and float theta_1_1 / theta_2_2 defaulting to 1) ships for its
end-to-end face alignment nets.  Its "affine" has other conventions (x a column, grid / (size - 1),
coordinates clamped) but the same name, so an "affine" layer stays daerduoCarey's; the types only
it has run as its GPU kernels compute them.  Output pixel (h, w) has the target coordinates
xt = w / (output_W - 1) * 2 - 1 and yt = h / (output_H - 1) * 2 - 1 (float32), theta (N, k) gives
per item:
    translation (k 2):          x = theta_1_1 xt + t0,  y = theta_2_2 yt + t1
    translation_scaling (k 4):  x = xt t0 + t1,  y = yt t2 + t3
    projective (k 8):           z = 1 / (xt t6 + yt t7 + 1), x = (xt t0 + yt t1 + t2) z,  y = (xt t3 + yt t4 + t5) z
    similarity (k 4):           x = t1 (xt cos t0 - yt sin t0) + t2,  y = t1 (xt sin t0 + yt cos t0) + t3
    similarity+ (k 5):          x = t1 xt cos t0 - t2 yt sin t0 + t3,  y = t1 xt sin t0 + t2 yt cos t0 + t4
and the image is read at column (x + 1) / 2 * (W - 1), row (y + 1) / 2 * (H - 1) (projective:
(x + 1) * (W - 1) / 2).  "grid" reads bottom 1 (N, output_H * output_W * 2 values, x then y per
pixel) as the column and row themselves.  The first three clamp the column and row into the image
(border values); similarity, similarity+ and grid do not, so taps outside add nothing.  The taps are
floor and ceil of each coordinate (one where they coincide), summed row by row as pixel * (1 - |x - col|)
* (1 - |y - row|).
"""
import re

import numpy as np
import torch

from .optical_flow import bilinear_taps, pixels_at
from .registry import Layer, LayerError, count, four_axes, need_blobs, positive_field, register_layer, torch_sources
from .warp_onnx import OnnxImageSampler

#: st_param's fixed-entry fields, in the order theta's values fill the matrix
THETA_FIELDS = ("theta_1_1", "theta_1_2", "theta_1_3", "theta_2_1", "theta_2_2", "theta_2_3")


def target_grid(size: int, device: torch.device):
    """The fork's output grid along one axis: float(i * 1.0 / size * 2 - 1), computed in double."""
    return (torch.arange(size, dtype=torch.float64, device=device) / size * 2 - 1).to(torch.float32)


def st_full_theta(theta, fixed):
    """(N, 6) matrices (N, 12 for caffe-3Dstn's 3-D one): the fixed entries (floats, None where bottom 1
    gives it), the rest from theta's values in order (full_theta in Forward_gpu)."""
    n = theta.shape[0]
    given = theta.flatten(1)
    cols, k = [], 0
    for value in fixed:
        if value is None:
            cols.append(given[:, k:k + 1])
            k += 1
        else:
            cols.append(torch.full((n, 1), value, dtype=given.dtype, device=given.device))
    return torch.cat(cols, 1)


def spatial_transformer(image, theta, out_h: int, out_w: int, fixed, image_grad: bool):
    """daerduoCarey's SpatialTransformer forward (its GPU kernel): affine grid, bilinear taps."""
    if not image_grad:
        image = image.detach()
    n, h, w = image.shape[0], image.shape[2], image.shape[3]
    a = st_full_theta(theta, fixed).to(image.dtype).reshape(n, 6, 1, 1, 1)
    gs = target_grid(out_h, image.device).to(image.dtype).reshape(1, 1, out_h, 1)
    gt = target_grid(out_w, image.device).to(image.dtype).reshape(1, 1, 1, out_w)
    x = (a[:, 0] * gs + a[:, 1] * gt + a[:, 2] + 1) / 2 * h      # (N, 1, out_h, out_w): rows
    y = (a[:, 3] * gs + a[:, 4] * gt + a[:, 5] + 1) / 2 * w      # columns
    return bilinear_taps(image, x, y, False)


TORCH_ST = torch_sources(target_grid, st_full_theta, spatial_transformer)

#: the e2e_face fork's transform types: theta values per item (None: the grid, two per output pixel)
E2E_TYPES = {"translation": 2, "translation_scaling": 4, "projective": 8, "similarity": 4, "similarity+": 5,
             "grid": None}
#: the types whose kernels clamp the read position into the image
E2E_CLAMPED = ("translation", "translation_scaling", "projective")


def e2e_st_source(theta, kind: str, out_h: int, out_w: int, h: int, w: int, scale_x: float, scale_y: float):
    """The e2e_face fork's read positions (column x, row y), each (N, 1, out_h, out_w), in pixels."""
    n = theta.shape[0]
    t = theta.reshape(n, -1, 1, 1)
    if kind == "grid":
        g = theta.reshape(n, 1, out_h, out_w, 2)
        return g[..., 0], g[..., 1]
    xt = (torch.arange(out_w, dtype=theta.dtype, device=theta.device) / (out_w - 1) * 2 - 1).reshape(1, 1, 1, -1)
    yt = (torch.arange(out_h, dtype=theta.dtype, device=theta.device) / (out_h - 1) * 2 - 1).reshape(1, 1, -1, 1)
    t = [t[:, i:i + 1] for i in range(t.shape[1])]
    if kind == "projective":
        z = 1 / (xt * t[6] + yt * t[7] + 1)
        x = xt * t[0] + yt * t[1] + t[2]
        y = xt * t[3] + yt * t[4] + t[5]
        return (x * z + 1) * (w - 1) / 2, (y * z + 1) * (h - 1) / 2
    if kind == "translation":
        x, y = scale_x * xt + t[0], scale_y * yt + t[1]
    elif kind == "translation_scaling":
        x, y = xt * t[0] + t[1], yt * t[2] + t[3]
    elif kind == "similarity":
        ct, st = torch.cos(t[0]), torch.sin(t[0])
        x = t[1] * (xt * ct - yt * st) + t[2]
        y = t[1] * (xt * st + yt * ct) + t[3]
    else:   # similarity+
        ct, st = torch.cos(t[0]), torch.sin(t[0])
        x = t[1] * xt * ct - t[2] * yt * st + t[3]
        y = t[1] * xt * st + t[2] * yt * ct + t[4]
    return (x + 1) / 2 * (w - 1), (y + 1) / 2 * (h - 1)


def e2e_st_sample(image, x, y, clamp: bool):
    """The e2e_face fork's bilinear read at column x, row y ((N, 1, h, w) each): clamped into the image
    when `clamp`; the taps floor and ceil inside the image (one where they coincide), row by row."""
    h, w = image.shape[2], image.shape[3]
    if clamp:
        x = torch.where(x > 0, x, torch.zeros_like(x))
        x = torch.where(x < w - 1, x, torch.full_like(x, w - 1))
        y = torch.where(y > 0, y, torch.zeros_like(y))
        y = torch.where(y < h - 1, y, torch.full_like(y, h - 1))
    x0, x1, y0, y1 = x.floor(), x.ceil(), y.floor(), y.ceil()
    total = torch.zeros((image.shape[0], image.shape[1], x.shape[2], x.shape[3]), dtype=image.dtype,
                        device=image.device)
    for row, new_row in ((y0, None), (y1, y1 != y0)):
        for col, new_col in ((x0, None), (x1, x1 != x0)):
            valid = (row >= 0) & (row <= h - 1) & (col >= 0) & (col <= w - 1)
            for new in (new_row, new_col):
                if new is not None:
                    valid = valid & new
            r = torch.where(valid, row, torch.zeros_like(row)).long()
            c = torch.where(valid, col, torch.zeros_like(col)).long()
            term = pixels_at(image, r, c) * (1 - (x - col).abs()) * (1 - (y - row).abs())
            total = total + torch.where(valid, term, torch.zeros_like(term))
    return total


def e2e_spatial_transformer(image, theta, kind: str, out_h: int, out_w: int, scale_x: float, scale_y: float):
    """The e2e_face fork's SpatialTransformer forward (its GPU kernels) for the types daerduoCarey's lacks."""
    x, y = e2e_st_source(theta.to(image.dtype), kind, out_h, out_w, image.shape[2], image.shape[3], scale_x, scale_y)
    return e2e_st_sample(image, x, y, kind in ("translation", "translation_scaling", "projective"))


TORCH_E2E_ST = torch_sources(e2e_st_source, e2e_st_sample, e2e_spatial_transformer)


def onnx_theta_entries(op, f32, i64, theta, fixed, given):
    """The transform's entries as (N, 1) ONNX tensors: the fixed ones as constants, the others sliced in order
    from theta, a bottom of `given` values per item (the 2-D and 3-D spatial transformers' layout)."""
    if given:
        theta = op("Reshape", [theta, i64([0, given])], "theta")
    coef, k = [], 0
    for i, value in enumerate(fixed):
        if value is None:
            coef.append(op("Slice", [theta, i64([k]), i64([k + 1]), i64([1])], f"a{i}"))
            k += 1
        else:
            coef.append(f32([[value]]))
    return coef


def _fixed_count(attrs):
    return sum(v is not None for v in attrs["fixed"])


@register_layer("SpatialTransformer")
class SpatialTransformer(Layer):
    def parse(self, lp):
        need_blobs(lp, "SpatialTransformer", 2, 1, "image, theta", in_place=False)
        p = lp.st_param
        if p.transform_type in E2E_TYPES:
            return self._parse_e2e(p)
        # LayerSetUp: "Transformation type only supports affine now!", "Sampler type only supports bilinear now!"
        if p.transform_type != "affine":
            raise LayerError(f'SpatialTransformer: st_param.transform_type "{p.transform_type}" is neither '
                             f'daerduoCarey\'s "affine" nor one of the e2e_face fork\'s '
                             f'{", ".join(repr(k) for k in E2E_TYPES)}')
        if p.sampler_type != "bilinear":
            raise LayerError(f'SpatialTransformer supports st_param.sampler_type "bilinear" only, as the fork, '
                             f'got "{p.sampler_type}"')
        size = [positive_field(getattr(p, f), f"st_param.{f}") if p.HasField(f) else None
                for f in ("output_H", "output_W")]
        # the fork keeps the fixed entries as Dtype (float32)
        fixed = tuple(float(np.float32(getattr(p, f))) if p.HasField(f) else None for f in THETA_FIELDS)
        return {"output_h": size[0], "output_w": size[1], "fixed": fixed, "image_grad": bool(p.to_compute_dU)}

    @staticmethod
    def _parse_e2e(p):
        kind = p.transform_type
        size = [positive_field(getattr(p, f), f"st_param.{f}") if p.HasField(f) else None
                for f in ("output_H", "output_W")]
        # the fork's theta_1_1 / theta_2_2 are floats defaulting to 1 (translation's fixed scales)
        scales = tuple(float(np.float32(getattr(p, f))) if p.HasField(f) else 1.0 for f in ("theta_1_1", "theta_2_2"))
        return {"e2e": kind, "output_h": size[0], "output_w": size[1], "scales": scales,
                "reading_notes": [f'transform_type "{kind}": the e2e_face fork\'s SpatialTransformer (its GPU '
                                  f'kernels)']}

    def _infer_e2e(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "SpatialTransformer", "image (bottom 0)")
        theta, kind = tuple(in_shapes[1]), attrs["e2e"]
        out = (attrs["output_h"] or h, attrs["output_w"] or w)
        want = E2E_TYPES[kind] or out[0] * out[1] * 2
        if len(theta) < 2 or theta[0] != n or count(theta, 1) != want:
            raise LayerError(f'SpatialTransformer "{kind}": theta (bottom 1, {list(theta)}) must be ({n}, {want}): '
                             f"the image's items, {want} values each")
        if kind != "grid" and min(out) < 2:
            raise LayerError(f'SpatialTransformer "{kind}": output {out[0]}x{out[1]}; the fork divides by '
                             f"output_H - 1 and output_W - 1, so both must be at least 2")
        attrs["_out"] = out
        return [(n, c) + out]

    def infer(self, attrs, in_shapes):
        if attrs.get("e2e"):
            return self._infer_e2e(attrs, in_shapes)
        n, c, h, w = four_axes(in_shapes[0], "SpatialTransformer", "image (bottom 0)")
        theta = tuple(in_shapes[1])
        given, fixed = count(theta, 1), _fixed_count(attrs)
        if given + fixed != 6:
            raise LayerError(f"SpatialTransformer's theta (bottom 1, {list(theta)}) gives {given} values per item "
                             f"and st_param fixes {fixed} entries: together they must make the 6 of the 2 x 3 matrix")
        if not theta or theta[0] != n:
            raise LayerError(f"SpatialTransformer's theta (bottom 1, {list(theta)}) must have the image's "
                             f"{n} items on axis 0")
        attrs["_out"] = (attrs["output_h"] or h, attrs["output_w"] or w)
        return [(n, c) + attrs["_out"]]

    def macs(self, attrs, in_shapes, out_shapes):
        return count(out_shapes[0]) * 4

    def forward(self, attrs, params, image, theta):
        if attrs.get("e2e"):
            return e2e_spatial_transformer(image, theta, attrs["e2e"], *attrs["_out"], *attrs["scales"])
        return spatial_transformer(image, theta, *attrs["_out"], attrs["fixed"], attrs["image_grad"])

    def onnx(self, ctx, node):
        if node.attrs.get("e2e"):
            onnx_e2e_st(ctx, node)
            return
        image, theta = node.inputs
        out_h, out_w = node.attrs["_out"]
        fixed, given = node.attrs["fixed"], 6 - _fixed_count(node.attrs)
        s = OnnxImageSampler(ctx, node.name, image)
        op, f32, i64 = s.op, s.f32, s.i64
        size = out_h * out_w
        coef = onnx_theta_entries(op, f32, i64, theta, fixed, given)
        grid = target_grid(out_h, "cpu").numpy(), target_grid(out_w, "cpu").numpy()
        gs = ctx.const(np.repeat(grid[0], out_w).reshape(1, size), node.name + "_gs")
        gt = ctx.const(np.tile(grid[1], out_h).reshape(1, size), node.name + "_gt")

        def source(a, b, c, extent, hint):   # ((a gs + b gt + c) + 1) / 2 * extent, as (N, 1, size)
            p = op("Add", [op("Add", [op("Mul", [a, gs], hint + "_gs"), op("Mul", [b, gt], hint + "_gt")],
                              hint + "_ab"), c], hint + "_p")
            v = op("Mul", [op("Div", [op("Add", [p, f32(1)], hint + "_p1"), f32(2)], hint + "_half"),
                           f32(extent)], hint)
            return op("Reshape", [v, i64([0, 1, size])], hint + "_col")

        x, y = source(*coef[:3], s.h, "x"), source(*coef[3:], s.w, "y")
        m0, n0 = op("Floor", [x], "m0"), op("Floor", [y], "n0")
        m1, n1 = op("Add", [m0, f32(1)], "m1"), op("Add", [n0, f32(1)], "n1")

        def weight(a, b, hint):   # 1 - (a - b), as the kernel writes each tap's factor
            return op("Sub", [f32(1), op("Sub", [a, b], "d" + hint)], "w" + hint)

        wm0, wm1, wn0, wn1 = weight(x, m0, "m0"), weight(m1, x, "m1"), weight(y, n0, "n0"), weight(n1, y, "n1")
        # every item's (C, size) indexes: the batch from the image (theta may give none of the entries)
        batch_c = op("Slice", [op("Shape", [s.flat], "shape"), i64([0]), i64([2])], "nc")
        spread = op("Concat", [batch_c, i64([size])], "spread", axis=0)
        total = None
        for t, (m, k, wm, wk) in enumerate(((m0, n0, wm0, wn0), (m1, n0, wm1, wn0), (m0, n1, wm0, wn1),
                                            (m1, n1, wm1, wn1))):
            inside = s.within(k, m, f"in{t}", True)      # 0 <= column < W, 0 <= row < H
            row = op("Where", [inside, m, f32(0)], f"row{t}")
            col = op("Where", [inside, k, f32(0)], f"col{t}")
            index = op("Cast", [op("Add", [op("Mul", [row, f32(s.w)], f"rw{t}"), col], f"i{t}")], f"i64_{t}", to=7)
            got = op("GatherElements", [s.flat, op("Expand", [index, spread], f"all{t}")], f"v{t}", axis=2)
            term = op("Mul", [op("Mul", [wm, wk], f"w{t}"), got], f"t{t}")
            term = op("Where", [inside, term, f32(0)], f"k{t}")
            total = term if total is None else op("Add", [total, term], f"s{t}")
        ctx.add_node("Reshape", [total, i64([0, s.c, out_h, out_w])], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        emit.helper(pixels_at)
        if node.attrs.get("e2e"):
            fn = emit.helper(TORCH_E2E_ST)
            a = node.attrs
            return (f"{fn}({emit.inputs[0]}, {emit.inputs[1]}, {a['e2e']!r}, {a['_out'][0]}, {a['_out'][1]}, "
                    f"{a['scales'][0]!r}, {a['scales'][1]!r})")
        emit.helper(bilinear_taps)
        fn = emit.helper(TORCH_ST)
        out_h, out_w = node.attrs["_out"]
        return (f"{fn}({emit.inputs[0]}, {emit.inputs[1]}, {out_h}, {out_w}, {node.attrs['fixed']!r}, "
                f"{node.attrs['image_grad']})")


def onnx_e2e_st(ctx, node):
    """e2e_spatial_transformer in ONNX: the read positions from theta as (N, 1, out_h, out_w) maps, then
    each of the four taps gathered (OnnxImageSampler.pixels) where it is inside and new, added row by row."""
    image, theta = node.inputs
    a = node.attrs
    kind, (out_h, out_w) = a["e2e"], a["_out"]
    s = OnnxImageSampler(ctx, node.name, image)
    op, f32, i64 = s.op, s.f32, s.i64
    h, w, size = s.h, s.w, out_h * out_w
    if kind == "grid":
        g = op("Reshape", [theta, i64([0, size, 2])], "grid")
        x, y = (op("Reshape", [op("Slice", [g, i64([k]), i64([k + 1]), i64([2])], f"g{k}"),
                               i64([0, 1, out_h, out_w])], "xy"[k]) for k in (0, 1))
    else:
        t = op("Reshape", [theta, i64([0, -1])], "theta")
        t = [op("Slice", [t, i64([k]), i64([k + 1]), i64([1])], f"t{k}") for k in range(E2E_TYPES[kind])]
        xt = ctx.const((np.arange(out_w, dtype=np.float32) / np.float32(out_w - 1) * 2 - 1)[None].repeat(out_h, 0)
                       .reshape(1, size), node.name + "_xt")
        yt = ctx.const((np.arange(out_h, dtype=np.float32) / np.float32(out_h - 1) * 2 - 1).repeat(out_w)
                       .reshape(1, size), node.name + "_yt")

        def mul(p, q, hint):
            return op("Mul", [p, q], hint)

        def add(p, q, hint):
            return op("Add", [p, q], hint)

        if kind == "projective":
            z = op("Div", [f32(1), add(add(mul(xt, t[6], "xt6"), mul(yt, t[7], "yt7"), "z0"), f32(1), "z1")], "z")
            x = add(add(mul(xt, t[0], "xt0"), mul(yt, t[1], "yt1"), "x0"), t[2], "x1")
            y = add(add(mul(xt, t[3], "xt3"), mul(yt, t[4], "yt4"), "y0"), t[5], "y1")
            x = op("Div", [mul(add(mul(x, z, "xz"), f32(1), "xz1"), f32(w - 1), "xw"), f32(2)], "xs")
            y = op("Div", [mul(add(mul(y, z, "yz"), f32(1), "yz1"), f32(h - 1), "yh"), f32(2)], "ys")
        else:
            if kind == "translation":
                x = add(mul(f32(a["scales"][0]), xt, "sx"), t[0], "x")
                y = add(mul(f32(a["scales"][1]), yt, "sy"), t[1], "y")
            elif kind == "translation_scaling":
                x, y = add(mul(xt, t[0], "sx"), t[1], "x"), add(mul(yt, t[2], "sy"), t[3], "y")
            else:
                ct, st = op("Cos", [t[0]], "cos"), op("Sin", [t[0]], "sin")
                if kind == "similarity":
                    x = add(mul(t[1], op("Sub", [mul(xt, ct, "xc"), mul(yt, st, "ys")], "rx"), "srx"), t[2], "x")
                    y = add(mul(t[1], add(mul(xt, st, "xs"), mul(yt, ct, "yc"), "ry"), "sry"), t[3], "y")
                else:
                    x = add(op("Sub", [mul(mul(t[1], xt, "sxx"), ct, "sxxc"), mul(mul(t[2], yt, "syy"), st, "syys")],
                               "rx"), t[3], "x")
                    y = add(add(mul(mul(t[1], xt, "sxx2"), st, "sxxs"), mul(mul(t[2], yt, "syy2"), ct, "syyc"), "ry"),
                            t[4], "y")
            x = mul(op("Div", [add(x, f32(1), "x1"), f32(2)], "xh"), f32(w - 1), "xs")
            y = mul(op("Div", [add(y, f32(1), "y1"), f32(2)], "yh"), f32(h - 1), "ys")
        x, y = (op("Reshape", [v, i64([0, 1, out_h, out_w])], hint) for v, hint in ((x, "x_map"), (y, "y_map")))
    if kind in E2E_CLAMPED:
        x = op("Where", [op("Less", [x, f32(w - 1)], "x_lt"), op("Where", [op("Greater", [x, f32(0)], "x_gt"), x,
                                                                            f32(0)], "x_lo"), f32(w - 1)], "x_in")
        y = op("Where", [op("Less", [y, f32(h - 1)], "y_lt"), op("Where", [op("Greater", [y, f32(0)], "y_gt"), y,
                                                                            f32(0)], "y_lo"), f32(h - 1)], "y_in")
    x0, x1, y0, y1 = op("Floor", [x], "x0"), op("Ceil", [x], "x1"), op("Floor", [y], "y0"), op("Ceil", [y], "y1")
    new_x = op("Not", [op("Equal", [x1, x0], "x_same")], "x_new")
    new_y = op("Not", [op("Equal", [y1, y0], "y_same")], "y_new")
    total = None
    for k, (row, col, news) in enumerate(((y0, x0, ()), (y0, x1, (new_x,)), (y1, x0, (new_y,)),
                                          (y1, x1, (new_y, new_x)))):
        valid = s.within(col, row, f"in{k}", False)      # 0 <= column <= W - 1, 0 <= row <= H - 1
        for j, new in enumerate(news):
            valid = op("And", [valid, new], f"in{k}_{j}")
        r = op("Where", [valid, row, f32(0)], f"row{k}")
        c = op("Where", [valid, col, f32(0)], f"col{k}")
        got = s.pixels(r, c, f"v{k}", (out_h, out_w))
        wx = op("Sub", [f32(1), op("Abs", [op("Sub", [x, col], f"dx{k}")], f"adx{k}")], f"wx{k}")
        wy = op("Sub", [f32(1), op("Abs", [op("Sub", [y, row], f"dy{k}")], f"ady{k}")], f"wy{k}")
        term = op("Where", [valid, op("Mul", [op("Mul", [got, wx], f"gx{k}"), wy], f"t{k}"), f32(0)], f"k{k}")
        total = term if total is None else op("Add", [total, term], f"s{k}")
    ctx.add_node("Identity", [total], [node.outputs[0]], name=node.name)


# ---- PowerFile --------------------------------------------------------------------------------
# The same fork's PowerFile (power_file_layer.cpp / .cu): top = bottom + shift, one shift value per
# element of an item (count(1) of them), read at setup with `ifstream >> Dtype` from shift_file, a
# path relative to the working directory; values the file lacks, or a file that cannot be opened,
# leave zeros.  Only the GPU forward exists (its Forward_cpu stops on a CHECK).

SHIFT_FILE_LIMIT = 1 << 24       # bytes of a shift file caffeq reads (the spatial transformers' are 6 numbers)
_NUMBER_PREFIX = re.compile(rb"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


def read_shift_file(path):
    """The numbers `ifstream >> float` reads from the file's start (float32), or None when it cannot
    be opened."""
    try:
        with open(path, "rb") as f:
            data = f.read(SHIFT_FILE_LIMIT + 1)
    except OSError:
        return None
    if len(data) > SHIFT_FILE_LIMIT:
        raise LayerError(f"power_file_param.shift_file: {path} is larger than {SHIFT_FILE_LIMIT} bytes")
    values = []
    for token in data.split():
        m = _NUMBER_PREFIX.match(token)
        if m is None:
            break
        values.append(float(m.group()))
        if m.end() < len(token):   # `>>` read the number's prefix; the rest stops the next read
            break
    return np.asarray(values, np.float32)


@register_layer("PowerFile")
class PowerFile(Layer):
    def parse(self, lp):
        need_blobs(lp, "PowerFile", 1, 1)
        p = lp.power_file_param
        attrs = {"values": np.zeros(0, np.float32), "reading_notes": []}
        if p.HasField("shift_file"):
            values = read_shift_file(p.shift_file)
            if values is None:
                attrs["reading_notes"].append(
                    f"power_file_param.shift_file {p.shift_file!r} cannot be opened (relative to the working "
                    f"directory, as the fork opens it): the shift is all zeros, as the fork then leaves it")
            else:
                attrs["values"] = values
        return attrs

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) < 1:
            raise LayerError("PowerFile needs an input with a batch axis")
        n = count(s[1:])
        shift = np.zeros(n, np.float32)
        given = attrs["values"][:n]
        shift[:len(given)] = given
        attrs["_shift"] = shift.reshape((1,) + s[1:])
        return [s]

    def forward(self, attrs, params, x):
        return x + torch.from_numpy(attrs["_shift"]).to(device=x.device, dtype=x.dtype)

    def onnx(self, ctx, node):
        ctx.add_node("Add", [node.inputs[0], ctx.const(node.attrs["_shift"])], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        module = emit.module(f"{emit.helper(ShiftByBuffer)}({list(node.attrs['_shift'].shape)!r})")
        emit.buffer("shift", node.attrs["_shift"])
        return f"{module}({emit.inputs[0]})"


class ShiftByBuffer(torch.nn.Module):
    """x + shift, the shift a buffer of one item's shape (PowerFile's shift file)."""

    def __init__(self, shape: list):
        super().__init__()
        self.register_buffer("shift", torch.zeros(shape))

    def forward(self, x):
        return x + self.shift
