"""stephenyan1231/caffe-hybridnet's DenseCRFMeanfield (Yan et al.'s HybridNet; "an optimized implementation of
CRF-RNN"): ee0e5c0 (hybridnet branch; its head 2985d3c has the same code) src/caffe/layers/
dense_crf_meanfield_layer.cpp/.cu, include/caffe/layers/dense_crf_meanfield_layer.hpp,
src/caffe/util/modified_permutohedral.cpp; dense_crf_meanfield_param (src/caffe/proto/caffe.proto:
DenseCRFMeanfieldParameter theta_alpha = 3 [80], theta_beta = 4 [3], theta_gamma = 5 [3], num_iterations = 6 [2],
spatial_filter_weight = 7 [3], bilateral_filter_weight = 8 [5]; compatibility_mode, threshold and the forced_
weights are read by no layer; 145 there, parameter_param here: 10145).

Bottoms (unary U, Q0, image), read through the legacy accessors; the top is U's (N, C, H, W).  LayerSetUp CHECKs
num_iterations > 1 and both filter weights >= 0; the blobs start as spatial_filter_weight (1, 1, 1, 1),
bilateral_filter_weight (1, 1, 1, 1) and the Potts compatibility -identity (1, 1, C, C).  Per image, with
P = H W pixels at (x, y) = (p mod W, p div W), as CRF-RNN's MultiStageMeanfield (crf_rnn.py) but with one weight
per kernel: a spatial lattice over (x / theta_gamma, y / theta_gamma), a bilateral one over (x / theta_alpha,
y / theta_alpha, c0 / theta_beta, c1 / theta_beta, c2 / theta_beta), c0..c2 the 3 H W values from the image's
offset(n) = n C' H' W' (read flat, so planes may run into the next image; refused where image N - 1's would run
past the blob), normalizers 1 / (filter(1) + 1e-20); num_iterations times from Q = Q0: prob = softmax over
channels of Q; message = ws (norm_s filter_s(prob)) + wb (norm_b filter_b(prob)); Q = U - mu message.  The top is
the last Q.  Q0 must hold N or more images of U's C x H W values (the fork never checks it: its lattices read U's
C x H x W values of each image n < N of Q0's softmax over axis 1).  U and Q0 need 2 axes or more (LayerSetUp's
softmaxes CHECK axis 1), and num_iterations, an int there, stays below 2^31.

The fork's CPU lattice is ModifiedPermutohedral with SSE_PERMUTOHEDRAL commented out, so not permutohedral.py's
(CRF-RNN's SSE build) in four ways: no origin points pad the last block of four; the nearest 0-coloured point
is the multiple of d + 1 nearer to each elevated coordinate e, compared in float32 as
ceil(v) (d + 1) - e < e - floor(v) (d + 1) (v = e / (d + 1)), ties going down; weight 0 adds
1.0 + the wrapped weight in double; every slice multiplies (weight x value) x alpha (the sequential path, for
any number of values).  Elevation, ranks, barycentric weights, 16-bit keys, neighbours, splat order and blur are
as there.  (Its scale factors call sqrt on floats: the double sqrt of plain C++, which gives CRF-RNN's constants;
a build whose headers declare float sqrt overloads globally rounds the bilateral lattice's fifth scale one
ulp lower.)  The GPU forward (modified_permutohedral.cu, Adams's GPU lattice) sums in other orders and reads
image n at n C H W, C the unary's channels: caffeq follows the CPU.
"""
import math

import numpy as np
import torch

from ..errors import ExportError
from .permutohedral import (
    LATTICE_BASICS,
    as_short,
    lattice_lookup,
    lattice_simplex,
    lattice_vertices,
    permutohedral_filter,
    pixel_xy,
)
from .permutohedral_onnx import OnnxLattice
from .registry import Layer, LayerError, legacy_nchw, need_blobs, register_layer

F32 = np.float32


def hybridnet_simplex(f):
    """The enclosing simplex of each of (P, d) float32 features as the fork's sequential init_cpu: (keys
    (P, d + 1, d) int64, each point's vertices as 16-bit shorts; weights (P, d + 1) float32)."""
    return lattice_simplex(f, double_first=True, ties_down=True)


