"""The permutohedral lattice (Adams, Baek and Davis, Eurographics 2010) as CRF-RNN builds and applies it:
torrvision/crfasrnn caffe-crfrnn src/caffe/util/modified_permutohedral.cpp (ModifiedPermutohedral, the
SSE path every x86-64 build compiles).  A Gaussian filter over d-dimensional per-pixel features, in
time linear in the pixels.

Building the lattice from features f (P points, d values each; float32 throughout, as the fork):
- elevate: with s_i = sqrt(2/3) (d + 1) / sqrt((i + 1)(i + 2)), walking j = d..1 with a running sum
  sm of c = f[j-1] s[j-1]: e[j] = sm - j c, then sm += c; e[0] = sm;
- round each e[i] / (d + 1) to the nearest integer (ties to even) giving rem0 = that x (d + 1);
- rank each coordinate by e - rem0: for i < j, rank[i] += 1 where (e - rem0)[i] < (e - rem0)[j], else
  rank[j] += 1 (so ties go to the later coordinate); add the rounded values' sum, and where a rank
  leaves [0, d] bring it back by d + 1, moving rem0 with it;
- barycentric weights: v_i = (e - rem0)[i] / (d + 1) added at d - rank[i] and subtracted at
  d - rank[i] + 1; weight 0 takes 1 + the wrapped weight d + 1;
- the point's d + 1 vertices: key[i] = rem0[i] + canonical[r][rank[i]] for i < d, r = 0..d, with
  canonical[r][j] = r for j <= d - r, else r - (d + 1).  Keys are the fork's 16-bit shorts, so a
  coordinate beyond +-32767 wraps as the fork's conversion does on x86;
- each vertex's neighbours along axis j: the key minus 1 everywhere but + d at j, and the key plus 1
  everywhere but - d at j (axis d: all minus 1, all plus 1).
The fork numbers vertices in a hash table's insertion order; here they are numbered by sorting their
keys.  Numbering changes no value: each vertex sums the same points in the same order.

Filtering C values per point: splat (each vertex sums weight x value over its points, in point order),
blur along axes 0..d (new = old + 0.5 (left + right), a missing neighbour reading 0), slice (each point
sums its vertices' values x weight x alpha, alpha = 1 / (1 + 2^-d)).  The fork's slice multiplies in
two orders: (weight x value) x alpha for at most 2 values per point (its sequential path), (weight x
alpha) x value for more (its SSE path); both are kept.  DeepLab v2's Permutohedral
(src/caffe/util/permutohedral.cpp, from Kraehenbuehl's densecrf) builds the same lattice and always
slices as the SSE path.

Plain torch functions, copied into model.py as they are.
"""
import math

import torch

from .c_numerics import c_round


def lattice_vertex_ids(keys):
    """Ids in [0, number of distinct rows) of the rows of an int64 (R, K) tensor (equal rows, equal ids),
    numbered in the rows' sorted order; and, for lattice_lookup, each column's sorted prefix codes.
    One column at a time, so a code stays below R x 65536."""
    ids = torch.zeros(keys.shape[0], dtype=torch.int64, device=keys.device)
    columns = []
    for column in keys.unbind(1):
        low, high = column.min(), column.max()
        span = high - low + 1
        codes, ids = torch.unique(ids * span + (column - low), return_inverse=True)
        columns.append((codes, low, high, span))
    return ids, columns


def lattice_lookup(columns, batches):
    """For each int64 (Q, K) tensor of `batches`: the id lattice_vertex_ids gave the row equal to each of its
    rows, or -1.  A query keeps the id of the prefix it matches, column by column, by binary search."""
    rows = []
    for queries in batches:
        found_id = torch.zeros(queries.shape[0], dtype=torch.int64, device=queries.device)
        found = torch.ones(queries.shape[0], dtype=torch.bool, device=queries.device)
        for (codes, low, high, span), asked in zip(columns, queries.unbind(1)):
            wanted = found_id * span + (asked - low).clamp(0, span - 1)
            found_id = torch.searchsorted(codes, wanted).clamp(max=codes.shape[0] - 1)
            found &= (codes[found_id] == wanted) & (asked >= low) & (asked <= high)
        rows.append(torch.where(found, found_id, -1))
    return rows


