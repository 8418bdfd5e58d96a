"""MyCaffe (MyCaffe/MyCaffe b8922aa, a C# rewrite of Caffe): its RUN net and the layers its model files use.

Sources (facts read from the C#; no code carried over):
  - MyCaffe.basecode/Interfaces.cs (Phase: NONE 0, TRAIN 1, TEST 2, RUN 3, ALL 5) and
    MyCaffe.basecode/ProjectEx.cs CreateModelForRunning: the net MyCaffe runs on given data.  It drops every
    layer excluded at RUN (an exclude at TEST or TRAIN keeps it: includeLayer reads "exlcude" rules, and
    Net.FilterNet at RUN meets no TEST rule), every layer whose include rules name TRAIN or TEST but not RUN, Input
    and data layers, its listed losses (Triplet, Contrastive, Euclidean, ...), LabelMapping and Debug; a
    SoftmaxWithLoss (or SoftmaxCrossEntropy(2)Loss) becomes a Softmax of its first bottom where the net keeps no
    Softmax (else it is dropped); a data layer's first top becomes the net's input, and the first layer left gets
    that name as its first bottom; a Decode keeps its first bottom only.  MyCaffe/common/Net.cs FilterNet /
    StateMeetsRule read the rules as Caffe does.  caffeq's TRAIN net keeps the layers as written.
  - MyCaffe/layers/InnerProductLayer.cs: with enable_noise the layer holds weight, bias, sigma_wt (like the
    weight) and sigma_bias (like the bias); only at TRAIN does forward use weight + sigma_wt * eps (and the
    bias alike); at TEST and RUN it is a plain InnerProduct.
  - MyCaffe.layers.ssd/layers.ssd/Normalization2Layer.cs: SSD's Normalize (norm = sqrt(sum x^2 + eps), over
    C, H, W with across_spatial or over C per pixel, times the scale blob, one value with channel_shared).
  - MyCaffe.layers.beta/layers.beta/DecodeLayer.cs (param.beta/DecodeParameter.cs): at TEST / RUN, top (N, L, 1, 1)
    holds sum_d (x[n, d] - centroid[l, d])^2 over the centroids blob (L, D, 1, 1) (blobs: centroids,
    status (L, 1, 1, 1), encoding counts (L, 1, 1, 1)); ignore_labels read float's maximum.  Target KNN
    (a cache of encodings, averaged nearest distances) is read but not run.
  - MyCaffe.layers.beta/layers.beta/LSTMAttentionLayer.cs with CudaDnnDLL/Cuda Files/math.cu (lstm_fwd,
    clip_add_kernel, activation_fwd_kernel, lstm_fwd_kernel): bottom x (T, N, ...), clip (T, N); blobs W_i
    (4H, I), W_h (4H, H), b (4H); gates = x W_i^T + b + clip_t * h_{t-1} W_h^T, in the order i, f, o
    (sigmoid), g (tanh); c_t = clip_t f c_{t-1} + i g, h_t = o tanh(c_t); without a clip bottom clip_t is
    (t > 0).  calculate_maxT: only the first maxT = max over n of sum_t clip[t, n] (+1 when clip[0, 0] is 0;
    1 for a one-value clip) steps run; the later rows of a fresh top stay 0.  enable_attention (a 4-bottom
    encoder attention) and num_output_ip are read but not run.
"""
import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ExportError
from ..io.schema import caffe_pb2
from .conv import InnerProduct
from .registry import Layer, LayerError, claim_layers, need_blobs, net_rewrite, register_layer
from .ssd.permute_normalize import NormalizeLayer

