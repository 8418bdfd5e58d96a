"""Which layers of a train_val net only train: losses, metrics and the layers that feed only them
(target samplers, label reshapes).  The graph builder (ir.py) drops them from inference graphs,
with a note, so that a train file reads without its datasets."""
import re

from .io.schema import caffe_pb2
from .layers import spec_for

# Layer types that only train or score a net beyond those whose names say "loss" or end in
# "accuracy".  A prototxt may hold them with no spec here (fork losses, evaluation layers); they are
# dropped from inference graphs with a note.
TRAINING_ONLY_TYPES = frozenset({
    "BoxAnnotatorOHEM", "DetectionEvaluate", "LabelSpecificAdd", "EvalDetection",
    # eric612/MobileNet-YOLO's YOLO v3 loss (Yolov3Layer, a LossLayer) under a name without "Loss",
    # its segmentation loss (YoloSegLayer, a LossLayer) and its segmentation scorer (69b4441)
    "Yolov3", "YoloSeg", "SegmentationEvaluate",
    # nudles/vldbj-code's V1 PRECISION_RECALL: a metric over scores and labels, like Accuracy
    "PrecisionRecall",
    # wy1iu/sphereface-plus's inter-class separability loss (InterClassLayer, a LossLayer over the
    # classifier weight it shares, and the labels)
    "InterClass",
    # JiajianZeng/ContextWithStructure: a landmark error metric, and the partial derivatives of feature maps
    # around the landmarks that only its PerceptualLoss reads
    "FacialLandmarkPerformance", "PatchSemantic",
    # XmBrain/Quantizer's (75dd74d) IoU of selected regions against the label map, a metric
    "AccuracyIOU",
    # hshustc/ECCV18_Lifelong_Learning fa9015b (lll-caffe/include/caffe/layers/knowledge_distillation_layer.hpp):
    # KnowledgeDistillationLayer, a LossLayer (KL divergence of student and teacher softmaxes at a temperature)
    "KnowledgeDistillation",
})


def is_training_only_type(type_name):
    """Losses and scorers (accuracy, detection evaluation): they train or measure, never infer.  A fork's
    loss may carry a suffix (Jallet/caffe_colorization's EuclideanLossWithTV, SoftmaxWithLossOHEM)."""
    lowered = type_name.lower()
    return type_name in TRAINING_ONLY_TYPES or "loss" in lowered or lowered.endswith("accuracy")


# layer kinds that hold a net's learned weights: a net left with none of them was not pruned to its inference part
_WEIGHTED_TYPES = frozenset({"Convolution", "Deconvolution", "InnerProduct", "Embed", "LSTM", "RNN"})


def _weighted(lp):
    return lp.type in _WEIGHTED_TYPES or lp.HasField("convolution_param") or lp.HasField("inner_product_param")


def drop_training_only(layers, source="", notes=None):
    """The layers inference keeps (_drop).  Where dropping the layers caffeq does not know would take every
    weighted layer with them (strawberryfg's 3dhuman nets, whose image comes from an unpublished
    GenUnifiedDataAndLabel reading label-derived blobs), those layers are kept instead, so that the read
    stops on their types by name rather than listing a net of its data layers alone."""
    layers = _unhook_data_layers(layers, notes, source)
    trial = []
    kept = _drop(layers, source, trial, drop_unknown=True)
    if not any(_weighted(lp) for lp in kept) and any(_weighted(lp) for lp in layers):
        trial = []
        kept = _drop(layers, source, trial, drop_unknown=False)
    if notes is not None:
        notes.extend(trial)
    return kept


def _unhook_data_layers(layers, notes, source):
    """A data layer whose spec sets `bottoms_ignored_at_inference` (strawberryfg's GenUnifiedDataAndLabel,
    which crops the image its sample index names) becomes a graph input: a copy without its bottoms,
    so that what only made those bottoms (index generators, file readers) feeds nothing the net runs."""
    out = []
    for lp in layers:
        spec = spec_for(lp)
        if spec is not None and spec.is_data and spec.bottoms_ignored_at_inference \
                and len(lp.bottom):
            copy = type(lp)()
            copy.CopyFrom(lp)
            del copy.bottom[:]
            if notes is not None:
                notes.append(f"{source + ': ' if source else ''}'{lp.name}' ({lp.type}) makes its tops from files "
                             f"its bottoms ({', '.join(lp.bottom)}) name: its tops are the net's inputs, its "
                             f"bottoms are not read")
            lp = copy
        out.append(lp)
    return out


