"""MyCaffe (MyCaffe/MyCaffe b8922aa, C#): its Temporal Fusion Transformer layers at TEST / RUN.

Sources (facts read from the C#; no code carried over): MyCaffe.layers.tft/layers.tft/*.cs, MyCaffe/param.tft/*.cs,
the layers they build (MyCaffe/layers/InnerProductLayer.cs, ELULayer.cs, RecurrentLayer.cs, MyCaffe.layers.gpt/
layers.gpt/LayerNormLayer.cs) and CudaDnnDLL/Cuda Files/math.cu (channel_copy, channel_mulv, channel_sum, mask_batch).
Every inner InnerProduct is Caffe's (y = x flattened from `axis` times W^T (O, K) + b (O)); dropout is the identity
at TEST / RUN.  Inner layer norm (LayerNormLayer.cs forward_local): over the last axis of a 2-axis blob, else over
the axes from 2 on: (x - mean) / sqrt(var + eps), var the mean of the squares, no scale or shift.
  - DataTemporal (DataTemporalLayer.cs, RawFileData / DataNpy.GetShape): a data layer; tops ns (B, static numeric),
    cs (B, static categorical), nh / ch (B, T_hist, F), nf / cf (B, T_fut, F) (not with ignore_future_data),
    trg (B, T_fut, 1), then trgh, tm, msk (B, T_hist, 1) and ids (B, 1, 1, 1) as their output_* flags ask.  The
    feature counts live in the data set's schema: caffeq reads them from the num_input of the ChannelEmbedding
    layers that take the tops (a note says so; 0 where none), or --input-shape.
  - ChannelEmbedding (ChannelEmbeddingLayer.cs, NumericTransformationLayer.cs, CategoricalTransformationLayer.cs):
    bottoms numeric, categorical (a side with num_input 0 is ignored).  Numeric input i: every num_input-th value
    from i, rows of count(from axis 1 or 2) / num_input, through its own InnerProduct (state_size, bias); categorical
    input i: column i as an index into its Embed table (cardinality[i], state_size) (+ bias with bias_term).  Top
    (N[, T], (numeric + categorical inputs) x state_size), numeric blocks first; the two state_size must agree
    (MyCaffe sizes the top with the categorical one and fills it with the numeric one's stride).
  - GRN, MyCaffe's (GrnLayer.cs; chosen over FoodDist's by grn_param's input / hidden / output_dim): residual x (or
    a skip InnerProduct when input_dim != output_dim), h = fc1(x) (+ context(c) without bias, a second bottom), ELU
    (alpha 1, exp(h) - 1) or ReLU, fc2, GLU, then layer norm (eps 1e-10) of GLU + residual.  Blobs: [skip w, b],
    fc1 w, b, [context w], fc2 w, b, GLU's four.
  - GLU (GluLayer.cs, inside GRN and GateAddNorm): fc2(x) * sigmoid(fc1(x)), both input_dim wide.
  - GateAddNorm (GateAddNormLayer.cs): layer norm (layer_norm_param.epsilon) of GLU(x) + residual, the residual
    bottom 1 from channel residual_channel_offset on (channel_copy of the last block), none with one bottom;
    layer_norm_param.enable_passthrough leaves the norm out (LayerNormLayer.forward copies its bottom).
  - VarSelNet (VarSelNetLayer.cs): x (N, num_inputs x input_dim); s = GRN_flat(x[, context]) (num_inputs x
    input_dim -> hidden -> num_inputs), w = softmax(s) over varselnet_param.axis; top 0 = sum_i w_i GRN_i(x_i)
    (input_dim -> hidden -> hidden), top 1 = s (before the softmax, as the C# copies it).  input_dim must equal
    hidden_dim: MyCaffe stacks the GRN_i outputs with input_dim's stride (channel_copy with m_blobGrn1.channels),
    which leaves part of the weighted sum unwritten otherwise.
The temporal layers (ReshapeTemporal, MultiheadAttentionInterp, MyCaffe's Lstm, the quantile losses) are in
mycaffe_tft_temporal.py; the pieces both modules share in mycaffe_tft_ops.py.
"""