def hybridnet_lattice(features):
    """The fork's lattice of (P, d) features, no padding: (slots (P, d + 1) int64, vertex rows 1..M; weights
    (P, d + 1) float32; neighbours (d + 1, 2, M) int64 rows along each axis, 0 where there is none)."""
    p, d = features.shape
    dev = features.device
    keys, weights = hybridnet_simplex(features.to(torch.float32))
    ids, columns, vertex_keys = lattice_vertices(keys)
    m = vertex_keys.shape[0]
    asked = []
    for j in range(d + 1):   # axis j: the key minus 1 but plus d at j, the key plus 1 but minus d at j
        axis = torch.zeros(d, dtype=torch.int64, device=dev)
        if j < d:
            axis[j] = d + 1
        asked.append(torch.cat([as_short(vertex_keys - 1 + axis), as_short(vertex_keys + 1 - axis)]))
    neighbours = torch.stack([(rows + 1).reshape(2, m) for rows in lattice_lookup(columns, asked)])
    return (ids + 1).reshape(p, d + 1), weights, neighbours


def hybridnet_filter(values, slots, weights, neighbours):
    """values (C, P) through the lattice as the fork's seqCompute: splat, blur along axes 0..d, slice with
    (weight x value) x alpha whatever C: (C, P)."""
    return permutohedral_filter(values, slots, weights, neighbours, sequential_only=True)


def dense_crf_meanfield(unary, q0, image, spatial_weight, bilateral_weight, compatibility, iterations: int,
                        theta_alpha: float, theta_beta: float, theta_gamma: float):
    """The fork's mean-field inference on (N, C, H, W) unaries from Q0 (N or more images of C x H x W values,
    the first N read); image (K, C', H', W'): image n's colours are the 3 H W values from its offset(n),
    n C' H' W', read flat (they may run into the next images).  float32 as the fork; the top takes U's dtype."""
    n, c, h, w = unary.shape
    pixels = h * w
    f32, dev = torch.float32, unary.device
    xy = pixel_xy(h, w, dev)
    ones = torch.ones(1, pixels, dtype=f32, device=dev)

    def theta(value):
        return torch.tensor(value, dtype=f32, device=dev)

    spatial = hybridnet_lattice(xy / theta(theta_gamma))
    spatial_norm = 1 / (hybridnet_filter(ones, *spatial) + 1e-20)
    ws, wb = spatial_weight.reshape(-1)[0].to(f32), bilateral_weight.reshape(-1)[0].to(f32)
    mu = compatibility.reshape(c, c).to(f32)
    flat, stride = image.reshape(-1), math.prod(image.shape[1:])
    tops = []
    for b in range(n):
        colours = flat[b * stride:b * stride + 3 * pixels].to(f32).reshape(3, pixels).t()
        features = torch.cat([xy / theta(theta_alpha), colours / theta(theta_beta)], 1)
        bilateral = hybridnet_lattice(features)
        bilateral_norm = 1 / (hybridnet_filter(ones, *bilateral) + 1e-20)
        start, q = unary[b].reshape(c, -1).to(f32), q0[b].reshape(c, -1).to(f32)
        for _ in range(iterations):
            prob = torch.softmax(q, 0)
            message = (ws * (spatial_norm * hybridnet_filter(prob, *spatial))
                       + wb * (bilateral_norm * hybridnet_filter(prob, *bilateral)))
            q = start - mu @ message
        tops.append(q.reshape(c, h, w))
    return torch.stack(tops).to(unary.dtype)


#: the functions model.py copies, in order (emit.helper each)
HYBRIDNET_HELPERS = (*LATTICE_BASICS, pixel_xy, hybridnet_simplex, hybridnet_lattice, permutohedral_filter,
                     hybridnet_filter, dense_crf_meanfield)


class HybridnetOnnxLattice(OnnxLattice):
    """OnnxLattice built and applied as the fork's sequential lattice (hybridnet_simplex, hybridnet_filter):
    features go to build() without the SSE padding."""

    sequential_slice = True

    def simplex(self, features, points, d, half_away=False, double_first=True, ties_down=True):
        return super().simplex(features, points, d, half_away, double_first, ties_down)