def _drop(layers, source, notes, drop_unknown):
    """Drop layers of training-only types that have no spec (forks' losses), with a note; then
    layers caffeq does not know whose results only train or score the net, with those readers:
      - a Python layer, or one its file includes only at TRAIN (or only at TEST: XmBrain's RegionSelect,
        read only by its AccuracyIOU), whose every top is read, and only by
        losses and scorers or by layers whose every top goes only to them (the targets a loss trains
        on, as Faster R-CNN's AnchorTargetLayer computes; deeplab_v2_python's pairwise-loss branch);
      - a layer of any type that reads a data layer's label (which a deployed net does not have)
        and whose tops are either unread or go only to losses and scorers that way (margin
        layers: LargeMarginInnerProduct, xialuxi's CosinAddm feeding Scale -> SoftmaxWithLoss);
    then every layer that reads a blob only dropped layers make.  Python layers without tops only
    observe the net (debug printing, writing files): they are dropped first, with their own note."""
    sinks = [lp for lp in layers if lp.type == "Python" and not lp.top and spec_for(lp) is None]
    if sinks and notes is not None:
        notes.append(f"{source + ': ' if source else ''}dropped {len(sinks)} Python layer(s) without tops, which "
                     f"only observe the net (debug output, files) and cannot change its outputs: "
                     + ", ".join(f"{lp.name} ({lp.python_param.module}.{lp.python_param.layer})" for lp in sinks))
    sink_ids = {id(lp) for lp in sinks}
    layers = [lp for lp in layers if id(lp) not in sink_ids]
    gone = {id(lp) for lp in layers
            if spec_for(lp) is None and (is_training_only_type(lp.type) or _is_python_loss(lp))}
    # a deploy file that kept its Accuracy or loss layer but not the label it reads: Caffe refuses
    # it ("Unknown bottom blob"); the net is whole without the scorer
    made = {top for lp in layers for top in lp.top}
    # (a blob that other layers read too is the net's input, not a label: an autoencoder's data, made at
    # another phase or stage, which the missing-bottom error then names)
    read_elsewhere = {b for lp in layers if id(lp) not in gone
                      and (spec_for(lp) is None or not spec_for(lp).is_training_only) for b in lp.bottom}
    unlabelled = [lp for lp in layers if id(lp) not in gone and spec_for(lp) is not None
                  and spec_for(lp).is_training_only and lp.bottom[:1] and lp.bottom[0] in made
                  and any(b not in made for b in lp.bottom[1:])
                  and not any(b not in made and b in read_elsewhere for b in lp.bottom[1:])]
    if unlabelled and notes is not None:
        notes.append(f"{source + ': ' if source else ''}" + "; ".join(
            f"'{lp.name}' ({lp.type}) reads '{next(b for b in lp.bottom[1:] if b not in made)}', which no layer "
            f"makes (a deploy file that kept its scorer): dropped, as the net needs it only to train"
            for lp in unlabelled))
    gone.update(id(lp) for lp in unlabelled)
    labels = _label_blobs(layers)
    readers = _readers(layers)
    images = _data_blobs(layers) - labels
    # what layers without bottoms make (data layers, a fork's generator such as ORION's CreateDeformation)
    sources = {top for lp in layers if not len(lp.bottom) for top in lp.top} | labels
    label_readers = []
    changed = drop_unknown
    while changed:
        changed = False
        only = _only_train(layers, gone, readers, images, sources)
        for i, lp in enumerate(layers):
            if id(lp) in gone or spec_for(lp) is not None or not len(lp.top):
                continue
            if _transforms_the_batch(lp, images, sources):
                # an augmentation Python layer, ORION's ApplyDeformation: the whole net reads what it gives, so
                # it is refused, never dropped with the net behind it
                continue
            if (lp.type == "Python" or _only_in_phase(lp, caffe_pb2.TRAIN) or _only_in_phase(lp, caffe_pb2.TEST)) \
                    and all(_trains_only_through(i, top, readers, only) for top in lp.top):
                drop = True
            elif any(b in labels or b not in made for b in lp.bottom):
                # it reads the label (or a blob no layer makes here: the label of a data layer the file
                # includes only at the other phase, which IrisParseNet's SliceLabel splits), and what it
                # gives goes only to losses and scorers, or nowhere (a scorer of the project's own:
                # puneet1189/SVHN's confusion-matrix Python layer, wzbazinga's misspelled Accutacy): a net
                # without labels could not run it
                drop = all(not readers.get((i, top)) or _trains_only_through(i, top, readers, only)
                           for top in lp.top)
                if drop:
                    label_readers.append(lp)
            else:
                continue
            if drop:
                gone.add(id(lp))
                changed = True
    if label_readers and notes is not None:
        notes.append(f"{source + ': ' if source else ''}" + "; ".join(
            f"'{lp.name}' ({_described(lp)}) reads the label "
            f"'{next(b for b in lp.bottom if b in labels or b not in made)}' and "
            f"only losses and scorers read what it gives, if anything: it only trains or scores the net"
            for lp in label_readers))
    # a known layer that feeds only dropped layers goes with them, its results would be net outputs
    # that nothing can compute: one that computes from labels alone (the Slice of a pose label for a
    # scorer), or one the file includes only at TRAIN (the Concat of features for
    # deeplab_v2_python's pairwise-loss branch)
    # a net whose labels come from a ground-truth source (strawberryfg's sample-index generators): a known
    # layer that reads a label, or is such a source, and whose tops no kept layer reads (or that has none:
    # OutputBlob) only builds ground truth or scores against it (the 3dhuman nets' ConvertDepth from the
    # true root depth, their camera-file reprojections)
    truth_net = any(getattr(spec_for(lp), "gives_ground_truth", False) for lp in layers)
    for i in range(len(layers) - 1, -1, -1):
        lp = layers[i]
        spec = spec_for(lp)
        if id(lp) in gone or spec is None or spec.is_data:
            continue
        if truth_net and (spec.gives_ground_truth or any(b in labels for b in lp.bottom)) \
                and all(all(id(layers[r]) in gone for r in readers.get((i, top), ())) for top in lp.top):
            gone.add(id(lp))
            continue
        if not len(lp.top):
            continue
        from_labels = len(lp.bottom) and all(b in labels for b in lp.bottom)
        if (from_labels or _only_in_phase(lp, caffe_pb2.TRAIN)) and all(
                readers.get((i, top)) and all(id(layers[r]) in gone for r in readers[(i, top)]) for top in lp.top):
            gone.add(id(lp))
    # what reads only results of dropped layers cannot be computed either (R-FCN's OHEM sums the
    # per-roi losses in an Eltwise for its annotator)
    producers = {}
    for position, lp in enumerate(layers):
        for top in lp.top:
            producers.setdefault(top, []).append((position, lp))
    changed = bool(gone)
    while changed:
        changed = False
        for position, lp in enumerate(layers):
            if id(lp) in gone:
                continue
            for b in lp.bottom:
                # the version it reads: the last one written before it (in-place chains write again)
                made = [p for at, p in producers.get(b, []) if at < position][-1:]
                if made and all(id(p) in gone for p in made):
                    gone.add(id(lp))
                    changed = True
                    break
    kept, dropped = [], []
    for lp in layers:
        if id(lp) in gone:
            dropped.append(f"{lp.name} ({lp.type})")
        else:
            kept.append(lp)
    if dropped and notes is not None:
        notes.append(f"{source + ': ' if source else ''}dropped {len(dropped)} training-only layer(s) "
                     f"that inference does not use: {', '.join(dropped[:6])}{', ...' if len(dropped) > 6 else ''}")
    return kept