from ..errors import ExportError
from ..io.schema import caffe_pb2
from .mycaffe_tft_ops import (
    TFT_TORCH,
    TftOnnx,
    emit_tft_blobs,
    grn_shapes,
    init_tft_blobs,
    ip_shapes,
    lead_and_width,
    tft_channel_embedding,
    tft_gate_add_norm,
    tft_glu,
    tft_grn,
    tft_layer_norm,
    tft_linear,
    tft_varselnet,
)
from .registry import (
    Layer,
    LayerError,
    claim_layers,
    count,
    need_blobs,
    needs_input_shape,
    net_rewrite,
    positive_field,
    register_layer,
    torch_sources,
)

# ---- DataTemporal ---------------------------------------------------------------------------------------------

_FEATURE_TOPS = ("ns", "cs", "nh", "ch", "nf", "cf")


def _data_temporal_tops(p):
    names = ["ns", "cs", "nh", "ch"] + ([] if p.ignore_future_data else ["nf", "cf"]) + ["trg"]
    names += [n for n, f in (("trgh", p.output_target_historical), ("tm", p.output_time), ("msk", p.output_mask),
                             ("ids", p.output_item_ids)) if f]
    return names


@register_layer("DataTemporal")
class DataTemporal(Layer):
    is_data = True

    def parse(self, lp):
        p = lp.data_temporal_param
        roles = _data_temporal_tops(p)
        need_blobs(lp, "DataTemporal (" + ", ".join(roles) + ")", 0, len(roles))
        attrs = {"name": lp.name, "tops": list(lp.top), "roles": roles, "source": p.source,
                 "batch": positive_field(p.batch_size, "data_temporal_param.batch_size"),
                 "hist": positive_field(p.num_historical_steps, "data_temporal_param.num_historical_steps"),
                 "fut": int(p.num_future_steps), "features": {}}
        for s, role in zip(lp.input_param.shape, roles):   # the feature counts mycaffe_tft_net found
            if role in _FEATURE_TOPS and len(s.dim) and s.dim[-1] >= 0:
                attrs["features"][role] = int(s.dim[-1])
        return attrs

    def infer(self, attrs, in_shapes):
        return self.top_shapes(attrs, {})

    def top_shapes(self, attrs, given):
        b, th, tf = attrs["batch"], attrs["hist"], attrs["fut"]
        lead = {"ns": (b,), "cs": (b,), "nh": (b, th), "ch": (b, th), "nf": (b, tf), "cf": (b, tf)}
        out = []
        for i, role in enumerate(attrs["roles"]):
            if given.get(i) is not None:
                out.append(tuple(given[i]))
            elif role in lead:
                if role not in attrs["features"]:
                    raise needs_input_shape(attrs, attrs["tops"][i], "its feature count lives in the data set's "
                                            "schema and no ChannelEmbedding layer takes it")
                out.append(lead[role] + (attrs["features"][role],))
            elif role == "trg":
                out.append((b, tf, 1))
            elif role == "ids":
                out.append((b, 1, 1, 1))
            else:
                out.append((b, th, 1))
        return out

    def preprocessing(self, attrs):
        return [f"MyCaffe's temporal data set {attrs['source']!r} (numpy files or its SQL database): static, "
                f"historical ({attrs['hist']} steps) and future ({attrs['fut']} steps) numeric and categorical "
                f"values, as its preprocessing scripts wrote them"]


def _producers(net):
    made = {}
    for i, lp in enumerate(net.layer):
        for t in lp.top:
            made.setdefault(t, []).append(i)
    return made


def _feature_counts(net, lp):
    """{role: count} from the ChannelEmbedding layers that take lp's tops."""
    roles = dict(zip(lp.top, _data_temporal_tops(lp.data_temporal_param)))
    found = {}
    for other in net.layer:
        if other.type != "ChannelEmbedding" or len(other.bottom) != 2:
            continue
        for b, n in zip(other.bottom, (other.numeric_trans_param.num_input, other.categorical_trans_param.num_input)):
            if roles.get(b) in _FEATURE_TOPS:
                found.setdefault(roles[b], int(n))
    return found


