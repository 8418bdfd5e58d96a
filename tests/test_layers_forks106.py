"""Round 106 fork items: torrvision/caffe-tvg's BoxFeatures and ChannelSelect (caffeq/layers/torrvision_tvg.py)
against numpy transcriptions of their Forward_cpu loops, in torch, onnxruntime and model.py; dicecco1/fpga_caffe's
HalfConversion and OCL engine fields (caffeq/layers/fpga_caffe.py); SSD_windows_caffe's
AnnotatedDataParameter.config; and the three forks' corpus files."""
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, check_everywhere, inspect_corpus_file, net, rng
from google.protobuf import text_format

from caffeq.errors import CaffeqError
from caffeq.io.schema import caffe_pb2
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F32 = np.float32


# ---- torrvision/caffe-tvg ----------------------------------------------------------------------------------

def box_features_ref(unary, dets, background=None):
    """box_features_layer.cpp's Forward_cpu: boxes cast to int, clamped to the map, both ends included."""
    _, c, h, w = unary.shape
    rows = dets.reshape(-1, 6)
    out = np.zeros((len(rows) + 1, c, h, w), F32)
    for i, row in enumerate(rows):
        x_start, y_start, x_end, y_end = (int(v) for v in row[1:5])   # int() truncates toward zero, as C does
        x_start, y_start = max(0, x_start), max(0, y_start)
        x_end, y_end = min(w - 1, x_end), min(h - 1, y_end)
        s = F32(row[5])
        e, e1 = (F32(np.exp(np.float64(v))) for v in (s, F32(1) - s))    # glibc's expf: correctly rounded
        score = e / (e + e1)
        for cc in range(c):
            for x in range(x_start, x_end + 1):
                for y in range(y_start, y_end + 1):
                    out[i + 1, cc, y, x] = unary[0, cc, y, x] * score
    if background is not None:
        out[0] = unary[0] * F32(background)
    return out


def channel_select_ref(unary, dets):
    """channel_select_layer.cpp's Forward_cpu: Blob::offset(i + 1, label, y, x) into the blob's memory, with
    zeros where the fork stops (label > C) or reads outside the blob."""
    n, c, h, w = unary.shape
    flat = unary.reshape(-1)
    out = np.zeros((n, 1, h, w), F32)
    out[0, 0] = unary[0, 0]
    for i, row in enumerate(dets.reshape(-1, 6)):
        label = int(row[0])
        if label > c:
            continue
        for y in range(h):
            for x in range(w):
                at = (((i + 1) * c + label) * h + y) * w + x
                if 0 <= at < flat.size:
                    out[i + 1, 0, y, x] = flat[at]
    return out


BOX_LAYER = ('layer {{ name: "bf" type: "BoxFeatures" bottom: "unary" bottom: "dets" top: "y" '
             'box_term_param {{ detection_box_input_dir: "" detection_pixel_input_dir: "" {} }} }}')


@pytest.mark.parametrize("param, background", [("is_background_det: true background_det_score: 0.35", 0.35),
                                               ("is_background_det: true", 0.7311), ("", None)])
def test_box_features_scales_each_box(param, background, tmp_path):
    unary = rng(1).standard_normal((1, 3, 7, 9)).astype(F32)
    dets = np.array([[4, 1.9, 2.2, 5.7, 6.0, 0.8],       # fractions cut toward zero
                     [7, -3.5, -1.2, 2.0, 1.9, -0.4],    # clamped at the top left
                     [1, 6.0, 4.0, 20.0, 11.0, 2.5],     # clamped at the bottom right
                     [2, 5.0, 3.0, 4.0, 5.0, 0.1],       # x_start > x_end: nothing
                     [3, 9.0, 0.0, 12.0, 3.0, 0.6]],     # right of the map: nothing
                    F32).reshape(1, 5, 1, 6)
    model = load_from_text(net(BOX_LAYER.format(param), inputs={"unary": unary.shape, "dets": dets.shape}))
    ref = box_features_ref(unary, dets, background)
    assert ref.shape == (6, 3, 7, 9) and not ref[4].any() and not ref[5].any()
    check_everywhere(model, {"unary": unary, "dets": dets}, {"y": ref}, tmp_path)