def as_short(keys):
    """The fork's short keys: integers wrapped into [-32768, 32767]."""
    if keys.numel() and (keys.min() < -32768 or keys.max() > 32767):
        return torch.remainder(keys + 32768, 65536) - 32768
    return keys


def pixel_xy(h: int, w: int, device):
    """(H W, 2) float32: each pixel's (x, y) = (p mod W, p div W), row by row, as the CRF layers feed them."""
    pixel = torch.arange(h * w, device=device)
    return torch.stack([pixel % w, torch.div(pixel, w, rounding_mode="floor")], 1).to(torch.float32)


def lattice_simplex(f, half_away: bool = False, double_first: bool = False, ties_down: bool = False):
    """The enclosing simplex of each of (P, d) float32 features (Adams et al., float32 as the forks): (keys
    (P, d + 1, d) int64, each point's d + 1 vertices as the forks' shorts; weights (P, d + 1) float32, their
    barycentric weights).  The nearest 0-coloured point rounds halves to even (CRF-RNN's SSE path), with
    half_away away from zero (bilateralNN's round()), or with ties_down is the nearer multiple of d + 1,
    compared in float32 as ceil(v) (d + 1) - e < e - floor(v) (d + 1), ties going down (caffe-hybridnet's
    sequential init_cpu); weight 0 takes 1 + the wrapped weight in float32, or in double with double_first
    (bilateralNN's and hybridnet's `1.0 + b[d + 1]`)."""
    p, d = f.shape
    f32, dev = torch.float32, f.device
    inv_std_dev = float(torch.tensor(math.sqrt(2.0 / 3.0) * (d + 1), dtype=f32))
    elevated = [f[:, 0]] * (d + 1)
    running = torch.zeros(p, dtype=f32, device=dev)
    for j in range(d, 0, -1):
        scale = torch.tensor(1.0 / math.sqrt((j + 1) * j) * inv_std_dev, dtype=f32, device=dev)
        c = f[:, j - 1] * scale
        elevated[j] = running - torch.tensor(float(j), dtype=f32, device=dev) * c
        running = running + c
    elevated[0] = running
    e = torch.stack(elevated, 1)
    d_plus_1 = torch.tensor(float(d + 1), dtype=f32, device=dev)
    down = torch.tensor(1.0, dtype=f32, device=dev) / d_plus_1
    if ties_down:
        up, low = torch.ceil(e * down), torch.floor(e * down)
        rounded = torch.where(up * d_plus_1 - e < e - low * d_plus_1, up, low)
    else:
        rounded = c_round(e * down) if half_away else torch.round(e * down)
    rem0 = rounded * d_plus_1
    rest = e - rem0
    later = torch.ones(d + 1, d + 1, dtype=torch.bool, device=dev).triu(1)   # [i, j]: j > i
    less = rest[:, :, None] < rest[:, None, :]
    rank = (less & later).sum(2) + (~less.transpose(1, 2) & later.t()).sum(2)
    rank = rank + rounded.sum(1, keepdim=True).to(torch.int64)
    shift = (rank < 0).to(torch.int64) * (d + 1) - (rank > d).to(torch.int64) * (d + 1)
    rank = (rank + shift).clamp(0, d)   # NaN features give ranks out of range: clamped, not indexed
    rem0 = rem0 + shift.to(f32)
    v = (e - rem0) * down
    bary = torch.zeros(p, d + 2, dtype=f32, device=dev)
    bary.scatter_add_(1, d - rank, v)
    bary.scatter_add_(1, d - rank + 1, -v)
    if double_first:
        first = (bary[:, :1].double() + (1.0 + bary[:, d + 1:].double())).to(f32)
    else:
        first = bary[:, :1] + (1 + bary[:, d + 1:])
    weights = torch.cat([first, bary[:, 1:d + 1]], 1)
    r = torch.arange(d + 1, device=dev)
    canonical = torch.where(r[None, :] <= d - r[:, None], r[:, None], r[:, None] - (d + 1))   # [r, rank]
    keys = as_short(rem0[:, None, :d].to(torch.int64) + canonical[:, rank[:, :d]].permute(1, 0, 2))
    return keys, weights