def _before_source(net, index, blob):
    """The (N, T, ...) bottom of the ReshapeTemporal BEFORE whose blob parameters reach `blob`, read by layer
    `index` (Layer.Setup copies bottom i's parameters to top i), or None."""
    made = _producers(net)
    while True:
        earlier = [i for i in made.get(blob, []) if i < index]
        if not earlier:
            return None
        index = earlier[-1]
        lp = net.layer[index]
        k = list(lp.top).index(blob)
        if lp.type == "ReshapeTemporal" and lp.reshape_temporal_param.mode == caffe_pb2.ReshapeTemporalParameter.BEFORE:
            if k:
                return None
            # Setup sets the parameters, then copies bottom 0's over them: an earlier BEFORE's win
            return _before_source(net, index, lp.bottom[0]) or lp.bottom[0]
        if k >= len(lp.bottom):
            return None
        blob = lp.bottom[k]


@net_rewrite
def mycaffe_tft_net(net, source=""):
    """DataTemporal's feature counts from the ChannelEmbedding layers; ReshapeTemporal AFTER's N and T from its
    BEFORE layer's input, given as a third, shape-only bottom."""
    where = f"{source + ': ' if source else ''}"
    notes = []
    for index, lp in enumerate(net.layer):
        if lp.type == "DataTemporal" and not len(lp.input_param.shape):
            counts = _feature_counts(net, lp)
            for role in _data_temporal_tops(lp.data_temporal_param)[:len(lp.top)]:
                lp.input_param.shape.add(dim=[counts.get(role, -1)] if role in _FEATURE_TOPS else [])
            if counts:
                notes.append(f"{where}layer '{lp.name}' (DataTemporal): the feature counts of its tops read from the "
                             f"ChannelEmbedding layers that take them ({', '.join(f'{r} {n}' for r, n in counts.items())}"
                             f"); MyCaffe reads them from the data set's schema")
        if (lp.type == "ReshapeTemporal" and lp.reshape_temporal_param.mode == caffe_pb2.ReshapeTemporalParameter.AFTER
                and len(lp.bottom) in (1, 2)):
            src = _before_source(net, index, lp.bottom[0])
            if src is None:
                continue
            if len(lp.bottom) == 1:
                lp.bottom.append(lp.bottom[0])
            lp.bottom.append(src)
            notes.append(f"{where}layer '{lp.name}' (ReshapeTemporal AFTER): its num_samples and num_temporal_steps "
                         f"(MyCaffe's blob parameters) taken from '{src}', the input of the BEFORE layer they come "
                         f"from, given to it as a shape-only bottom")
    return list(dict.fromkeys(notes))


# ---- ChannelEmbedding -----------------------------------------------------------------------------------------