def _only_in_phase(lp, phase):
    """The file includes the layer only in `phase`: its author marked it as training's (TRAIN), or as the
    evaluation's (TEST) where what it gives goes only to scorers."""
    return bool(len(lp.include)) and not len(lp.exclude) and all(
        rule.HasField("phase") and rule.phase == phase for rule in lp.include)


def _described(lp):
    return f"Python {lp.python_param.module}.{lp.python_param.layer}" if lp.type == "Python" else lp.type


_LABEL_NAME = re.compile(r"label|target|truth|annot|(^|[_/])gt($|[_/])|^gt", re.IGNORECASE)


def _label_blobs(layers):
    """The labels: every top after the first of a data layer, the one top of a data layer named as a
    label, and what a loss or scorer reads after its first bottom that no layer of this net makes (a
    label of the other phase's data layer, as in a train_val file whose only data layer is TRAIN's)."""
    labels, made = set(), set()
    computed_from = {b for lp in layers if spec_for(lp) is not None and not spec_for(lp).is_training_only
                     and not spec_for(lp).makes_training_targets for b in lp.bottom}
    for lp in layers:
        spec = spec_for(lp)
        if getattr(spec, "gives_ground_truth", False):
            # a sample-index generator (strawberryfg's GenSequentialIndex): what it names is ground truth
            labels.update(lp.top)
        if spec is not None and (spec.is_data or spec.makes_training_targets):
            # a Python data layer's tops are the project's own: one that a layer caffeq runs reads is an input
            # unless named as a label (drnet's qa, qb, im, posdata and labels; SubCNN's data, info_boxes and
            # parameters, whose info_boxes only its ROI sampler and losses read)
            named = lp.type == "Python" and not len(lp.bottom)
            labels.update(t for t in lp.top[1:] if not named or _LABEL_NAME.search(t) or t not in computed_from)
            # FCN-style nets read their labels with a data layer of their own (ParseNet's, FCN's "label")
            if spec.is_data and len(lp.top) == 1 and "label" in lp.top[0].lower():
                labels.add(lp.top[0])
        made.update(lp.top)
    labels.update(b for lp in layers if is_training_only_type(lp.type) for b in lp.bottom[1:] if b not in made)
    # what a known layer computes from labels alone is label too (xinghaochen/caffe-pose slices its
    # label into the pose and the hand centre its PoseDistance scorer reads)
    for lp in layers:
        spec = spec_for(lp)
        if spec is not None and not spec.is_data and len(lp.bottom) and all(b in labels for b in lp.bottom):
            labels.update(lp.top)
    return labels


