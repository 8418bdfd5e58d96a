"""xyyu-callen/caffe-3Dstn's 3-D layers (read at 3e81d58): TridimConvolution, TridimPooling,
TridimSpatialTransformer and TridimData, on 5-axis blobs (N, C, D, H, W).

Sources: src/caffe/proto/caffe.proto (tridim_convolution_param, tridim_pooling_param, tridim_st_param,
tridim_data_param; their LayerParameter numbers 155-158 are taken here: 87155-87158, proto/README.md),
src/caffe/layers/tridim_convolution_layer.cpp/.cu, src/caffe/util/vol2col.cpp, tridim_pooling_layer.cpp/.cu,
tridim_st_layer.cpp/.cu, tridim_data_layer.cpp, src/caffe/data_transformer.cpp (InferBlobShape of a
VolumeDatum) and src/caffe/util/image_io.cpp (3-channel clips).

- TridimConvolution: C3D's Convolution3D (caffeq/layers/c3d.py) with one kernel_size, stride and pad for all
  three axes: LayerSetUp sets kernel_d_ = kernel_size, stride_d_ = stride, pad_d_ = pad (the fork's
  kernel_d / stride_d / pad_d reads are commented out).  vol2col + GEMM is a cross-correlation over the
  zero-padded input, each output extent (n + 2 pad - k) / stride + 1 rounded down; weight
  (num_output, C, k, k, k), bias (1, 1, 1, 1, num_output).  Unlike BVLC's (and NdConvolution's) group,
  filter_group only splits the GEMM into num_output / filter_group filters at a time, every filter seeing
  all C channels: the same numbers as filter_group 1.  The declared kernel_h/w/d, stride_h/w/d, pad_h/w/d
  and group are never read by the C++: ignored, with a note.
- TridimPooling: MAX, AVE or SUM over k x k x k windows, stride s and pad p on every axis (depth
  included: C3D's Pooling3D pads H and W only and has its own kernel_depth).  As C3D, each output extent
  rounds up, ceil((n + 2 p - k) / s) + 1, and the last window is never dropped (BVLC, P3D and N-D Pooling
  drop one that starts in the padding).  MAX takes the largest cell of the window clipped to the input
  (-FLT_MAX where it is empty); AVE sums the clipped window and divides by the window clipped to n + p on
  each axis (padding counts); SUM (the fork's addition) is AVE's sum, undivided.  pad needs AVE (the fork's
  CHECK); STOCHASTIC is refused (NOT_IMPLEMENTED on the CPU, no output on the GPU).  The windows are the
  helpers of caffeq/layers/pooling_nd.py.
- TridimSpatialTransformer: the GPU forward (Forward_cpu stops on a CHECK, and reads (p + 1) / 2 where the
  GPU reads (p + 1) / 3).  The 3 x 4 matrix theta is filled row-major from bottom 1's values per item,
  skipping the entries tridim_st_param fixes (theta_1_1 ... theta_3_4, kept as float).  LayerSetUp writes the
  output grid, a (P, 4) float blob (P = output_D * output_H * output_W), with a stride of 3: for i < P,
  data[3i] = (i % output_H) / output_H * 2 - 1, data[3i + 1] = (i % output_W) / output_W * 2 - 1,
  data[3i + 2] = (i % output_D) / output_D * 2 - 1, data[3i + 3] = 1 (overwritten by the next i but the last),
  computed in double and stored as float; the rest of the blob stays 0.  Row p of that buffer read with a
  stride of 4 times theta's rows gives (pz, px, py) for output voxel p = (d * output_H + s) * output_W + t,
  so the grid is not the affine grid of a regular lattice (that is what the fork computes; caffeq keeps it).
  The sample is read at z = (pz + 1) / 3 * D, x = (px + 1) / 3 * H, y = (py + 1) / 3 * W from the eight taps
  (floor z or floor(z + 1), floor x or + 1, floor y or + 1), in the kernel's order, each weighted
  (1 - |z - l|)(1 - |x - m|)(1 - |y - n|) as the kernel writes them; a tap outside the volume adds nothing.
  Top (N, C, output_D, output_H, output_W), each defaulting to the image's.  to_compute_dU false: the
  image gets no gradient (detached).  ONNX gathers the eight taps (GatherElements).
- TridimData: a graph input (batch_size, 3, new_length, crop_size, crop_size) or new_height x new_width
  without transform_param.crop_size (the frames' own size without either: --input-shape); the label top is
  (batch_size,), or (batch_size, num_of_labels) with use_multiple_label.
"""
import numpy as np
import torch
import torch.nn.functional as F

