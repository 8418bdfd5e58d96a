"""fp16 weights: every float blob rounded to IEEE half precision.

Values beyond +-65504 are clamped (and counted); nonzero values that round to
zero are counted as underflows.  BatchNorm is folded (or at least its moving
average factor divided out) in fp32 *before* rounding, because Caffe stores
raw accumulators (mean and variance times ~999.98) that fp16 would distort.
"""
import numpy as np

from ..transforms import fold_batchnorm
from .base import QuantizedBlob, Quantizer, register_quantizer

FP16_MAX = float(np.finfo(np.float16).max)   # 65504


class Fp16Stats:
    def __init__(self):
        self.clamped = 0
        self.underflow = 0
        self.subnormal = 0

    def to_dict(self):
        return {"clamped": self.clamped, "underflow": self.underflow, "subnormal": self.subnormal}


def round_fp16(array, stats=None):
    w = np.asarray(array, np.float32)
    over = np.abs(w) > FP16_MAX
    clamped = np.clip(w, -FP16_MAX, FP16_MAX) if over.any() else w
    codes = clamped.astype(np.float16)
    if stats is not None:
        stats.clamped += int(np.count_nonzero(over & np.isfinite(w)))
        stats.underflow += int(np.count_nonzero((codes == 0) & (w != 0)))
        tiny = np.finfo(np.float16).tiny
        stats.subnormal += int(np.count_nonzero((np.abs(codes) < tiny) & (codes != 0)))
    return codes


@register_quantizer
class Float16(Quantizer):
    name = "fp16"
    bits = 16
    weights_only = False   # biases, BatchNorm, Scale, PReLU ... all go to fp16

    def __init__(self):
        self.stats = Fp16Stats()

    def quantize(self, array, axis=None, groups=1):
        return QuantizedBlob("fp16", None, None, round_fp16(array, self.stats), 1)


def normalize_batchnorm(model):
    """Divide Caffe's moving-average factor out of every BatchNorm, in fp32 -> notes.

    Caffe stores mean and variance times the factor s (about 999.98 in trained
    models); the layer uses blob / s.  Storing mean * (1/s), variance * (1/s)
    and s = 1 gives the same numbers the layer used before (the same float32
    products), and fp16 then rounds the true statistics, not accumulators that
    may pass 65504.
    """
    changed = []
    for node in model.graph.nodes:
        if node.type != "BatchNorm" or not node.blobs or len(node.blobs) < 3:
            continue
        if node.attrs.get("scale_bias"):
            continue  # NVCaffe's form ignores the factor and already holds the statistics
        if 2 in node.shared_from or 0 in node.shared_from or 1 in node.shared_from:
            continue
        s = np.float32(np.asarray(node.blobs[2], np.float32).reshape(-1)[0])
        if s == 1:
            continue
        f = np.float32(0) if s == 0 else np.float32(1) / s
        blobs = list(node.blobs)
        blobs[0] = (np.asarray(blobs[0], np.float32) * f).astype(np.float32)
        blobs[1] = (np.asarray(blobs[1], np.float32) * f).astype(np.float32)
        blobs[2] = np.ones_like(np.asarray(blobs[2], np.float32))
        node.blobs = blobs
        changed.append(node.name)
    return changed


def prepare_fp16(model):
    """Fold BatchNorm in fp32 before rounding (in place on a model copy) -> notes for the report."""
    notes = []
    folded = fold_into_model(model, fold_batchnorm)
    if folded:
        model.folded_layers = folded
        notes.append(f"BatchNorm/Scale folded in fp32 into the layer before them, then rounded: "
                     f"{', '.join(folded)}")
    normed = normalize_batchnorm(model)
    if normed:
        notes.append(f"BatchNorm moving-average factor divided out in fp32 before rounding: {', '.join(normed)}")
    return notes


def fold_into_model(model, fold):
    """Replace model.graph by fold(model).graph and model.net to match -> names of layers folded away.

    The net is rewritten too (folded layers removed, changed layers' parameters
    and tops updated), so the .caffemodel/.caffeq writers and Model.reshaped
    see the same layers as the graph.  Layers of other phases stay as they are.
    """
    folded = fold(model)
    old_names = [n.name for n in model.graph.nodes]
    new_nodes = {n.name: n for n in folded.graph.nodes}
    gone = [n for n in old_names if n not in new_nodes]
    if not gone:
        return []
    old_params = {n.name: n.param for n in model.graph.nodes}
    model.graph = folded.graph
    if model.net is not None:
        net = type(model.net)()
        net.CopyFrom(model.net)
        del net.layer[:]
        for lp in model.net.layer:
            # the phase's own layer (a train_val net may hold another of the same name)
            ours = lp.name in old_params and lp == old_params[lp.name]
            node = new_nodes.get(lp.name) if ours else None
            if ours and node is None:
                continue   # folded away
            if node is None:
                net.layer.add().CopyFrom(lp)
                continue
            new_lp = net.layer.add()
            new_lp.CopyFrom(node.param)
            del new_lp.bottom[:]
            new_lp.bottom.extend(node.bottoms)
            del new_lp.top[:]
            new_lp.top.extend(node.tops)
            # a layer whose type changed (BatchNorm -> Scale) must not keep stale ParamSpecs
            if node.type != lp.type or len(node.param.param) > len(node.blobs or []):
                del new_lp.param[:]
        model.net = net
    return gone