_FLT_MAX = float(np.finfo(np.float32).max)
_DATA_TYPES = {"Data", "AnnotatedData", "BatchData"}   # ProjectEx.CreateModelForRunning's data layers
# the types (lower case) CreateModelForRunning drops from the RUN net, and the losses it turns into a Softmax
# (on their first bottom) where the RUN net has no Softmax, else drops
_RUN_DROPPED = {"memoryloss", "contrastive_loss", "contrastiveloss", "euclidean_loss", "euclideanloss", "hinge_loss",
                "hingeloss", "infogain_loss", "infogainloss", "multinomiallogistic_loss", "multinomiallogisticloss",
                "sigmoidcrossentropy_loss", "sigmoidcrossentropyloss", "triplet_loss", "tripletloss",
                "triplet_loss_simple", "tripletlosssimple", "labelmapping", "debug"}
_RUN_SOFTMAX_LOSSES = {"softmaxwithloss", "softmaxcrossentropy_loss", "softmaxcrossentropyloss",
                       "softmaxcrossentropy2_loss", "softmaxcrossentropy2loss"}


# ---- the RUN net ------------------------------------------------------------------------------------------

def is_mycaffe_net(net):
    """What only MyCaffe writes: a RUN phase rule, the IMAGEDB backend or one of its own fields."""
    for lp in net.layer:
        if any(r.HasField("phase") and r.phase == caffe_pb2.RUN for r in (*lp.include, *lp.exclude)):
            return True
        if lp.HasField("data_param") and lp.data_param.backend == caffe_pb2.DataParameter.IMAGEDB:
            return True
        if lp.HasField("lstm_attention_param") or lp.HasField("normalization2_param") or lp.freeze_learning \
                or lp.inner_product_param.enable_noise:
            return True
    return False


def _run_rules(lp):
    """(keep, include phases) of a layer in MyCaffe's RUN net read as caffeq's TEST net, the TRAIN net unchanged;
    (True, None) where its rules name no phase.

    The TRAIN net as Caffe filters it (the include rules, else the exclude rules).  The RUN net as
    CreateModelForRunning, then Net.FilterNet at RUN, build it: an exclude at RUN, or include rules that name
    TRAIN or TEST and not RUN, leave a layer out; an exclude at TEST or TRAIN does not (its phase is not RUN),
    nor do the types it drops (_RUN_DROPPED).  A data layer stays in the TEST net as Caffe's TEST net has it: it is
    the graph input that MyCaffe's RUN net names after it."""
    run, test, train = caffe_pb2.RUN, caffe_pb2.TEST, caffe_pb2.TRAIN
    if not any(r.HasField("phase") for r in (*lp.include, *lp.exclude)) and lp.type.lower() not in _RUN_DROPPED:
        return True, None
    excluded = {r.phase for r in lp.exclude if r.HasField("phase")}
    included = {r.phase if r.HasField("phase") else None for r in lp.include}

    def caffe_net(phase):
        return phase in included or None in included if lp.include else phase not in excluded

    if lp.type in _DATA_TYPES:
        in_run = caffe_net(test)
    elif run in excluded or lp.type.lower() in _RUN_DROPPED:
        in_run = False
    else:
        in_run = not lp.include or bool(included & {run, None})
    phases = [p for p, keep in ((train, caffe_net(train)), (test, in_run)) if keep]
    return bool(phases), phases


