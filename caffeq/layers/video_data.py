"""The "VideoData" type of three forks, told apart by the message the layer carries.

All three call their message VideoDataParameter and the field video_data_param; caffe.proto
declares them apart (proto/README.md) and the text reader (caffeq/io/prototxt.py) reads the
block into the one whose fields it sets.  Each is a graph input shaped from its parameters:

- C3D v1.1 (facebookarchive/C3D, video_data_layer.cpp DataLayerSetUp and
  DataTransformer::InferBlobShape(VolumeDatum)), c3d_video_data_param: clips of new_length
  colour frames (image_io.cpp always reads 3 channels), top0 (batch_size, 3, new_length, H, W)
  with H = W = transform_param.crop_size, else new_height x new_width, else the frames' own
  size.  The label is (batch_size,), or (batch_size, num_of_labels) with use_multiple_label.
  3DMM-ICME2024/tc3d (976340e) adds num_segments: that many snippets (image_io.cpp
  ReadImageSequenceToVolumeDatum_Seg), 3 x num_segments channels.
- TSN (yjxiong/caffe 9831a2b, video_data_layer.cpp and io.cpp ReadSegment*ToDatum),
  tsn_video_data_param: num_segments snippets of new_length frames stacked on channels, 3 per
  RGB frame (1 with grayscale), 2 per FLOW frame (x and y); top0 (batch_size, C, crop, crop)
  with transform_param.crop_size, else new_height x new_width, else the frames' own size.
  The label is (batch_size, 1, 1, 1).  video_data_param.crop_size / mirror / mean_file are
  declared there but unused: the transformer's are what apply.  ECO's copy (mzolfaghari/
  ECO-efficient-video-understanding 1e77cbd caffe_3d) adds length_first (the channels hold each colour's
  frames in turn), step and rand_step (the frame stride): they change which values land where, not
  the shapes.  zhengshou/scnn's C3D v1.1 adds a third top, the overlap, (batch_size,).
  kevin-ssy/Optical-Flow-Guided-Feature's caffe-action (07d4501, video_data_layer.cpp, io.cpp) adds
  RGB_FLOW (8 channels a frame: two RGB images and x, y flow) and RGB_POSE (3), takes
  transform_param crop_height x crop_width before crop_size, and stacks one copy of the data per
  transform_param.is_roi entry (num_branches = is_roi_size(); caffeq reads none as one).
- zhujiagang/gating-ConvNet-code's caffe-action (8fc27b2, video_data_layer.cpp, util/io.cpp
  ReadSegmentFLOW_RGBToDatum): TSN's messages, field for field, but its VideoData ignores modality and
  always reads both streams: each segment's new_length x and y flow images, then each segment's first
  colour frame, (2 x new_length + 3) x num_segments channels; exactly two tops, shaped as TSN's.  No
  field tells it from TSN (TSN declares is_flow too): a mean_value list of exactly that length, which
  TSN's transformer would refuse, does.
- SSD (weiliu89/caffe), video_data_param: webcam or video-file frames; shaped like any other
  fork data layer (caffeq/layers/fork_data.py: --input-shape or crop_size).
- apir8181/caffe_lrcn (0b29d69, video_data_layer.cpp DataLayerSetUp), lrcn_video_data_param: clips of
  clip_size colour frames (cv::imread) from each listed folder, frame-major on axis 0 (row
  frame * batch_size + clip, as load_batch writes them, the clip markers 0 on frame 0); exactly three
  tops: data (clip_size * batch_size, 3, H, W) with H = W = transform_param.crop_size, else
  new_height x new_width, else the frames' own size; label and the clip marker (clip_size * batch_size,).
"""
from .c3d import SCNN_OVERLAP
from .data import DataLayer, describe_transform, transform_attrs
from .fork_data import UNKNOWN_FORK_DATA
from .registry import LayerError, needs_input_shape, register_layer

TSN_RGB, TSN_FLOW, TSN_RGB_FLOW, TSN_RGB_POSE = 0, 1, 2, 3


def _frame_size(attrs, field):
    """(H, W) of the data: the transformer's crop, else the resize, else None (the frames' own)."""
    crop, resize = attrs["transform"]["crop_size"], attrs["resize"]
    if resize and crop and (crop > resize[0] or crop > resize[1]):
        raise LayerError(f"transform_param.crop_size {crop} exceeds the {resize[0]}x{resize[1]} frames "
                         f"({field}.new_height x new_width)")
    return (crop, crop) if crop else resize


def _resize(p, field):
    if bool(p.new_height) != bool(p.new_width):
        raise LayerError(f"{field}.new_height and new_width must be set together, got {p.new_height} "
                         f"and {p.new_width}")
    return (int(p.new_height), int(p.new_width)) if p.new_height else None