from .c3d import Convolution3D
from .data import DataLayer, describe_transform, transform_attrs
from .pooling_nd import (
    POOL_AVE,
    POOL_MAX,
    WindowPool3d,
    onnx_window_sums,
    pool_extents,
)
from .registry import (
    Layer,
    LayerError,
    count,
    need_blobs,
    needs_input_shape,
    positive_field,
    register_layer,
    torch_sources,
)
from .spatial_transformer import onnx_theta_entries, st_full_theta

POOL_SUM = 3   # TridimPoolingParameter.SUM
_POOL_NAMES = {POOL_MAX: "MAX", POOL_AVE: "AVE", 2: "STOCHASTIC", POOL_SUM: "SUM"}


def _ignored_fields(p, fields, what):
    """A reading note for the declared fields the fork's C++ never reads."""
    given = [f for f in fields if p.HasField(f)]
    if not given:
        return []
    return [f"{what}: {', '.join(given)} ignored, as the fork's LayerSetUp reads only kernel_size, stride and pad "
            f"(one value for depth, height and width)"]


def _need_5d(shape, what):
    if len(shape) != 5:
        raise LayerError(f"{what} needs a 5-axis input (N, C, D, H, W), got {list(shape)}")


# ---- TridimConvolution -------------------------------------------------------------------------

