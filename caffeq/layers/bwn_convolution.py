"""TrellixVulnTeam/ssd_phone_detection's binary-weight Convolution (78b05ff): `convolution_param { binary: true }`.

The repository's own pytorch2caffe (caffe_models/model_converter/pytorch2caffe/mapping.py, create_binaryconv2d)
writes the field for its BinaryConv2d, and its caffe2pytorch reads it back as that module.  No Caffe fork that
declares the field is public, so its number is caffeq's own.  BinaryConv2d (custom_nn/cnnc_util.py, the BWN
decorator) convolves with sign(W) times each output channel's mean |W| (torch.sign: a zero weight stays 0),
computed from the stored weights before every forward.  Binarizing twice gives the same values (unless an
output channel holds an exact zero), so the stored blobs may hold the float or the binarized weights.
"""
import torch

from .conv import Convolution
from .registry import Layer, LayerError, claim_layers
from .transformed_weights import TransformedConvolution


def bwn_sign_weights(w):
    """sign(W) times the mean |W| of each output channel (the blob's first axis)."""
    return torch.sign(w) * w.abs().mean(dim=tuple(range(1, w.dim())), keepdim=True)


@claim_layers("Convolution", lambda lp: lp.convolution_param.binary)
class BinaryWeightConvolution(TransformedConvolution, Convolution):
    types = ("Convolution",)

    def weight_transform(self, attrs, weight):
        return bwn_sign_weights(weight)

    def weight_transform_note(self, attrs):
        return ("a Convolution with binary: true exports sign(W) times each output channel's mean |W| as its weights "
                "(ssd_phone_detection's BinaryConv2d computes them from the stored weights at every forward)")


@claim_layers("Deconvolution", lambda lp: lp.convolution_param.binary)
class BinaryWeightDeconvolution(Layer):
    """binary: true on a Deconvolution: the repository's pytorch2caffe writes it for convolutions only."""
    types = ("Deconvolution",)

    def parse(self, lp):
        raise LayerError("convolution_param.binary on a Deconvolution: ssd_phone_detection's pytorch2caffe writes it "
                         "for convolutions only, and caffeq binarizes only those")
