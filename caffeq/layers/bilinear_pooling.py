"""Bilinear pooling nets' layers: SignedSqrt and L2Normalize (gy20073/compact_bilinear_pooling 1b7c58a,
caffe-20160312/src/caffe/layers; ChaojianYu/Hierarchical-Bilinear-Pooling 034e848 ships the same files)
and SumPooling (Hierarchical-Bilinear-Pooling, src/caffe/layers/sum_pooling_layer.cpp / .cu).

- SignedSqrt: x >= 0 ? sqrt(x) : -sqrt(-x) (so -0 gives -0 and NaN stays NaN); not in place.
- L2Normalize: each item (axis 0) times pow(sum of its squares + 1e-7, -0.5), that sum in float32 (cuBLAS
  asum on the GPU, a loop on the CPU: the order of the additions may differ in the last bits), the
  power in double and rounded to float32 before the product.  The top is (num, channels, height, width)
  as Caffe's legacy accessors read the bottom: an (N, C) bottom gives (N, C, 1, 1).  Not in place.
- SumPooling: Caffe's Pooling (the same geometry, MAX, AVE and STOCHASTIC) with a fourth method SUM, the
  sum over each window (the fork allows no padding with it); `sum_pooling_param` holds the
  PoolingParameter fields under their numbers.
- CompactBilinear (gy20073/compact_bilinear_pooling, compact_bilinear_layer.cpp / .cu; Tensor Sketch):
  two 4-axis bottoms of one N, H and W (the same blob in the nets).  Each is count-sketched at every
  position into D = num_output bins, bin h[c] getting s[c] x channel c, then the two sketches are
  multiplied through unnormalized real FFTs both ways: D times their circular convolution.  With
  sum_pool (the default) the positions are summed: top (N, D, 1, 1), else (N, D, H, W).  The hashes h
  (rand() % D) and signs s (2 (rand() % 2) - 1) are not stored: each Reshape seeds glibc's rand() with 1
  and draws h for bottom 0's channels, then its signs, then bottom 1's hashes and signs (glibc_rand
  below is that generator, so the tables are the fork's on Linux).  ONNX: opset 17's DFT.
- Bilinear: two 4-axis bottoms; top channel ca * Cb + cb is the sum of a[ca] * b[cb] over positions,
  unnormalized.  gy20073's caffe-20160312 (as aimerykong/Low-Rank-Bilinear-Pooling ships it) sums over the
  whole map: (N, Ca Cb, 1, 1).  Ganin's layer in madkn/MultiregionBilinearCNN-ReId's caffe-bilinear
  (bilinear_layer.cu, GPU only) reads `convolution_param` and sums over each of its im2col windows (zeros
  in the padding): (N, Ca Cb, out_h, out_w); a Bilinear with convolution_param is read as that one.
- SoftAttention (akirafukui/caffe fa7bab7, branch feature/20160617_cb_softattention; the MCB VQA nets and
  Seth-Park/MultimodalExplanations): features a (N, C, H, W), an attention map (N, 1, H, W) and a weight
  beta of N values: top[n, c] = sum over positions of beta[n] a[n, c] alpha[n], (N, C, 1, 1).
"""
import numpy as np
import torch

from ..errors import ExportError
from ..io.schema import caffe_pb2
from .conv import conv_out_size
from .norm import onnx_reduce
from .pooling import AVE, CEIL, TORCH_POOL_FUNCTIONS, TORCH_POOL_MODULE, Pooling, as_pooling_param, caffe_pool2d, window
from .registry import Layer, LayerError, legacy_nchw, need_blobs, register_layer, spatial_params
from .segaware import onnx_window_views, window_views

DOUBLE, FLOAT = 11, 1   # onnx.TensorProto
NORM_EPS = float(np.float32(1e-7))   # the fork's Dtype epsilon = 0.0000001
SUM = caffe_pb2.SumPoolingParameter.SUM


def signed_sqrt(x):
    """SignedSqrt: sqrt(x) where x >= 0, else -sqrt(-x), correctly rounded as the fork's sqrt is
    (through double: torch's float32 sqrt on the CPU may be an ulp off)."""
    wide = x.double()
    return torch.where(x >= 0, torch.sqrt(wide), -torch.sqrt(-wide)).to(x.dtype)


