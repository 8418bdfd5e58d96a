"""Evaluation metrics: per-target sums kept on the device (Caffe's accuracy rule, agreement with the
reference target, differences), and the side-by-side table of a result."""
import torch

from .fs import format_bytes

# slots of the float64 sum vector
N, LABELED, TOP1, TOP5, POS, AGREE, ABS, ELEMS, COS = range(9)
NSLOTS = 9


class Sums:
    """Sums of one target's metrics, kept on the device (no sync per batch)."""

    def __init__(self, device, layer_names):
        self.sums = torch.zeros(NSLOTS + len(layer_names), dtype=torch.float64, device=device)
        self.max_abs = torch.zeros((), dtype=torch.float64, device=device)
        self.layer_names = list(layer_names)
        self.seconds = 0.0


def flat_scores(s, n):
    """(n, C) for per-image scores; (n, C, P) when each image has P positions."""
    if s.dim() == 0:
        s = s.reshape(1, 1)
    s = s.reshape(n, s.shape[1] if s.dim() > 1 else 1, -1).float()
    return s


def add_batch(acc, out, score, metric_names, labels, labeled, ref, n):
    s = flat_scores(out[score], n)
    c = s.shape[1]
    parts = torch.zeros(NSLOTS, dtype=torch.float64, device=s.device)
    parts[N] = n
    if labels is not None and s.shape[2] == 1:
        x = s[:, :, 0]
        lab = labels.clamp(0, max(c - 1, 0))
        true = x.gather(1, lab[:, None])
        # Caffe's AccuracyLayer: every class scoring >= the true one counts, the true one included
        better = (x >= true).sum(1) - 1
        ok = labeled & torch.isfinite(true[:, 0])
        parts[LABELED] = labeled.sum()
        parts[TOP1] = ((better < 1) & ok).sum()
        parts[TOP5] = ((better < 5) & ok).sum()
    if ref is not None:
        r = ref
        parts[POS] = s.shape[0] * s.shape[2]
        parts[AGREE] = (s.argmax(1) == r.argmax(1)).sum()
        d = (s.double() - r.double()).abs()
        parts[ABS] = d.sum()
        parts[ELEMS] = d.numel()
        if d.numel():
            acc.max_abs = torch.maximum(acc.max_abs, d.max())
        a, b = s.reshape(n, -1).double(), r.reshape(n, -1).double()
        parts[COS] = torch.nn.functional.cosine_similarity(a, b, dim=1, eps=1e-12).sum()
    # a target that cannot compute a metric layer (static int8 runs the inference graph) adds 0
    layer_vals = [out[m].double().reshape(()) * n if m in out else parts.new_zeros(()) for m in metric_names]
    acc.sums[:NSLOTS] += parts
    if layer_vals:
        acc.sums[NSLOTS:] += torch.stack(layer_vals)
    return s


def fraction(num, den):
    return float(num) / float(den) if den else None


def format_table(result):
    """The side-by-side table of targets (percentages for reading; the JSON keeps fractions)."""
    res = result["results"]
    names = list(res)
    ref = names[0] if names else None
    layer_names = []
    for r in res.values():
        for m in (r.get("layers") or {}):
            if m not in layer_names:
                layer_names.append(m)
    cols = [("target", lambda t, r: t)]
    if any("top1" in r for r in res.values()):
        cols += [("top-1", lambda t, r: _pct(r.get("top1"))), ("top-5", lambda t, r: _pct(r.get("top5")))]
    for m in layer_names:
        cols.append((m, lambda t, r, m=m: _num((r.get("layers") or {}).get(m))))
    if len(names) > 1:
        cols += [("agree@1", lambda t, r: _pct(r.get("agreement_top1")) if t != ref else "-"),
                 ("cosine", lambda t, r: _num(r.get("cosine"), 5) if t != ref else "-"),
                 ("mean|d|", lambda t, r: _num(r.get("mean_abs_diff")) if t != ref else "-"),
                 ("max|d|", lambda t, r: _num(r.get("max_abs_diff")) if t != ref else "-")]
    cols += [("images/s", lambda t, r: f"{r['images_per_s']:.0f}" if r.get("images_per_s") else "-"),
             ("size", lambda t, r: _size(r.get("model_size_bytes")))]
    rows = [[c[0] for c in cols]] + [[c[1](t, res[t]) for c in cols] for t in names]
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    lines = ["  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _pct(v):
    return "-" if v is None else f"{100 * v:.2f}%"


def _num(v, digits=4):
    if v is None:
        return "-"
    return f"{v:.{digits}g}"


def _size(b):
    if b is None:
        return "-"
    return format_bytes(b)  # one unit style in every report
