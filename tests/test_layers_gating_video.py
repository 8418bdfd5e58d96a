"""zhujiagang/gating-ConvNet-code's caffe-action VideoData (8fc27b2, video_data_layer.cpp DataLayerSetUp and
util/io.cpp ReadSegmentFLOW_RGBToDatum): TSN's fields, but every sample holds each segment's new_length x and y
flow images and then each segment's first colour frame, (2 x new_length + 3) x num_segments channels.  caffeq
tells it from TSN by a mean_value list of exactly that length; other TSN forks keep their readings."""
from pathlib import Path

import numpy as np
import pytest
from conftest import check_everywhere, rng

from caffeq.layers import LayerError
from caffeq.model import load, load_from_text

REALWORLD = Path(__file__).parent / "fixtures" / "realworld"
GATING = "zhujiagang__gating-ConvNet-code__prototxt_models__ucf101__gating_three_2_"


def gating_net(params, transform, tops=("data", "label"), tail=""):
    top_lines = "".join(f' top: "{t}"' for t in tops)
    return (f'name: "gating"\nlayer {{ name: "data" type: "VideoData"{top_lines}\n'
            f'  video_data_param {{ source: "list.txt" {params} }}\n'
            f'  transform_param {{ {transform} }} }}\n{tail}')


def means(count):
    return "mean_value: [" + ", ".join(str(100 + i) for i in range(count)) + "]"


def sliced(flow, length, segments, crop):
    """The gating nets' head: a Slice after the flow channels, each stream reshaped to one row per segment."""
    return (f'layer {{ name: "slice" type: "Slice" bottom: "data" top: "flow" top: "rgb"\n'
            f'  slice_param {{ axis: 1 slice_point: {flow} }} }}\n'
            f'layer {{ name: "flow_rows" type: "Reshape" bottom: "flow" top: "flow_rows"\n'
            f'  reshape_param {{ shape {{ dim: [-1, {2 * length}, {crop}, {crop}] }} }} }}\n'
            f'layer {{ name: "rgb_rows" type: "Reshape" bottom: "rgb" top: "rgb_rows"\n'
            f'  reshape_param {{ shape {{ dim: [-1, 3, {crop}, {crop}] }} }} }}\n')


# batch 2, new_length 3, num_segments 4: (2 x 3 + 3) x 4 = 36 channels, 24 of them flow
PARAMS = "batch_size: 2 new_length: 3 num_segments: 4 new_height: 17 new_width: 19"


def test_gating_video_data_shapes_flow_and_rgb_channels():
    model = load_from_text(gating_net(PARAMS, f"crop_size: 13 is_flow: true {means(36)}",
                                      tail=sliced(24, 3, 4, 13)))
    shapes = model.blob_shapes
    assert shapes["data"] == (2, 36, 13, 13) and shapes["label"] == (2, 1, 1, 1)
    assert shapes["flow"] == (2, 24, 13, 13) and shapes["rgb"] == (2, 12, 13, 13)
    assert shapes["flow_rows"] == (8, 6, 13, 13) and shapes["rgb_rows"] == (8, 3, 13, 13)
    assert any("gating-ConvNet-code" in w and "36 mean_value entries fit 24 flow + 12 RGB" in w
               for w in model.warnings), model.warnings
    # no crop: the frames as resized, new_height x new_width
    uncropped = load_from_text(gating_net(PARAMS, means(36)))
    assert uncropped.blob_shapes["data"] == (2, 36, 17, 19)


def test_gating_layout_gives_one_row_per_segment_after_the_nets_reshape(tmp_path):
    """io.cpp's order: segment s's frames f as x then y at channels 2 (s L + f), 2 (s L + f) + 1; then segment
    s's B, G, R at 2 L S + 3 s + c.  The nets' Reshape to (-1, 2 L) and (-1, 3) then give row b S + s."""
    batch, length, segments, hw = 2, 3, 4, 5
    model = load_from_text(gating_net(f"batch_size: {batch} new_length: {length} num_segments: {segments}",
                                      f"crop_size: {hw} {means(36)}", tail=sliced(24, length, segments, hw)))
    flow = rng(1).standard_normal((batch, segments, length, 2, hw, hw)).astype(np.float32)
    colour = rng(2).standard_normal((batch, segments, 3, hw, hw)).astype(np.float32)
    data = np.zeros((batch, 36, hw, hw), np.float32)
    for b in range(batch):
        for s in range(segments):
            for f in range(length):
                for axis in range(2):
                    data[b, 2 * (s * length + f) + axis] = flow[b, s, f, axis]
            for c in range(3):
                data[b, 2 * length * segments + 3 * s + c] = colour[b, s, c]
    flow_rows = np.zeros((batch * segments, 2 * length, hw, hw), np.float32)
    rgb_rows = np.zeros((batch * segments, 3, hw, hw), np.float32)
    for b in range(batch):
        for s in range(segments):
            for f in range(length):
                flow_rows[b * segments + s, 2 * f] = flow[b, s, f, 0]
                flow_rows[b * segments + s, 2 * f + 1] = flow[b, s, f, 1]
            rgb_rows[b * segments + s] = colour[b, s]
    labels = np.arange(batch, dtype=np.float32).reshape(batch, 1, 1, 1)
    check_everywhere(model, {"data": data, "label": labels}, {"flow_rows": flow_rows, "rgb_rows": rgb_rows}, tmp_path)


def test_gating_preprocessing_names_the_two_streams():
    model = load_from_text(gating_net(PARAMS, f"crop_size: 13 mirror: true is_flow: true {means(36)}"))
    node = next(n for n in model.graph.nodes if n.type == "VideoData")
    lines = node.spec.preprocessing(node.attrs)
    assert lines[0].startswith("4 segments x 3 frames of x and y flow (channels 0-23")
    assert "channels 24-35" in lines[0]
    assert lines[1] == "is_flow: a flipped sample gets 255 - v on the even channels below 30"
    assert "frames resized to 17x19" in lines