@register_layer("ChannelEmbedding")
class ChannelEmbedding(Layer):

    def parse(self, lp):
        need_blobs(lp, "ChannelEmbedding", 2, 1, "numeric, categorical")
        n, c = lp.numeric_trans_param, lp.categorical_trans_param
        attrs = {"name": lp.name, "n_num": int(n.num_input), "n_cat": int(c.num_input), "cards": [int(v) for v in c.cardinality],
                 "bias": bool(c.bias_term), "state": int(c.state_size)}
        if not attrs["n_num"] and not attrs["n_cat"]:
            raise LayerError("ChannelEmbedding: numeric_trans_param.num_input or categorical_trans_param.num_input "
                             "must be > 0")
        if attrs["n_cat"] and len(attrs["cards"]) != attrs["n_cat"]:
            raise LayerError(f"categorical_trans_param gives {len(attrs['cards'])} cardinality values for "
                             f"num_input {attrs['n_cat']}")
        if int(n.state_size) != attrs["state"]:   # the top is sized with the one and filled with the other
            raise LayerError(f"numeric_trans_param.state_size {n.state_size} and categorical_trans_param.state_size "
                             f"{c.state_size} differ (MyCaffe sizes the top with the one, fills it with the other)")
        positive_field(attrs["state"], "categorical_trans_param.state_size")
        if any(v < 1 for v in attrs["cards"]):
            raise LayerError(f"categorical_trans_param.cardinality must be >= 1, got {attrs['cards']}")
        return attrs

    def infer(self, attrs, in_shapes):
        num, cat = in_shapes
        used = [s for s, k in ((num, attrs["n_num"]), (cat, attrs["n_cat"])) if k]
        if len({len(s) for s in used}) > 1 or len({s[:-1] for s in used}) > 1:
            raise LayerError(f"ChannelEmbedding: the numeric {list(num)} and categorical {list(cat)} bottoms must "
                             f"share their leading axes")
        s = used[0]
        if len(s) not in (2, 3):
            raise LayerError(f"ChannelEmbedding takes (N, F) or (N, T, F) bottoms, got {list(s)}")
        if attrs["n_num"] and num[-1] % attrs["n_num"]:
            raise LayerError(f"ChannelEmbedding: the numeric bottom's {num[-1]} values per row do not split into "
                             f"num_input {attrs['n_num']}")
        if attrs["n_cat"] and cat[-1] != attrs["n_cat"]:
            raise LayerError(f"ChannelEmbedding: the categorical bottom has {cat[-1]} columns for num_input "
                             f"{attrs['n_cat']}")
        attrs["_spatial"] = num[-1] // attrs["n_num"] if attrs["n_num"] else 0
        return [tuple(s[:-1]) + ((attrs["n_num"] + attrs["n_cat"]) * attrs["state"],)]

    def param_shapes(self, attrs, in_shapes):
        self.infer(attrs, in_shapes)
        e = attrs["state"]
        shapes = ip_shapes(attrs["_spatial"], e) * attrs["n_num"]
        for card in attrs["cards"]:
            shapes += [(card, e)] + ([(e,)] if attrs["bias"] else [])
        return shapes

    def init_params(self, attrs, shapes, rng):
        return init_tft_blobs(shapes, rng)

    def cannot_run(self, attrs, in_shapes):
        if attrs["n_cat"] > 1 and len(in_shapes[1]) == 2:
            return ("a 2-axis categorical bottom with several inputs: MyCaffe's channel_copy reads it with the "
                    "bottom's channels as time steps, across the samples")
        return None

    def forward(self, attrs, params, num, cat):
        self.refuse_if_cannot_run(attrs["name"], attrs, [tuple(num.shape), tuple(cat.shape)], LayerError)
        return tft_channel_embedding(num, cat, list(params), attrs["n_num"], attrs["n_cat"], attrs["bias"])

    def pytorch_source(self, node, emit):
        a = node.attrs
        self.refuse_if_cannot_run(node.name, a, [emit.in_shape(0), emit.in_shape(1)], ExportError)
        emit.helper(torch_sources(tft_linear))
        blobs = emit_tft_blobs(emit, node, [b.shape for b in node.blobs])
        return (f"{emit.helper(tft_channel_embedding)}({emit.inputs[0]}, {emit.inputs[1]}, {blobs}, {a['n_num']}, "
                f"{a['n_cat']}, {a['bias']})")

    def onnx(self, ctx, node):
        a = node.attrs
        num, cat = node.inputs
        self.refuse_if_cannot_run(node.name, a, [ctx.shape(num), ctx.shape(cat)], ExportError)
        b = TftOnnx(ctx, node)
        s = ctx.shape(num) if a["n_num"] else ctx.shape(cat)
        rows = count(s, 0, len(s) - 1)
        parts, k = [], 0
        if a["n_num"]:
            cols = ctx.op("Reshape", [num, ctx.i64([-1, a["n_num"]])], "num_cols")
            for i in range(a["n_num"]):
                col = ctx.op("Gather", [cols, ctx.i64(i)], f"num{i}", axis=1)
                y, _ = b.linear(col, (rows, a["_spatial"]), k, k + 1, 1)
                parts.append(y)
                k += 2
        if a["n_cat"]:
            cols = ctx.op("Reshape", [cat, ctx.i64([-1, a["n_cat"]])], "cat_cols")
            for i in range(a["n_cat"]):
                col = ctx.op("Gather", [cols, ctx.i64(i)], f"cat{i}", axis=1)
                idx = ctx.op("Cast", [ctx.trunc(col)], f"idx{i}", to=7)
                y = ctx.op("Gather", [ctx.weight(node, k), idx], f"emb{i}", axis=0)
                k += 1
                if a["bias"]:
                    y = ctx.op("Add", [y, ctx.weight(node, k)], f"emb_b{i}")
                    k += 1
                parts.append(y)
        stacked = [ctx.op("Unsqueeze", [p, ctx.i64([1])], "unsq") for p in parts]
        cat_all = ctx.op("Concat", stacked, "blocks", axis=1) if len(stacked) > 1 else stacked[0]
        ctx.add_node("Reshape", [cat_all, ctx.i64(list(ctx.shape(node.outputs[0])))], [node.outputs[0]],
                     name=node.name)


# ---- GRN (MyCaffe's) ------------------------------------------------------------------------------------------