def test_box_features_cuts_negative_box_ends_toward_zero(tmp_path):
    """detection.hpp's static_cast<int>: an end in (-1, 0) is 0 (floor would give -1 and an empty box), so the
    box keeps column / row 0."""
    unary = rng(4).standard_normal((1, 2, 5, 6)).astype(F32)
    dets = np.array([[1, -2.5, 1.0, -0.6, 3.7, 1.2],     # x_end -0.6 -> 0: column 0, rows 1 to 3
                     [2, 2.0, -1.9, 4.2, -0.3, 0.3]],    # y_end -0.3 -> 0: row 0, columns 2 to 4
                    F32).reshape(1, 2, 1, 6)
    model = load_from_text(net(BOX_LAYER.format(""), inputs={"unary": unary.shape, "dets": dets.shape}))
    ref = box_features_ref(unary, dets)
    assert ref[1, :, 1:4, 0].all() and not ref[1, :, :, 1:].any() and not ref[1, :, 0].any()
    assert ref[2, :, 0, 2:5].all() and not ref[2, :, 1:].any() and not ref[0].any()
    check_everywhere(model, {"unary": unary, "dets": dets}, {"y": ref}, tmp_path)


def test_box_features_refuses_a_batch_and_a_bad_detection_blob():
    with pytest.raises(LayerError, match="batch of 1 only"):
        load_from_text(net(BOX_LAYER.format(""), inputs={"unary": (2, 3, 5, 7), "dets": (1, 2, 1, 6)}))
    with pytest.raises(LayerError, match=r"\(1, D, \.\.\.\) holding D rows of 6 values"):
        load_from_text(net(BOX_LAYER.format(""), inputs={"unary": (1, 3, 5, 7), "dets": (1, 2, 1, 5)}))


SELECT_LAYER = 'layer { name: "cs" type: "ChannelSelect" bottom: "unary" bottom: "dets" top: "y" }'


def test_channel_select_takes_each_detections_label_plane(tmp_path):
    unary = rng(2).standard_normal((6, 4, 3, 5)).astype(F32)
    dets = np.array([[2.7, 0, 0, 1, 1, 0.5],     # row 1, channel 2
                     [4.0, 0, 0, 1, 1, 0.5],     # label == C: row 3's channel 0 (offset checks only c <= C)
                     [-1.5, 0, 0, 1, 1, 0.5],    # label -1: row 2's channel 3
                     [0.0, 0, 0, 1, 1, 0.5]],    # row 4, channel 0; row 5 stays zero
                    F32).reshape(1, 4, 1, 6)
    model = load_from_text(net(SELECT_LAYER, inputs={"unary": unary.shape, "dets": dets.shape}))
    ref = channel_select_ref(unary, dets)
    np.testing.assert_array_equal(ref[2, 0], unary[3, 0])
    np.testing.assert_array_equal(ref[3, 0], unary[2, 3])
    assert not ref[5].any()
    check_everywhere(model, {"unary": unary, "dets": dets}, {"y": ref}, tmp_path)


def test_channel_select_gives_zeros_where_the_fork_stops_or_reads_outside(tmp_path):
    unary = rng(3).standard_normal((3, 2, 5, 3)).astype(F32)
    dets = np.array([[3, 0, 0, 0, 0, 1],         # label > C: the fork stops
                     [2, 0, 0, 0, 0, 1]],        # plane 3 * 2 + 2 = 8 > 6 planes: outside the blob
                    F32).reshape(1, 2, 6, 1)
    model = load_from_text(net(SELECT_LAYER, inputs={"unary": unary.shape, "dets": dets.shape}))
    ref = channel_select_ref(unary, dets)
    assert not ref[1:].any()
    check_everywhere(model, {"unary": unary, "dets": dets}, {"y": ref}, tmp_path)


def test_channel_select_needs_a_row_per_detection():
    with pytest.raises(LayerError, match="has 3 rows but 3 detections need 4"):
        load_from_text(net(SELECT_LAYER, inputs={"unary": (3, 2, 4, 4), "dets": (1, 3, 1, 6)}))