def _parse_c3d(lp):
    field = "c3d_video_data_param"
    p = lp.c3d_video_data_param
    if p.new_length < 1:
        raise LayerError(f"video_data_param.new_length (frames per clip) must be > 0, got {p.new_length}")
    if p.batch_size < 1:
        raise LayerError(f"video_data_param.batch_size must be > 0, got {p.batch_size}")
    if p.use_multiple_label and not p.HasField("num_of_labels"):
        raise LayerError("video_data_param.num_of_labels must be set with use_multiple_label")
    if p.num_segments < 1:
        raise LayerError(f"video_data_param.num_segments must be > 0, got {p.num_segments}")
    return {"fork": "C3D v1.1", "field": field, "length": int(p.new_length), "channels": 3 * int(p.num_segments),
            "batch_size": int(p.batch_size), "resize": _resize(p, "video_data_param"),
            "labels": int(p.num_of_labels) if p.use_multiple_label else None,
            "sampling_rate": int(p.sampling_rate)}


def _parse_tsn(lp):
    field = "tsn_video_data_param"
    p = lp.tsn_video_data_param
    if p.new_length < 1 or p.num_segments < 1:
        raise LayerError(f"video_data_param.new_length and num_segments must be > 0, got {p.new_length} "
                         f"and {p.num_segments}")
    per_frame = {TSN_FLOW: 2, TSN_RGB_FLOW: 8, TSN_RGB_POSE: 3}.get(p.modality, 1 if p.grayscale else 3)
    t = lp.transform_param
    # caffe-action (Optical-Flow-Guided-Feature): one copy of the frames per is_roi entry
    branches = len(t.is_roi) or 1
    return {"fork": "TSN", "field": field, "length": int(p.new_length), "segments": int(p.num_segments),
            "modality": p.Modality.Name(p.modality),
            "channels": branches * per_frame * int(p.new_length) * int(p.num_segments),
            # no default there (a 0 batch); 1 as for the other fork data layers
            "batch_size": max(1, int(p.batch_size)), "resize": _resize(p, "video_data_param"),
            "length_first": bool(p.length_first),
            # caffe-action: transform_param crop_height x crop_width before crop_size
            "crop_hw": (int(t.crop_height), int(t.crop_width)) if t.crop_height > 0 and t.crop_width > 0 else None}


def _is_gating(lp, tsn):
    """A TSN-shaped VideoData whose mean_value list fits gating-ConvNet's flow + RGB channels only."""
    p, t = lp.tsn_video_data_param, lp.transform_param
    if p.modality not in (TSN_RGB, TSN_FLOW) or tsn["crop_hw"] or tsn["length_first"] or len(t.is_roi) \
            or p.grayscale:
        return False   # other TSN forks' fields: that fork's reading stays
    means = len(t.mean_value)
    return means != tsn["channels"] and means == _gating_channels(p)


def _gating_channels(p):
    # new_length x and y flow images a segment, then one colour frame a segment
    return (2 * int(p.new_length) + 3) * int(p.num_segments)


def _parse_gating(lp, tsn):
    p = lp.tsn_video_data_param
    if len(lp.top) != 2:   # ExactNumTopBlobs() == 2
        raise LayerError(f"zhujiagang/gating-ConvNet-code's VideoData has two tops (data, label), got {len(lp.top)}")
    flow = 2 * tsn["length"] * tsn["segments"]
    note = (f"read as zhujiagang/gating-ConvNet-code's caffe-action (flow + RGB): its "
            f"{len(lp.transform_param.mean_value)} mean_value entries fit {flow} flow + {3 * tsn['segments']} RGB "
            f"channels, not TSN's {tsn['channels']}")
    if p.HasField("modality"):
        note += "; that fork ignores modality"
    return dict(tsn, fork="gating-ConvNet", channels=_gating_channels(p), flow_channels=flow,
                is_flow=bool(lp.transform_param.is_flow), reading_notes=[note])


def _parse_lrcn(lp):
    field = "lrcn_video_data_param"
    p = lp.lrcn_video_data_param
    if p.batch_size < 1 or p.clip_size < 1:   # DataLayerSetUp's CHECK_GTs
        raise LayerError(f"video_data_param.batch_size and clip_size must be > 0, got {p.batch_size} and "
                         f"{p.clip_size}")
    if len(lp.top) != 3:
        raise LayerError(f"apir8181/caffe_lrcn's VideoData has three tops (data, label, marker), got {len(lp.top)}")
    return {"fork": "apir8181/caffe_lrcn", "field": field, "length": int(p.clip_size), "channels": 3,
            "batch_size": int(p.batch_size) * int(p.clip_size), "resize": _resize(p, "video_data_param")}