@net_rewrite
def mycaffe_run_net(net, source=""):
    """A MyCaffe net's rules rewritten so that caffeq's TEST net is MyCaffe's RUN net (its TRAIN net unchanged)."""
    if not is_mycaffe_net(net):
        return []
    where = f"{source + ': ' if source else ''}"
    kept, dropped, notes = [], [], []
    softmax = any(lp.type.lower() == "softmax" and (not lp.include or any(
        not r.HasField("phase") or r.phase == caffe_pb2.RUN for r in lp.include)) for lp in net.layer)
    for lp in net.layer:
        keep, phases = _run_rules(lp)
        kind = lp.type.lower()
        if kind in _RUN_SOFTMAX_LOSSES and keep and softmax:
            phases = [p for p in (phases or (caffe_pb2.TRAIN,)) if p != caffe_pb2.TEST]
            keep = bool(phases)
        if not keep:
            dropped.append(lp.name)
            continue
        if phases is not None:
            del lp.include[:]
            del lp.exclude[:]
            for p in phases:
                lp.include.add(phase=p)
        run_form = kind in _RUN_SOFTMAX_LOSSES or (kind == "decode" and len(lp.bottom) > 1)
        if run_form and (phases is None or caffe_pb2.TEST in phases):
            run = lp
            if phases is None or caffe_pb2.TRAIN in phases:   # the TRAIN net keeps the layer as written
                run = type(lp)()
                run.CopyFrom(lp)
                del lp.include[:]
                lp.include.add(phase=caffe_pb2.TRAIN)
                kept.append(lp)
            del run.include[:]
            run.include.add(phase=caffe_pb2.TEST)
            del run.bottom[1:]   # a Decode's labels only train; the Softmax reads the loss's first bottom
            if kind in _RUN_SOFTMAX_LOSSES:
                run.type = "Softmax"
                del run.loss_weight[:]
                run.ClearField("loss_param")
                del run.propagate_down[:]
                notes.append(f"{where}layer '{run.name}': {lp.type} read as a Softmax of its first bottom in the RUN "
                             f"net, as MyCaffe's CreateModelForRunning turns it where the net has no Softmax")
            lp = run
        kept.append(lp)
    del net.layer[:]
    net.layer.extend(kept)
    notes.insert(0, f"{where}MyCaffe's RUN net read as the TEST net (ProjectEx.CreateModelForRunning): layers "
                 f"excluded at RUN, included only at TRAIN or TEST, or of the types it drops are left out"
                 + (f" ({len(dropped)}: {', '.join(map(repr, dropped[:4]))}{', ...' if len(dropped) > 4 else ''})"
                    if dropped else ""))
    notes.extend(_run_input(net, where))
    return notes


def _run_input(net, where):
    """MyCaffe names the RUN net's input after the data layer's first top and gives that name to the first
    layer's first bottom; where that bottom has no producer, it is renamed so (with a note)."""
    from ..ir import filter_layers
    layers = filter_layers(net, "TEST")
    data = [lp for lp in layers if lp.type in _DATA_TYPES and len(lp.top)]
    rest = [lp for lp in layers if lp.type not in _DATA_TYPES and lp.type != "Input"]
    if not data or not rest or not len(rest[0].bottom):
        return []
    first, name = rest[0], data[0].top[0]
    produced = {t for lp in layers for t in lp.top}
    old = first.bottom[0]
    if old == name or old in produced:
        return []
    first.bottom[0] = name
    return [f"{where}layer '{first.name}': bottom '{old}' (made by a layer MyCaffe's RUN net leaves out) read as "
            f"the data layer's top '{name}', as MyCaffe names its RUN net's input"]


# ---- noisy InnerProduct -------------------------------------------------------------------------------------

def _noisy(lp):
    p = lp.inner_product_param
    return "enable_noise" in p.DESCRIPTOR.fields_by_name and p.enable_noise


