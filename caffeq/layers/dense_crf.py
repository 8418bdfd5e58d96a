"""DeepLab v2's DenseCRF: the fully connected CRF of Kraehenbuehl and Koltun as a test-time layer.

DeepLab v2 (xmyqsh/deeplab-v2 and the deeplab-public-ver2 copies): src/caffe/layers/densecrf_layer.cpp,
util/densecrf_pairwise.cpp (PottsPotential), util/permutohedral.cpp (the lattice: permutohedral.py's,
sliced as its SSE path), include/caffe/util/densecrf_util.hpp (fast_exp).  dense_crf_param: max_iter
[10], pos_w / pos_xy_std (spatial terms), bi_w / bi_xy_std / bi_rgb_std (bilateral terms),
output_probability [true].  Bottoms (scores (N, M, Hp, Wp), image size, image (N, 3, Hp, Wp)); top =
the scores' shape.  For each image n:
- the region: (H, W) = (Hp, Wp) when Hp <= h and Wp <= w, else (h, w), with (h, w) the size bottom's
  first two values of image n truncated to int; the top is 0 outside it;
- features: (x / pos_xy_std) per spatial term, (x / bi_xy_std, y / bi_xy_std, r / bi_rgb_std, g ..., b
  ...) per bilateral term, the colours read from image 0 for every n (the fork indexes the image blob
  without the batch offset), channels 0, 1, 2 as they are;
- each term's normalizer norm = 1 / (filter(1) + 1e-20) (per-pixel normalization, the default);
- Q = softmax(scores) then max_iter times: Q = softmax(scores + sum over terms of (w norm) filter(Q)),
  each softmax with libDenseCRF's fast_exp (a polynomial exp with range reduction, 0 below -20), in
  the terms' order (spatial, then bilateral);
- top = Q, or log(max(Q, FLT_MIN)) without output_probability.
A two-bottom DenseCRF (no image) cannot run: the fork's Reshape reads bottom[2] regardless.

CCNN's (pathak22/caffe-ccnn, `densecrf_param`): bottoms (scores, image), top the label map (N, 1, H, W);
read and sized, refused to run.
"""
import numpy as np
import torch

from ..errors import ExportError
from .norm import onnx_reduce
from .permutohedral import LATTICE_HELPERS, permutohedral_filter, permutohedral_lattice, pixel_xy
from .permutohedral_onnx import OnnxLattice
from .registry import Layer, LayerError, need_blobs, register_layer
from .ssd.common import scalar_tensor


def densecrf_fast_exp(x):
    """libDenseCRF's scalar fast_exp (densecrf_util.hpp) in float32: exp(-|x|) by a degree-7 polynomial
    after halving |x| into (0, 0.69] (by 8, 4 and 2, squaring back as many times), inverted for x >= 0;
    0 where |x| > 20."""
    a = magnitude = x.abs()
    halvings = torch.zeros_like(x, dtype=torch.int64)
    for bound, divisor, count, rounds in ((0.69 * 8, 8.0, 3, 2), (0.69 * 4, 4.0, 2, 2), (0.69, 2.0, 1, 3)):
        for _ in range(rounds):   # enough rounds for every |x| <= 20 (the rest gives 0); FAST_EXP_STEPS
            big = a.double() > bound   # the fork compares in double
            a = torch.where(big, a / divisor, a)
            halvings = halvings + big.to(torch.int64) * count
    t = torch.full_like(a, 0.0001413161)
    for c in (0.0013298820, 0.0083013598, 0.0416573475, 0.1666653019, 0.4999999206, 0.9999999995):
        t = torch.tensor(c, dtype=a.dtype, device=a.device) - a * t
    y = 1 - a * t
    for _ in range(7):   # at most 2 x 3 + 2 x 2 + 3 squarings are asked; the loop stops where none is left
        y = torch.where(halvings > 0, y * y, y)
        halvings = halvings - 1
    y = torch.where(x < 0, y, 1 / y)
    return torch.where(magnitude > 20, torch.zeros_like(y), y)


#: fast_exp's range reduction: (bound compared in double, divisor, squarings owed, rounds enough for |x| <= 20)
FAST_EXP_STEPS = ((0.69 * 8, 8.0, 3, 2), (0.69 * 4, 4.0, 2, 2), (0.69, 2.0, 1, 3))
#: its polynomial's coefficients, innermost first, after 0.0001413161
FAST_EXP_POLYNOMIAL = (0.0013298820, 0.0083013598, 0.0416573475, 0.1666653019, 0.4999999206, 0.9999999995)


