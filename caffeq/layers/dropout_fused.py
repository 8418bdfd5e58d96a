"""Miaomz/caffe-opencl's (505693d) DropoutAndConvolution and DropoutAndInnerProduct: a dropout of the bottom
fused into the layer after it (dropout_and_conv_layer.cpp, dropout_and_inner_product_layer.cpp; their
messages hold the base layer's fields with the same numbers, plus dropout_ratio and dropout_type).  At TEST
each is exactly BVLC's Convolution / InnerProduct on the same blobs: no mask, no scaling (the dropout only
trains).  The fork runs DropoutAndConvolution through LibDNN only (its CPU forward is not implemented).
"""
from google.protobuf.message import Message

from ..io.schema import caffe_pb2
from .conv import Convolution, InnerProduct
from .registry import register_layer

#: fields of the fused messages that only the training dropout reads
DROPOUT_FIELDS = ("dropout_ratio", "dropout_type", "engine")


def as_base_layer(lp, fused_field, base_field):
    """A copy of lp whose base_field holds the fused message's base-layer fields."""
    base = caffe_pb2.LayerParameter()
    base.CopyFrom(lp)
    target = getattr(base, base_field)
    for field, value in getattr(lp, fused_field).ListFields():
        if field.name in DROPOUT_FIELDS:
            continue
        if isinstance(value, Message):
            getattr(target, field.name).CopyFrom(value)
        elif hasattr(value, "extend"):    # a repeated field
            getattr(target, field.name).extend(value)
        else:
            setattr(target, field.name, value)
    return base


@register_layer("DropoutAndConvolution")
class DropoutAndConvolution(Convolution):
    def parse(self, lp):
        return super().parse(as_base_layer(lp, "dropout_and_convolution_param", "convolution_param"))


@register_layer("DropoutAndInnerProduct")
class DropoutAndInnerProduct(InnerProduct):
    def parse(self, lp):
        return super().parse(as_base_layer(lp, "dropout_and_inner_product_param", "inner_product_param"))


__all__ = ["DropoutAndConvolution", "DropoutAndInnerProduct", "as_base_layer"]
