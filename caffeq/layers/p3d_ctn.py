"""roundchuan/P3D-CTN's two 5-D reorder layers (797ac4a, P3D-module/caffe: include/caffe/layers/ and
src/caffe/layers/{deconv_trans,clip2img}_layer.{cpp,cu}; deconv_trans_param in src/caffe/proto/caffe.proto).

Blobs are (N, C, D, H, W), D the frames.  Neither layer has blobs; each moves values without changing them.

- DeconvTrans (deconv_trans_param.stride: exactly three values sd, sh, sw; f = sd * sh * sw must divide C):
  a 3-D depth-to-space.  Top (N, C / f, D sd, H sh, W sw); bottom channel c = oc f + (k sh + j) sw + i of
  voxel (d, h, w) goes to top channel oc at (d sd + k, h sh + j, w sw + i).  That is the GPU kernel
  (DeconvTransForward, one thread per value).  The CPU Forward_cpu loops over bottom->num() values only, so
  in CPU mode all but N values of the top keep what the blob held before (zeros on the first pass): caffeq
  computes the GPU forward, the one the fork's nets ran with.
- Clip2Img: top (N D, C, H, W), image n D + d holding frame d of clip n (the GPU kernel clip2img_forward;
  the CPU forward is NOT_IMPLEMENTED there, and LayerSetUp refuses in-place use).  Its C++ type() says
  "Reshape"; prototxt files name it Clip2Img.

The torch functions below are also copied into the standalone model.py (inspect.getsource).
"""
from .registry import Layer, LayerError, need_blobs, positive_field, register_layer

# ---- torch (model.py gets the same code) ------------------------------------------------------------

def deconv_trans(x, stride: list[int]):
    """P3D-CTN's DeconvTrans: channel oc * f + (k * sh + j) * sw + i of voxel (d, h, w) to channel oc at
    (d * sd + k, h * sh + j, w * sw + i), f = sd * sh * sw."""
    n, c, d, h, w = x.shape
    sd, sh, sw = stride
    oc = c // (sd * sh * sw)
    y = x.reshape(n, oc, sd, sh, sw, d, h, w).permute(0, 1, 5, 2, 6, 3, 7, 4)
    return y.reshape(n, oc, d * sd, h * sh, w * sw)


def clip_to_images(x):
    """P3D-CTN's Clip2Img: (N, C, D, H, W) -> (N * D, C, H, W), frame d of clip n as image n * D + d."""
    n, c, d, h, w = x.shape
    return x.transpose(1, 2).reshape(n * d, c, h, w)


def _five_axes(shape, what):
    if len(shape) != 5:   # both LayerSetUps: CHECK_EQ(num_axes(), 5)
        raise LayerError(f"{what} needs a 5-axis bottom (N, C, D, H, W), got {list(shape)}")
    return tuple(int(v) for v in shape)


# ---- DeconvTrans ------------------------------------------------------------------------------------

@register_layer("DeconvTrans")
class DeconvTrans(Layer):
    reading_note = ("DeconvTrans: computed as the fork's GPU kernel (deconv_trans_layer.cu); its CPU forward "
                    "moves only the first N values")

    def parse(self, lp):
        # one bottom, one top (ExactNum*Blobs); in place the kernel would read values it has already moved
        need_blobs(lp, "DeconvTrans", 1, 1, in_place=False)
        strides = list(lp.deconv_trans_param.stride)
        if len(strides) != 3:
            raise LayerError(f"deconv_trans_param.stride needs 3 values (depth, height, width), got {strides}")
        return {"stride": [positive_field(s, "deconv_trans_param.stride") for s in strides]}

    def infer(self, attrs, in_shapes):
        n, c, d, h, w = _five_axes(in_shapes[0], "DeconvTrans")
        sd, sh, sw = attrs["stride"]
        factor = sd * sh * sw
        if c % factor:
            raise LayerError(f"DeconvTrans: the bottom's {c} channels are not a multiple of "
                             f"deconv_trans_param.stride's product {factor}")
        return [(n, c // factor, d * sd, h * sh, w * sw)]

    def forward(self, attrs, params, x):
        return deconv_trans(x, attrs["stride"])

    def onnx(self, ctx, node):
        _, c, d, h, w = ctx.shape(node.inputs[0])
        sd, sh, sw = node.attrs["stride"]
        oc = c // (sd * sh * sw)
        split = ctx.op("Reshape", [node.inputs[0], ctx.i64([-1, oc, sd, sh, sw, d, h, w])], "split",
                       name=node.name)
        moved = ctx.op("Transpose", [split], "moved", perm=[0, 1, 5, 2, 6, 3, 7, 4])
        ctx.add_node("Reshape", [moved, ctx.i64([-1, oc, d * sd, h * sh, w * sw])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        return f"{emit.helper(deconv_trans)}({emit.inputs[0]}, {list(node.attrs['stride'])})"


# ---- Clip2Img ---------------------------------------------------------------------------------------

@register_layer("Clip2Img")
class Clip2Img(Layer):
    reading_note = "Clip2Img: computed as the fork's GPU kernel (clip2img_layer.cu); its CPU forward is not implemented"

    def parse(self, lp):
        need_blobs(lp, "Clip2Img", 1, 1, in_place=False)   # LayerSetUp's CHECK_NE(top, bottom)
        return {}

    def infer(self, attrs, in_shapes):
        n, c, d, h, w = _five_axes(in_shapes[0], "Clip2Img")
        return [(n * d, c, h, w)]

    def forward(self, attrs, params, x):
        return clip_to_images(x)

    def onnx(self, ctx, node):
        _, c, _, h, w = ctx.shape(node.inputs[0])
        frames = ctx.op("Transpose", [node.inputs[0]], "frames", name=node.name, perm=[0, 2, 1, 3, 4])
        ctx.add_node("Reshape", [frames, ctx.i64([-1, c, h, w])], [node.outputs[0]])

    def pytorch_source(self, node, emit):
        return f"{emit.helper(clip_to_images)}({emit.inputs[0]})"