@register_layer("TridimConvolution")
class TridimConvolution(Convolution3D):
    def parse(self, lp):
        need_blobs(lp, "TridimConvolution", 1, 1)
        p = lp.tridim_convolution_param
        if not p.num_output:
            raise LayerError("tridim_convolution_param.num_output must be > 0")
        k = positive_field(p.kernel_size, "tridim_convolution_param.kernel_size")
        s = positive_field(p.stride, "tridim_convolution_param.stride")
        if p.filter_group < 1 or p.num_output % p.filter_group:
            raise LayerError(f"tridim_convolution_param.filter_group {p.filter_group} must divide num_output "
                             f"{p.num_output}")
        notes = _ignored_fields(p, ("kernel_h", "kernel_w", "kernel_d", "stride_h", "stride_w", "stride_d",
                                    "pad_h", "pad_w", "pad_d", "group"), "tridim_convolution_param")
        return {"num_output": int(p.num_output), "bias_term": bool(p.bias_term), "kernel": [k] * 3,
                "stride": [s] * 3, "pad": [int(p.pad)] * 3, "reading_notes": notes}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        _need_5d(s, "TridimConvolution")
        out = [(n + 2 * p - k) // st + 1 for n, k, st, p in zip(s[2:], attrs["kernel"], attrs["stride"], attrs["pad"])]
        if min(out) < 1:
            raise LayerError(f"TridimConvolution's output would be empty: input {list(s)}, kernel {attrs['kernel'][0]}, "
                             f"pad {attrs['pad'][0]}")
        return [(s[0], attrs["num_output"]) + tuple(out)]


# ---- TridimPooling -----------------------------------------------------------------------------

def sum_pool3d_windows(x, kernel: list[int], stride: list[int], pad: list[int], out: list[int]):
    """The sum over each window's cells inside the input (0 for an empty window)."""
    sizes = [x.shape[2], x.shape[3], x.shape[4]]
    back = [max(0, (o - 1) * s + k - p - n) for n, k, s, p, o in zip(sizes, kernel, stride, pad, out)]
    x = F.pad(x, [pad[2], back[2], pad[1], back[1], pad[0], back[0]])
    return F.avg_pool3d(x, kernel, stride, divisor_override=1)[:, :, :out[0], :out[1], :out[2]]


@register_layer("TridimPooling")
class TridimPooling(WindowPool3d):
    def parse(self, lp):
        need_blobs(lp, "TridimPooling", 1, 1)
        p = lp.tridim_pooling_param
        method = int(p.pool)
        if method not in (POOL_MAX, POOL_AVE, POOL_SUM):
            raise LayerError("tridim_pooling_param.pool STOCHASTIC is not implemented by the fork's TridimPooling")
        k = positive_field(p.kernel_size, "tridim_pooling_param.kernel_size")
        s = positive_field(p.stride, "tridim_pooling_param.stride")
        if p.pad and method != POOL_AVE:
            raise LayerError(f"tridim_pooling_param.pad {p.pad}: the fork pads only AVE pooling, got "
                             f"{_POOL_NAMES[method]}")
        notes = _ignored_fields(p, ("kernel_h", "kernel_w", "kernel_d", "stride_h", "stride_w", "stride_d",
                                    "pad_h", "pad_w", "pad_d"), "tridim_pooling_param")
        return {"method": method, "kernel": [k] * 3, "stride": [s] * 3, "pad": [int(p.pad)] * 3,
                "reading_notes": notes}

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        _need_5d(s, "TridimPooling")
        k, st, p = attrs["kernel"][0], attrs["stride"][0], attrs["pad"][0]
        out = [-((-(n + 2 * p - k)) // st) + 1 for n in s[2:]]
        if min(out) < 1:
            raise LayerError(f"TridimPooling's output would be empty: input {list(s)}, kernel {k}")
        if attrs["method"] == POOL_AVE:
            for axis, (n, o) in enumerate(zip(s[2:], out)):
                if min(pool_extents(n, k, st, p, o)) < 1:
                    raise LayerError(f"TridimPooling: the last AVE window of axis {axis + 2} starts past the input "
                                     f"and its padding (stride {st} > kernel {k}); the fork divides by a size "
                                     f"below 1 there")
        attrs["_out"] = out
        return [s[:2] + tuple(out)]

    def windows(self, attrs):
        return list(attrs["kernel"]), list(attrs["stride"]), list(attrs["pad"]), list(attrs["_out"])

    def forward(self, attrs, params, x):
        if attrs["method"] == POOL_SUM:
            return sum_pool3d_windows(x, *self.windows(attrs))
        return super().forward(attrs, params, x)

    def onnx(self, ctx, node):
        if node.attrs["method"] != POOL_SUM:
            return super().onnx(ctx, node)
        kernel, stride, pad, out = self.windows(node.attrs)
        sizes = ctx.shape(node.inputs[0])
        back = [max(0, (o - 1) * s + k - p - n) for n, k, s, p, o in zip(sizes[2:], kernel, stride, pad, out)]
        pads = ctx.const(np.array([0, 0] + pad + [0, 0] + back, np.int64), node.name + "_pads")
        padded = ctx.add_node("Pad", [node.inputs[0], pads, ctx.const(np.array(0.0, np.float32))],
                              [ctx.tmp(node.name + "_padded")], name=node.name)[0]
        sums = onnx_window_sums(ctx, node, padded, int(sizes[1]), {"kernel_shape": kernel, "strides": stride})
        full = [(n + p + b - k) // s + 1 for n, k, s, p, b in zip(sizes[2:], kernel, stride, pad, back)]
        if full == out:
            ctx.add_node("Identity", [sums], [node.outputs[0]])
            return
        consts = [ctx.const(np.array(v, np.int64)) for v in ([0, 0, 0], out, [2, 3, 4])]
        ctx.add_node("Slice", [sums] + consts, [node.outputs[0]])

    def pytorch_source(self, node, emit):
        if node.attrs["method"] != POOL_SUM:
            return super().pytorch_source(node, emit)
        kernel, stride, pad, out = self.windows(node.attrs)
        return f"{emit.helper(sum_pool3d_windows)}({emit.inputs[0]}, {kernel}, {stride}, {pad}, {out})"


# ---- TridimSpatialTransformer ------------------------------------------------------------------

#: tridim_st_param's fixed-entry fields, in the order bottom 1's values fill the 3 x 4 matrix
TRIDIM_THETA_FIELDS = tuple(f"theta_{r}_{c}" for r in (1, 2, 3) for c in (1, 2, 3, 4))


def tridim_st_grid(out_d: int, out_h: int, out_w: int):
    """The fork's output_grid blob, (P, 4) float32: the stride-3 writes of LayerSetUp read back with a stride of 4."""
    p = out_d * out_h * out_w
    i = torch.arange(p, dtype=torch.float64)
    rows = torch.stack([(i % out_h) / out_h * 2 - 1, (i % out_w) / out_w * 2 - 1, (i % out_d) / out_d * 2 - 1], 1)
    flat = torch.zeros(4 * p, dtype=torch.float32)
    flat[:3 * p] = rows.reshape(-1).to(torch.float32)
    flat[3 * p] = 1.0
    return flat.reshape(p, 4)


def tridim_spatial_transformer(image, theta, out_d: int, out_h: int, out_w: int, fixed, image_grad: bool):
    """caffe-3Dstn's TridimSpatialTransformer forward (its GPU kernel)."""
    if not image_grad:
        image = image.detach()
    n, c, d, h, w = image.shape
    p = out_d * out_h * out_w
    g = tridim_st_grid(out_d, out_h, out_w).to(device=image.device, dtype=image.dtype)
    a = st_full_theta(theta.to(image.dtype), fixed)   # (N, 12): infer checks theta's batch is the image's
    coords = []
    for r in range(3):   # the GEMM's row r: sum over k of grid[:, k] * theta[r, k]
        acc = g[None, :, 0] * a[:, 4 * r:4 * r + 1]
        for k in range(1, 4):
            acc = acc + g[None, :, k] * a[:, 4 * r + k:4 * r + k + 1]
        coords.append(acc)
    z = (coords[0] + 1) / 3 * d
    x = (coords[1] + 1) / 3 * h
    y = (coords[2] + 1) / 3 * w
    l0, l1, m0, n0 = z.floor(), (z + 1).floor(), x.floor(), y.floor()
    m1, n1 = m0 + 1, n0 + 1
    wl0, wl1 = 1 - (z - l0), 1 - (l1 - z)
    wm0, wm1 = 1 - (x - m0), 1 - (m1 - x)
    wn0, wn1 = 1 - (y - n0), 1 - (n1 - y)
    flat = image.reshape(n, c, d * h * w)
    total = torch.zeros((n, c, p), dtype=image.dtype, device=image.device)
    for l, wl in ((l0, wl0), (l1, wl1)):
        for m, nn, wm, wn in ((m0, n0, wm0, wn0), (m1, n0, wm1, wn0), (m0, n1, wm0, wn1), (m1, n1, wm1, wn1)):
            inside = (l >= 0) & (l < d) & (m >= 0) & (m < h) & (nn >= 0) & (nn < w)
            zero = torch.zeros_like(l)
            index = (torch.where(inside, l, zero).long() * h + torch.where(inside, m, zero).long()) * w \
                + torch.where(inside, nn, zero).long()
            got = torch.gather(flat, 2, index[:, None, :].expand(n, c, p))
            term = ((wl * wm) * wn)[:, None, :] * got
            total = total + torch.where(inside[:, None, :], term, torch.zeros_like(term))
    return total.reshape(n, c, out_d, out_h, out_w)


TORCH_TRIDIM_ST = torch_sources(tridim_st_grid, st_full_theta, tridim_spatial_transformer)


@register_layer("TridimSpatialTransformer")
class TridimSpatialTransformer(Layer):
    def parse(self, lp):
        need_blobs(lp, "TridimSpatialTransformer", 2, 1, "image, theta", in_place=False)
        p = lp.tridim_st_param
        if p.transform_type != "affine":
            raise LayerError(f'tridim_st_param.transform_type "{p.transform_type}": the fork supports "affine" only')
        if p.sampler_type != "trilinear":
            raise LayerError(f'tridim_st_param.sampler_type "{p.sampler_type}": the fork supports "trilinear" only')
        size = [positive_field(getattr(p, f), f"tridim_st_param.{f}") if p.HasField(f) else None
                for f in ("output_D", "output_H", "output_W")]
        fixed = tuple(float(np.float32(getattr(p, f))) if p.HasField(f) else None for f in TRIDIM_THETA_FIELDS)
        return {"output": size, "fixed": fixed, "image_grad": bool(p.to_compute_dU)}

    def infer(self, attrs, in_shapes):
        image, theta = tuple(in_shapes[0]), tuple(in_shapes[1])
        _need_5d(image, "TridimSpatialTransformer's image (bottom 0)")
        fixed = sum(v is not None for v in attrs["fixed"])
        if not theta or count(theta, 1) + fixed != 12:
            raise LayerError(f"TridimSpatialTransformer's theta (bottom 1, {list(theta)}) gives "
                             f"{count(theta, 1) if theta else 0} values per item and tridim_st_param fixes {fixed}: "
                             f"together they must make the 12 of the 3 x 4 matrix")
        if theta[0] != image[0]:
            raise LayerError(f"TridimSpatialTransformer's theta (bottom 1, {list(theta)}) must have the image's "
                             f"{image[0]} items on axis 0")
        attrs["_out"] = tuple(o or s for o, s in zip(attrs["output"], image[2:]))
        return [image[:2] + attrs["_out"]]

    def macs(self, attrs, in_shapes, out_shapes):
        return count(out_shapes[0]) * 8

    def forward(self, attrs, params, image, theta):
        return tridim_spatial_transformer(image, theta, *attrs["_out"], attrs["fixed"], attrs["image_grad"])

    def pytorch_source(self, node, emit):
        fn = emit.helper(TORCH_TRIDIM_ST)
        od, oh, ow = node.attrs["_out"]
        return (f"{fn}({emit.inputs[0]}, {emit.inputs[1]}, {od}, {oh}, {ow}, {node.attrs['fixed']!r}, "
                f"{node.attrs['image_grad']})")

    def onnx(self, ctx, node):
        image, theta = node.inputs
        op, f32, i64 = ctx.op, ctx.f32, ctx.i64
        _, c, d, h, w = ctx.shape(image)
        od, oh, ow = node.attrs["_out"]
        fixed = node.attrs["fixed"]
        given = sum(v is None for v in fixed)
        p = od * oh * ow
        flat = op("Reshape", [image, i64([0, c, d * h * w])], "flat")
        coef = onnx_theta_entries(op, f32, i64, theta, fixed, given)
        grid = tridim_st_grid(od, oh, ow).numpy()
        g = [ctx.const(np.ascontiguousarray(grid[:, j]).reshape(1, p), f"{node.name}_g{j}") for j in range(4)]
        coords = []
        for r, extent in enumerate((d, h, w)):
            acc = op("Mul", [g[0], coef[4 * r]], f"c{r}_0")
            for j in range(1, 4):
                acc = op("Add", [acc, op("Mul", [g[j], coef[4 * r + j]], f"c{r}_m{j}")], f"c{r}_{j}")
            v = op("Div", [op("Add", [acc, f32(1)], f"p{r}"), f32(3)], f"q{r}")
            coords.append(op("Mul", [v, f32(extent)], "zxy"[r]))
        z, x, y = coords
        l0, m0, n0 = (op("Floor", [t], f"{a}0") for t, a in ((z, "l"), (x, "m"), (y, "n")))
        l1 = op("Floor", [op("Add", [z, f32(1)], "z1")], "l1")
        m1, n1 = op("Add", [m0, f32(1)], "m1"), op("Add", [n0, f32(1)], "n1")

        def one_minus(a, b, hint):   # 1 - (a - b), as the kernel writes each factor
            return op("Sub", [f32(1), op("Sub", [a, b], "d" + hint)], "w" + hint)

        wl0, wl1 = one_minus(z, l0, "l0"), one_minus(l1, z, "l1")
        wm0, wm1 = one_minus(x, m0, "m0"), one_minus(m1, x, "m1")
        wn0, wn1 = one_minus(y, n0, "n0"), one_minus(n1, y, "n1")
        spread = op("Shape", [flat], "spread")   # (N, C, D * H * W): every item's channels

        def within(t, size, hint):   # 0 <= t < size
            return op("And", [op("Not", [op("Less", [t, f32(0)], hint + "_neg")], hint + "_ge0"),
                              op("Less", [t, f32(size)], hint + "_lt")], hint + "_in")

        def as_index(t, inside, hint):
            return op("Cast", [op("Where", [inside, t, f32(0)], hint + "_z")], hint + "_i", to=7)

        total, tap = None, 0
        for l, wl in ((l0, wl0), (l1, wl1)):
            for m, nn, wm, wn in ((m0, n0, wm0, wn0), (m1, n0, wm1, wn0), (m0, n1, wm0, wn1), (m1, n1, wm1, wn1)):
                hint = f"t{tap}"
                inside = op("And", [op("And", [within(l, d, hint + "l"), within(m, h, hint + "m")], hint + "_lm"),
                                    within(nn, w, hint + "n")], hint + "_in")
                index = op("Add", [op("Mul", [op("Add", [op("Mul", [as_index(l, inside, hint + "l"), i64(h)],
                                                             hint + "_lh"), as_index(m, inside, hint + "m")],
                                                 hint + "_lhm"), i64(w)], hint + "_lhmw"),
                                   as_index(nn, inside, hint + "n")], hint + "_idx")
                index = op("Expand", [op("Reshape", [index, i64([0, 1, p])], hint + "_i3"),
                                      op("Concat", [op("Slice", [spread, i64([0]), i64([2])], hint + "_nc"),
                                                    i64([p])], hint + "_shape", axis=0)], hint + "_all")
                got = op("GatherElements", [flat, index], hint + "_v", axis=2)
                weight = op("Mul", [op("Mul", [wl, wm], hint + "_wlm"), wn], hint + "_w")
                term = op("Mul", [op("Reshape", [weight, i64([0, 1, p])], hint + "_w3"), got], hint + "_term")
                term = op("Where", [op("Reshape", [inside, i64([0, 1, p])], hint + "_in3"), term, f32(0)],
                          hint + "_kept")
                total = term if total is None else op("Add", [total, term], hint + "_sum")
                tap += 1
        ctx.add_node("Reshape", [total, i64([0, c, od, oh, ow])], [node.outputs[0]], name=node.name)


# ---- TridimData --------------------------------------------------------------------------------

@register_layer("TridimData")
class TridimData(DataLayer):
    def parse(self, lp):
        need_blobs(lp, "TridimData", 0, 2)
        p = lp.tridim_data_param
        length = positive_field(p.new_length, "tridim_data_param.new_length")
        if bool(p.new_height) != bool(p.new_width):
            raise LayerError("tridim_data_param.new_height and new_width must be set together (or both 0)")
        transform = transform_attrs(lp)
        crop = transform["crop_size"]
        if crop and p.new_height and (crop > p.new_height or crop > p.new_width):
            raise LayerError(f"transform_param.crop_size {crop} exceeds the {p.new_height}x{p.new_width} frames "
                             f"(tridim_data_param.new_height / new_width)")
        hw = (crop, crop) if crop else ((int(p.new_height), int(p.new_width)) if p.new_height else None)
        labels = positive_field(p.num_of_labels, "tridim_data_param.num_of_labels") if p.use_multiple_label else None
        return {"tops": list(lp.top), "num_tops": 2, "source": p.source, "root_folder": p.root_folder,
                "batch_size": positive_field(p.batch_size, "tridim_data_param.batch_size"), "length": length,
                "hw": hw, "labels": labels, "use_image": bool(p.use_image),
                "sampling_rate": int(p.sampling_rate), "transform": transform}

    def top_shapes(self, attrs, given):
        data = given.get(0)
        if data is None:
            if attrs["hw"] is None:
                raise needs_input_shape(attrs, attrs["tops"][0], "TridimData without transform_param.crop_size or "
                                        "tridim_data_param.new_height/new_width takes the frames' own size")
            data = (attrs["batch_size"], 3, attrs["length"]) + tuple(attrs["hw"])
        label = given.get(1) or ((data[0], attrs["labels"]) if attrs["labels"] else (data[0],))
        return [tuple(data), tuple(label)]

    def guessed_label_tops(self, attrs, given):
        return ()

    def preprocessing(self, attrs):
        frames = ("frames <dir>/%06d.jpg of each listed folder" if attrs["use_image"]
                  else "frames decoded from each listed video")
        lines = [f"clips of {attrs['length']} {frames} (sampling_rate {attrs['sampling_rate']}), list "
                 f"{attrs['source']!r}; 3 colour channels (BGR) x frames x height x width"]
        if attrs["labels"]:
            lines.append(f"labels: {attrs['labels']} per clip, 1 at each listed class id (use_multiple_label)")
        t = dict(attrs["transform"])
        mean = t.pop("mean_file", None)
        lines += describe_transform(t)
        if mean:
            lines.append(f"subtract the per-voxel mean volume {mean!r} (cropped like the data)")
        return lines

