"""BraveApple/my_caffe's Box (c52fce6 box_layer.cpp; its MNIST LeNet): the image cut into a grid of
box_height x box_width boxes, each through its own convolution, ReLU and pooling (box_param's
convolution_param / relu_param / pooling_param), each box's result of the box's size, stitched back into
(N, num_output, H, W).

Read and sized, not run: the fork never registers the boxes' convolution weights with the net, so no
caffemodel holds them (its Net draws them from the fillers anew at every build), and its edge boxes read
and write past the image's rows into the next row, channel or image.
"""
from .registry import LayerError, ReadOnlyLayer, legacy_nchw, need_blobs, register_layer


@register_layer("Box")
class Box(ReadOnlyLayer):
    def parse(self, lp):
        need_blobs(lp, "Box", 1, 1)
        p = lp.box_param
        if p.box_height < 1 or p.box_width < 1:
            raise LayerError(f"box_param.box_height and box_width must be >= 1, got {p.box_height} x {p.box_width}")
        if not p.convolution_param.HasField("num_output"):
            raise LayerError("box_param.convolution_param.num_output is required")
        return {"name": lp.name, "num_output": int(p.convolution_param.num_output),
                "box": (int(p.box_height), int(p.box_width))}

    def infer(self, attrs, in_shapes):
        n, _, h, w = legacy_nchw(in_shapes[0], "Box")
        return [(n, attrs["num_output"], h, w)]

    def why_not_run(self, attrs):
        return ("BraveApple/my_caffe's per-box convolutions keep weights the fork never saves (its net draws them "
                "anew at every build) and its edge boxes wrap into the next rows; caffeq sizes it but does not "
                "run it")


__all__ = ["Box"]
