"""dengshuo/D-M-F-ConvNets' DeformableConvolution (97752b4, caffe/src/caffe/layers/deformable_conv_layer.{cpp,cu},
caffe/src/caffe/util/deformable_im2col.cu, caffe/src/caffe/proto/caffe.proto).

Its DeformableConvolutionParameter is SAR_plane's / Xdet's (fields 1-18, deformable_convolution_param = 999)
without deformable_group.  LayerSetUp and Reshape are BaseConvolution's on the data bottom alone: top (N,
num_output, Ho, Wo) as Convolution's, weights (num_output, C / group, kh, kw) and a bias when bias_term; the
offsets bottom is never checked.  caffeq reads a layer as dengshuo's when it names no deformable_group and its
offsets do not have the 2 x kh x kw x 4 channels SAR_plane's / Xdet's layer needs with its default group 4
(offsets never sized for a deformable group; only this fork loads the layer).  Any other DeformableConvolution
reads as before (deformable_conv.py): offsets with those channels but another height, width or batch stay
SAR_plane's / Xdet's error, as Xdet's own lenet example, whose offsets are sized for group 4, shows.

The forward cannot be reproduced: Forward_cpu is empty, and Forward_gpu is unfinished.  It passes
bottom[0]->shape(1) and shape(0), the channels and the batch, as the im2col's height and width; a deformable
group fixed at 4 (the kernel then gives height / 4 channels to each group); the data blob itself as the
column buffer, written while it is read; image n's offsets at n times the data's per-image count; a GEMM
over kh kw C x Ho Wo columns from that C x H x W buffer; and no bias.  caffeq sizes the layer and refuses
to run or export it.
"""
from .conv import check_groups
from .deformable_conv import DeformableConvolution, deformable_out_hw
from .registry import LayerError, claim_layers, four_axes

SAR_PLANE_GROUP = 4   # the default deformable_group of SAR_plane's / Xdet's message


def _no_deformable_group(lp):
    """deformable_convolution_param without deformable_group (dengshuo's message has no such field)."""
    return (lp.HasField("deformable_convolution_param")
            and not lp.deformable_convolution_param.HasField("deformable_group"))


def sized_for_sar_plane_group(kernel, offset_shape) -> bool:
    """Whether the offsets have the channels SAR_plane's / Xdet's layer needs with its default deformable group."""
    return len(offset_shape) >= 2 and offset_shape[1] == 2 * kernel[0] * kernel[1] * SAR_PLANE_GROUP


@claim_layers("DeformableConvolution", _no_deformable_group)
class DengshuoDeformableConvolution(DeformableConvolution):
    def _check(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], "DeformableConvolution", "data bottom")
        attrs["dengshuo"] = not sized_for_sar_plane_group(attrs["kernel"], tuple(in_shapes[1]))
        if not attrs["dengshuo"]:
            return super()._check(attrs, in_shapes)
        if attrs["axis"] not in (1, -3):
            raise LayerError(f"deformable_convolution_param.axis must be 1: the kernel is read for (N, C, H, W), "
                             f"got {attrs['axis']}")
        check_groups(attrs, c)   # the fork's LayerSetUp checks channels and num_output against group
        return (n, c, h, w), deformable_out_hw(attrs, in_shapes[0])

    def infer(self, attrs, in_shapes):
        (n, _, _, _), (ho, wo) = self._check(attrs, in_shapes)
        if not attrs["dengshuo"]:
            return super().infer(attrs, in_shapes)
        kh, kw = attrs["kernel"]
        attrs["reading_notes"] = [
            f"read as dengshuo/D-M-F-ConvNets' DeformableConvolution: no deformable_group, and the offsets "
            f"{list(in_shapes[1])} do not have the 2 x {kh} x {kw} x {SAR_PLANE_GROUP} channels SAR_plane's / Xdet's "
            f"layer needs; that fork never checks them (sized, not run)"]
        return [(n, attrs["num_output"], ho, wo)]

    def cannot_run(self, attrs, in_shapes):
        if attrs.get("dengshuo"):
            return ("dengshuo/D-M-F-ConvNets' forward is unfinished (its im2col gets the channels and batch as "
                    "height and width, writes its columns into the data blob and adds no bias; Forward_cpu is "
                    "empty): there are no numbers to reproduce")
        return super().cannot_run(attrs, in_shapes)