def item_l2_normalize(x, legacy_shape: list[int], eps: float):
    """L2Normalize: each item times float32(pow(float32 sum of squares + eps, -0.5)), 4-axis as legacy_shape."""
    squares = (x * x).reshape(x.shape[0], -1).sum(1)
    scale = torch.pow((squares + eps).double(), -0.5).to(x.dtype)
    return (x.reshape(x.shape[0], -1) * scale[:, None]).reshape(legacy_shape)


@register_layer("SignedSqrt")
class SignedSqrt(Layer):
    def parse(self, lp):
        need_blobs(lp, "SignedSqrt", 1, 1, in_place=False)
        return {}

    def forward(self, attrs, params, x):
        return signed_sqrt(x)

    def onnx(self, ctx, node):
        x = node.inputs[0]
        wide = ctx.op("Cast", [x], "in_double", name=node.name, to=DOUBLE)
        root = ctx.op("Sqrt", [wide], "root")
        negative_root = ctx.op("Neg", [ctx.op("Sqrt", [ctx.op("Neg", [wide], "negated")], "negated_root")], "signed")
        chosen = ctx.op("Where", [ctx.op("GreaterOrEqual", [x, ctx.f32(0.0)], "nonnegative"), root, negative_root],
                        "chosen")
        ctx.add_node("Cast", [chosen], [node.outputs[0]], to=FLOAT)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(signed_sqrt)}({emit.inputs[0]})"


@register_layer("L2Normalize")
class L2Normalize(Layer):
    def parse(self, lp):
        need_blobs(lp, "L2Normalize", 1, 1, in_place=False)
        return {}

    def infer(self, attrs, in_shapes):
        return [legacy_nchw(in_shapes[0], "L2Normalize")]

    def forward(self, attrs, params, x):
        return item_l2_normalize(x, [x.shape[0]] + list(legacy_nchw(x.shape, "L2Normalize")[1:]), NORM_EPS)

    def onnx(self, ctx, node):
        x, out = node.inputs[0], node.outputs[0]
        shape = legacy_nchw(ctx.shape(x), "L2Normalize")
        flat = ctx.op("Flatten", [x], "items", name=node.name, axis=1)
        squares = ctx.op("ReduceSum", [ctx.op("Mul", [flat, flat], "squares"), ctx.i64([1])], "sum_squares",
                         keepdims=1)
        power = ctx.op("Pow", [ctx.op("Cast", [ctx.op("Add", [squares, ctx.f32(NORM_EPS)], "plus_eps")],
                                      "in_double", to=DOUBLE), ctx.const(np.array(-0.5))], "inverse_norm")
        scaled = ctx.op("Mul", [flat, ctx.op("Cast", [power], "scale", to=FLOAT)], "scaled")
        ctx.add_node("Reshape", [scaled, ctx.i64([0] + list(shape[1:]))], [out])

    def pytorch_source(self, node, emit):
        shape = legacy_nchw(emit.in_shape(0), "L2Normalize")
        x = emit.inputs[0]
        return (f"{emit.helper(item_l2_normalize)}({x}, [{x}.shape[0]] + {emit.lit(list(shape[1:]))}, "
                f"{emit.lit(NORM_EPS)})")


