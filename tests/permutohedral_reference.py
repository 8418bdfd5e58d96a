"""The permutohedral lattice as CRF-RNN's ModifiedPermutohedral (torrvision/crfasrnn caffe-crfrnn
src/caffe/util/modified_permutohedral.cpp, the SSE path) and DeepLab v2's Permutohedral build and apply it,
written here from their C++: float32 loops point by point, a dict in insertion order for the hash table.
test_layers_crf_rnn.py and test_layers_dense_crf.py check caffeq's vectorised lattice against it."""
import numpy as np

F32 = np.float32


def short(k):
    """The fork's short key: a C++ float -> short conversion on x86 (through int32) keeps the low 16 bits."""
    return int(np.array([k], np.int64).astype(np.int16)[0])


def point_simplex(f, half_away=False, double_first=False):
    """One point's enclosing simplex (Adams et al.) in float32 steps as the forks' loops: (rem0, rank,
    barycentric weights (d + 2)).  The nearest 0-coloured point rounds halves to even (CRF-RNN's rint) or,
    half_away, away from zero (bilateralNN's round()); weight 0 adds 1 + the wrapped weight in float32 or,
    double_first, in double (bilateralNN)."""
    d = len(f)
    inv_std_dev = F32(np.sqrt(2.0 / 3.0) * (d + 1))
    scale = [F32(1.0 / np.sqrt((i + 2) * (i + 1)) * float(inv_std_dev)) for i in range(d)]
    down, up = F32(F32(1) / F32(d + 1)), F32(d + 1)
    elevated, sm = [F32(0)] * (d + 1), F32(0)
    for j in range(d, 0, -1):
        cf = F32(f[j - 1] * scale[j - 1])
        elevated[j] = F32(sm - F32(j) * cf)
        sm = F32(sm + cf)
    elevated[0] = sm
    rem0, total = [], 0
    for i in range(d + 1):
        x = F32(down * elevated[i])
        v = F32(np.sign(x) * np.floor(abs(float(x)) + 0.5)) if half_away else F32(np.rint(x))
        rem0.append(F32(v * up))
        total += int(v)
    rank = [0] * (d + 1)
    for i in range(d):
        di = F32(elevated[i] - rem0[i])
        for j in range(i + 1, d + 1):
            if di < F32(elevated[j] - rem0[j]):
                rank[i] += 1
            else:
                rank[j] += 1
    for i in range(d + 1):
        rank[i] += total
        if rank[i] < 0:
            rank[i] += d + 1
            rem0[i] = F32(rem0[i] + F32(d + 1))
        elif rank[i] >= d + 1:
            rank[i] -= d + 1
            rem0[i] = F32(rem0[i] - F32(d + 1))
    bary = [F32(0)] * (d + 2)
    for i in range(d + 1):
        v = F32(F32(elevated[i] - rem0[i]) * down)
        bary[d - rank[i]] = F32(bary[d - rank[i]] + v)
        bary[d - rank[i] + 1] = F32(bary[d - rank[i] + 1] - v)
    if double_first:
        bary[0] = F32(float(bary[0]) + (1.0 + float(bary[d + 1])))
    else:
        bary[0] = F32(bary[0] + F32(1 + bary[d + 1]))
    return rem0, rank, bary


def fork_lattice(features, pad_to_blocks=True, simplex=point_simplex):
    """ModifiedPermutohedral::init, point by point: (offsets, barycentric weights, neighbours, M); simplex: a
    fork's own point rule (caffe-hybridnet's)."""
    n, d = features.shape
    canonical = [[i if j <= d - i else i - (d + 1) for j in range(d + 1)] for i in range(d + 1)]
    table = {}
    offsets, weights = np.zeros((n, d + 1), np.int64), np.zeros((n, d + 1), F32)
    blocks = n + (-n) % 4 if pad_to_blocks else n   # the SSE loop reads 4 points at a time, zeros past the end
    for k in range(blocks):
        f = features[k] if k < n else np.zeros(d, F32)
        rem0, rank, bary = simplex(f)
        for r in range(d + 1):
            key = tuple(short(int(rem0[i]) + canonical[r][rank[i]]) for i in range(d))
            o = table.setdefault(key, len(table))
            if k < n:
                offsets[k, r], weights[k, r] = o, bary[r]
    keys = list(table)
    neighbours = []
    for j in range(d + 1):
        row = []
        for key in keys:
            n1 = [short(c - 1) for c in key]
            n2 = [short(c + 1) for c in key]
            if j < d:
                n1[j], n2[j] = short(key[j] + d), short(key[j] - d)
            row.append((table.get(tuple(n1), -1), table.get(tuple(n2), -1)))
        neighbours.append(row)
    return offsets, weights, neighbours, len(keys)


def fork_filter(lattice, values, sse_only=False, sequential=False):
    """ModifiedPermutohedral::compute of values (C, N): seqCompute for C <= 2, sseCompute above
    (DeepLab's Permutohedral::compute: always the SSE path; caffe-hybridnet's: always seqCompute)."""
    offsets, weights, neighbours, m = lattice
    c, n = values.shape
    d = offsets.shape[1] - 1
    grid = np.zeros((m + 2, c), F32)
    for i in range(n):
        for j in range(d + 1):
            grid[offsets[i, j] + 1] += weights[i, j] * values[:, i]
    for j in range(d + 1):
        new = grid.copy()
        for v in range(m):
            n1, n2 = neighbours[j][v]
            new[v + 1] = grid[v + 1] + F32(0.5) * (grid[n1 + 1] + grid[n2 + 1])
        grid = new
    alpha = F32(F32(1) / F32(1 + F32(2.0 ** -d)))
    out = np.zeros((c, n), F32)
    for i in range(n):
        acc = np.zeros(c, F32)
        for j in range(d + 1):
            w, v = weights[i, j], grid[offsets[i, j] + 1]
            acc = acc + ((w * v) * alpha if (c <= 2 or sequential) and not sse_only else F32(w * alpha) * v)
        out[:, i] = acc
    return out