_GRN_FIELDS = ("input_dim", "hidden_dim", "output_dim", "context_dim", "activation", "axis", "batch_first",
               "weight_filler", "bias_filler", "dropout_ratio", "enable_noise", "sigma_init")


def _mycaffe_grn(lp):
    """MyCaffe's GRN sets its grn_param's dimensions; FoodDist's (GRN normalization) sets bias only."""
    p = lp.grn_param
    return any(f in p.DESCRIPTOR.fields_by_name and p.HasField(f) for f in _GRN_FIELDS)


@claim_layers("GRN", _mycaffe_grn)
class MyCaffeGRN(Layer):

    def parse(self, lp):
        need_blobs(lp, "GRN (MyCaffe)", (1, 2), 1, "x, context")
        p = lp.grn_param
        attrs = {"in": positive_field(p.input_dim, "grn_param.input_dim"),
                 "hidden": positive_field(p.hidden_dim, "grn_param.hidden_dim"),
                 "out": positive_field(p.output_dim, "grn_param.output_dim"),
                 "axis": int(p.axis), "elu": p.activation == caffe_pb2.GRNParameter.ELU,
                 "context": len(lp.bottom) > 1}
        if p.enable_noise:
            attrs["reading_notes"] = ["grn_param.enable_noise: the noise only trains; TEST / RUN use the weights"]
        return attrs

    def _check(self, attrs, in_shapes):
        x = in_shapes[0]
        axis = attrs["axis"] if attrs["axis"] >= 0 else attrs["axis"] + len(x)
        lead, k = lead_and_width(x, axis, "grn_param")
        if k != attrs["in"]:
            raise LayerError(f"GRN: the bottom {list(x)} has {k} values from axis {axis}, grn_param.input_dim is "
                             f"{attrs['in']}")
        ck = None
        if attrs["context"]:
            c = in_shapes[1]
            clead, ck = lead_and_width(c, axis, "grn_param")
            if count(clead) != count(lead):
                raise LayerError(f"GRN: the context {list(c)} projects to {count(clead)} rows, the input to "
                                 f"{count(lead)}")
        return axis, lead, ck

    def infer(self, attrs, in_shapes):
        axis, lead, _ = self._check(attrs, in_shapes)
        attrs["_axis"] = axis
        return [lead + (attrs["out"],)]

    def param_shapes(self, attrs, in_shapes):
        _, _, ck = self._check(attrs, in_shapes)
        return grn_shapes(attrs["in"], attrs["hidden"], attrs["out"], ck)

    def init_params(self, attrs, shapes, rng):
        return init_tft_blobs(shapes, rng)

    def forward(self, attrs, params, x, context=None):
        return tft_grn(x, context, list(params), attrs["in"] != attrs["out"], attrs["elu"], attrs["_axis"])

    def pytorch_source(self, node, emit):
        a = node.attrs
        emit.helper(torch_sources(*TFT_TORCH))
        blobs = emit_tft_blobs(emit, node, [b.shape for b in node.blobs])
        ctx = emit.inputs[1] if a["context"] else "None"
        return f"tft_grn({emit.inputs[0]}, {ctx}, {blobs}, {a['in'] != a['out']}, {a['elu']}, {a['_axis']})"

    def onnx(self, ctx, node):
        a = node.attrs
        x = node.inputs[0]
        c = node.inputs[1] if a["context"] else None
        y, _ = TftOnnx(ctx, node).grn(x, ctx.shape(x), c, ctx.shape(c) if c else None, 0, a["in"] != a["out"],
                                    a["elu"], a["_axis"])
        ctx.add_node("Identity", [y], [node.outputs[0]], name=node.name)


# ---- GateAddNorm ----------------------------------------------------------------------------------------------

