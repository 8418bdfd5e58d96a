"""maunzzz/caffe-crfgd (c0cbacb; Larsson et al., "Revisiting deep structured models for pixel-level
labeling with gradient-based inference"): its CRF layers, run as gradient steps over class
probabilities, and the per-pixel features they read.

- PixelFeature (pixel_feature_layer.cpp, Max Planck bilateralNN's): (N, C, H, W) -> position and colour
  features.  POSITION_AND_RGB: [pos_scale y + offset_h, pos_scale x + offset_w, color_scale x_c...]
  (N, 2 + C, H, W); RGB_AND_POSITION: the colours first; RGB: color_scale x; POSITION: the two
  position channels.  WARPED_POSITION (N, 3, H, W), per pixel (y, x), with the float32 angle
  a = -rotation_angle / 180 pi (in double, then float), its float cos and sin (taken correctly rounded;
  the fork's cosf / sinf), Y = y pos_scale - H div 2, X = x pos_scale - W div 2 (integer halves):
  [sin a X + cos a Y + H div 2, cos a X - sin a Y + W div 2, a / rotation_sigma], float32 steps as
  pixel_feature_layer.cpp (its .cu kernel the same formula).  RANDOM_POSITION, NUM_RANDOM_POSITION and
  RANDOM_ROTATE draw random numbers and are refused.
- CrfFilterbankEd (crf_filterbank_ed.cpp): bottoms Q0 (N, C, H, W) class probabilities and per-pixel
  filter weights (N, F, H, W); blobs the unary weight w (1, 1, 1, 1) and the filters (C, C F, k, k),
  whose memory is a bias-free k x k convolution with C F outputs, output c F + f (pad (k - 1) / 2).
  U = -w log(Q0 + log_eps); X = Q0; int(num_iterations) times: R = conv(X), D_c = sum_f feat_f R_{cF+f},
  G = D + U (U alone with skip_pw_term), t = sqrt(2 ln C / (it + 1)) / step_size_factor (double, then
  float), X = X exp(-t G) / sum_c X exp(-t G) (the exponent less its per-pixel maximum first, which
  changes nothing).  The top: X, (N, C, H, W) probabilities.
- CrfEd (crf_ed_layer.cpp) and CrfGrad (crf_grad_layer.cpp): bottoms Q0 (N, C, H, W) and lattice features
  (N, d, H, W) (PixelFeature's); blobs the unary weight (1, 1, 1, 1), a k x k spatial filter (C, C, k, k)
  and a lattice filter (C, C, 1, 2^(d+1) - 1).  Each step's gradient is conv(X) + PL(X) + U, PL the fork's
  internal Permutohedral layer (Max Planck bilateralNN's, permutohedral.cpp): per image, a lattice of the
  H W feature points (elevated, rounded with C's round(), ranked, barycentric weights as Adams et al.),
  each vertex's 2^(d+1) - 1 taps reached by one step along each direction whose bit is set, in increasing
  direction, through vertices that exist (a missing one: the tap reads 0); splat, the taps times the filter
  (C_out x C_in x taps), slice; normalized symmetrically by 1 / sqrt(the same filtering of ones with
  bilateralNN's Gaussian taps + 1e-20) before and after.  CrfEd then takes CrfFilterbankEd's entropic step
  (the step from num_classes); skip_pl_term leaves out PL, skip_conv_term the spatial term.  CrfGrad steps X - step_size G, then projects each pixel's C values onto the
  simplex with leak_factor below it (sorted, the first running mean (sum - 1) / ii that reaches the next
  value).  With calculate_energy the second top (N, 1, 1, T) holds, in its first T values, each step's
  sum over the blob of X (U + conv(X) + PL(X)) (the fork writes nothing else there).  ONNX
  (crfgd_onnx.py): the lattice built in the graph, the steps unrolled.
The torch functions below serve `forward` and are copied into model.py.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from .norm import onnx_reduce
from .permutohedral import LATTICE_BASICS, as_short, lattice_lookup, lattice_simplex, lattice_vertices
from .registry import Layer, LayerError, need_blobs, register_layer, torch_sources

# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------


def pixel_features(x, kind: str, pos_scale: float, color_scale: float, offset_h: float, offset_w: float):
    """PixelFeature's top for kind POSITION_AND_RGB, RGB_AND_POSITION, RGB or POSITION (float32 steps)."""
    n, _, h, w = x.shape
    f32 = torch.float32
    scale = torch.tensor(pos_scale, dtype=f32)
    rows = (torch.arange(h, dtype=f32) * scale + torch.tensor(offset_h, dtype=f32)).to(x.device, x.dtype)
    cols = (torch.arange(w, dtype=f32) * scale + torch.tensor(offset_w, dtype=f32)).to(x.device, x.dtype)
    position = torch.stack([rows[:, None].expand(h, w), cols[None, :].expand(h, w)])[None].expand(n, 2, h, w)
    if kind == "POSITION":
        return position.contiguous()
    colour = x * torch.tensor(color_scale, dtype=x.dtype, device=x.device)
    if kind == "RGB":
        return colour
    parts = [position, colour] if kind == "POSITION_AND_RGB" else [colour, position]
    return torch.cat(parts, 1)