@claim_layers("InnerProduct", _noisy)
class NoisyInnerProduct(InnerProduct):
    """MyCaffe's InnerProduct with enable_noise: four blobs; at TEST / RUN forward uses the weight and bias only."""
    blob_names = ("weight", "bias", "sigma_weight", "sigma_bias")

    def parse(self, lp):
        attrs = super().parse(lp)
        if attrs["normalize"]:
            raise LayerError("inner_product_param.enable_noise does not combine with normalize")
        attrs["sigma_init"] = float(lp.inner_product_param.sigma_init)
        return attrs

    def blob_names_for(self, attrs):
        return self.blob_names if attrs["bias_term"] else ("weight", "sigma_weight")

    def param_shapes(self, attrs, in_shapes):
        shapes = super().param_shapes(attrs, in_shapes)
        return shapes + shapes   # sigma_wt like the weight, sigma_bias like the bias

    def init_params(self, attrs, shapes, rng):
        blobs = super().init_params(attrs, shapes[:len(shapes) // 2], rng)
        # InnerProductLayer.cs: sigma = sigma_init / sqrt(fan in) (sigma_bias: / sqrt(num_output))
        sigma = [np.full(s, attrs["sigma_init"] / np.sqrt(s[-1] if len(s) > 1 else s[0]), np.float32)
                 for s in shapes[len(shapes) // 2:]]
        return blobs + sigma

    def forward(self, attrs, params, x):
        return super().forward(attrs, params[:len(params) // 2], x)


# ---- Normalization2 -----------------------------------------------------------------------------------------

@register_layer("Normalization2")
class Normalization2(NormalizeLayer):
    """MyCaffe's Normalization2: SSD's Normalize read from normalization2_param."""

    def parse(self, lp):
        need_blobs(lp, "Normalization2", 1, 1)
        p = lp.normalization2_param
        attrs = {"across_spatial": bool(p.across_spatial), "channel_shared": bool(p.channel_shared),
                 "eps": float(p.eps), "fill": 1.0}
        if p.HasField("scale_filler"):
            if p.scale_filler.type != "constant":
                raise LayerError(f"normalization2_param.scale_filler type '{p.scale_filler.type}': only 'constant' is "
                                 f"supported for filling a missing scale blob")
            attrs["fill"] = float(p.scale_filler.value)
        if attrs["eps"] < 0:
            raise LayerError(f"normalization2_param.eps must be >= 0, got {attrs['eps']}")
        return attrs


# ---- Decode -------------------------------------------------------------------------------------------------

_MYCAFFE_DECODE_FIELDS = ("centroid_output_iteration", "enable_centroid_update", "cache_size", "output_centroids",
                          "target", "pregen_alpha", "pregen_label_count", "k")


def _mycaffe_decode(lp):
    """MyCaffe's Decode (centroid distances; its writer sets its decode_param fields), not
    caffe-3dnormal_joint_past's (a codebook it reads from files)."""
    p = lp.decode_param
    return not p.source_dict and not p.source_triids and \
        (any(p.HasField(f) for f in _MYCAFFE_DECODE_FIELDS) or len(p.ignore_labels) > 0)


def centroid_distances(x, centroids, ignore: list):
    """MyCaffe's Decode at TEST / RUN: (N, L, 1, 1) squared distances of each row of x to each centroid row;
    the ignored labels' columns hold float's maximum."""
    flat = x.flatten(1)
    c = centroids.reshape(centroids.shape[0], -1)
    d = ((flat.unsqueeze(1) - c.unsqueeze(0)) ** 2).sum(dim=2)
    if ignore:
        keep = torch.ones(c.shape[0], dtype=torch.bool, device=x.device)
        keep[ignore] = False
        d = torch.where(keep, d, torch.full_like(d, 3.4028234663852886e38))
    return d.reshape(d.shape[0], d.shape[1], 1, 1)


@claim_layers("Decode", _mycaffe_decode)
class MyCaffeDecode(Layer):
    blob_names = ("centroids", "status", "encoding_counts")
    buffer_blobs = (0, 1, 2)

    def parse(self, lp):
        need_blobs(lp, "Decode", (1, 2), 1, "encodings, labels")
        p = lp.decode_param
        if p.target == caffe_pb2.DecodeParameter.KNN:
            raise LayerError("decode_param.target KNN (nearest encodings of a training cache) is not run by caffeq; "
                             "CENTROID and PREGEN are")
        if p.pregen_label_count < 1:
            raise LayerError("decode_param.pregen_label_count must give the label count (MyCaffe sizes the centroids "
                             "to the largest training label + 1)")
        labels = int(p.pregen_label_count)
        bad = [i for i in p.ignore_labels if not 0 <= i < labels]
        if bad:
            raise LayerError(f"decode_param.ignore_labels {bad} outside the {labels} labels")
        return {"labels": labels, "ignore": sorted(set(int(i) for i in p.ignore_labels))}

    def infer(self, attrs, in_shapes):
        s = in_shapes[0]
        attrs["_dim"] = int(np.prod(s[1:]))
        return [(s[0], attrs["labels"], 1, 1)]

    def param_shapes(self, attrs, in_shapes):
        n = attrs["labels"]
        return [(n, int(np.prod(in_shapes[0][1:])), 1, 1), (n, 1, 1, 1), (n, 1, 1, 1)]

    def init_params(self, attrs, shapes, rng):
        return [rng.standard_normal(shapes[0]).astype(np.float32), np.ones(shapes[1], np.float32),
                np.zeros(shapes[2], np.float32)]

    def forward(self, attrs, params, x):
        return centroid_distances(x, params[0], attrs["ignore"])

    def macs(self, attrs, in_shapes, out_shapes):
        return in_shapes[0][0] * attrs["labels"] * attrs["_dim"]

    def onnx(self, ctx, node):
        a = node.attrs
        x = node.inputs[0]
        n, labels = ctx.shape(x)[0], a["labels"]
        flat = ctx.op("Reshape", [x, ctx.i64([n, 1, a["_dim"]])], "rows")
        c = ctx.op("Reshape", [ctx.weight(node, 0), ctx.i64([1, labels, a["_dim"]])], "centroids")
        diff = ctx.op("Sub", [flat, c], "diff")
        sq = ctx.op("Mul", [diff, diff], "sq")
        d = ctx.op("ReduceSum", [sq, ctx.i64([2])], "dist", keepdims=0)
        if a["ignore"]:
            mask = np.zeros((1, labels), bool)
            mask[0, a["ignore"]] = True
            d = ctx.op("Where", [ctx.const(mask), ctx.f32(_FLT_MAX), d], "ignored")
        ctx.add_node("Reshape", [d, ctx.i64([n, labels, 1, 1])], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        c = emit.module(f"nn.Parameter(torch.zeros({tuple(emit.blob(0).shape)}))")
        emit.param("", 0)
        return f"{emit.helper(centroid_distances)}({emit.inputs[0]}, {c}, {node.attrs['ignore']!r})"


# ---- LstmAttention ------------------------------------------------------------------------------------------

def mycaffe_lstm(x, clip, w_i, w_h, bias):
    """MyCaffe's LstmAttention forward without attention: x (T, N, ...), clip (T, N) or None; returns (T, N, H)."""
    steps, batch = x.shape[0], x.shape[1]
    hidden = w_h.shape[1]
    pre = F.linear(x.reshape(steps, batch, -1), w_i, bias)
    if clip is None:
        clip = (torch.arange(steps, device=x.device) > 0).to(x.dtype).reshape(steps, 1).expand(steps, batch)
    clip = clip.reshape(steps, batch).to(x.dtype)
    h = x.new_zeros(batch, hidden)
    c = x.new_zeros(batch, hidden)
    out = []
    for t in range(steps):
        k = clip[t].unsqueeze(1)
        g = pre[t] + k * F.linear(h, w_h)
        i_t = torch.sigmoid(g[:, :hidden])
        f_t = torch.sigmoid(g[:, hidden:2 * hidden])
        o_t = torch.sigmoid(g[:, 2 * hidden:3 * hidden])
        g_t = torch.tanh(g[:, 3 * hidden:])
        c = k * f_t * c + i_t * g_t
        h = o_t * torch.tanh(c)
        out.append(h)
    top = torch.stack(out)
    # calculate_maxT: the steps after max_n sum_t clip[t, n] (+1 when clip[0, 0] is 0) are never computed
    if clip.numel() > 1:
        max_t = clip.sum(dim=0).max() + (clip[0, 0] == 0).to(x.dtype)
        ran = torch.arange(steps, device=x.device).to(x.dtype).reshape(steps, 1, 1) < max_t
        top = torch.where(ran, top, torch.zeros_like(top))
    return top


@register_layer("LstmAttention")
class LstmAttention(Layer):
    blob_names = ("weight_i", "weight_h", "bias")
    reading_note = ("LstmAttention (MyCaffe) starts from a zero state: a MyCaffe layer whose clip starts at 1 "
                    "carries the last step's state over from its previous forward pass")

    def parse(self, lp):
        p = lp.lstm_attention_param
        need_blobs(lp, "LstmAttention", (1, 2, 3, 4), 1, "x, clip, encoding, encoding clip")
        if not p.HasField("num_output") or p.num_output < 1:
            raise LayerError("lstm_attention_param.num_output is required")
        attrs = {"name": lp.name, "hidden": int(p.num_output), "attention": bool(p.enable_attention),
                 "ip": int(p.num_output_ip), "clip": len(lp.bottom) > 1}
        if not attrs["attention"] and len(lp.bottom) > 2:
            raise LayerError("LstmAttention without enable_attention takes two bottoms at most: x, clip")
        return attrs

    def infer(self, attrs, in_shapes):
        x = in_shapes[0]
        if len(x) < 2:
            raise LayerError(f"LstmAttention needs a (T, N, ...) input, got {list(x)}")
        if attrs["clip"] and int(np.prod(in_shapes[1])) != x[0] * x[1]:
            raise LayerError(f"LstmAttention: the clip {list(in_shapes[1])} must hold T x N = {x[0] * x[1]} values")
        attrs["_input"] = int(np.prod(x[2:]))
        return [(x[0], x[1], attrs["ip"] or attrs["hidden"])]

    def param_shapes(self, attrs, in_shapes):
        h, i = attrs["hidden"], int(np.prod(in_shapes[0][2:]))
        shapes = [(4 * h, i), (4 * h, h), (4 * h,)]
        if attrs["ip"]:
            shapes += [(h, attrs["ip"]), (1, attrs["ip"])]   # Whd (H, ip), Whdb (1, ip) as LSTMAttentionLayer.cs
        if attrs["attention"]:
            shapes.append((4 * h, i))
        return shapes

    def cannot_run(self, attrs, in_shapes):
        if attrs["attention"]:
            return "enable_attention (its 4-bottom encoder attention) is read with shapes but not run by caffeq"
        if attrs["ip"]:
            return "num_output_ip (its output projection) is read with shapes but not run by caffeq"
        return None

    def forward(self, attrs, params, x, clip=None):
        self.refuse_if_cannot_run(attrs["name"], attrs, [tuple(x.shape)], LayerError)
        return mycaffe_lstm(x, clip, params[0], params[1], params[2])

    def macs(self, attrs, in_shapes, out_shapes):
        t, n = in_shapes[0][0], in_shapes[0][1]
        return t * n * 4 * attrs["hidden"] * (attrs["_input"] + attrs["hidden"])

    def pytorch_source(self, node, emit):
        self.refuse_if_cannot_run(node.name, node.attrs, [emit.in_shape(0)], ExportError)
        names = []
        for i, name in enumerate(("weight_i", "weight_h", "bias")):
            names.append(emit.module(f"nn.Parameter(torch.zeros({tuple(emit.blob(i).shape)}))", attr=None
                                     if i == 0 else emit.extra_attr(name)))
        emit.param("", 0)
        emit.param("", 1, attr=names[1][len("self."):])
        emit.param("", 2, attr=names[2][len("self."):])
        clip = emit.inputs[1] if node.attrs["clip"] else "None"
        return f"{emit.helper(mycaffe_lstm)}({emit.inputs[0]}, {clip}, {', '.join(names)})"

    def onnx(self, ctx, node):
        a = node.attrs
        self.refuse_if_cannot_run(node.name, a, [ctx.shape(node.inputs[0])], ExportError)
        x = node.inputs[0]
        steps, batch = ctx.shape(x)[0], ctx.shape(x)[1]
        h_dim = a["hidden"]
        rows = ctx.op("Reshape", [x, ctx.i64([steps, batch, a["_input"]])], "x")
        w_i = ctx.weight(node, 0, transpose=True)
        w_h = ctx.weight(node, 1, transpose=True)
        pre = ctx.op("Add", [ctx.op("MatMul", [rows, w_i], "xw"), ctx.weight(node, 2)], "pre")
        if a["clip"]:
            clip = ctx.op("Reshape", [node.inputs[1], ctx.i64([steps, batch, 1])], "clip")
        else:
            clip = ctx.const((np.arange(steps) > 0).astype(np.float32).reshape(steps, 1, 1) *
                             np.ones((1, batch, 1), np.float32), node.name + "_clip")
        h = c = ctx.const(np.zeros((batch, h_dim), np.float32), node.name + "_zero")
        outs = []
        split = ctx.i64([h_dim] * 4)
        for t in range(steps):
            k = ctx.op("Gather", [clip, ctx.i64(t)], f"k{t}", axis=0)
            pre_t = ctx.op("Gather", [pre, ctx.i64(t)], f"pre{t}", axis=0)
            g = ctx.op("Add", [pre_t, ctx.op("Mul", [k, ctx.op("MatMul", [h, w_h], f"hw{t}")], f"khw{t}")], f"g{t}")
            gi, gf, go, gg = ctx.add_node("Split", [g, split], [ctx.tmp(f"{node.name}_{q}{t}") for q in "ifog"],
                                          axis=1)
            i_t = ctx.op("Sigmoid", [gi], f"i{t}")
            f_t = ctx.op("Sigmoid", [gf], f"f{t}")
            o_t = ctx.op("Sigmoid", [go], f"o{t}")
            g_t = ctx.op("Tanh", [gg], f"gt{t}")
            c = ctx.op("Add", [ctx.op("Mul", [ctx.op("Mul", [k, f_t], f"kf{t}"), c], f"kfc{t}"),
                               ctx.op("Mul", [i_t, g_t], f"ig{t}")], f"c{t}")
            h = ctx.op("Mul", [o_t, ctx.op("Tanh", [c], f"tc{t}")], f"h{t}")
            outs.append(ctx.op("Unsqueeze", [h, ctx.i64([0])], f"hu{t}"))
        top = ctx.op("Concat", outs, "top", axis=0) if len(outs) > 1 else outs[0]
        if steps * batch > 1:
            flat = ctx.op("Reshape", [clip, ctx.i64([steps, batch])], "clip2")
            total = ctx.op("ReduceMax", [ctx.op("ReduceSum", [flat, ctx.i64([0])], "per_n", keepdims=0)], "max_sum",
                           keepdims=0)
            first = ctx.op("Gather", [ctx.op("Reshape", [flat, ctx.i64([-1])], "clip1"), ctx.i64(0)], "first", axis=0)
            extra = ctx.op("Cast", [ctx.op("Equal", [first, ctx.f32(0.0)], "first0")], "extra", to=1)
            max_t = ctx.op("Add", [total, extra], "max_t")
            ran = ctx.op("Less", [ctx.const(np.arange(steps, dtype=np.float32).reshape(steps, 1, 1)), max_t], "ran")
            top = ctx.op("Where", [ran, top, ctx.f32(0.0)], "masked")
        ctx.add_node("Identity", [top], [node.outputs[0]], name=node.name)


__all__ = ["LstmAttention", "MyCaffeDecode", "Normalization2", "NoisyInnerProduct", "centroid_distances",
           "is_mycaffe_net", "mycaffe_lstm", "mycaffe_run_net"]