@register_layer("GateAddNorm")
class GateAddNorm(Layer):

    def parse(self, lp):
        need_blobs(lp, "GateAddNorm", (1, 2), 1, "x, residual")
        g = lp.glu_param
        if g.modulation != caffe_pb2.GluParameter.SIGMOID:
            raise LayerError("glu_param.modulation: only SIGMOID exists")
        return {"dim": positive_field(g.input_dim, "glu_param.input_dim"), "axis": int(g.axis),
                "bias": bool(g.bias_term), "offset": int(lp.gateaddnorm_param.residual_channel_offset),
                "eps": None if lp.layer_norm_param.enable_passthrough else float(lp.layer_norm_param.epsilon),
                "residual": len(lp.bottom) > 1}

    def infer(self, attrs, in_shapes):
        x = in_shapes[0]
        axis = attrs["axis"] if attrs["axis"] >= 0 else attrs["axis"] + len(x)
        lead, k = lead_and_width(x, axis, "glu_param")
        attrs["_axis"], attrs["_k"] = axis, k
        top = lead + (attrs["dim"],)
        if attrs["residual"]:
            r = in_shapes[1]
            if attrs["offset"] > 0:
                if len(r) < 2 or r[1] <= attrs["offset"] or r[1] % (r[1] - attrs["offset"]):
                    raise LayerError(f"GateAddNorm: gateaddnorm_param.residual_channel_offset {attrs['offset']} must "
                                     f"leave a part of the residual's {r[1] if len(r) > 1 else '?'} channels that "
                                     f"divides them")
                size = r[0] * (r[1] - attrs["offset"]) * count(r, 2)
            else:
                size = count(r)
            if size != count(top):
                raise LayerError(f"GateAddNorm: the residual {list(r)} (from channel {attrs['offset']}) does not match "
                                 f"the gate's {list(top)}")
        return [top]

    def param_shapes(self, attrs, in_shapes):
        self.infer(attrs, in_shapes)
        return ip_shapes(attrs["_k"], attrs["dim"], attrs["bias"]) * 2

    def init_params(self, attrs, shapes, rng):
        return init_tft_blobs(shapes, rng)

    def forward(self, attrs, params, x, residual=None):
        return tft_gate_add_norm(x, residual, list(params), attrs["bias"], attrs["_axis"], attrs["offset"],
                                 attrs["eps"])

    def pytorch_source(self, node, emit):
        a = node.attrs
        emit.helper(torch_sources(tft_linear, tft_layer_norm, tft_glu))
        blobs = emit_tft_blobs(emit, node, [b.shape for b in node.blobs])
        res = emit.inputs[1] if a["residual"] else "None"
        return (f"{emit.helper(tft_gate_add_norm)}({emit.inputs[0]}, {res}, {blobs}, {a['bias']}, {a['_axis']}, "
                f"{a['offset']}, {a['eps']!r})")

    def onnx(self, ctx, node):
        a = node.attrs
        x = node.inputs[0]
        b = TftOnnx(ctx, node)
        g, gshape = b.glu(x, ctx.shape(x), 0, a["bias"], a["_axis"])
        if a["residual"]:
            r = node.inputs[1]
            if a["offset"] > 0:
                rs = ctx.shape(r)
                r = ctx.op("Slice", [r, ctx.i64([a["offset"]]), ctx.i64([rs[1]]), ctx.i64([1])], "res_part")
            g = ctx.op("Add", [g, ctx.op("Reshape", [r, ctx.i64(list(gshape))], "res")], "sum")
        if a["eps"] is not None:
            g = b.layer_norm(g, gshape, a["eps"])
        ctx.add_node("Identity", [g], [node.outputs[0]], name=node.name)


# ---- VarSelNet ------------------------------------------------------------------------------------------------