def pixel_warped_position(x, pos_scale: float, angle: float, cos_angle: float, sin_angle: float,
                          rotation_sigma: float):
    """PixelFeature's WARPED_POSITION top (N, 3, H, W) for x (N, C, H, W), float32 steps: the positions
    rotated by the float32 angle (cos_angle, sin_angle its float cos and sin) about the integer halves of
    H and W, and angle / rotation_sigma."""
    n, _, h, w = x.shape
    f32 = torch.float32
    scale, cos_a, sin_a = (torch.tensor(v, dtype=f32) for v in (pos_scale, cos_angle, sin_angle))
    mid_y, mid_x = torch.tensor(float(h // 2), dtype=f32), torch.tensor(float(w // 2), dtype=f32)
    ys = (torch.arange(h, dtype=f32) * scale - mid_y)[:, None]
    xs = (torch.arange(w, dtype=f32) * scale - mid_x)[None, :]
    first = sin_a * xs + cos_a * ys + mid_y
    second = cos_a * xs - sin_a * ys + mid_x
    third = (torch.tensor(angle, dtype=f32) / torch.tensor(rotation_sigma, dtype=f32)).expand(h, w)
    return torch.stack([first, second, third])[None].expand(n, 3, h, w).to(x.device, x.dtype).contiguous()


def entropic_step_size(classes: int, it: int, step_size_factor: float):
    """crfgd's step at iteration it: sqrt(2 ln classes / (it + 1)) / step_size_factor in double, kept as float."""
    return float(torch.tensor(math.sqrt(2.0 * math.log(classes) / (it + 1)) / step_size_factor, dtype=torch.float32))


def entropic_step(x, g, step: float):
    """One exponentiated-gradient step of crfgd's EntropyDescentLayer: x exp(-step g), renormalized
    over the channels (the exponent less its per-pixel maximum first)."""
    e = g * torch.tensor(-step, dtype=g.dtype, device=g.device)
    e = torch.exp(e - e.amax(1, keepdim=True)) * x
    return e / e.sum(1, keepdim=True)


def crf_filterbank_ed(q, feats, unary_weight, filters, iterations: int, step_size_factor: float, log_eps: float,
                      skip_pw: bool = False):
    """CrfFilterbankEd's top: entropic descent from q (N, C, H, W) over a per-pixel weighted filter bank."""
    n, c, h, w = q.shape
    f = feats.shape[1]
    k = filters.shape[-1]
    bank = filters.reshape(c * f, c, k, k)   # the blob's memory read as the convolution's
    unary = -unary_weight.reshape(()) * torch.log(q + log_eps)
    x = q
    for it in range(iterations):
        g = unary
        if not skip_pw:
            response = F.conv2d(x, bank, padding=(k - 1) // 2).reshape(n, c, f, h, w)
            g = (response * feats[:, None]).sum(2) + unary
        x = entropic_step(x, g, entropic_step_size(c, it, step_size_factor))
    return x


class CrfFilterbankEd(nn.Module):
    """crf_filterbank_ed with its two blobs as parameters."""

    def __init__(self, classes, filters_per_class, kernel_size, iterations, step_size_factor, log_eps,
                 skip_pw=False):
        super().__init__()
        self.unary_weight = nn.Parameter(torch.zeros(1, 1, 1, 1))
        self.filters = nn.Parameter(torch.zeros(classes, classes * filters_per_class, kernel_size, kernel_size))
        self.iterations, self.step_size_factor, self.log_eps = iterations, step_size_factor, log_eps
        self.skip_pw = skip_pw

    def forward(self, q, feats):
        return crf_filterbank_ed(q, feats, self.unary_weight, self.filters, self.iterations, self.step_size_factor,
                                 self.log_eps, self.skip_pw)


def bnn_gauss_filter(d: int):
    """bilateralNN's GaussianFilter (neighbourhood 1): a [0.5, 1, 0.5] blur along each of the d + 1 lattice
    directions over the 2^(d+1) - 1 taps, float32, divided by its centre.  Tap t is the sum of the steps e_k
    for the k whose bit d - k is set in t (the lattice traversal's order)."""
    taps = 2 ** (d + 1) - 1
    points = {}
    for t in range(taps):
        c = [(t >> (d - k)) & 1 for k in range(d + 1)]
        points[tuple(c)] = t

    def find(c):   # a point is its step counts up to adding one step in every direction
        low = min(c)
        return points.get(tuple(v - low for v in c), taps)   # taps: the zero slot

    lattice = torch.zeros(taps + 1, dtype=torch.float32)
    lattice[0] = 1.0
    for k in range(d + 1):
        up, down = [], []
        for c in points:
            up.append(find([v + (j == k) for j, v in enumerate(c)]))
            down.append(find([v - (j == k) for j, v in enumerate(c)]))
        blurred = lattice[:taps] + (lattice[up] + lattice[down]) * 0.5
        lattice = torch.cat([blurred, lattice.new_zeros(1)])
    return lattice[:taps] / lattice[0]


def bnn_lattice(features):
    """bilateralNN's permutohedral lattice (Permutohedral::init) of (P, d) float32 features: slots (P, d + 1)
    int64, each point's vertices as rows 1..M; weights (P, d + 1) float32, their barycentric weights; taps
    (2^(d+1) - 1, M) int64, each vertex's filter taps as rows (0: none), tap 0 the vertex itself, tap t
    reached by a step along each direction k whose bit d - k is set in t, in increasing k, through
    vertices of the lattice (a missing one ends the walk: the tap reads 0)."""
    p, d = features.shape
    dev = features.device
    keys, weights = lattice_simplex(features.to(torch.float32), half_away=True, double_first=True)
    ids, columns, vertex_keys = lattice_vertices(keys)
    m = vertex_keys.shape[0]
    steps = []   # along direction k: every key coordinate less 1, coordinate k (k < d) plus d + 1
    for k in range(d + 1):
        axis = torch.zeros(d, dtype=torch.int64, device=dev)
        if k < d:
            axis[k] = d + 1
        steps.append(lattice_lookup(columns, [as_short(vertex_keys - 1 + axis)])[0])
    taps = []
    for t in range(2 ** (d + 1) - 1):
        walking = torch.arange(m, device=dev)
        for k in range(d + 1):
            if (t >> (d - k)) & 1:
                walking = torch.where(walking >= 0, steps[k][walking.clamp(min=0)], walking)
        taps.append(walking + 1)
    return (ids + 1).reshape(p, d + 1), weights, torch.stack(taps)


def bnn_filter(values, slots, weights, taps, filters):
    """bilateralNN's PermutohedralReverseCpu::compute: values (C, P) splatted onto the lattice, each vertex's
    taps times filters (O, C, T) summed, sliced back: (O, P)."""
    c, p = values.shape
    grid = values.new_zeros(taps.shape[1] + 1, c)
    grid.index_add_(0, slots.reshape(-1), (weights[:, :, None] * values.t()[:, None, :]).reshape(-1, c))
    blurred = grid.new_zeros(taps.shape[1] + 1, filters.shape[0])   # row 0: the slot of no vertex
    for t in range(taps.shape[0]):   # tap by tap: an (M, C) gather at a time, not (taps, M, C)
        blurred[1:] += grid[taps[t]] @ filters[:, :, t].t()
    out = None
    for j in range(slots.shape[1]):
        term = weights[:, j:j + 1] * blurred[slots[:, j]]
        out = term if out is None else out + term
    return out.t()


def bnn_lattices(feats):
    """Each image's lattice of its features (N, d, H, W) (bnn_lattice, built on the CPU) with its symmetric
    normalization, 1 / sqrt(the Gaussian taps' filtering of ones + 1e-20): [(slots, weights, taps, norm)]."""
    n, d, h, w = feats.shape
    gauss = bnn_gauss_filter(d).to(feats.device)[None, None, :]
    lattices = []
    for i in range(n):
        slots, weights, taps = (t.to(feats.device) for t in bnn_lattice(feats[i].reshape(d, h * w).t().float().cpu()))
        ones = feats.new_ones(1, h * w, dtype=torch.float32)
        norm = (1.0 / torch.sqrt(bnn_filter(ones, slots, weights, taps, gauss).double() + 1e-20)).float()
        lattices.append((slots, weights, taps, norm))
    return lattices


def bnn_lattice_filter(x, lattices, filters):
    """crfgd's internal Permutohedral layer (neighbourhood 1, symmetric normalization, the filters as they
    are): each image's values x (C, H, W) filtered over its lattice (bnn_lattices)."""
    n, c, h, w = x.shape
    outs = []
    for i, (slots, weights, taps, norm) in enumerate(lattices):
        norm = norm.to(x.dtype)
        y = bnn_filter(x[i].reshape(c, h * w) * norm, slots, weights, taps, filters.reshape(filters.shape[0], c, -1))
        outs.append((y * norm).reshape(-1, h, w))
    return torch.stack(outs)


def simplex_leaky_projection(x, leak: float):
    """crfgd's ProjectBlobSimplex_ over the channels of (N, C, H, W): t from the largest values' running sums
    ((sum - 1) / ii at the first ii where it reaches the next value, else over all C), then v - t where
    positive, leak (v - t) elsewhere."""
    c = x.shape[1]
    ranked = torch.sort(x, 1, descending=True).values
    sums = torch.cumsum(ranked, 1)
    count = torch.arange(1, c + 1, dtype=x.dtype, device=x.device).reshape(1, c, 1, 1)
    t_all = (sums - 1) / count
    hit = t_all[:, :c - 1] >= ranked[:, 1:]
    first = torch.where(hit.any(1, keepdim=True), hit.to(torch.int64).argmax(1, keepdim=True), c - 1)
    t = torch.gather(t_all, 1, first)
    shifted = x - t
    return torch.where(shifted > 0, shifted, shifted * leak)


def crf_descent(q, feats, unary_weight, spatial, lattice, iterations: int, log_eps: float, num_classes: int,
                step_size_factor: float = 1.0, projected: bool = False, step_size: float = 0.0, leak: float = 0.0,
                skip_conv: bool = False, skip_pl: bool = False, energy: bool = False):
    """CrfEd (entropic steps of entropic_step_size) or, projected, CrfGrad (a gradient step of step_size, then
    the leaky simplex projection) from q (N, C, H, W) and the lattice features feats (N, d, H, W) -> (the
    state, with energy the energies (iterations,) summed over the blob before each step, else [])."""
    k = spatial.shape[-1]
    unary = (q + log_eps).log() * (-unary_weight.reshape(()))
    x = q
    energies = []
    lattices = None if skip_pl else bnn_lattices(feats)   # the fork builds them once a call, on its first step
    for it in range(iterations):
        conv = None if skip_conv else F.conv2d(x, spatial, padding=(k - 1) // 2)
        pl = None if skip_pl else bnn_lattice_filter(x, lattices, lattice)
        if energy:
            energies.append(((x * conv + x * unary) + x * pl).double().sum())
        pairwise = conv if pl is None else pl if conv is None else conv + pl
        g = unary if pairwise is None else pairwise + unary
        if projected:
            x = simplex_leaky_projection(x + g * (-step_size), leak)
        else:
            x = entropic_step(x, g, entropic_step_size(num_classes, it, step_size_factor))
    return x, energies


TORCH_CRF_FILTERBANK_ED = torch_sources(entropic_step_size, entropic_step, crf_filterbank_ed, CrfFilterbankEd)


class CrfDescent(nn.Module):
    """crf_descent with its three blobs as parameters; with energy, also the (N, 1, 1, T) energy top
    (the fork writes the T sums into its first row)."""

    def __init__(self, iterations, log_eps, num_classes, step_size_factor=1.0, projected=False, step_size=0.0, leak=0.0,
                 skip_conv=False, skip_pl=False, spatial_shape=(1, 1, 1, 1), lattice_shape=(1, 1, 1, 1), energy=False):
        super().__init__()
        self.unary_weight = nn.Parameter(torch.zeros(1, 1, 1, 1))
        self.spatial_filter = nn.Parameter(torch.zeros(spatial_shape))
        self.lattice_filter = nn.Parameter(torch.zeros(lattice_shape))
        self.settings = dict(iterations=iterations, log_eps=log_eps, num_classes=num_classes,
                             step_size_factor=step_size_factor, projected=projected, step_size=step_size, leak=leak,
                             skip_conv=skip_conv, skip_pl=skip_pl, energy=energy)
        self.energy = energy

    def run(self, q, feats, unary_weight, spatial, lattice):
        x, energies = crf_descent(q, feats, unary_weight, spatial, lattice, **self.settings)
        if not self.energy:
            return x
        top = x.new_zeros(q.shape[0], 1, 1, self.settings["iterations"])
        top.view(-1)[:len(energies)] = torch.stack(energies).to(x.dtype)
        return x, top

    def forward(self, q, feats):
        return self.run(q, feats, self.unary_weight, self.spatial_filter, self.lattice_filter)


TORCH_CRF_DESCENT = torch_sources(bnn_gauss_filter, bnn_lattice, bnn_filter, bnn_lattices, bnn_lattice_filter,
                                  simplex_leaky_projection, entropic_step_size, entropic_step, crf_descent, CrfDescent)


# ---- specs ---------------------------------------------------------------------------------------


@register_layer("PixelFeature")
class PixelFeature(Layer):
    RUNS = ("POSITION", "POSITION_AND_RGB", "RGB_AND_POSITION", "RGB", "WARPED_POSITION")

    def parse(self, lp):
        need_blobs(lp, "PixelFeature", 1, 1)
        p = lp.pixel_feature_param
        kind = p.Feature.Name(p.type)
        if kind not in self.RUNS:
            raise LayerError(f"pixel_feature_param.type {kind} draws random positions; caffeq runs "
                             f"{', '.join(self.RUNS)}")
        attrs = {"kind": kind, "pos_scale": float(p.pos_scale), "color_scale": float(p.color_scale),
                 "offset_h": float(p.offset_h), "offset_w": float(p.offset_w)}
        if kind == "WARPED_POSITION":
            # the fork: Dtype angle = -rotation_angle / 180.0 * M_PI (double steps), std::cos / std::sin of it
            angle = float(torch.tensor(-float(p.rotation_angle) / 180.0 * math.pi, dtype=torch.float32))
            trig = [float(torch.tensor(f(angle), dtype=torch.float32)) for f in (math.cos, math.sin)]
            attrs["warp"] = (angle, *trig, float(p.rotation_sigma))
        return attrs

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        if len(s) != 4:
            raise LayerError(f"PixelFeature needs an (N, C, H, W) bottom, got {list(s)}")
        channels = {"POSITION": 2, "RGB": s[1], "WARPED_POSITION": 3}.get(attrs["kind"], 2 + s[1])
        return [(s[0], channels, s[2], s[3])]

    def _args(self, attrs):
        return (attrs["kind"], attrs["pos_scale"], attrs["color_scale"], attrs["offset_h"], attrs["offset_w"])

    def forward(self, attrs, params, x):
        if attrs["kind"] == "WARPED_POSITION":
            return pixel_warped_position(x, attrs["pos_scale"], *attrs["warp"])
        return pixel_features(x, *self._args(attrs))

    def pytorch_source(self, node, emit):
        if node.attrs["kind"] == "WARPED_POSITION":
            args = ", ".join(emit.lit(v) for v in (node.attrs["pos_scale"], *node.attrs["warp"]))
            return f"{emit.helper(pixel_warped_position)}({emit.inputs[0]}, {args})"
        args = ", ".join(emit.lit(v) for v in self._args(node.attrs))
        return f"{emit.helper(pixel_features)}({emit.inputs[0]}, {args})"

    def onnx(self, ctx, node):
        # the position channels are constants of the exported size; the colours a Mul
        a = node.attrs
        n, c, h, w = ctx.shape(node.inputs[0])
        zeros = torch.zeros((n, c, h, w))
        if a["kind"] == "WARPED_POSITION":   # depends on the bottom's shape only
            warped = pixel_warped_position(zeros, a["pos_scale"], *a["warp"]).numpy()
            ctx.add_node("Identity", [ctx.const(warped, node.name + "_warped")], [node.outputs[0]], name=node.name)
            return
        position = pixel_features(zeros, "POSITION", a["pos_scale"], 1.0, a["offset_h"], a["offset_w"]).numpy()
        if a["kind"] == "POSITION":
            ctx.add_node("Identity", [ctx.const(position, node.name + "_position")], [node.outputs[0]], name=node.name)
            return
        colour = ctx.op("Mul", [node.inputs[0], ctx.f32(a["color_scale"])], "colour")
        if a["kind"] == "RGB":
            ctx.add_node("Identity", [colour], [node.outputs[0]], name=node.name)
            return
        pos = ctx.const(position, node.name + "_position")
        parts = [pos, colour] if a["kind"] == "POSITION_AND_RGB" else [colour, pos]
        ctx.add_node("Concat", parts, [node.outputs[0]], name=node.name, axis=1)


def _crf_shapes(kind, in_shapes, classes=None):
    """Q0 (N, C, H, W) and the per-pixel second bottom (N, d, H, W) of a crfgd CRF layer."""
    q, feats = (tuple(s) for s in in_shapes[:2])
    if len(q) != 4 or len(feats) != 4 or q[0] != feats[0] or q[2:] != feats[2:]:
        raise LayerError(f"{kind}: bottoms must be (N, C, H, W) probabilities and (N, d, H, W) per-pixel "
                         f"features of the same N, H, W, got {list(q)} and {list(feats)}")
    if classes is not None and classes != q[1]:
        raise LayerError(f"{kind}: num_classes {classes} but the probabilities have {q[1]} channels")
    return q, feats


def _iterations(value, field):
    if value < 1:
        raise LayerError(f"{field} must be >= 1, got {value}")
    return int(value)   # the fork stores the float into an int


@register_layer("CrfFilterbankEd")
class CrfFilterbankEdLayer(Layer):
    blob_names = ("unary_weight", "filters")

    def parse(self, lp):
        need_blobs(lp, "CrfFilterbankEd", 2, 1, "probabilities, per-pixel filter weights")
        p = lp.crffilterbanked_param
        if p.kernel_size % 2 == 0:
            raise LayerError(f"crffilterbanked_param.kernel_size must be odd (padding (k - 1) / 2 keeps the size), "
                             f"got {p.kernel_size}")
        if p.step_size_factor == 0:
            raise LayerError("crffilterbanked_param.step_size_factor must not be 0")
        return {"iterations": _iterations(p.num_iterations, "crffilterbanked_param.num_iterations"),
                "kernel_size": int(p.kernel_size), "step_size_factor": float(p.step_size_factor),
                "log_eps": float(p.log_eps), "skip_pw": bool(p.skip_pw_term)}

    def infer(self, attrs, in_shapes):
        q, feats = _crf_shapes("CrfFilterbankEd", in_shapes)
        attrs["classes"], attrs["filters_per_class"] = q[1], feats[1]
        return [q]

    def param_shapes(self, attrs, in_shapes):
        c, f, k = attrs["classes"], attrs["filters_per_class"], attrs["kernel_size"]
        return [(1, 1, 1, 1), (c, c * f, k, k)]

    def forward(self, attrs, params, q, feats):
        return crf_filterbank_ed(q, feats, params[0], params[1], attrs["iterations"], attrs["step_size_factor"],
                                 attrs["log_eps"], attrs["skip_pw"])

    def macs(self, attrs, in_shapes, out_shapes):
        n, c, h, w = in_shapes[0]
        return attrs["iterations"] * n * h * w * c * c * attrs["filters_per_class"] * attrs["kernel_size"] ** 2

    def onnx(self, ctx, node):
        # the iterations unrolled: Conv, the per-pixel weighted sum, the entropic step, as forward
        from .crfgd_onnx import onnx_entropic_step
        a = node.attrs
        q, feats = node.inputs
        n, c, h, w = ctx.shape(q)
        f, k = a["filters_per_class"], a["kernel_size"]
        bank = ctx.op("Reshape", [ctx.weight(node, 1), ctx.i64([c * f, c, k, k])], "bank")
        weight = ctx.op("Reshape", [ctx.weight(node, 0), ctx.i64([])], "unary_weight")
        logs = ctx.op("Log", [ctx.op("Add", [q, ctx.f32(a["log_eps"])], "q_eps")], "log_q")
        unary = ctx.op("Neg", [ctx.op("Mul", [weight, logs], "wlog")], "unary")
        feats5 = ctx.op("Unsqueeze", [feats, ctx.i64([1])], "feats5")
        x = q
        for it in range(a["iterations"]):
            g = unary
            if not a["skip_pw"]:
                pad = (k - 1) // 2
                response = ctx.op("Conv", [x, bank], f"conv{it}", pads=[pad] * 4, kernel_shape=[k, k])
                response = ctx.op("Reshape", [response, ctx.i64([n, c, f, h, w])], f"response{it}")
                pairwise = onnx_reduce(ctx, "ReduceSum", ctx.op("Mul", [response, feats5], f"weighted{it}"), [2], False)
                g = ctx.op("Add", [pairwise, unary], f"g{it}")
            out = node.outputs[0] if it == a["iterations"] - 1 else None
            x = onnx_entropic_step(ctx, x, g, entropic_step_size(c, it, a["step_size_factor"]), f"ed{it}", out)

    def pytorch_source(self, node, emit):
        a = node.attrs
        args = [a["classes"], a["filters_per_class"], a["kernel_size"], a["iterations"],
                emit.lit(a["step_size_factor"]), emit.lit(a["log_eps"])]
        if a["skip_pw"]:
            args.append("skip_pw=True")
        m = emit.module(f"{emit.helper(TORCH_CRF_FILTERBANK_ED)}({', '.join(str(v) for v in args)})")
        emit.param("unary_weight", 0)
        emit.param("filters", 1)
        return f"{m}({emit.inputs[0]}, {emit.inputs[1]})"


class _LatticeCrf(Layer):
    """CrfEd and CrfGrad: crf_descent with their three blobs (unary weight, spatial filters, lattice filters)."""
    blob_names = ("unary_weight", "spatial_filter", "lattice_filter")
    field = ""

    def parse(self, lp):
        kind = self.types[0]
        need_blobs(lp, kind, 2, (1, 2), "probabilities, lattice features")
        p = getattr(lp, self.field)
        if p.kernel_size % 2 == 0:
            raise LayerError(f"{self.field}.kernel_size must be odd, got {p.kernel_size}")
        if len(lp.top) == 2 and not p.calculate_energy:
            raise LayerError(f"{kind}: a second top (the energies) needs {self.field}.calculate_energy: true")
        return {"classes": int(p.num_classes), "kernel_size": int(p.kernel_size), "tops": len(lp.top),
                "iterations": _iterations(p.num_iterations, f"{self.field}.num_iterations"),
                "log_eps": float(p.log_eps)}

    def infer(self, attrs, in_shapes):
        q, feats = _crf_shapes(self.types[0], in_shapes, attrs["classes"])
        attrs["feature_dims"] = feats[1]
        shapes = [q]
        if attrs["tops"] == 2:
            shapes.append((q[0], 1, 1, attrs["iterations"]))
        return shapes

    def param_shapes(self, attrs, in_shapes):
        c, k = attrs["classes"], attrs["kernel_size"]
        return [(1, 1, 1, 1), (c, c, k, k), (c, c, 1, 2 ** (attrs["feature_dims"] + 1) - 1)]

    @staticmethod
    def settings(attrs):
        keys = ("iterations", "log_eps", "step_size_factor", "projected", "step_size", "leak", "skip_conv", "skip_pl")
        return {"num_classes": attrs["classes"], **{key: attrs[key] for key in keys}}

    def forward(self, attrs, params, q, feats):
        module = CrfDescent(**self.settings(attrs), energy=attrs["tops"] == 2)
        return module.run(q, feats, *params)

    def macs(self, attrs, in_shapes, out_shapes):
        n, c, h, w = in_shapes[0]
        per_step = c * c * (attrs["kernel_size"] ** 2 + 2 ** (attrs["feature_dims"] + 1) - 1)
        return attrs["iterations"] * n * h * w * per_step

    def onnx(self, ctx, node):
        from .crfgd_onnx import emit_crf_descent
        emit_crf_descent(ctx, node)

    def pytorch_source(self, node, emit):
        a = node.attrs
        c, k = a["classes"], a["kernel_size"]
        shapes = {"spatial_shape": (c, c, k, k), "lattice_shape": (c, c, 1, 2 ** (a["feature_dims"] + 1) - 1)}
        args = ", ".join(f"{key}={emit.lit(v)}" for key, v in {**self.settings(a), **shapes}.items())
        energy = ", energy=True" if a["tops"] == 2 else ""
        emit.note(f"{node.name} ({node.type}): its lattice is built from the features on every call.")
        for helper in LATTICE_BASICS:
            emit.helper(helper)
        m = emit.module(f"{emit.helper(TORCH_CRF_DESCENT)}({args}{energy})")
        emit.param("unary_weight", 0)
        emit.param("spatial_filter", 1)
        emit.param("lattice_filter", 2)
        return f"{m}({emit.inputs[0]}, {emit.inputs[1]})"


@register_layer("CrfEd")
class CrfEd(_LatticeCrf):
    field = "crfed_param"

    def parse(self, lp):
        attrs = super().parse(lp)
        p = lp.crfed_param
        if p.step_size_factor == 0:
            raise LayerError("crfed_param.step_size_factor must not be 0")
        if len(lp.top) == 2 and (p.skip_pl_term or p.skip_conv_term):
            raise LayerError("crfed_param.calculate_energy with skip_pl_term or skip_conv_term is not supported (the "
                             "fork sums a stale blob there)")
        return {**attrs, "step_size_factor": float(p.step_size_factor), "projected": False, "step_size": 0.0,
                "leak": 0.0, "skip_conv": bool(p.skip_conv_term), "skip_pl": bool(p.skip_pl_term)}


@register_layer("CrfGrad")
class CrfGrad(_LatticeCrf):
    field = "crfgrad_param"

    def parse(self, lp):
        attrs = super().parse(lp)
        p = lp.crfgrad_param
        if p.step_size == 0:
            raise LayerError("crfgrad_param.step_size must not be 0")
        return {**attrs, "step_size_factor": 1.0, "projected": True, "step_size": float(p.step_size),
                "leak": float(p.leak_factor), "skip_conv": False, "skip_pl": False}
