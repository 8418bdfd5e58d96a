"""sp9103/DeepHandPoseRecognizer (f2e4e5d; its Windows Caffe, Caffe/src/caffe/proto/caffe.proto's
DataLoadParameter, data_load_param 146 there): the Leap Motion stereo-hand data layers and the EuclideanDist metric.

Data layers (Caffe/src/caffe/layers/leap_data_layer.cpp, leap_predata_layer.cpp, leap_single_data_layer.cpp,
leap_predata_single_layer.cpp): each reads data_load_param batch_size, channels, height, width (their product
CHECKed > 0), data_path (a folder of recordings, walked with the Win32 API) and data_limit, and gives two tops,
shaped in DataLayerSetUp:
- LeapData: the left and right grey images (N, 2, H, W), values / 255; the class id (N,) (the recording's folder
  name, 0-13);
- LeapPredata: (N, 2, H, W) the same way; the 5 x 4 x 3 finger-joint positions (N, 60) (each bone's next joint,
  Leap's millimetres / 10);
- LeapSingleData and LeapPredataSingle: as LeapData and LeapPredata with the left image only, (N, 1, H, W).
Their Forward copies channels x H x W values per item into the image top, so channels must be that top's
channel count (2, or 1 for the single ones): anything else leaves part of each item unwritten or overruns it.
As every fork data layer here, they are graph inputs (eval cannot read their recordings).

EuclideanDist (Caffe/src/caffe/layers/euclidean_dist_layer.cpp; CPU only, no Backward): a test-time metric.  Its
Forward takes bottom 0 - bottom 1 over bottom 0's count, prints, for each of 20 joints (3 values each, 60 per item),
the batch's mean Euclidean distance to stdout, and writes 0 into its scalar () top: the top is always 0, the
distances are not a blob.  Reshape only checks accuracy_param.axis against bottom 0.  Dropped on export as
Accuracy is.
"""
import math

from .data import transform_attrs
from .fork_data import ForkDataLayer
from .registry import AT_LEAST, Layer, LayerError, canonical_axis, need_blobs, positive_field, register_layer

#: type -> (the image top's channels, the label top's shape after N, what the label holds)
_LEAP_TOPS = {
    "LeapData": (2, (), "the recording's class id (its folder name, 0-13)"),
    "LeapPredata": (2, (60,), "the 5 x 4 x 3 finger-joint positions (Leap millimetres / 10)"),
    "LeapSingleData": (1, (), "the recording's class id (its folder name, 0-13)"),
    "LeapPredataSingle": (1, (60,), "the 5 x 4 x 3 finger-joint positions (Leap millimetres / 10)"),
}


@register_layer(*_LEAP_TOPS)
class LeapHandData(ForkDataLayer):
    def parse(self, lp):
        need_blobs(lp, f"{lp.type} (tops image, label)", 0, 2)
        p = lp.data_load_param
        channels = _LEAP_TOPS[lp.type][0]
        for field in ("batch_size", "channels", "height", "width"):
            positive_field(getattr(p, field), f"data_load_param.{field}")
        if p.channels != channels:
            raise LayerError(f"{lp.type} copies data_load_param.channels x height x width values into each item of "
                             f"its ({channels}-channel) image top: channels must be {channels}, got {p.channels}")
        return {"type": lp.type, "tops": list(lp.top), "num_tops": 2, "transform": transform_attrs(lp),
                "source": p.data_path, "batch_size": int(p.batch_size), "channels": channels,
                "hw": (int(p.height), int(p.width))}

    def label_shape(self, attrs, data):
        return (data[0],) + _LEAP_TOPS[attrs["type"]][1]

    def guessed_label_tops(self, attrs, given):
        return ()   # the fork's own label shape

    def preprocessing(self, attrs):
        images = "left and right" if attrs["channels"] == 2 else "left"
        return [f"the Leap Motion recordings under {attrs['source']!r}: the {images} grey images, resized to "
                f"{attrs['hw'][0]} x {attrs['hw'][1]} beforehand, as 0-255 values / 255",
                f"label top: {_LEAP_TOPS[attrs['type']][2]}"]


@register_layer("EuclideanDist")
class EuclideanDist(Layer):
    is_training_only = True
    reading_note = ("EuclideanDist (sp9103/DeepHandPoseRecognizer) prints each joint's mean distance; its top "
                    "is always 0")

    def parse(self, lp):
        need_blobs(lp, "EuclideanDist (prediction, target)", range(2, AT_LEAST), 1)
        return {"axis": int(lp.accuracy_param.axis)}

    def infer(self, attrs, in_shapes):
        pred, target = in_shapes[0], in_shapes[1]
        canonical_axis(attrs["axis"], len(pred), "accuracy_param.axis")
        if len(pred) < 2:
            raise LayerError(f"EuclideanDist reads its prediction's shape()[1]: it needs 2 axes or more, got {list(pred)}")
        if math.prod(target) < math.prod(pred):
            raise LayerError(f"EuclideanDist subtracts its target over the prediction's count: target {list(target)} "
                             f"is smaller than prediction {list(pred)}")
        if math.prod(pred) < pred[0] * 60:
            raise LayerError(f"EuclideanDist reads 20 joints x 3 values (60) per item: prediction {list(pred)} "
                             f"holds fewer")
        return [()]

    def forward(self, attrs, params, *bottoms):
        return bottoms[0].new_zeros(())