@register_layer("VarSelNet")
class VarSelNet(Layer):

    def parse(self, lp):
        need_blobs(lp, "VarSelNet", (1, 2), (1, 2), "x, context")
        p = lp.varselnet_param
        attrs = {"in": positive_field(p.input_dim, "varselnet_param.input_dim"),
                 "hidden": positive_field(p.hidden_dim, "varselnet_param.hidden_dim"),
                 "n": positive_field(p.num_inputs, "varselnet_param.num_inputs"), "axis": int(p.axis),
                 "context": len(lp.bottom) > 1, "tops": len(lp.top)}
        if attrs["axis"] != 1:
            raise LayerError(f"varselnet_param.axis {attrs['axis']}: caffeq reads MyCaffe's (N, features) form, axis 1")
        if attrs["in"] != attrs["hidden"]:
            raise LayerError(f"VarSelNet: varselnet_param.input_dim {attrs['in']} != hidden_dim {attrs['hidden']}: "
                             f"MyCaffe stacks the per-input GRN outputs with input_dim's stride and leaves part of "
                             f"the weighted sum unwritten (its nets use input_dim = hidden_dim)")
        return attrs

    def _shapes(self, attrs, in_shapes):
        x = in_shapes[0]
        flat = attrs["n"] * attrs["in"]
        if len(x) != 2 or x[1] != flat:
            raise LayerError(f"VarSelNet needs a (N, num_inputs x input_dim = {flat}) bottom, got {list(x)}")
        ck = None
        if attrs["context"]:
            c = in_shapes[1]
            if len(c) < 2 or c[0] != x[0]:
                raise LayerError(f"VarSelNet: the context {list(c)} must have the bottom's {x[0]} rows")
            ck = count(c, 1)
        attrs["_flat"] = len(grn_shapes(flat, attrs["hidden"], attrs["n"], ck))
        attrs["_var"] = len(grn_shapes(attrs["in"], attrs["hidden"], attrs["hidden"]))
        return (grn_shapes(flat, attrs["hidden"], attrs["n"], ck)
                + grn_shapes(attrs["in"], attrs["hidden"], attrs["hidden"]) * attrs["n"])

    def infer(self, attrs, in_shapes):
        self._shapes(attrs, in_shapes)
        n = in_shapes[0][0]
        return [(n, attrs["hidden"]), (n, attrs["n"])][:attrs["tops"]]

    def param_shapes(self, attrs, in_shapes):
        return self._shapes(attrs, in_shapes)

    def init_params(self, attrs, shapes, rng):
        return init_tft_blobs(shapes, rng)

    def _args(self, a):
        return (a["n"], a["_flat"], a["_var"], a["n"] * a["in"] != a["n"], a["in"] != a["hidden"], 1)

    def forward(self, attrs, params, x, context=None):
        out = tft_varselnet(x, context, list(params), *self._args(attrs))
        return list(out[:attrs["tops"]]) if attrs["tops"] > 1 else out[0]

    def pytorch_source(self, node, emit):
        a = node.attrs
        emit.helper(torch_sources(*TFT_TORCH))
        blobs = emit_tft_blobs(emit, node, [b.shape for b in node.blobs])
        ctx = emit.inputs[1] if a["context"] else "None"
        call = f"{emit.helper(tft_varselnet)}({emit.inputs[0]}, {ctx}, {blobs}, {', '.join(map(str, self._args(a)))})"
        if a["tops"] == 1:
            return f"{call}[0]"
        t = emit.tmp("vsn")
        emit.stmt(f"{t} = {call}")
        return [f"{t}[0]", f"{t}[1]"]

    def onnx(self, ctx, node):
        a = node.attrs
        x = node.inputs[0]
        xs = ctx.shape(x)
        n_inputs, n_flat, n_var, flat_skip, var_skip, axis = self._args(a)
        b = TftOnnx(ctx, node)
        c = node.inputs[1] if a["context"] else None
        sparse, _ = b.grn(x, xs, c, ctx.shape(c) if c else None, 0, flat_skip, True, axis)
        weights = ctx.op("Softmax", [sparse], "weights", axis=1)
        parts = ctx.op("Reshape", [x, ctx.i64([xs[0], n_inputs, a["in"]])], "parts")
        outs = []
        for i in range(n_inputs):
            xi = ctx.op("Gather", [parts, ctx.i64(i)], f"x{i}", axis=1)
            g, _ = b.grn(xi, (xs[0], a["in"]), None, None, n_flat + i * n_var, var_skip, True, axis)
            outs.append(ctx.op("Unsqueeze", [g, ctx.i64([2])], f"g{i}"))
        processed = ctx.op("Concat", outs, "processed", axis=2) if len(outs) > 1 else outs[0]
        w = ctx.op("Reshape", [weights, ctx.i64([xs[0], 1, n_inputs])], "w")
        weighted = ctx.op("Cast", [ctx.op("Mul", [processed, w], "weighted")], "weighted64", to=11)
        summed = ctx.op("ReduceSum", [weighted, ctx.i64([2])], "sum64", keepdims=0)
        ctx.add_node("Cast", [summed], [node.outputs[0]], name=node.name, to=1)
        if a["tops"] > 1:
            ctx.add_node("Identity", [sparse], [node.outputs[1]], name=node.name + "_sparse")


__all__ = ["ChannelEmbedding", "DataTemporal", "GateAddNorm", "MyCaffeGRN", "VarSelNet", "mycaffe_tft_net"]
