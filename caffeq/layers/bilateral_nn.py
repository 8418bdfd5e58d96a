"""MPI-IS/bilateralNN (e174e4e; Jampani, Kiefel and Gehler, "Learning Sparse High Dimensional Filters",
CVPR 2016): its Permutohedral layer, a learned filter over the permutohedral lattice of per-pixel features.
Sources: bilateralnn_code/src/caffe/proto/caffe.proto (PermutohedralParameter), src/caffe/layers/
permutohedral_layer.cpp/.cu, src/caffe/util/permutohedral.cpp/.cu, include/caffe/util/permutohedral.hpp.
Its PixelFeature layer is caffeq/layers/crfgd.py's (caffe-crfgd carries the same file).

Permutohedral: bottoms data (N, C, H, W), input features (N, d, H, W), output features (N, d, Ho, Wo) and
optionally a lattice (another Permutohedral's second top); tops (N, num_output, Ho, Wo) and optionally the
lattice.  Blobs: the filter (num_output, C / group, 1, T), T = (s + 1)^(d+1) - s^(d+1) for
neighborhood_size s, and with bias_term the bias (1, 1, 1, num_output).  Per image (Forward_cpu):
- the lattice (Permutohedral::init) of the H W input points followed by the Ho Wo output points: each
  point elevated, rounded with C's round(), ranked, its d + 1 vertices and barycentric weights as Adams et
  al. (permutohedral.py's lattice_simplex with half_away and double_first; visualize_lattice: weights 1);
- each vertex's T taps in the traversal order (LatticeApproximateTraversal): the step counts (i_0..i_d),
  each in 0..s and at least one 0, in lexicographic order, tap 0 the vertex itself; the tap walks i_0
  steps along direction 0, then i_1 along direction 1, ..., a step along k taking every key coordinate
  less 1 and coordinate k (k < d) plus d + 1, through vertices of the lattice only (a missing one ends
  the walk: the tap reads 0);
- the Gaussian taps (GaussianFilter): a delta at the centre blurred by [0.5, 1, 0.5] along each
  direction in turn over the T tap points only (others read 0), float32, divided by the centre;
- the normalization, filtering ones through the Gaussian taps: AFTER: norm_back = 1 / (ones splatted
  from the input points, sliced at the output points + 1e-20), norm_there = 1; SYMMETRIC:
  norm_there = 1 / sqrt(input -> input + 1e-20), norm_back = 1 / sqrt(output -> output + 1e-20) (double,
  stored as float);
- the filter offset: FULL adds the Gaussian taps to every (output, input channel) filter, DIAG only to
  filter (o, o), NONE none;
- top = slice(blur(splat(data norm_there))) norm_back + bias: splat sums weight x value at each vertex
  over the input points, blur gives output o of group g the sum over the group's channels c and the taps
  t of filter[o, c, t] x splatted[c, tap t], slice sums each output point's vertices' values x weight.
  do_skip_blur: no blur (needs num_output == C), the splatted values sliced as they are.
With a lattice bottom the layer takes the other layer's lattice and both its normalizations (its own
norm_type and feature bottoms are then unused).  The fork passes pointers in that blob (N, 3, 1, 8);
here the lattice top is (N, d + 1, 1, H W + Ho Wo): the producer's features (input points, then
output points) and, in channel d, its norm_there then norm_back, from which the consumer rebuilds the
same lattice.  The consumer's neighborhood_size and visualize_lattice are used for the taps and
weights (the fork's blob would carry the producer's; nets give both the same).  repeated_init false
keeps, in the fork, the lattice of the first forward pass for later ones; caffeq computes every pass as
a first one.  The GPU path (.cu) computes the same values (its splat adds with atomics, in no fixed
order).  ONNX: refused.  The fork's GaussPermutohedral (gauss_permutohedral.cpp) is not registered.
"""
import torch
from torch import nn