def lattice_vertices(keys):
    """The distinct vertices of keys (P, d + 1, d): (ids (P (d + 1),) in [0, M), the columns lattice_lookup
    searches, the vertices' keys (M, d))."""
    d = keys.shape[-1]
    ids, columns = lattice_vertex_ids(keys.reshape(-1, d))
    vertex_keys = torch.zeros(columns[-1][0].shape[0], d, dtype=torch.int64, device=keys.device)
    vertex_keys[ids] = keys.reshape(-1, d)
    return ids, columns, vertex_keys


def permutohedral_lattice(features):
    """The lattice of (P, d) float32 features: (slots (P, d + 1) int64, the vertex rows 1..M of the
    point's vertices; weights (P, d + 1) float32, their barycentric weights; neighbours (d + 1, 2, M)
    int64, each vertex's two neighbours along each axis as rows, 0 (a row of zeros) where there is none)."""
    p, d = features.shape
    f32, dev = torch.float32, features.device
    # the SSE build reads points four at a time, the last block padded with points at the origin: their
    # vertices join the lattice (and carry values in the blur) though nothing is splatted there
    f = torch.cat([features.to(f32), torch.zeros((-p) % 4, d, dtype=f32, device=dev)])
    keys, weights = lattice_simplex(f)
    ids, columns, vertex_keys = lattice_vertices(keys)
    m = vertex_keys.shape[0]

    def along_each_axis():   # axis j: the key minus 1 but plus d at j, the key plus 1 but minus d at j
        for j in range(d + 1):
            axis = torch.zeros(d, dtype=torch.int64, device=dev)
            if j < d:
                axis[j] = d + 1
            yield torch.cat([as_short(vertex_keys - 1 + axis), as_short(vertex_keys + 1 - axis)])

    neighbours = torch.stack([(rows + 1).reshape(2, m) for rows in lattice_lookup(columns, along_each_axis())])
    return (ids + 1).reshape(-1, d + 1)[:p], weights[:p], neighbours


def permutohedral_filter(values, slots, weights, neighbours, sse_only: bool = False, sequential_only: bool = False):
    """Filter values (C, P) through the lattice (permutohedral_lattice's three tensors): (C, P).
    sse_only: slice as the SSE path whatever C (DeepLab's Permutohedral has no sequential path);
    sequential_only: (weight x value) x alpha whatever C (caffe-hybridnet's seqCompute)."""
    c, p = values.shape
    d = slots.shape[1] - 1
    grid = values.new_zeros(neighbours.shape[2] + 1, c)
    grid.index_add_(0, slots.reshape(-1), (weights[:, :, None] * values.t()[:, None, :]).reshape(-1, c))
    for j in range(d + 1):
        blurred = torch.add(grid[1:], grid.index_select(0, neighbours[j, 0]) + grid.index_select(0, neighbours[j, 1]),
                            alpha=0.5)
        grid = torch.cat([grid[:1], blurred])
    one = torch.tensor(1.0, dtype=values.dtype, device=values.device)
    alpha = one / (1 + one * 2.0 ** -d)
    out = values.new_zeros(p, c)
    for j in range(d + 1):
        w = weights[:, j:j + 1]
        picked = grid.index_select(0, slots[:, j])
        out = out + ((w * picked) * alpha if (c <= 2 or sequential_only) and not sse_only else (w * alpha) * picked)
    return out.t()


#: the functions model.py copies for a layer that filters through lattices (emit.helper each, in order)
#: the lattice building blocks every lattice layer's model.py needs (emit.helper each)
LATTICE_BASICS = (as_short, lattice_vertex_ids, lattice_lookup, c_round, lattice_simplex, lattice_vertices)
LATTICE_HELPERS = LATTICE_BASICS + (pixel_xy, permutohedral_lattice, permutohedral_filter)