@register_layer("DenseCRFMeanfield")
class DenseCRFMeanfield(Layer):
    blob_names = ("spatial_weight", "bilateral_weight", "compatibility")

    def parse(self, lp):
        need_blobs(lp, "DenseCRFMeanfield", 3, 1, "unary, Q0, image")
        p = lp.dense_crf_meanfield_param
        if not 1 < p.num_iterations < 2 ** 31:   # the fork's int: past 2^31 - 1 it wraps negative
            raise LayerError(f"dense_crf_meanfield_param.num_iterations must be > 1 (the fork's CHECK, on an int), "
                             f"got {p.num_iterations}")
        weights = []
        for field in ("spatial_filter_weight", "bilateral_filter_weight"):
            value = float(F32(getattr(p, field)))
            if not value >= 0:
                raise LayerError(f"dense_crf_meanfield_param.{field} must be >= 0 (the fork's CHECK), got {value}")
            weights.append(value)
        return {"name": lp.name, "iterations": int(p.num_iterations), "theta_alpha": float(p.theta_alpha),
                "theta_beta": float(p.theta_beta), "theta_gamma": float(p.theta_gamma), "start_weights": weights}

    def infer(self, attrs, in_shapes):
        for i, what in enumerate(("unary (bottom 0)", "Q0 (bottom 1)")):
            if len(in_shapes[i]) < 2:   # LayerSetUp's softmaxes (of Q0, of Q shaped as U) take axis 1
                raise LayerError(f"DenseCRFMeanfield's {what} needs a channel axis (the fork's softmax over axis 1 "
                                 f"CHECKs it), got shape {list(in_shapes[i])}")
        return [legacy_nchw(in_shapes[0], "DenseCRFMeanfield's unary (bottom 0)")]

    def param_shapes(self, attrs, in_shapes):
        c = legacy_nchw(in_shapes[0], "DenseCRFMeanfield's unary (bottom 0)")[1]
        return [(1, 1, 1, 1), (1, 1, 1, 1), (1, 1, c, c)]

    def init_params(self, attrs, shapes, rng):
        """The fork's start: the two filter weights and the Potts compatibility -identity."""
        c = shapes[2][-1]
        spatial, bilateral = (np.full((1, 1, 1, 1), v, np.float32) for v in attrs["start_weights"])
        return [spatial, bilateral, -np.eye(c, dtype=np.float32).reshape(1, 1, c, c)]

    def cannot_run(self, attrs, in_shapes):
        unary, q0, image = (tuple(s) for s in in_shapes)
        n, c, h, w = legacy_nchw(unary, "DenseCRFMeanfield's unary (bottom 0)")
        if len(q0) < 2 or q0[0] < n or q0[1] != c or math.prod(q0[2:]) != h * w:
            return (f"Q0 {list(q0)} is not shaped as the unary {list(unary)} (N or more images, C, then H x W "
                    f"values): the fork's lattices read the unary's C x H x W values of each image from Q0's "
                    f"softmax over axis 1")
        if len(image) > 4:
            return f"the fork reads the image {list(image)} at offset(n) (at most 4 axes)"
        k, *rest = legacy_nchw(image, "DenseCRFMeanfield's image (bottom 2)")
        stride = math.prod(rest)
        if n and (n - 1) * stride + 3 * h * w > k * stride:
            return (f"the image {list(image)} does not hold 3 x {h} x {w} colour values from offset(n), n x "
                    f"{stride}, for each of the unary's {n} images (the fork would read past it)")
        return None

    def _call_args(self, attrs):
        return attrs["iterations"], attrs["theta_alpha"], attrs["theta_beta"], attrs["theta_gamma"]

    def forward(self, attrs, params, unary, q0, image):
        self.refuse_if_cannot_run(attrs["name"], attrs, [unary.shape, q0.shape, image.shape], LayerError)
        shape = legacy_nchw(unary.shape, "DenseCRFMeanfield")
        image = image.reshape(legacy_nchw(image.shape, "DenseCRFMeanfield"))
        q0 = q0.reshape(q0.shape[0], shape[1], shape[2] * shape[3])
        return dense_crf_meanfield(unary.reshape(shape), q0, image, *params, *self._call_args(attrs))

    def macs(self, attrs, in_shapes, out_shapes):
        n, c, h, w = out_shapes[0]
        return n * attrs["iterations"] * (c * c + 2 * 7 * c) * h * w

    def onnx(self, ctx, node):
        a = node.attrs
        shapes = [ctx.shape(t) for t in node.inputs]
        self.refuse_if_cannot_run(node.name, a, shapes, ExportError)
        n, c, h, w = legacy_nchw(shapes[0], "DenseCRFMeanfield")
        p = h * w
        xy = pixel_xy(h, w, "cpu").numpy()
        with torch.no_grad():
            spatial = hybridnet_lattice(torch.from_numpy(xy / F32(a["theta_gamma"])))
            spatial_norm = 1 / (hybridnet_filter(torch.ones(1, p), *spatial) + 1e-20)
        spatial = HybridnetOnnxLattice(ctx, "spatial").constant(*spatial)
        spatial_norm = ctx.const(spatial_norm.numpy().reshape(p, 1))
        ws, wb = (ctx.op("Reshape", [ctx.weight(node, i), ctx.i64([1, 1])], "w") for i in (0, 1))
        mu_t = ctx.op("Transpose", [ctx.op("Reshape", [ctx.weight(node, 2), ctx.i64([c, c])], "mu")], "mu_t")
        unary, q0, colours = (ctx.op("Reshape", [x, ctx.i64([-1])], "flat") for x in node.inputs)
        stride = math.prod(legacy_nchw(shapes[2], "DenseCRFMeanfield")[1:])   # the image's offset(1)

        def block(flat, start, rows, columns):   # rows x columns values of flat from start, as (columns, rows)
            one = ctx.op("Slice", [flat, ctx.i64([start]), ctx.i64([start + rows * columns]), ctx.i64([0])], "img")
            return ctx.op("Transpose", [ctx.op("Reshape", [one, ctx.i64([rows, columns])], "img")], "pc")

        ones = ctx.const(np.ones((p, 1), F32))
        tops = []
        for b in range(n):
            lattice = HybridnetOnnxLattice(ctx, f"bilateral{b}")
            features = ctx.op("Concat", [ctx.const(xy / F32(a["theta_alpha"])),
                                         ctx.op("Div", [block(colours, b * stride, 3, p), ctx.f32(a["theta_beta"])],
                                                "rgb")],
                              "features", axis=1)
            bilateral = lattice.build(features, p, 5)
            norm = ctx.op("Reciprocal", [ctx.op("Add", [lattice.filter(bilateral, ones, 1, 5), ctx.f32(1e-20)],
                                                "norm")], "norm")

            def message(x):
                near = ctx.op("Mul", [spatial_norm, lattice.filter(spatial, x, c, 2)], "spatial")
                alike = ctx.op("Mul", [norm, lattice.filter(bilateral, x, c, 5)], "bilateral")
                return ctx.op("Add", [ctx.op("Mul", [ws, near], "ms"), ctx.op("Mul", [wb, alike], "mb")], "message")

            start, z = block(unary, b * c * p, c, p), block(q0, b * c * p, c, p)
            for _ in range(a["iterations"]):
                prob = ctx.op("Softmax", [z], "prob", axis=1)
                z = ctx.op("Sub", [start, ctx.op("MatMul", [message(prob), mu_t], "pairwise")], "q")
            tops.append(ctx.op("Reshape", [ctx.op("Transpose", [z], "cp"), ctx.i64([1, c, h, w])], "top"))
        ctx.add_node("Concat", tops, [node.outputs[0]], axis=0)

    def pytorch_source(self, node, emit):
        shapes = [emit.in_shape(i) for i in range(3)]
        self.refuse_if_cannot_run(node.name, node.attrs, shapes, ExportError)
        shape = legacy_nchw(shapes[0], "DenseCRFMeanfield")
        m = emit.module("torch.nn.ParameterDict()")
        for i, (name, blob) in enumerate(zip(self.blob_names, self.param_shapes(node.attrs, shapes))):
            emit.init(f"{m}['{name}'] = torch.nn.Parameter(torch.zeros{blob})")
            emit.param(name, i)
        for helper in HYBRIDNET_HELPERS:
            fn = emit.helper(helper)
        weights = ", ".join(f"{m}['{name}']" for name in self.blob_names)
        args = ", ".join(emit.lit(v) for v in self._call_args(node.attrs))
        unary = f"{emit.inputs[0]}.reshape{shape}"
        q0 = f"{emit.inputs[1]}.reshape{shapes[1][0], shape[1], shape[2] * shape[3]}"
        image = f"{emit.inputs[2]}.reshape{legacy_nchw(shapes[2], 'DenseCRFMeanfield')}"
        return f"{fn}({unary}, {q0}, {image}, {weights}, {args})"


__all__ = ["DenseCRFMeanfield", "HybridnetOnnxLattice", "dense_crf_meanfield", "hybridnet_filter",
           "hybridnet_lattice", "hybridnet_simplex"]