from .permutohedral import LATTICE_BASICS, as_short, lattice_lookup, lattice_simplex, lattice_vertices
from .registry import Layer, LayerError, need_blobs, positive_field, register_layer

# ---- torch: used by forward and copied into model.py (inspect.getsource) ---------------


def bnn_tap_steps(d: int, s: int):
    """The step counts (i_0..i_d) of the T taps, each in 0..s and at least one 0, in the order of
    bilateralNN's lattice traversal (lexicographic), the centre first."""
    counts = [()]
    for _ in range(d + 1):
        counts = [c + (i,) for c in counts for i in range(s + 1)]
    return [c for c in counts if min(c) == 0]


def bnn_gauss_taps(d: int, s: int):
    """bilateralNN's GaussianFilter: the T taps of a delta blurred by [0.5, 1, 0.5] along each direction
    in turn over the tap points only, float32, divided by the centre."""
    steps = bnn_tap_steps(d, s)
    index = {c: t for t, c in enumerate(steps)}
    taps = len(steps)

    def find(c):   # a point is its step counts up to a step along every direction
        low = min(c)
        return index.get(tuple(v - low for v in c), taps)   # taps: the zero slot

    lattice = torch.zeros(taps + 1, dtype=torch.float32)
    lattice[0] = 1.0
    for k in range(d + 1):
        up = [find([v + (j == k) for j, v in enumerate(c)]) for c in steps]
        down = [find([v - (j == k) for j, v in enumerate(c)]) for c in steps]
        blurred = lattice[:taps] * 1.0 + (lattice[up] + lattice[down]) * 0.5
        lattice = torch.cat([blurred, lattice.new_zeros(1)])
    return lattice[:taps] / lattice[0]


def bnn_build_lattice(features, s: int, visualize: bool):
    """The lattices of B images' points (B, P, d) float32, each its own: (slots (B P, d + 1) int64, each
    point's vertices as rows 1..M; weights (B P, d + 1) float32; taps (T, M) int64, each vertex's taps as
    rows, 0 where the walk meets a missing vertex)."""
    b, p, d = features.shape
    dev = features.device
    keys, weights = lattice_simplex(features.reshape(b * p, d).to(torch.float32), half_away=True, double_first=True)
    if visualize:
        weights = torch.ones_like(weights)
    image = torch.arange(b, device=dev).repeat_interleave(p)[:, None, None].expand(b * p, d + 1, 1)
    ids, columns, vertex_keys = lattice_vertices(torch.cat([image, keys], 2))
    m = vertex_keys.shape[0]
    steps = []   # along direction k: every key coordinate less 1, coordinate k (k < d) plus d + 1
    for k in range(d + 1):
        axis = torch.zeros(d, dtype=torch.int64, device=dev)
        if k < d:
            axis[k] = d + 1
        moved = torch.cat([vertex_keys[:, :1], as_short(vertex_keys[:, 1:] - 1 + axis)], 1)
        steps.append(lattice_lookup(columns, [moved])[0])
    taps = []
    for counts in bnn_tap_steps(d, s):
        walking = torch.arange(m, device=dev)
        for k, count in enumerate(counts):
            for _ in range(count):
                walking = torch.where(walking >= 0, steps[k][walking.clamp(min=0)], walking)
        taps.append(walking + 1)
    return (ids + 1).reshape(b * p, d + 1), weights, torch.stack(taps)


def bnn_lattice_compute(values, in_slots, in_weights, out_slots, out_weights, taps, filters, group: int,
                        skip_blur: bool):
    """PermutohedralReverseCpu::compute: values (C, Pin) splatted at the input points, blurred through the
    taps with filters (O, C / group, T) group by group (skip_blur: as they are), sliced at the output
    points: (O, Pout)."""
    c = values.shape[0]
    grid = values.new_zeros(taps.shape[1] + 1, c)   # row 0: the slot of no vertex
    grid.index_add_(0, in_slots.reshape(-1), (in_weights[:, :, None] * values.t()[:, None, :]).reshape(-1, c))
    if skip_blur:
        blurred = grid
    else:
        o = filters.shape[0]
        cg, og = c // group, o // group
        blurred = grid.new_zeros(grid.shape[0], o)
        for g in range(group):
            for t in range(taps.shape[0]):
                blurred[1:, g * og:(g + 1) * og] += grid[taps[t], g * cg:(g + 1) * cg] @ filters[g * og:(g + 1) * og, :, t].t()
    out = None
    for j in range(out_slots.shape[1]):
        term = out_weights[:, j:j + 1] * blurred[out_slots[:, j]]
        out = term if out is None else out + term
    return out.t()