@register_layer("VideoData")
class VideoData(DataLayer):
    def parse(self, lp):
        if lp.HasField("c3d_video_data_param"):
            attrs = _parse_c3d(lp)
        elif lp.HasField("tsn_video_data_param"):
            attrs = _parse_tsn(lp)
            if _is_gating(lp, attrs):
                attrs = _parse_gating(lp, attrs)
        elif lp.HasField("lrcn_video_data_param"):
            attrs = _parse_lrcn(lp)
        else:
            return dict(UNKNOWN_FORK_DATA.parse(lp), fork="SSD")
        # SCNN's C3D v1.1 adds the overlap top, LRCN the marker
        most = 2 if attrs["fork"] in ("TSN", "gating-ConvNet") else 3
        if not 1 <= len(lp.top) <= most:
            raise LayerError(f"{attrs['fork']}'s VideoData takes one or two tops"
                             f"{' (three in SCNN' + chr(39) + 's C3D)' if most == 3 else ''}, got {len(lp.top)}")
        attrs.update(type=lp.type, tops=list(lp.top), num_tops=len(lp.top), transform=transform_attrs(lp),
                     source=getattr(lp, attrs["field"]).source)
        attrs["hw"] = attrs.get("crop_hw") or _frame_size(attrs, "video_data_param")
        return attrs

    def top_shapes(self, attrs, given):
        if attrs["fork"] == "SSD":
            return UNKNOWN_FORK_DATA.top_shapes(attrs, given)
        data = given.get(0)
        if data is None:
            if attrs["hw"] is None:
                raise needs_input_shape(attrs, attrs["tops"][0], f"{attrs['fork']}'s VideoData without "
                                        "crop_size or new_height/new_width takes the frames' own size")
            n, c, hw = attrs["batch_size"], attrs["channels"], tuple(attrs["hw"])
            data = (n, c, attrs["length"]) + hw if attrs["fork"] == "C3D v1.1" else (n, c) + hw
        shapes = [tuple(data)]
        if attrs["num_tops"] > 1:
            if attrs["fork"] in ("TSN", "gating-ConvNet"):
                label = (data[0], 1, 1, 1)
            elif attrs["fork"] == "apir8181/caffe_lrcn":
                label = (data[0],)
            else:
                label = (data[0],) if attrs["labels"] is None else (data[0], attrs["labels"])
            shapes.append(tuple(given.get(1) or label))
        if attrs["num_tops"] > 2:   # SCNN's overlap, LRCN's clip marker: one per row of the data
            shapes.append(tuple(given.get(2) or (data[0],)))
        return shapes

    def preprocessing(self, attrs):
        if attrs["fork"] == "SSD":
            return UNKNOWN_FORK_DATA.preprocessing(attrs)
        if attrs["fork"] == "C3D v1.1":
            lines = [(f"clips of {attrs['length']} colour frames (every {attrs['sampling_rate']}th), "
                      f"channels x frames x height x width")]
        elif attrs["fork"] == "apir8181/caffe_lrcn":
            lines = [f"clips of {attrs['length']} colour frames (cv::imread of NNNNN.jpg from a listed offset), "
                     f"frame-major on axis 0 (row frame x batch_size + clip); the third top marks each clip's first frame "
                     f"with 0 (LRCN)"]
        elif attrs["fork"] == "gating-ConvNet":
            lines = [f"{attrs['segments']} segments x {attrs['length']} frames of x and y flow (channels 0-"
                     f"{attrs['flow_channels'] - 1}, x then y a frame), then each segment's first colour frame "
                     f"(BGR, channels {attrs['flow_channels']}-{attrs['channels'] - 1}), stacked on the channel axis"]
            # data_transformer.cpp: only a flipped sample (mirror && Rand(2), in either phase) is changed, and
            # its bound is C // 10 x 10, not the flow count
            if attrs["is_flow"] and attrs["transform"]["mirror"]:
                lines.append(f"is_flow: a flipped sample gets 255 - v on the even channels below "
                             f"{attrs['channels'] // 10 * 10}")
        else:
            per = "x and y flow images" if attrs["modality"] == "FLOW" else "frames"
            lines = [(f"{attrs['segments']} segments x {attrs['length']} {per} ({attrs['modality']}), "
                      f"stacked on the channel axis")]
            if attrs.get("length_first"):
                lines.append("ECO's length_first: the channels hold each colour's (or flow axis's) frames "
                             "in turn, not each frame's colours")
        if attrs["num_tops"] > 2 and attrs["fork"] == "C3D v1.1":
            lines.append(SCNN_OVERLAP)
        if attrs["resize"]:
            lines.append(f"frames resized to {attrs['resize'][0]}x{attrs['resize'][1]}")
        return lines + describe_transform(attrs["transform"])
