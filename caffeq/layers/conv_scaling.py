"""Jaekyumkim/ssd-caffe-test's ConvolutionScaling (7558eb1 src/caffe/layers/conv_scaling_layer.cu; its RGB-D SSD
nets run it on the depth image): a Convolution with convolution_param's fields and blobs.  Its GPU forward is
Caffe's convolution, which caffeq computes.  Its CPU forward first divides the bottom, in place, by the count of
-122 values in each run of 9 flat values (an experiment that changed between the fork's commits and reads past
the end of the blob), which caffeq does not reproduce; it says so when it reads the layer."""
from .conv import Convolution
from .registry import register_layer

CPU_NOTE = ("read as the fork's GPU forward, a plain convolution; its CPU forward first rescales "
            "the bottom by the -122 values (missing depth) in runs of 9 flat values, which caffeq does not reproduce")


@register_layer("ConvolutionScaling")
class ConvolutionScaling(Convolution):
    reading_note = CPU_NOTE
