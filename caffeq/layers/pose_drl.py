"""aleksispi/pose-drl's Cos (2e16678, caffe/src/caffe/layers/cos_layer.cpp / .cu and
caffe/include/caffe/layers/cos_layer.hpp; the same files in install-files/): a NeuronLayer without
parameters whose top is cos(bottom), element by element in float32 (CPU and GPU alike).  Its agent nets use
it for the von Mises term of the angle policy.
"""
import torch

from .registry import FunctionLayer, register_layer


def caffe_cos(x: torch.Tensor) -> torch.Tensor:
    """aleksispi/pose-drl's Cos: the cosine of every element."""
    return torch.cos(x)


@register_layer("Cos")
class Cos(FunctionLayer):
    fn = staticmethod(caffe_cos)

    def onnx(self, ctx, node):
        ctx.add_node("Cos", [node.inputs[0]], [node.outputs[0]], name=node.name)


__all__ = ["Cos"]
