"""LabelMix of MagicSen/source_read's StructuredFeature-master (106ebe0: caffe-multi/src/caffe/layers/
label_mix_layer.cpp, include/caffe/loss_layers.hpp, LabelMixLayerParameter in caffe-multi/src/caffe/proto/
caffe.proto), the structured-feature pose net's label builder.

Bottoms: joint label maps (N, K, H, W) and each joint's mixture type (N, K, ...: the fork checks the channel
counts agree).  Top: (N, K * M, H, W), M = label_mix_param.mix_num [13] read as an int (a float field,
truncated); the CPU forward (the only one) zeroes it and copies joint k's map into channel 13 k + type - 1
(13 fixed, whatever M), adding 13 k to the type blob in place as it goes.  It turns labels into the targets
SoftmaxWithLossMask trains on, so caffeq treats it as it treats losses and scorers: read and sized, marked
training-only (dropped from inference graphs and exports), not run.  The file's SoftmaxWithLossMask
(softmax_mask_param) and ChannelDropout (dropout_param; caffeq/layers/pose_action.py) read as they are.
"""
from .registry import LayerError, ReadOnlyLayer, legacy_nchw, need_blobs, register_layer


@register_layer("LabelMix")
class LabelMix(ReadOnlyLayer):
    is_training_only = True

    def parse(self, lp):
        need_blobs(lp, "LabelMix", 2, 1, "label maps, mixture types")
        mix = int(lp.label_mix_param.mix_num)   # the fork's int Mix_Num_
        if mix < 1:
            raise LayerError(f"label_mix_param.mix_num must be >= 1, got {lp.label_mix_param.mix_num}")
        return {"name": lp.name, "mix_num": mix}

    def infer(self, attrs, in_shapes):
        n, k, h, w = legacy_nchw(in_shapes[0], "LabelMix")
        types = legacy_nchw(in_shapes[1], "LabelMix")
        if types[1] != k:
            raise LayerError(f"LabelMix needs as many mixture-type channels as label channels (the fork checks it), "
                             f"got {types[1]} and {k}")
        return [(n, k * attrs["mix_num"], h, w)]

    def why_not_run(self, attrs):
        return "it only builds SoftmaxWithLossMask's training targets from the labels (training-only)"
