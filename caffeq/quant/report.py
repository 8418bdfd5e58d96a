"""The quantization report: what changed, per layer, and what it cost in accuracy of the weights."""
import json
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class LayerRow:
    name: str
    type: str
    params: int
    precision: str           # "binary", "int8", "fp16" or "fp32"
    bytes_before: int
    bytes_after: int
    rel_l2_error: float      # ||W_q - W|| / ||W|| over the blobs that changed (0 when none)
    reason: str = ""         # why a layer stayed fp32 ("kept: first weighted layer", ...)
    blobs: list = field(default_factory=list)   # precision of each blob, in Caffe's order


@dataclass
class QuantReport:
    target: str
    layers: list = field(default_factory=list)
    changed: list = field(default_factory=list)     # layer names whose weights changed precision
    kept: dict = field(default_factory=dict)        # layer name -> reason it stayed fp32
    notes: list = field(default_factory=list)
    stats: dict = field(default_factory=dict)       # e.g. fp16 clamped/underflow counts

    @property
    def bytes_before(self):
        return sum(r.bytes_before for r in self.layers)

    @property
    def bytes_after(self):
        return sum(r.bytes_after for r in self.layers)

    @property
    def params(self):
        return sum(r.params for r in self.layers)

    @property
    def ratio(self):
        return self.bytes_before / self.bytes_after if self.bytes_after else float("inf")

    def totals(self):
        return {"params": self.params, "bytes_before": self.bytes_before, "bytes_after": self.bytes_after,
                "compression": round(self.ratio, 3) if self.bytes_after else None,
                "layers_changed": len(self.changed), "layers_kept": len(self.kept)}

    def to_dict(self):
        return {"target": self.target,
                "layers": [asdict(r) for r in self.layers],
                "changed": list(self.changed), "kept": dict(self.kept),
                "totals": self.totals(), "notes": list(self.notes), "stats": dict(self.stats)}

    def to_json(self, **kw):
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_dict(cls, d):
        rep = cls(d["target"])
        rep.layers = [LayerRow(**{k: v for k, v in r.items() if k in LayerRow.__dataclass_fields__})
                      for r in d.get("layers", [])]
        rep.changed = list(d.get("changed", []))
        rep.kept = dict(d.get("kept", {}))
        rep.notes = list(d.get("notes", []))
        rep.stats = dict(d.get("stats", {}))
        return rep

    def format_table(self):
        head = ("layer", "type", "params", "precision", "bytes before", "bytes after", "rel. L2 err")
        rows = [head]
        for r in self.layers:
            prec = r.precision + (f" ({r.reason})" if r.reason else "")
            rows.append((r.name, r.type, f"{r.params:,}", prec, f"{r.bytes_before:,}", f"{r.bytes_after:,}",
                         f"{r.rel_l2_error:.4g}" if r.precision != "fp32" else "-"))
        t = self.totals()
        rows.append(("total", "", f"{t['params']:,}", self.target, f"{t['bytes_before']:,}",
                     f"{t['bytes_after']:,}", "-"))   # (the size ratio is in the summary, not under the error)
        widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
        lines = []
        for k, row in enumerate(rows):
            cells = [str(c).ljust(w) if i in (0, 1, 3) else str(c).rjust(w)
                     for i, (c, w) in enumerate(zip(row, widths))]
            lines.append("  ".join(cells).rstrip())
            if k == 0 or k == len(rows) - 2:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def summary(self):
        """One or two lines: which layers changed, which were kept."""
        lines = []
        if self.changed:
            lines.append(f"{self.target}: changed {len(self.changed)} layer(s): {', '.join(self.changed)}")
        else:
            lines.append(f"{self.target}: no layer changed")
        if self.kept:
            lines.append("kept fp32: " + ", ".join(f"{k} ({v})" for k, v in self.kept.items()))
        return "\n".join(lines)

    def __str__(self):
        parts = [self.summary(), self.format_table()]
        parts += [f"note: {n}" for n in self.notes]
        return "\n".join(parts)


def rel_l2(before, after):
    """||after - before|| / ||before|| over lists of arrays (0 for all-zero weights)."""
    num = den = 0.0
    for b, a in zip(before, after):
        b64 = np.asarray(b, np.float64)
        num += float(np.sum((np.asarray(a, np.float64) - b64) ** 2))
        den += float(np.sum(b64 * b64))
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return float(np.sqrt(num / den))
