"""BraveApple/my_caffe's Box (c52fce6 box_layer.cpp; its MNIST LeNet): the image cut into a grid of
box_height x box_width boxes, each through its own convolution, ReLU and pooling (box_param's
convolution_param / relu_param / pooling_param), each box's result of the box's size, stitched back into
(N, num_output, H, W).

Read and sized, not run: the fork never registers the boxes' convolution weights with the net, so no
caffemodel holds them (its Net draws them from the fillers anew at every build), and its edge boxes read
and write past the image's rows into the next row, channel or image.
"""
from .conv import conv_out_size
from .pooling import pooled_size
from .registry import LayerError, ReadOnlyLayer, legacy_nchw, need_blobs, register_layer, spatial_params


@register_layer("Box")
class Box(ReadOnlyLayer):
    def parse(self, lp):
        need_blobs(lp, "Box", 1, 1)
        p = lp.box_param
        if p.box_height < 1 or p.box_width < 1:
            raise LayerError(f"box_param.box_height and box_width must be >= 1, got {p.box_height} x {p.box_width}")
        c, pool = p.convolution_param, p.pooling_param
        if not c.HasField("num_output"):
            raise LayerError("box_param.convolution_param.num_output is required")
        if not p.HasField("pooling_param") or len(p.param) != 2:
            raise LayerError("box_param needs a pooling_param and two param specs (the fork's CHECKs)")
        box = (int(p.box_height), int(p.box_width))
        # each box's convolution and pooling must give back the box's size (the fork's CHECK_EQ in Reshape)
        conv = [conv_out_size(b, k, st, pd, d) for b, k, st, pd, d in zip(
            box, spatial_params(c, 2, "kernel_size", None, min_value=1), spatial_params(c, 2, "stride", 1),
            spatial_params(c, 2, "pad", 0), spatial_params(c, 2, "dilation", 1, allow_hw=False))]
        pooled = [pooled_size(b, k, st, pd) for b, k, st, pd in zip(
            conv, spatial_params(pool, 2, "kernel_size", None, min_value=1), spatial_params(pool, 2, "stride", 1),
            spatial_params(pool, 2, "pad", 0))]
        if tuple(pooled) != box:
            raise LayerError(f"box_param: a {box[0]} x {box[1]} box comes out of its convolution and pooling "
                             f"{pooled[0]} x {pooled[1]}; the fork CHECKs it keeps the box's size")
        return {"name": lp.name, "num_output": int(c.num_output), "box": box}

    def infer(self, attrs, in_shapes):
        n, _, h, w = legacy_nchw(in_shapes[0], "Box")
        if h < attrs["box"][0] or w < attrs["box"][1]:
            raise LayerError(f"box_param: the {attrs['box'][0]} x {attrs['box'][1]} box is larger than the "
                             f"{h} x {w} input (the fork's CHECK_GE)")
        return [(n, attrs["num_output"], h, w)]

    def why_not_run(self, attrs):
        return ("BraveApple/my_caffe's per-box convolutions keep weights the fork never saves (its net draws them "
                "anew at every build) and its edge boxes wrap into the next rows; caffeq sizes it but does not "
                "run it")


__all__ = ["Box"]