@register_layer("SumPooling")
class SumPooling(Pooling):
    def pooling_params(self, lp):
        p = lp.sum_pooling_param
        if p.pool == SUM and (p.pad or p.pad_h or p.pad_w):
            raise LayerError("sum_pooling_param: SUM with padding (the fork's check: padding is implemented only "
                             "for average and max pooling)")
        return as_pooling_param(p, AVE if p.pool == SUM else int(p.pool))   # SUM: AVE's windows, not divided

    def parse(self, lp):
        attrs = super().parse(lp)
        attrs["sum"] = lp.sum_pooling_param.pool == SUM
        return attrs

    def _sum_window(self, attrs, h, w):
        k, s, p, _ = window(attrs, h, w)
        return list(k), list(s), list(p), attrs["round_mode"] == CEIL

    def forward(self, attrs, params, x):
        if not attrs["sum"]:
            return super().forward(attrs, params, x)
        return caffe_pool2d(x, "sum", *self._sum_window(attrs, x.shape[2], x.shape[3]))

    def onnx(self, ctx, node):
        if not node.attrs["sum"]:
            return super().onnx(ctx, node)
        x = node.inputs[0]
        _, c, h, w = ctx.shape(x)
        k, s, _, _ = self._sum_window(node.attrs, h, w)
        out = window(node.attrs, h, w)[3]
        extra = [max(0, (o - 1) * st + kk - n) for o, st, kk, n in zip(out, s, k, (h, w))]
        padded = ctx.op("Pad", [x, ctx.i64([0, 0, 0, 0, 0, 0, extra[0], extra[1]])], "padded", name=node.name) \
            if any(extra) else x
        ones = ctx.const(np.ones((c, 1, k[0], k[1]), np.float32), node.name + "_ones")
        sums = ctx.op("Conv", [padded, ones], "sums", group=c, kernel_shape=k, strides=s)
        ctx.add_node("Slice", [sums, ctx.i64([0, 0]), ctx.i64(list(out)), ctx.i64([2, 3])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        if not node.attrs["sum"]:
            return super().pytorch_source(node, emit)
        k, s, p, ceil = self._sum_window(node.attrs, *emit.in_shape(0)[2:])
        m = emit.instance(TORCH_POOL_MODULE, "sum", k, s, p, ceil, needs=[TORCH_POOL_FUNCTIONS])
        return f"{m}({emit.inputs[0]})"


# ---- CompactBilinear ---------------------------------------------------------------------------------

def glibc_rand(seed, count):
    """The first `count` outputs of glibc's rand() after srand(seed) (its TYPE_3 additive feedback generator)."""
    r = [seed]
    for i in range(1, 31):
        hi, lo = divmod(r[i - 1], 127773)
        word = 16807 * lo - 2836 * hi
        r.append(word + 2147483647 if word < 0 else word)
    r += [r[i - 31] for i in range(31, 34)]
    for i in range(34, 344 + count):
        r.append((r[i - 31] + r[i - 3]) & 0xFFFFFFFF)
    return [v >> 1 for v in r[344:344 + count]]


def compact_bilinear_tables(channels, num_output):
    """The fork's [(hashes, signs) of bottom 0, of bottom 1] for these channel counts."""
    stream = iter(glibc_rand(1, 2 * sum(channels)))
    tables = []
    for c in channels:
        hashes = [next(stream) % num_output for _ in range(c)]
        signs = [2 * (next(stream) % 2) - 1 for _ in range(c)]
        tables.append((hashes, signs))
    return tables


def count_sketch(x, hashes: list[int], signs: list[int], num_output: int):
    """(N, C, H, W) -> (N, D, H W): bin h[c] sums s[c] x[:, c], channel by channel."""
    n, c = x.shape[0], x.shape[1]
    sign = torch.tensor(signs, dtype=x.dtype, device=x.device)
    flat = x.reshape(n, c, -1) * sign[None, :, None]
    out = torch.zeros((n, num_output, flat.shape[2]), dtype=x.dtype, device=x.device)
    return out.index_add_(1, torch.tensor(hashes, dtype=torch.long, device=x.device), flat)


def compact_bilinear(a, b, tables: list, num_output: int, sum_pool: bool):
    """CompactBilinear: D x the circular convolution of the two count sketches, positions summed or kept."""
    sa = count_sketch(a, tables[0][0], tables[0][1], num_output)
    sb = count_sketch(b, tables[1][0], tables[1][1], num_output)
    spectrum = torch.fft.rfft(sa, dim=1) * torch.fft.rfft(sb, dim=1)
    z = torch.fft.irfft(spectrum, n=num_output, dim=1) * num_output     # the fork's unnormalized inverse
    if sum_pool:
        return z.sum(dim=2).reshape(a.shape[0], num_output, 1, 1)
    return z.reshape(a.shape[0], num_output, a.shape[2], a.shape[3])


@register_layer("CompactBilinear")
class CompactBilinear(Layer):
    def parse(self, lp):
        need_blobs(lp, "CompactBilinear", 2, 1, in_place=False)
        p = lp.compact_bilinear_param
        if not p.HasField("num_output") or p.num_output < 1:
            raise LayerError("compact_bilinear_param.num_output is required and must be >= 1 (the fork's check)")
        return {"num_output": int(p.num_output), "sum_pool": bool(p.sum_pool)}

    def infer(self, attrs, in_shapes):
        a, b = (tuple(s) for s in in_shapes)
        if len(a) != 4 or len(b) != 4 or a[0] != b[0] or a[2:] != b[2:]:
            raise LayerError(f"CompactBilinear needs two 4-axis bottoms of one N, H and W, got {list(a)} and {list(b)}")
        attrs["_tables"] = compact_bilinear_tables([a[1], b[1]], attrs["num_output"])
        d = attrs["num_output"]
        return [(a[0], d, 1, 1) if attrs["sum_pool"] else (a[0], d, a[2], a[3])]

    def macs(self, attrs, in_shapes, out_shapes):
        n, c, h, w = in_shapes[0]
        d = attrs["num_output"]
        return n * h * w * (c + in_shapes[1][1] + 3 * d * max(1, int(np.log2(d))))

    def forward(self, attrs, params, a, b):
        return compact_bilinear(a, b, attrs["_tables"], attrs["num_output"], attrs["sum_pool"])

    def onnx(self, ctx, node):
        if ctx.opset < 17:
            raise ExportError(f"layer '{node.name}' (CompactBilinear): its FFTs need ONNX's DFT, opset 17 and later; "
                              f"export with --opset 17 or later")
        def dft(x, hint, **kw):
            """DFT along axis 2: an attribute until opset 20, an input from then on."""
            if ctx.opset >= 20:
                return ctx.op("DFT", [x, "", ctx.i64(2)], hint, **kw)
            return ctx.op("DFT", [x], hint, axis=2, **kw)
        a_name, b_name = node.inputs
        n, _, h, w = ctx.shape(a_name)
        d = node.attrs["num_output"]
        spectra = []
        for k, x in enumerate((a_name, b_name)):
            hashes, signs = node.attrs["_tables"][k]
            c = len(hashes)
            sketch = np.zeros((d, c), np.float32)
            sketch[hashes, np.arange(c)] = signs      # one signed 1 per channel: the count sketch as a matrix
            flat = ctx.op("Reshape", [x, ctx.i64([n, c, h * w])], f"flat{k}", name=node.name)
            sk = ctx.op("MatMul", [ctx.const(sketch), flat], f"sketch{k}")                 # (N, D, P)
            real = ctx.op("Unsqueeze", [ctx.op("Transpose", [sk], f"pd{k}", perm=[0, 2, 1]), ctx.i64([3])], f"re{k}")
            spectra.append(dft(real, f"spec{k}"))                                            # (N, P, D, 2)
        ar, ai = (ctx.op("Slice", [spectra[0], ctx.i64([i]), ctx.i64([i + 1]), ctx.i64([3])], f"a{i}") for i in (0, 1))
        br, bi = (ctx.op("Slice", [spectra[1], ctx.i64([i]), ctx.i64([i + 1]), ctx.i64([3])], f"b{i}") for i in (0, 1))
        pr = ctx.op("Sub", [ctx.op("Mul", [ar, br], "rr"), ctx.op("Mul", [ai, bi], "ii")], "pr")
        pi = ctx.op("Add", [ctx.op("Mul", [ar, bi], "ri"), ctx.op("Mul", [ai, br], "ir")], "pi")
        inverse = dft(ctx.op("Concat", [pr, pi], "prod", axis=3), "inv", inverse=1)
        real = ctx.op("Slice", [inverse, ctx.i64([0]), ctx.i64([1]), ctx.i64([3])], "real")
        # ONNX's inverse divides by D; the fork's does not
        z = ctx.op("Mul", [ctx.op("Squeeze", [real, ctx.i64([3])], "z_pd"), ctx.f32(float(d))], "z")   # (N, P, D)
        if node.attrs["sum_pool"]:
            summed = onnx_reduce(ctx, "ReduceSum", z, [1], False)
            ctx.add_node("Reshape", [summed, ctx.i64([n, d, 1, 1])], [node.outputs[0]])
        else:
            ctx.add_node("Reshape", [ctx.op("Transpose", [z], "dp", perm=[0, 2, 1]), ctx.i64([n, d, h, w])],
                         [node.outputs[0]])

    def pytorch_source(self, node, emit):
        emit.helper(count_sketch)
        a = node.attrs
        return (f"{emit.helper(compact_bilinear)}({', '.join(emit.inputs)}, {a['_tables']!r}, {a['num_output']}, "
                f"{a['sum_pool']})")


# ---- Bilinear ------------------------------------------------------------------------------------

def bilinear_sum(a, b, geometry):
    """(N, Ca Cb, ...): the outer products of a's and b's channels summed over the whole map (geometry
    None) or over each window of geometry = (kernel, pad, stride, dilation)."""
    n, ca = a.shape[:2]
    cb = b.shape[1]
    if geometry is None:
        outer = torch.matmul(a.reshape(n, ca, -1), b.reshape(n, cb, -1).transpose(1, 2))
        return outer.reshape(n, ca * cb, 1, 1)
    va = torch.stack(window_views(a, *geometry)[1], 2)      # (N, Ca, K, out_h, out_w)
    vb = torch.stack(window_views(b, *geometry)[1], 2)
    oh, ow = va.shape[3:]
    outer = torch.matmul(va.permute(0, 3, 4, 1, 2), vb.permute(0, 3, 4, 2, 1))   # (N, out_h, out_w, Ca, Cb)
    return outer.permute(0, 3, 4, 1, 2).reshape(n, ca * cb, oh, ow)


@register_layer("Bilinear")
class Bilinear(Layer):
    def parse(self, lp):
        need_blobs(lp, "Bilinear", 2, 1, roles="a, b")
        if not lp.HasField("convolution_param"):
            return {"geometry": None}
        p = lp.convolution_param
        return {"geometry": ([int(v) for v in spatial_params(p, 2, "kernel_size", None, min_value=1, pair_required=False)],
                             [int(v) for v in spatial_params(p, 2, "pad", 0, min_value=0, pair_required=False)],
                             [int(v) for v in spatial_params(p, 2, "stride", 1, min_value=1, pair_required=False)],
                             [int(v) for v in spatial_params(p, 2, "dilation", 1, allow_hw=False, min_value=1)])}

    def infer(self, attrs, in_shapes):
        a, b = (tuple(s) for s in in_shapes)
        if len(a) != 4 or len(b) != 4:
            raise LayerError(f"Bilinear takes 4-axis bottoms, got {list(a)} and {list(b)}")
        if (a[0], a[2], a[3]) != (b[0], b[2], b[3]):
            raise LayerError(f"Bilinear's bottoms need one num, height and width, got {list(a)} and {list(b)}")
        if attrs["geometry"] is None:
            return [(a[0], a[1] * b[1], 1, 1)]
        kernel, pad, stride, dilation = attrs["geometry"]
        out = [conv_out_size(a[2 + i], kernel[i], stride[i], pad[i], dilation[i]) for i in range(2)]
        if min(out) < 1:
            raise LayerError(f"Bilinear's window (convolution_param) does not fit the {a[2]}x{a[3]} map")
        return [(a[0], a[1] * b[1], out[0], out[1])]

    def forward(self, attrs, params, a, b):
        return bilinear_sum(a, b, attrs["geometry"])

    def macs(self, attrs, in_shapes, out_shapes):
        a = in_shapes[0]
        per = a[2] * a[3] if attrs["geometry"] is None else attrs["geometry"][0][0] * attrs["geometry"][0][1]
        return int(np.prod(out_shapes[0])) * per

    def pytorch_source(self, node, emit):
        emit.uses("F")
        for helper in (conv_out_size, window_views):
            emit.helper(helper)
        fn = emit.helper(bilinear_sum)
        return f"{fn}({emit.inputs[0]}, {emit.inputs[1]}, {emit.lit(node.attrs['geometry'])})"

    def onnx(self, ctx, node):
        a, b = node.inputs
        n, ca, h, w = ctx.shape(a)
        cb = ctx.shape(b)[1]
        g = node.attrs["geometry"]
        if g is None:
            rows_a = ctx.op("Reshape", [a, ctx.i64([0, ca, -1])], "a")
            rows_b = ctx.op("Transpose", [ctx.op("Reshape", [b, ctx.i64([0, cb, -1])], "b")], "bt", perm=[0, 2, 1])
            outer = ctx.op("MatMul", [rows_a, rows_b], "outer")
            ctx.add_node("Reshape", [outer, ctx.i64([-1, ca * cb, 1, 1])], [node.outputs[0]], name=node.name)
            return
        oh, ow = self.infer(node.attrs, [ctx.shape(a), ctx.shape(b)])[0][2:]
        stacks = []
        for x, hint in ((a, "a"), (b, "b")):
            _, views = onnx_window_views(ctx, x, h, w, *g, name=f"{node.name}_{hint}")
            cells = [ctx.op("Unsqueeze", [v, ctx.i64([2])], f"{hint}_cell{k}") for k, v in enumerate(views)]
            stacks.append(ctx.op("Concat", cells, f"{hint}_windows", axis=2))      # (N, C, K, out_h, out_w)
        left = ctx.op("Transpose", [stacks[0]], "a_rows", perm=[0, 3, 4, 1, 2])    # (N, out_h, out_w, Ca, K)
        right = ctx.op("Transpose", [stacks[1]], "b_cols", perm=[0, 3, 4, 2, 1])   # (N, out_h, out_w, K, Cb)
        outer = ctx.op("Transpose", [ctx.op("MatMul", [left, right], "outer")], "outer_t", perm=[0, 3, 4, 1, 2])
        ctx.add_node("Reshape", [outer, ctx.i64([-1, ca * cb, oh, ow])], [node.outputs[0]], name=node.name)


# ---- SoftAttention ------------------------------------------------------------------------------------

@register_layer("SoftAttention")
class SoftAttention(Layer):
    def parse(self, lp):
        need_blobs(lp, "SoftAttention", 3, 1, roles="features, attention, beta")
        return {}

    def infer(self, attrs, in_shapes):
        a, alpha, beta = (tuple(s) for s in in_shapes)
        if len(a) != 4 or len(alpha) != 4:
            raise LayerError(f"SoftAttention's features and attention map need 4 axes, got {list(a)} and {list(alpha)}")
        if alpha != (a[0], 1, a[2], a[3]):
            raise LayerError(f"SoftAttention's attention map must be (N, 1, H, W) = ({a[0]}, 1, {a[2]}, {a[3]}), "
                             f"got {list(alpha)}")
        if int(np.prod(beta)) != a[0]:
            raise LayerError(f"SoftAttention's third bottom holds one beta per item: {a[0]} values, got {list(beta)}")
        return [(a[0], a[1], 1, 1)]

    def forward(self, attrs, params, a, alpha, beta):
        n, c = a.shape[:2]
        weighted = torch.matmul(a.reshape(n, c, -1), alpha.reshape(n, -1, 1))     # (N, C, 1)
        return (weighted * beta.reshape(n, 1, 1)).reshape(n, c, 1, 1)

    def pytorch_source(self, node, emit):
        a, alpha, beta = emit.inputs
        _, c, h, w = emit.in_shape(0)
        return (f"(torch.matmul({a}.reshape(-1, {c}, {h * w}), {alpha}.reshape(-1, {h * w}, 1)) * "
                f"{beta}.reshape(-1, 1, 1)).reshape(-1, {c}, 1, 1)")

    def onnx(self, ctx, node):
        a, alpha, beta = node.inputs
        _, c, h, w = ctx.shape(a)
        rows = ctx.op("Reshape", [a, ctx.i64([-1, c, h * w])], "rows")
        weights = ctx.op("Reshape", [alpha, ctx.i64([-1, h * w, 1])], "weights")
        summed = ctx.op("MatMul", [rows, weights], "summed")
        scaled = ctx.op("Mul", [summed, ctx.op("Reshape", [beta, ctx.i64([-1, 1, 1])], "beta")], "scaled")
        ctx.add_node("Reshape", [scaled, ctx.i64([-1, c, 1, 1])], [node.outputs[0]], name=node.name)
