"""JiahaoLi-gdut/CAFFE-DACH (388c826): the inference layers of its GAN example (examples/@HGAN).

Sources: src/caffe/proto/caffe.proto (RandomBlobParameter, ImageStorageParameter, the LayerParameter
fields listed in proto/README.md), src/caffe/layers/random_blob_layer.cpp and image_storage_layer.cpp with
include/caffe/layers/random_blob_layer.hpp and image_storage_layer.hpp.

- RandomBlob: zero or one bottom, one top.  With a bottom the top takes the bottom's shape(0..3) (a 4-axis
  bottom; only its shape is read), without one random_blob_param's num x channel x height x width.  type
  "uniform" (caffe_rng_uniform in [min, max]) or "gaussian" (caffe_rng_gaussian, mean, sigma), anything
  else a CHECK failure.  Each forward draws new numbers from Caffe's generator, which caffeq does not
  reproduce: read, checked and sized, not run (as caffeq's other layers that draw random numbers).
- ImageStorage: one bottom, no top.  With OpenCV each forward writes every image of the batch as a
  3-channel picture of bottom height rows under image_storage_param.saveroot, encoded as `encoder`; the
  bottom is left alone.  caffeq writes no file (as RoomNet's HeatmapVisualize): nothing to compute.

The fork's asynchronous forward / backward schedule (async_command_pusher / async_command_puller,
*_down_init) steers training only: read, and ignored at inference.
"""
from .common import Sink
from .registry import LayerError, ReadOnlyLayer, need_blobs, register_layer

RANDOM_TYPES = ("uniform", "gaussian")


@register_layer("RandomBlob")
class RandomBlob(ReadOnlyLayer):
    def parse(self, lp):
        need_blobs(lp, "RandomBlob", (0, 1), 1, "shape source")
        p = lp.random_blob_param
        if p.type not in RANDOM_TYPES:
            raise LayerError(f"random_blob_param.type '{p.type}': RandomBlob draws 'uniform' or 'gaussian' only")
        attrs = {"name": lp.name, "type": p.type, "has_bottom": len(lp.bottom) == 1}
        if not attrs["has_bottom"]:
            shape = (p.num, p.channel, p.height, p.width)
            if min(shape) < 1:
                raise LayerError(f"random_blob_param: without a bottom, num, channel, height and width must all be "
                                 f">= 1, got {list(shape)}")
            attrs["shape"] = tuple(int(d) for d in shape)
        return attrs

    def infer(self, attrs, in_shapes):
        if not attrs["has_bottom"]:
            return [attrs["shape"]]
        s = tuple(in_shapes[0])
        if len(s) != 4:
            raise LayerError(f"RandomBlob takes its top's shape from a 4-axis bottom, got {list(s)}")
        return [s]

    def why_not_run(self, attrs):
        return (f"draws {attrs['type']} noise from Caffe's random generator at every forward, which caffeq does "
                f"not reproduce; feed the noise yourself in its place")


@register_layer("ImageStorage")
class ImageStorage(Sink):
    bottoms, tops = 1, 0
    bottom_roles = "images"
    reading_note = ("ImageStorage only writes its bottom's images as files under image_storage_param.saveroot "
                    "at every forward: caffeq writes no file (its bottom is an output where nothing else reads it)")
