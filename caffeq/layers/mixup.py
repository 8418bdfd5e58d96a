"""Mixup of Wheatly2/Bag-of-Tricks-for-Image-Classification (9661ccc, mixup_layer.cpp / .hpp, caffe.proto's
MixupParameter: alpha 1, cls_num 0).

Bottoms: the image batch and its labels; tops: the mixed batch (the image's shape) and soft labels.  The
labels' top is the labels' shape for one-hot (2-axis) labels, else (N, cls_num) (cls_num taken from a 2-axis
label's second axis; at least 2, alpha above 0: LayerSetUp's checks).  Its forward runs at every phase: it
shuffles the batch (Caffe's random generator) and mixes item i with item batch_idx[i] by one lambda drawn from
Beta(alpha, alpha) per forward.  The numbers change from call to call and depend on Caffe's random state, so
caffeq reads, checks and sizes the layer but does not run or export it: to run the net for inference, feed
the images where the mixed batch goes (`--outputs` / `--input-shape`), or drop the layer from the file.
"""
from .registry import LayerError, ReadOnlyLayer, need_blobs, register_layer

FORK = "Wheatly2/Bag-of-Tricks-for-Image-Classification"


@register_layer("Mixup")
class Mixup(ReadOnlyLayer):
    def parse(self, lp):
        need_blobs(lp, f"Mixup ({FORK})", 2, 2, "data, labels")
        p = lp.mixup_param
        if not p.alpha > 0:
            raise LayerError(f"mixup_param.alpha must be above 0, got {p.alpha}")
        return {"name": lp.name, "cls_num": int(p.cls_num)}

    def infer(self, attrs, in_shapes):
        data, labels = tuple(in_shapes[0]), tuple(in_shapes[1])
        if labels[:1] != data[:1]:
            raise LayerError(f"Mixup: the labels {list(labels)} have not the data's batch {data[0]}")
        if len(labels) == 2:
            if labels[1] < 2:
                raise LayerError(f"Mixup: one-hot labels need at least 2 classes, got {list(labels)}")
            return [data, labels]
        if attrs["cls_num"] < 2:
            raise LayerError(f"mixup_param.cls_num must be at least 2 for class-index labels, got {attrs['cls_num']}")
        return [data, (data[0], attrs["cls_num"])]

    def why_not_run(self, attrs):
        return ("mixes each item with a randomly shuffled partner by a Beta(alpha, alpha) weight drawn at every "
                "forward (a training augmentation that the fork runs in every phase), which caffeq does not "
                "reproduce; for inference feed the images where its mixed top goes")