def onnx_fast_exp(ctx, x):
    """densecrf_fast_exp in ONNX, the same float32 steps."""
    def op(kind, inputs, hint, **attrs):
        return ctx.op(kind, inputs, f"fexp_{hint}", **attrs)
    a = magnitude = op("Abs", [x], "abs")
    halvings = None
    for bound, divisor, count, rounds in FAST_EXP_STEPS:
        for _ in range(rounds):
            big = op("Greater", [op("Cast", [a], "a64", to=11), ctx.const(np.array(bound, np.float64))], "big")
            a = op("Where", [big, op("Div", [a, ctx.f32(divisor)], "div"), a], "a")
            owed = op("Mul", [op("Cast", [big], "bf", to=1), ctx.f32(float(count))], "owed")
            halvings = owed if halvings is None else op("Add", [halvings, owed], "halvings")
    t = ctx.f32(0.0001413161)
    for c in FAST_EXP_POLYNOMIAL:
        t = op("Sub", [ctx.f32(c), op("Mul", [a, t], "at")], "t")
    y = op("Sub", [ctx.f32(1.0), op("Mul", [a, t], "at")], "y")
    for _ in range(7):
        y = op("Where", [op("Greater", [halvings, ctx.f32(0.0)], "owe"), op("Mul", [y, y], "sq"), y], "y")
        halvings = op("Sub", [halvings, ctx.f32(1.0)], "halvings")
    y = op("Where", [op("Less", [x, ctx.f32(0.0)], "neg"), y, op("Div", [ctx.f32(1.0), y], "inv")], "y")
    return op("Where", [op("Greater", [magnitude, ctx.f32(20.0)], "far"), ctx.f32(0.0), y], "exp")


def onnx_densecrf_softmax(ctx, x):
    """densecrf_softmax of (P, M) rows (classes on axis 1)."""
    e = onnx_fast_exp(ctx, ctx.op("Sub", [x, onnx_reduce(ctx, "ReduceMax", x, [1], True)], "shifted"))
    return ctx.op("Div", [e, onnx_reduce(ctx, "ReduceSum", e, [1], True)], "q")


def densecrf_softmax(x):
    """DenseCRF's ExpAndNormalize over the classes (axis 0) of (M, P) with fast_exp."""
    e = densecrf_fast_exp(x - x.max(0, keepdim=True).values)
    return e / e.sum(0, keepdim=True)


def deeplab_dense_crf(scores, sizes, image, iterations: int, spatial: list[tuple[float, float]],
                      bilateral: list[tuple[float, float, float]], probability: bool):
    """DeepLab v2's DenseCRF forward.  spatial: (w, xy_std) per term; bilateral: (w, xy_std, rgb_std)."""
    n, m, hp, wp = scores.shape
    f32, dev = torch.float32, scores.device
    top = torch.zeros(n, m, hp, wp, dtype=f32, device=dev)
    sizes = sizes.reshape(n, -1)
    for b in range(n):
        h, w = int(sizes[b, 0]), int(sizes[b, 1])
        if not (hp <= h and wp <= w):
            if not (0 <= h <= hp and 0 <= w <= wp):
                raise ValueError(f"image {b}'s size {h} x {w} leaves the {hp} x {wp} scores (the fork would read "
                                 f"outside them)")
            if h * w == 0:
                continue
        else:
            h, w = hp, wp
        xy = pixel_xy(h, w, dev)
        colours = image[0, :3, :h, :w].reshape(3, -1).t().to(f32)
        ones = torch.ones(1, h * w, dtype=f32, device=dev)
        terms = []
        for weight, xy_std in spatial:
            terms.append((weight, xy / torch.tensor(xy_std, dtype=f32, device=dev)))
        for weight, xy_std, rgb_std in bilateral:
            terms.append((weight, torch.cat([xy / torch.tensor(xy_std, dtype=f32, device=dev),
                                             colours / torch.tensor(rgb_std, dtype=f32, device=dev)], 1)))
        kernels = []
        for weight, features in terms:
            lattice = permutohedral_lattice(features)
            norm = 1 / (permutohedral_filter(ones, *lattice, sse_only=True) + 1e-20)
            kernels.append((torch.tensor(weight, dtype=f32, device=dev) * norm, lattice))
        unary = scores[b, :, :h, :w].reshape(m, -1).to(f32)
        q = densecrf_softmax(unary)
        for _ in range(iterations):
            energy = unary
            for scale, lattice in kernels:
                energy = energy + scale * permutohedral_filter(q, *lattice, sse_only=True)
            q = densecrf_softmax(energy)
        top[b, :, :h, :w] = (q if probability else torch.log(q.clamp(min=torch.finfo(torch.float32).tiny))).reshape(m, h, w)
    return top.to(scores.dtype)


