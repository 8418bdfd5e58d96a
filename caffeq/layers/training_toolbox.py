"""opencv/training_toolbox_caffe (789ff8dd; Intel's Caffe for the OpenVINO person-detection and
action-recognition nets), the layer types caffeq has not met elsewhere.  Its GRN with `grn_param` is in
grn.py, its DetectionOutputExtended and PriorBoxClustered in ssd/; its LabelSpecificAdd (label_specific_add.cpp:
the AM-Softmax margin, which this fork applies only in TRAIN since transform_test is and-ed with the phase) is
a training-only type (training_layers.py).

- ScaleFilter (caffe/src/caffe/layers/scale_filter_layer.cpp/.cu, scale_filter_param): a neuron layer over a
  4-axis bottom (LayerSetUp CHECKs it).  TEST copies the bottom.  TRAIN multiplies each (n, c) map by its own
  draw from uniform [min_scale, max_scale] (caffe_rng_uniform, one scale per item and channel per forward).
  The fork's checks that 0 < min_scale < max_scale are DCHECKs (debug builds only): caffeq reads any value.
- AnchorEmbeddingExtractor (anchor_embedding_extractor_layer.cpp/.cu, include/caffe/layers/
  anchor_embedding_extractor_layer.hpp; embedding_extractor_param): training-only.  Bottom 0 holds the
  matched detections (records of 11 values: item, label, x_min, y_min, x_max, y_max, anchor, track id,
  action, x, y), as its fork's Python DetMatcherLayer makes them from the ground truth; bottoms 1 to
  num_anchors (CHECKed to be 4) are the anchors' embedding maps (N, E, H, W), all alike.  The records read are
  the first bottom-0 height of them.  A record is kept when int(item) >= 0 and, with num_valid_actions set,
  int(action) < num_valid_actions (C++'s int casts truncate toward zero).  Top 0 (K, E): the kept records'
  embedding anchor_map[int(anchor)][int(item), :, int(y), int(x)]; top 1 (K,): int(record[label_src_pos]).
  A third top holds either 1 / (how many kept records share (int(track id) * 1000 + int(item))) per record
  (output_instance_weights) or (item, x_min, y_min, x_max, y_max) per record (output_proposals).  With no
  record kept: K = 1, the labels (and the weights or proposals) -1 and the embedding row 0 (the fork zeroes
  only its first 11 values and leaves the rest of the reused blob as it was: caffeq gives zeros).
"""
import torch

from .registry import AT_LEAST, Layer, LayerError, count, legacy_nchw, need_blobs, register_layer

RECORD = 11                        # MATCHED_DET_RECORD_SIZE
ITEM, X_MIN, Y_MIN, X_MAX, Y_MAX, ANCHOR, TRACK, ACTION, X, Y = 0, 2, 3, 4, 5, 6, 7, 8, 9, 10
PROPOSAL = 5                       # PROPOSAL_RECORD_SIZE


# ---- ScaleFilter ------------------------------------------------------------------------------