def test_gating_notes_only_what_the_file_sets():
    """is_flow changes only flipped samples (mirror), modality is noted only when set, and a missing batch_size
    (no default in the fork's proto) is read as 1, as for TSN."""
    model = load_from_text(gating_net(PARAMS.replace("batch_size: 2 ", ""), f"crop_size: 13 is_flow: true {means(36)}"))
    node = next(n for n in model.graph.nodes if n.type == "VideoData")
    assert model.blob_shapes["data"] == (1, 36, 13, 13) and model.blob_shapes["label"] == (1, 1, 1, 1)
    assert not any("is_flow" in line for line in node.spec.preprocessing(node.attrs))
    flipped = load_from_text(gating_net(PARAMS, f"crop_size: 13 mirror: true {means(36)}"))
    node = next(n for n in flipped.graph.nodes if n.type == "VideoData")
    assert not any("is_flow" in line for line in node.spec.preprocessing(node.attrs))
    notes = [w for w in model.warnings if "gating-ConvNet-code" in w]
    assert notes and not any("modality" in w for w in notes), model.warnings


@pytest.mark.parametrize("params, transform, data", [
    (PARAMS + " grayscale: true modality: RGB", "crop_size: 13", (2, 12, 13, 13)),   # TSN's gray frames
    (PARAMS + " length_first: true", "crop_size: 13", (2, 24, 13, 13)),             # ECO
    (PARAMS, "crop_height: 13 crop_width: 11", (2, 24, 13, 11)),                    # kevin-ssy's caffe-action
    (PARAMS, "crop_size: 13 is_roi: false", (2, 24, 13, 13)),                       # kevin-ssy's branches
])
def test_other_forks_fields_keep_their_reading_even_with_a_gating_mean_count(params, transform, data):
    """Fields the gating fork's proto lacks name another TSN fork, whatever the mean_value count."""
    model = load_from_text(gating_net(params, f"{transform} {means(36)}"))
    assert model.blob_shapes["data"] == data
    assert not any("gating-ConvNet-code" in w for w in model.warnings), model.warnings


def test_gating_ignores_modality_with_a_note():
    # new_length 2: (2 x 2 + 3) x 4 = 28, where TSN's RGB would be 3 x 2 x 4 = 24
    model = load_from_text(gating_net(PARAMS.replace("new_length: 3", "new_length: 2") + " modality: RGB",
                                      f"crop_size: 13 {means(28)}"))
    assert model.blob_shapes["data"] == (2, 28, 13, 13)
    assert any("ignores modality" in w for w in model.warnings), model.warnings


@pytest.mark.parametrize("params, transform, channels", [
    (PARAMS, "crop_size: 13 is_flow: true mean_value: 128", 2 * 3 * 4),        # one mean: TSN's FLOW
    (PARAMS, f"crop_size: 13 is_flow: true {means(24)}", 2 * 3 * 4),          # TSN's own count
    (PARAMS + " modality: RGB", f"crop_size: 13 {means(36)}", 36),             # 3 x 3 x 4: TSN's too, same shape
    (PARAMS.replace("new_length: 3", "new_length: 2") + " modality: RGB_FLOW",  # kevin-ssy's caffe-action
     f"crop_size: 13 {means(28)}", 8 * 2 * 4),
])
def test_other_tsn_readings_stay(params, transform, channels):
    model = load_from_text(gating_net(params, transform))
    assert model.blob_shapes["data"] == (2, channels, 13, 13)
    assert not any("gating-ConvNet-code" in w for w in model.warnings), model.warnings


def test_gating_bad_input_names_the_layer_and_field():
    with pytest.raises(LayerError, match=r"layer 'data' \(VideoData\): zhujiagang/gating-ConvNet-code's VideoData "
                                         r"has two tops \(data, label\), got 1"):
        load_from_text(gating_net(PARAMS, f"crop_size: 13 {means(36)}", tops=("data",)))
    with pytest.raises(LayerError, match=r"layer 'data' \(VideoData\): transform_param.crop_size 21 exceeds the "
                                         r"17x19 frames"):
        load_from_text(gating_net(PARAMS, f"crop_size: 21 {means(36)}"))


def test_real_gating_train_val_reads():
    """The fixture's 39 mean values (30 x 128 for the flow, 3 x BGR) make data 4x39: the Slice at 30 and the
    per-segment Reshapes give both streams 12 rows, so the gating Concat of their features lines up."""
    model = load(REALWORLD / (GATING + "train_val.prototxt"))
    shapes = model.blob_shapes
    assert shapes["data"] == (4, 39, 224, 224)
    assert shapes["flow_data"] == (4, 30, 224, 224) and shapes["rgb_data"] == (4, 9, 224, 224)
    assert shapes["flow_data_reshape"] == (12, 10, 224, 224) and shapes["rgb_reshape_data"] == (12, 3, 224, 224)
    assert shapes["gating_inception_4e/output/concat"] == (12, 2112, 7, 7)


@pytest.mark.parametrize("name, concat", [("train_val.prototxt", (12, 2112, 7, 7)),
                                          ("concat_train_val.prototxt", (12, 1056, 14, 7))])
def test_corpus_gating_train_vals_read(name, concat):
    path = REALWORLD / (GATING + name)
    model = load(path)
    assert model.blob_shapes["data"] == (4, 39, 224, 224)
    assert model.blob_shapes["rgb_reshape_data"] == (12, 3, 224, 224)
    assert model.blob_shapes["gating_inception_4e/output/concat"] == concat
