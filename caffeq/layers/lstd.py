"""haochen-rye/LSTD's SSLConvolution (its few-shot detection nets' conv4_x, conv5_x, fc6 and fc7): the fork's
public source has no such layer (0dbad12 registers only BVLC's Convolution, so the fork stops on these nets),
and its maintainer answers (haochen-rye/LSTD#2) that it "is just a toy project for fun. You can simply replace
it with the normal Convolution layer".  caffeq reads it as that Convolution, convolution_param and blobs alike,
and says so.  Structured sparsity (SSL's group lasso) only shapes training: sparse weights convolve the same."""
from .conv import Convolution
from .registry import register_layer

NOTE = ("read as BVLC's Convolution: the fork's source has no SSLConvolution, and its maintainer says to use "
        "the normal Convolution (haochen-rye/LSTD#2)")


@register_layer("SSLConvolution")
class SSLConvolution(Convolution):
    reading_note = NOTE


__all__ = ["SSLConvolution"]