@register_layer("ScaleFilter")
class ScaleFilter(Layer):
    """TEST: a copy.  TRAIN: each (n, c) map times its own uniform [min_scale, max_scale) draw."""

    uses_training_flag = True
    bottoms = tops = 1

    def parse(self, lp):
        super().parse(lp)
        p = lp.scale_filter_param
        return {"min_scale": float(p.min_scale), "max_scale": float(p.max_scale)}

    def infer(self, attrs, in_shapes):
        if len(in_shapes[0]) != 4:
            raise LayerError(f"ScaleFilter needs a 4-axis bottom (the fork checks num_axes == 4), "
                             f"got {list(in_shapes[0])}")
        return [tuple(in_shapes[0])]

    def forward(self, attrs, params, x, training=False):
        if not training:
            return x
        lo, hi = attrs["min_scale"], attrs["max_scale"]
        scales = torch.rand(x.shape[0], x.shape[1], 1, 1, dtype=x.dtype, device=x.device) * (hi - lo) + lo
        return x * scales

    def onnx(self, ctx, node):
        ctx.add_node("Identity", [node.inputs[0]], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        return emit.inputs[0]


# ---- AnchorEmbeddingExtractor ---------------------------------------------------------------

def _truncated(values):
    """C++'s static_cast<int> of float values (toward zero), as int64."""
    return torch.trunc(values).to(torch.int64)


@register_layer("AnchorEmbeddingExtractor")
class AnchorEmbeddingExtractor(Layer):
    is_training_only = True
    data_dependent_shape = True
    onnx_refusal = ("AnchorEmbeddingExtractor gathers embeddings at ground-truth-matched detections, a training "
                    "layer with a data-dependent top: exports leave it out")

    def parse(self, lp):
        need_blobs(lp, "AnchorEmbeddingExtractor", range(2, AT_LEAST), (2, 3),
                   "matched detections, one embedding map per anchor")
        p = lp.embedding_extractor_param
        if not p.HasField("num_anchors"):
            raise LayerError("AnchorEmbeddingExtractor needs embedding_extractor_param.num_anchors (the fork checks it)")
        if p.num_anchors != 4:
            raise LayerError(f"AnchorEmbeddingExtractor supports embedding_extractor_param.num_anchors 4 only (the "
                             f"fork checks it), got {p.num_anchors}")
        if not p.HasField("label_src_pos"):
            raise LayerError("AnchorEmbeddingExtractor needs embedding_extractor_param.label_src_pos "
                             "(the fork checks it)")
        if not 0 <= p.label_src_pos < RECORD:
            raise LayerError(f"embedding_extractor_param.label_src_pos must be in [0, {RECORD}) (a position in the "
                             f"{RECORD}-value detection record), got {p.label_src_pos}")
        mode = None
        notes = []
        if len(lp.top) == 3:
            if p.output_instance_weights:
                mode = "weights"   # the fork tests this flag first
            elif p.output_proposals:
                mode = "proposals"
            else:
                notes.append("AnchorEmbeddingExtractor has a third top but neither output_instance_weights nor "
                             "output_proposals: the fork logs an error and never fills it (an empty blob here)")
        if p.output_instance_weights and p.output_proposals:
            notes.append("AnchorEmbeddingExtractor: output_instance_weights and output_proposals are both set (the "
                         "fork logs an error); the third top holds the instance weights")
        return {"num_anchors": int(p.num_anchors), "label_src_pos": int(p.label_src_pos),
                "num_valid_actions": int(p.num_valid_actions) if p.HasField("num_valid_actions") else -1,
                "mode": mode, "tops": len(lp.top), "reading_notes": notes}

    def infer(self, attrs, in_shapes):
        if len(in_shapes) != attrs["num_anchors"] + 1:
            raise LayerError(f"AnchorEmbeddingExtractor takes num_anchors + 1 = {attrs['num_anchors'] + 1} bottoms "
                             f"(matched detections, one map per anchor), got {len(in_shapes)}")
        det = legacy_nchw(in_shapes[0], "AnchorEmbeddingExtractor matched detections")
        if det[3] != RECORD:
            raise LayerError(f"AnchorEmbeddingExtractor's matched detections need width {RECORD} (one record per row; "
                             f"the fork checks it), got {list(in_shapes[0])}")
        maps = [tuple(legacy_nchw(s, "AnchorEmbeddingExtractor embedding map")) for s in in_shapes[1:]]
        if any(m[1:] != maps[0][1:] for m in maps) or min(maps[0][1:]) <= 0:
            raise LayerError(f"AnchorEmbeddingExtractor's anchor maps need one nonzero channels, height and width "
                             f"(the fork checks it), got {[list(s) for s in in_shapes[1:]]}")
        k = max(1, det[2])   # at most the records read (at least the 1 row given with none kept)
        tops = [(k, maps[0][1]), (k,)]
        if attrs["tops"] == 3:
            tops.append({"weights": (k,), "proposals": (k, PROPOSAL)}.get(attrs["mode"], (0,)))
        return tops

    def macs(self, attrs, in_shapes, out_shapes):
        return count(out_shapes[0])

    def forward(self, attrs, params, det, *maps):
        e, h, w = legacy_nchw(list(maps[0].shape), "AnchorEmbeddingExtractor")[1:]
        rows = legacy_nchw(list(det.shape), "AnchorEmbeddingExtractor")[2]
        records = det.reshape(-1)[:rows * RECORD].reshape(rows, RECORD)
        item = _truncated(records[:, ITEM])
        keep = item >= 0
        if attrs["num_valid_actions"] >= 0:
            keep = keep & (_truncated(records[:, ACTION]) < attrs["num_valid_actions"])
        kept = records[keep]
        third = []
        if kept.shape[0] == 0:
            emb = det.new_zeros((1, e))
            labels = det.new_full((1,), -1.0)
            if attrs["mode"] == "weights":
                third = [det.new_full((1,), -1.0)]
            elif attrs["mode"] == "proposals":
                third = [det.new_full((1, PROPOSAL), -1.0)]
        else:
            item = _truncated(kept[:, ITEM])
            anchor = _truncated(kept[:, ANCHOR])
            x, y = _truncated(kept[:, X]), _truncated(kept[:, Y])
            stacked = torch.stack([m.reshape(-1, e, h, w) for m in maps])   # (anchors, N, E, H, W)
            emb = stacked[anchor, item, :, y, x]
            labels = _truncated(kept[:, attrs["label_src_pos"]]).to(det.dtype)
            if attrs["mode"] == "weights":
                instance = _truncated(kept[:, TRACK]) * 1000 + item
                same = (instance[:, None] == instance[None, :]).sum(dim=1)
                third = [1.0 / same.to(det.dtype)]
            elif attrs["mode"] == "proposals":
                third = [torch.cat([item.to(det.dtype)[:, None], kept[:, X_MIN:Y_MAX + 1]], dim=1)]
        if attrs["tops"] == 3 and attrs["mode"] is None:
            third = [det.new_zeros((0,))]
        return (emb, labels, *third)