def _data_blobs(layers):
    """The batches data layers give (their first top; the caller takes away labels: ParseNet's label
    comes from a data layer of its own)."""
    images = set()
    for lp in layers:
        spec = spec_for(lp)
        if (spec is not None and spec.is_data or lp.type == "Python" and not len(lp.bottom)) and len(lp.top):
            images.add(lp.top[0])
    return images


def _readers(layers):
    """{(position, blob): positions of the layers that read the blob layers[position] writes, until
    it is written again}, in one pass."""
    writer, readers = {}, {}
    for position, lp in enumerate(layers):
        for blob in dict.fromkeys(lp.bottom):
            if blob in writer:
                readers.setdefault((writer[blob], blob), []).append(position)
        for blob in lp.top:
            writer[blob] = position
    return readers


def _trains_only_through(index, blob, readers, only):
    """True when the `blob` layers[index] writes is read, and every reader only trains (`only`)."""
    read = readers.get((index, blob), ())
    return bool(read) and all(only[r] for r in read)


def _transforms_the_batch(lp, images, sources):
    """An unknown layer at the head of the net: it reads a batch and nothing the net computes (an
    augmentation layer; not HGAN's GANGate, which mixes the batch with the generator's output for the
    discriminator, nor a SubRegion cropping around predicted landmarks for a loss)."""
    return spec_for(lp) is None and any(b in images for b in lp.bottom) and all(b in sources for b in lp.bottom)


def _only_train(layers, gone, readers, images=frozenset(), sources=frozenset()):
    """only[i]: layers[i] is a loss or scorer, a Silence (it swallows the blob: it adds nothing to
    any output), a dropped layer, or a layer whose every top is read, and only by such layers (never
    a net output).  A layer caffeq does not know that transforms a batch of `images` (only sources
    in, _transforms_the_batch) makes the data the net runs on: never.  Readers come after what they read, so one sweep from the last layer back
    decides them all, without recursion (converted nets run to thousands of layers)."""
    only = [False] * len(layers)
    for i in range(len(layers) - 1, -1, -1):
        lp = layers[i]
        if id(lp) in gone or is_training_only_type(lp.type) or lp.type == "Silence":
            only[i] = True
        elif _transforms_the_batch(lp, images, sources):
            only[i] = False
        else:
            only[i] = bool(len(lp.top)) and all(_trains_only_through(i, top, readers, only) for top in lp.top)
    return only


# Python layers known to only score a net against its labels (module.class): NVIDIA DIGITS
# DetectNet's ground-truth clustering and mean-average-precision layers
SCORING_PYTHON_LAYERS = frozenset({
    "caffe.layers.detectnet.clustering.ClusterGroundtruth",
    "caffe.layers.detectnet.mean_ap.ScoreDetections",
    "caffe.layers.detectnet.mean_ap.mAP",
})


def _is_python_loss(lp):
    """A Python layer that Caffe treats as a loss (a loss_weight), one whose class is named as a loss,
    or one known to only score the net against its labels: it only trains or evaluates the net."""
    if lp.type != "Python":
        return False
    known = f"{lp.python_param.module}.{lp.python_param.layer}" in SCORING_PYTHON_LAYERS
    # a class named as a loss (pycaffe-yolo's YoloLossLayer) or a scorer (TextMaps' WebAccuracyLayer),
    # as a type named "...Loss" or "...Accuracy" is one
    named_loss = lp.python_param.layer.lower().removesuffix("layer").endswith(("loss", "accuracy"))
    return known or named_loss or any(w != 0 for w in lp.loss_weight)