@register_layer("DenseCRF")
class DenseCRF(Layer):
    def parse(self, lp):
        if lp.HasField("densecrf_param"):   # CCNN's: (scores, image) -> the label map
            need_blobs(lp, lp.type, 2, roles="scores, image")
            return {"name": lp.name, "ccnn": True}
        need_blobs(lp, lp.type, (2, 3))
        p = lp.dense_crf_param
        if len(p.pos_w) != len(p.pos_xy_std):
            raise LayerError("dense_crf_param: pos_w and pos_xy_std must come in pairs (the fork's check)")
        if not len(p.bi_w) == len(p.bi_xy_std) == len(p.bi_rgb_std):
            raise LayerError("dense_crf_param: bi_w, bi_xy_std and bi_rgb_std must come in threes (the fork's check)")
        if len(lp.bottom) == 3 and not len(p.bi_w):
            raise LayerError("dense_crf_param: an image bottom needs the bilateral terms (bi_w, bi_xy_std, "
                             "bi_rgb_std), as the fork checks")
        return {"name": lp.name, "iterations": int(p.max_iter), "image": len(lp.bottom) == 3,
                "probability": bool(p.output_probability), "ccnn": False,
                "spatial": [(float(w), float(s)) for w, s in zip(p.pos_w, p.pos_xy_std)],
                "bilateral": [(float(w), float(s), float(r)) for w, s, r in zip(p.bi_w, p.bi_xy_std, p.bi_rgb_std)]}

    def infer(self, attrs, in_shapes):
        scores = tuple(in_shapes[0])
        if len(scores) != 4:
            raise LayerError(f"DenseCRF needs 4-axis scores (N, C, H, W), got {list(scores)}")
        if attrs["ccnn"]:   # caffe-ccnn's Reshape: the image's N, H, W; at least as many classes as channels
            image = tuple(in_shapes[1])
            if len(image) != 4 or (image[0],) + image[2:] != (scores[0],) + scores[2:] or image[1] > scores[1]:
                raise LayerError(f"CCNN's DenseCRF takes the scores (N, C, H, W) then the image (N, <= C, H, W), "
                                 f"got {list(scores)} and {list(image)}")
            return [(scores[0], 1) + scores[2:]]
        if any(s[0] != scores[0] for s in in_shapes[1:]):
            raise LayerError(f"DenseCRF's bottoms must share N: {[list(s) for s in in_shapes]}")
        sizes = tuple(in_shapes[1])
        if int(np.prod(sizes[1:])) < 2:
            raise LayerError(f"DenseCRF reads each image's height and width from its second bottom, which holds "
                             f"{int(np.prod(sizes[1:]))} value(s) per image ({list(sizes)})")
        if attrs["image"]:
            image = tuple(in_shapes[2])
            if len(image) != 4 or image[1] != 3 or image[2:] != scores[2:]:
                raise LayerError(f"DenseCRF's image must be (N, 3, H, W) with the scores' H and W {list(scores[2:])}, "
                                 f"got {list(image)}")
        return [scores]

    def cannot_run(self, attrs, in_shapes):
        if attrs["ccnn"]:
            return ("CCNN's fully connected CRF (caffe-ccnn's densecrf) labels each pixel; caffeq does not "
                    "implement it: the net reads and its shapes are known, but it cannot run or be exported "
                    "(take the scores before it)")
        if not attrs["image"]:
            return ("DeepLab's DenseCRF without an image bottom cannot run: the fork's Reshape reads a third "
                    "bottom all the same (give it the image)")
        return None

    def _call_args(self, attrs):
        return (attrs["iterations"], attrs["spatial"], attrs["bilateral"], attrs["probability"])

    def forward(self, attrs, params, scores, sizes, image=None):
        self.refuse_if_cannot_run(attrs["name"], attrs, [scores.shape, sizes.shape], LayerError)
        try:
            return deeplab_dense_crf(scores, sizes, image, *self._call_args(attrs))
        except ValueError as e:
            raise LayerError(f"layer '{attrs['name']}' (DenseCRF): {e}") from None

    def macs(self, attrs, in_shapes, out_shapes):
        n, c, h, w = in_shapes[0]
        return n * attrs["iterations"] * (len(attrs.get("spatial", ())) + len(attrs.get("bilateral", ()))) * 8 * c * h * w

    def onnx(self, ctx, node):
        a = node.attrs
        shapes = [ctx.shape(t) for t in node.inputs]
        self.refuse_if_cannot_run(node.name, a, shapes, ExportError)
        (n, m, hp, wp), (scores, sizes, image) = shapes[0], node.inputs
        op, i64, f32 = ctx.op, ctx.i64, ctx.f32
        sizes = op("Cast", [op("Reshape", [sizes, i64([n, -1])], "sizes")], "sizes", to=7)   # truncated as C's int
        tops = []
        for b in range(n):
            h0, w0 = (op("Reshape", [op("Slice", [sizes, i64([b, j]), i64([b + 1, j + 1]), i64([0, 1])], "s"),
                                     i64([1])], "hw") for j in (0, 1))
            whole = op("And", [op("LessOrEqual", [i64([hp]), h0], "hfits"), op("LessOrEqual", [i64([wp]), w0], "wfits")],
                       "whole")
            h, w = op("Where", [whole, i64([hp]), h0], "h"), op("Where", [whole, i64([wp]), w0], "w")
            inside = [op("And", [op("GreaterOrEqual", [v, i64([0])], "ge0"), op("LessOrEqual", [v, i64([top])], "le")],
                         "in") for v, top in ((h, hp), (w, wp))]
            valid = op("And", inside, "valid")   # caffeq's run refuses the rest; here they give NaN
            empty = op("Equal", [op("Mul", [h, w], "area"), i64([0])], "empty")
            h = op("Min", [op("Max", [h, i64([1])], "h1"), i64([hp])], "h")
            w = op("Min", [op("Max", [w, i64([1])], "w1"), i64([wp])], "w")
            points = op("Mul", [h, w], "points")
            pixel = op("Range", [i64(0), op("Squeeze", [points, i64([0])], "p"), i64(1)], "pixel")
            w_scalar = op("Squeeze", [w, i64([0])], "ws")
            xy = op("Cast", [op("Concat", [op("Unsqueeze", [op("Mod", [pixel, w_scalar], "x"), i64([1])], "x"),
                                           op("Unsqueeze", [op("Div", [pixel, w_scalar], "y"), i64([1])], "y")],
                                "xy", axis=1)], "xy", to=1)

            def crop(x, first, channels):   # image `first`, its first `channels` channels, region only: (P, channels)
                ends = op("Concat", [i64([first + 1, channels]), h, w], "ends", axis=0)
                part = op("Slice", [x, i64([first, 0, 0, 0]), ends, i64([0, 1, 2, 3])], "crop")
                return op("Transpose", [op("Reshape", [part, i64([channels, -1])], "flat")], "pc")

            colours = crop(image, 0, 3)   # the fork's first image, for every n
            ones = op("ConstantOfShape", [op("Concat", [points, i64([1])], "os", axis=0)], "ones",
                      value=scalar_tensor(1.0))
            terms = [(weight, op("Div", [xy, f32(std)], "pos"), 2) for weight, std in a["spatial"]]
            terms += [(weight, op("Concat", [op("Div", [xy, f32(std)], "pos"), op("Div", [colours, f32(rgb)], "rgb")],
                                  "bi", axis=1), 5) for weight, std, rgb in a["bilateral"]]
            kernels = []
            for k, (weight, features, d) in enumerate(terms):
                lattice = OnnxLattice(ctx, f"crf{b}_{k}")
                built = lattice.build(lattice.padded(features, points, d), points, d)
                norm = op("Reciprocal", [op("Add", [lattice.filter(built, ones, 1, d, sse_only=True), f32(1e-20)],
                                            "n")], "norm")
                kernels.append((op("Mul", [f32(weight), norm], "scale"), lattice, built, d))
            energy = crop(scores, b, m)
            q = onnx_densecrf_softmax(ctx, energy)
            for _ in range(a["iterations"]):
                step = energy
                for scale, lattice, built, d in kernels:
                    step = op("Add", [step, op("Mul", [scale, lattice.filter(built, q, m, d, sse_only=True)], "msg")],
                              "energy")
                q = onnx_densecrf_softmax(ctx, step)
            if not a["probability"]:
                q = op("Log", [op("Max", [q, f32(float(np.finfo(np.float32).tiny))], "floor")], "logq")
            out = op("Reshape", [op("Transpose", [q], "cp"), op("Concat", [i64([1, m]), h, w], "shape", axis=0)], "out")
            pads = op("Concat", [i64([0] * 6), op("Sub", [i64([hp]), h], "ph"), op("Sub", [i64([wp]), w], "pw")],
                      "pads", axis=0)
            out = op("Pad", [out, pads, f32(0.0)], "pad")
            out = op("Where", [empty, f32(0.0), out], "top")
            tops.append(op("Where", [valid, out, f32(float("nan"))], "top"))
        ctx.add_node("Concat", tops, [node.outputs[0]], axis=0)

    def pytorch_source(self, node, emit):
        self.refuse_if_cannot_run(node.name, node.attrs, [emit.in_shape(i) for i in range(len(node.inputs))],
                                  ExportError)
        for helper in LATTICE_HELPERS + (densecrf_fast_exp, densecrf_softmax):
            emit.helper(helper)
        fn = emit.helper(deeplab_dense_crf)
        args = ", ".join(emit.lit(v) for v in self._call_args(node.attrs))
        return f"{fn}({', '.join(emit.inputs)}, {args})"