# ---- dicecco1/fpga_caffe -----------------------------------------------------------------------------------

def test_half_conversion_and_the_ocl_engine_fields_read():
    """test2_output's path: HalfConversion (CPFPConversion's older name) around the OCL layers, engine: OCL and
    subengine on their convolution_param."""
    layers = ('layer { name: "half" type: "HalfConversion" bottom: "h" top: "q" half_conversion_param { '
              'convert_to: true } }\n'
              'layer { name: "conv1" type: "OCLCRHWCN" bottom: "q" top: "c1" convolution_param { engine: OCL '
              'subengine: WINOGRAD num_output: 8 pad: 2 kernel_size: 5 } ocl_enable: true cr_param { relu: 1 } }\n'
              'layer { name: "back" type: "HalfConversion" bottom: "c1" top: "f" half_conversion_param { '
              'convert_to: false } }')
    model = load_from_text(net(layers, inputs={"h": (9, 11, 4, 2)}), random_weights=True)
    assert model.blob_shapes["q"] == (9, 11, 4, 2) and model.blob_shapes["f"] == (9, 11, 8, 2)
    with pytest.raises(CaffeqError, match="layer 'half' \\(HalfConversion\\): its top holds the fork's 14-bit chalf"):
        model.run({"h": np.zeros((9, 11, 4, 2), F32)})
    p = caffe_pb2.ConvolutionParameter(engine=caffe_pb2.ConvolutionParameter.OCL,
                                       subengine=caffe_pb2.ConvolutionParameter.WINOGRAD)
    assert p.subengine == 1
    for message in (caffe_pb2.PoolingParameter, caffe_pb2.LRNParameter, caffe_pb2.ReLUParameter,
                    caffe_pb2.SigmoidParameter, caffe_pb2.SoftmaxParameter, caffe_pb2.TanHParameter,
                    caffe_pb2.SPPParameter):
        assert message.Engine.Name(message.OCL) == "OCL"
    assert caffe_pb2.SoftmaxParameter.OCL == 3


def test_half_conversion_checks_its_blobs():
    with pytest.raises(LayerError, match="HalfConversion"):
        load_from_text(net('layer { name: "half" type: "HalfConversion" bottom: "h" top: "q" top: "r" }',
                           inputs={"h": (3, 3, 4, 2)}))


# ---- dreadlord1984/SSD_windows_caffe -----------------------------------------------------------------------

def test_annotated_data_config_is_read():
    p = caffe_pb2.LayerParameter()
    text_format.Parse('name: "data" type: "AnnotatedData" annotated_data_param { config: "frcnn.json" '
                      'label_map_file: "labels.prototxt" }', p)
    assert p.annotated_data_param.config == "frcnn.json"


# ---- the corpus files ----------------------------------------------------------------------------------------

REALWORLD = REPO / "tests" / "fixtures" / "realworld"
CORPUS = [
    ("dicecco1__fpga_caffe__scripts__prototxtConvert__test2_output.prototxt",
     ("--input-shape", "data=192,3,32,32", "--input-shape", "label=192"), "half2 -> hwcn2           192x10"),
    ("dreadlord1984__SSD_windows_caffe__Pedestrian__trainD1add_noSqrt_rcnn.prototxt", (),
     "-> mbox_priorbox_1  1x2x85992"),
    ("torrvision__caffe-tvg__src__caffe__test__matlab_tests__box_features_layer__data__"
     "box_features_layer.prototxt", (), "unary,detections -> box_features  31x512x66x66"),
    ("torrvision__caffe-tvg__src__caffe__test__matlab_tests__channel_select_layer__data__"
     "channel_select_layer.prototxt", (), "unary,detections -> selected_channels  31x1x66x66"),
]


@pytest.mark.parametrize("path, args, row", CORPUS, ids=[Path(p).name[:48] for p, _, _ in CORPUS])
def test_the_forks_files_read(path, args, row):
    out = inspect_corpus_file(REALWORLD / path, *args)
    assert row in out, out