def bnn_permutohedral(x, in_feats, out_feats, lattice, weight, bias, s: int, group: int, norm_type: str,
                      offset_type: str, skip_blur: bool, visualize: bool, with_lattice: bool):
    """bilateralNN's Permutohedral layer (Forward_cpu) on data x (N, C, H, W), features (N, d, H, W) and
    (N, d, Ho, Wo) or the lattice (N, d + 1, 1, H W + Ho Wo) of another such layer: the top (N, O, Ho, Wo),
    and with with_lattice the lattice blob as well."""
    n, c, h, w = x.shape
    d = in_feats.shape[1]
    ho, wo = out_feats.shape[2:]
    p_in, p_out = h * w, ho * wo
    chunk = max(1, (1 << 19) // (p_in + p_out))   # images per lattice build: bounded memory
    if n > chunk:
        parts = [bnn_permutohedral(x[i:i + chunk], in_feats[i:i + chunk], out_feats[i:i + chunk],
                                   None if lattice is None else lattice[i:i + chunk], weight, bias, s, group,
                                   norm_type, offset_type, skip_blur, visualize, with_lattice)
                 for i in range(0, n, chunk)]
        if not with_lattice:
            return torch.cat(parts)
        return torch.cat([q[0] for q in parts]), torch.cat([q[1] for q in parts])
    gauss = bnn_gauss_taps(d, s).to(x.device)
    if lattice is None:
        points = torch.cat([in_feats.reshape(n, d, p_in), out_feats.reshape(n, d, p_out)], 2).to(torch.float32)
    else:
        points = lattice[:, :d].reshape(n, d, p_in + p_out).to(torch.float32)
    slots, weights, taps = bnn_build_lattice(points.transpose(1, 2), s, visualize)
    slots, weights = slots.reshape(n, p_in + p_out, d + 1), weights.reshape(n, p_in + p_out, d + 1)
    in_slots, in_weights = slots[:, :p_in].reshape(-1, d + 1), weights[:, :p_in].reshape(-1, d + 1)
    out_slots, out_weights = slots[:, p_in:].reshape(-1, d + 1), weights[:, p_in:].reshape(-1, d + 1)
    if lattice is not None:
        norms = lattice[:, d].reshape(n, p_in + p_out).to(torch.float32)
        there, back = norms[:, :p_in], norms[:, p_in:]
    else:
        gauss_filter = gauss.reshape(1, 1, -1)
        if norm_type == "AFTER":
            ones = x.new_ones(1, n * p_in, dtype=torch.float32)
            smooth = bnn_lattice_compute(ones, in_slots, in_weights, out_slots, out_weights, taps, gauss_filter, 1, False)
            back = (1.0 / (smooth.double() + 1e-20)).float().reshape(n, p_out)
            there = torch.ones(n, p_in, dtype=torch.float32, device=x.device)
        else:
            ones = x.new_ones(1, n * p_in, dtype=torch.float32)
            smooth = bnn_lattice_compute(ones, in_slots, in_weights, in_slots, in_weights, taps, gauss_filter, 1, False)
            there = (1.0 / torch.sqrt(smooth.double() + 1e-20)).float().reshape(n, p_in)
            ones = x.new_ones(1, n * p_out, dtype=torch.float32)
            smooth = bnn_lattice_compute(ones, out_slots, out_weights, out_slots, out_weights, taps, gauss_filter, 1,
                                         False)
            back = (1.0 / torch.sqrt(smooth.double() + 1e-20)).float().reshape(n, p_out)
    filters = weight.reshape(weight.shape[0], weight.shape[1], -1)
    if offset_type == "FULL":
        filters = filters + gauss
    elif offset_type == "DIAG":
        eye = torch.eye(filters.shape[0], filters.shape[1], dtype=torch.bool, device=x.device)
        filters = torch.where(eye[:, :, None], filters + gauss, filters)
    values = (x.reshape(n, c, p_in) * there[:, None, :].to(x.dtype)).transpose(0, 1).reshape(c, n * p_in)
    y = bnn_lattice_compute(values, in_slots, in_weights, out_slots, out_weights, taps, filters.to(x.dtype), group,
                            skip_blur)
    y = y.reshape(-1, n, p_out).transpose(0, 1) * back[:, None, :].to(x.dtype)
    if bias is not None:
        y = y + bias.reshape(1, -1, 1).to(x.dtype)
    top = y.reshape(n, -1, ho, wo)
    if not with_lattice:
        return top
    if lattice is None:
        norms = torch.cat([there, back], 1)
        lattice = torch.cat([points, norms[:, None, :]], 1).reshape(n, d + 1, 1, p_in + p_out).to(x.dtype)
    return top, lattice


class BnnPermutohedral(nn.Module):
    """bilateralNN's Permutohedral layer with its filter (O, C / group, 1, T) and bias (1, 1, 1, O)."""

    def __init__(self, weight_shape, bias: bool, s: int, group: int, norm_type: str, offset_type: str,
                 skip_blur: bool, visualize: bool, with_lattice: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(weight_shape))
        self.bias = nn.Parameter(torch.zeros(1, 1, 1, weight_shape[0])) if bias else None
        self.s, self.group, self.norm_type, self.offset_type = s, group, norm_type, offset_type
        self.skip_blur, self.visualize, self.with_lattice = skip_blur, visualize, with_lattice

    def forward(self, x, in_feats, out_feats, lattice=None):
        return bnn_permutohedral(x, in_feats, out_feats, lattice, self.weight, self.bias, self.s, self.group,
                                 self.norm_type, self.offset_type, self.skip_blur, self.visualize, self.with_lattice)


_NEEDS = LATTICE_BASICS + (bnn_tap_steps, bnn_gauss_taps, bnn_build_lattice, bnn_lattice_compute, bnn_permutohedral)


def bnn_filter_size(s: int, d: int):
    """permutohedral::get_filter_size: (s + 1)^(d + 1) - s^(d + 1)."""
    return (s + 1) ** (d + 1) - s ** (d + 1)


@register_layer("Permutohedral")
class Permutohedral(Layer):
    blob_names = ("filter", "bias")
    weight_axes = {0: 0, 1: 3}
    onnx_refusal = ("bilateralNN's Permutohedral builds a data-dependent lattice with a learned multi-step "
                    "neighbourhood; caffeq runs it in torch and model.py only")

    def parse(self, lp):
        need_blobs(lp, "Permutohedral", (3, 4), (1, 2), "data, input features, output features[, lattice]")
        p = lp.permutohedral_param
        group = positive_field(p.group, "permutohedral_param.group")
        num_output = positive_field(p.num_output, "permutohedral_param.num_output")
        if num_output % group:
            raise LayerError(f"permutohedral_param.num_output {num_output} is not divisible by group {group}")
        notes = []
        if not p.repeated_init:
            notes.append("repeated_init false keeps, in the fork, the first "
                         "forward pass's lattice for later passes; caffeq builds it on every pass")
        return {"num_output": num_output, "group": group, "s": int(p.neighborhood_size),
                "bias_term": bool(p.bias_term), "norm_type": p.NormType.Name(p.norm_type),
                "offset_type": p.OffsetType.Name(p.offset_type), "skip_blur": bool(p.do_skip_blur),
                "visualize": bool(p.visualize_lattice), "with_lattice": len(lp.top) == 2,
                "given_lattice": len(lp.bottom) == 4, "reading_notes": notes}

    def _shapes(self, attrs, in_shapes):
        shapes = [tuple(s) for s in in_shapes]
        if any(len(s) != 4 for s in shapes):
            raise LayerError(f"Permutohedral needs 4-axis (N, C, H, W) bottoms, got {[list(s) for s in shapes]}")
        (n, c, h, w), (fn, d, fh, fw), (on, od, oh, ow) = shapes[:3]
        if (fn, fh, fw) != (n, h, w) or on != n or od != d:
            raise LayerError(f"Permutohedral: input features must be (N, d, H, W) of the data's N, H, W and output "
                             f"features (N, d, Ho, Wo), got data {list(shapes[0])}, input features {list(shapes[1])}, "
                             f"output features {list(shapes[2])}")
        if c % attrs["group"]:
            raise LayerError(f"Permutohedral: the data's {c} channels are not divisible by group {attrs['group']}")
        if attrs["offset_type"] == "DIAG" and attrs["num_output"] != c // attrs["group"]:
            raise LayerError(f"Permutohedral: offset_type DIAG needs num_output == channels / group, got "
                             f"{attrs['num_output']} and {c} / {attrs['group']}")
        if attrs["skip_blur"] and attrs["num_output"] != c:
            raise LayerError(f"Permutohedral: do_skip_blur needs num_output == channels, got {attrs['num_output']} "
                             f"and {c}")
        lattice = (n, d + 1, 1, h * w + oh * ow)
        if len(shapes) == 4 and shapes[3] != lattice:
            raise LayerError(f"Permutohedral: the lattice bottom must be another Permutohedral's lattice top of "
                             f"these sizes, {list(lattice)}, got {list(shapes[3])}")
        return (n, c, h, w), d, (oh, ow), lattice

    def infer(self, attrs, in_shapes):
        (n, _, _, _), _, (oh, ow), lattice = self._shapes(attrs, in_shapes)
        tops = [(n, attrs["num_output"], oh, ow)]
        return tops + [lattice] if attrs["with_lattice"] else tops

    def param_shapes(self, attrs, in_shapes):
        (_, c, _, _), d, _, _ = self._shapes(attrs, in_shapes)
        shapes = [(attrs["num_output"], c // attrs["group"], 1, bnn_filter_size(attrs["s"], d))]
        return shapes + [(1, 1, 1, attrs["num_output"])] if attrs["bias_term"] else shapes

    def macs(self, attrs, in_shapes, out_shapes):
        (n, c, h, w), d, (oh, ow), _ = self._shapes(attrs, in_shapes)
        taps = bnn_filter_size(attrs["s"], d)
        return n * (h * w + oh * ow) * (d + 1) * (c // attrs["group"]) * attrs["num_output"] * taps

    def _args(self, attrs):
        return (attrs["s"], attrs["group"], attrs["norm_type"], attrs["offset_type"], attrs["skip_blur"],
                attrs["visualize"], attrs["with_lattice"])

    def forward(self, attrs, params, x, in_feats, out_feats, lattice=None):
        bias = params[1] if attrs["bias_term"] else None
        return bnn_permutohedral(x, in_feats, out_feats, lattice, params[0], bias, *self._args(attrs))

    def pytorch_source(self, node, emit):
        a = node.attrs
        m = emit.instance(BnnPermutohedral, list(emit.blob(0).shape), a["bias_term"], *self._args(a), needs=_NEEDS)
        emit.param("weight", 0)
        if a["bias_term"]:
            emit.param("bias", 1)
        call = f"{m}({', '.join(emit.inputs)})"
        if not a["with_lattice"]:
            return call
        out = emit.tmp("permutohedral")
        emit.stmt(f"{out} = {call}")
        return [f"{out}[0]", f"{out}[1]"]
