"""Cambricon's Caffe for its MLU accelerators (Cambricon/caffe b4bd3b7, as CNStream's MLU100 sample nets
use it): two layers that only the closed MLU library computes.  caffeq reads and sizes them; they refuse
to run or export, as the fork's own CPU forward does (MLUYUVtoRGB aborts, SsdDetection leaves its top
unwritten).

- MLUYUVtoRGB (yuvtorgb_param input_format [NV21], output_format [RGB0]): a YUV420SP image (N, 1, 3 H / 2, W)
  to (N, 4, H, W) pixels (RGB0, BGR0 or ARGB).  The first convolution after it reads 4 channels.
- SsdDetection (detection_output_param, one priorbox_params per level): SSD's whole detection head in one
  layer, bottoms K loc maps, K conf maps (raw scores), the K feature maps the priors come from and the
  image; top (N, keep_top_k, 1, 6) rows [xmin, ymin, xmax, ymax, score, label].
"""
from .registry import LayerError, ReadOnlyLayer, legacy_nchw, need_blobs, register_layer

_MLU_ONLY = "Cambricon's Caffe computes it only on the MLU, in its closed library (its CPU forward does not run it)"


@register_layer("MLUYUVtoRGB")
class MLUYUVtoRGB(ReadOnlyLayer):
    def parse(self, lp):
        need_blobs(lp, "MLUYUVtoRGB", 1, 1)
        return {"name": lp.name}

    def infer(self, attrs, in_shapes):
        n, c, h, w = legacy_nchw(in_shapes[0], "MLUYUVtoRGB")
        if c != 1 or h % 3 or w % 2:
            raise LayerError(f"MLUYUVtoRGB takes a YUV420SP image (N, 1, 3 H / 2, W) with W even (the fork's "
                             f"check), got {[n, c, h, w]}")
        return [(n, 4, h * 2 // 3, w)]

    def why_not_run(self, attrs):
        return _MLU_ONLY


@register_layer("SsdDetection")
class SsdDetection(ReadOnlyLayer):
    def parse(self, lp):
        count = len(lp.bottom)
        if count < 4 or (count - 1) % 3:
            raise LayerError(f"SsdDetection takes K loc maps, K conf maps, K feature maps and the image, got "
                             f"{count} bottoms")
        need_blobs(lp, "SsdDetection", count, 1)
        p = lp.detection_output_param
        if not p.HasField("num_classes"):
            raise LayerError("SsdDetection needs detection_output_param.num_classes (the fork's check)")
        levels = (count - 1) // 3
        if len(lp.priorbox_params) != levels:
            raise LayerError(f"SsdDetection needs one priorbox_params per level ({levels}), got "
                             f"{len(lp.priorbox_params)}")
        return {"name": lp.name, "keep_top_k": int(p.keep_top_k)}

    def infer(self, attrs, in_shapes):
        if attrs["keep_top_k"] < 1:
            raise LayerError("SsdDetection sizes its top by detection_output_param.keep_top_k, which it needs >= 1")
        return [(in_shapes[0][0], attrs["keep_top_k"], 1, 6)]

    def why_not_run(self, attrs):
        return _MLU_ONLY
