"""C3D v1.0's 3-D layers (facebookarchive/C3D, C3D-v1.0) in V1 files: Convolution3D, Pooling3D,
VoxelSoftmax and VideoData.  References are numpy loops written from convolution3d_layer.cpp (vol2col + GEMM) and
pool3d_layer.cpp's Forward_cpu, on (N, C, L, H, W) shapes where every axis differs."""
import math

import numpy as np
import pytest
from conftest import REPO, assert_close, bvlc_pool3d_ref, node_of, rng
from conftest import check_everywhere as shared_check

from caffeq.layers import LayerError
from caffeq.model import load_from_text

FLT_MAX = float(np.finfo(np.float32).max)



def check_everywhere(model, feeds, refs, tmp_path, atol=0.0, rtol=0.0):
    """torch (every blob), onnxruntime (opset 13 and the default) and model.py against refs."""
    shared_check(model, feeds, refs, tmp_path, atol, rtol, all_blobs=True)


def v1_net(shape, *layers):
    dims = " ".join(f"dim: {d}" for d in shape)
    return f'name: "c3d"\ninput: "x"\ninput_shape {{ {dims} }}\n' + "\n".join(layers)


def conv3d_ref(x, w, b, stride, tstride, pad, tpad):
    """Each output voxel: sum over C x kd x k x k of the zero-padded input times the filter, plus bias."""
    n, c, length, h, wd = x.shape
    o, _, kd, k, _ = w.shape
    ol = (length + 2 * tpad - kd) // tstride + 1
    oh, ow = (h + 2 * pad - k) // stride + 1, (wd + 2 * pad - k) // stride + 1
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (tpad, tpad), (pad, pad), (pad, pad)))
    out = np.zeros((n, o, ol, oh, ow))
    for t in range(ol):
        for i in range(oh):
            for j in range(ow):
                patch = xp[:, :, t * tstride:t * tstride + kd, i * stride:i * stride + k, j * stride:j * stride + k]
                out[:, :, t, i, j] = np.einsum("ncdkl,ocdkl->no", patch, w) + b.reshape(-1)
    return out


@pytest.mark.parametrize("stride, tstride, pad, tpad, groups", [(1, 1, 1, 1, 1), (2, 1, 0, 1, 2), (2, 2, 1, 0, 1)])
def test_convolution3d(stride, tstride, pad, tpad, groups, tmp_path):
    x = rng(21).standard_normal((2, 3, 5, 7, 6)).astype(np.float32)
    text = v1_net(x.shape, f"layers {{ name: 'c' type: CONVOLUTION3D bottom: 'x' top: 'c'\n"
                           f"  convolution_param {{ num_output: 4 kernel_size: 3 kernel_depth: 2 stride: {stride} "
                           f"temporal_stride: {tstride} pad: {pad} temporal_pad: {tpad} filter_group: {groups} }} }}")
    model = load_from_text(text, random_weights=True)
    node = next(n for n in model.layers if n.name == "c")
    w, b = node.blobs
    assert w.shape == (4, 3, 2, 3, 3) and b.shape == (1, 1, 1, 1, 4)
    node.blobs = [w, rng(22).standard_normal(b.shape).astype(np.float32)]   # a bias that is not zero
    check_everywhere(model, {"x": x}, {"c": conv3d_ref(x, w, node.blobs[1], stride, tstride, pad, tpad)},
                     tmp_path, atol=1e-5, rtol=1e-5)


def deconv3d_ref(x, w, b, stride, tstride, pad, tpad):
    """deconvolution3d_layer.cpp: col = W^T x (one column per input voxel), then col2vol adds each
    column's kd x k x k block into the output at (t * tstride - tpad, i * stride - pad, ...)."""
    n, c, length, h, wd = x.shape
    _, o, kd, k, _ = w.shape
    ol, oh, ow = (length - 1) * tstride - 2 * tpad + kd, (h - 1) * stride - 2 * pad + k, (wd - 1) * stride - 2 * pad + k
    out = np.zeros((n, o, ol + 2 * tpad + kd, oh + 2 * pad + k, ow + 2 * pad + k))
    for t in range(length):
        for i in range(h):
            for j in range(wd):
                block = np.einsum("nc,cokpq->nokpq", x[:, :, t, i, j].astype(np.float64), w)
                out[:, :, t * tstride:t * tstride + kd, i * stride:i * stride + k, j * stride:j * stride + k] += block
    out = out[:, :, tpad:tpad + ol, pad:pad + oh, pad:pad + ow]
    return out + b.reshape(1, -1, 1, 1, 1)


@pytest.mark.parametrize("stride, tstride, pad, tpad", [(2, 2, 1, 1), (2, 1, 0, 1), (3, 2, 1, 0)])
def test_deconvolution3d_is_the_transpose_of_c3ds_vol2col(stride, tstride, pad, tpad, tmp_path):
    """C3D v1.0's DECONVOLUTION3D (the v2v nets' upsampling): weight (C, O, kd, k, k)."""
    x = rng(25).standard_normal((2, 3, 3, 4, 5)).astype(np.float32)
    text = v1_net(x.shape, f"layers {{ name: 'd' type: DECONVOLUTION3D bottom: 'x' top: 'd'\n"
                           f"  convolution_param {{ num_output: 2 kernel_size: 4 kernel_depth: 3 stride: {stride} "
                           f"temporal_stride: {tstride} pad: {pad} temporal_pad: {tpad} }} }}")
    model = load_from_text(text, random_weights=True)
    node = next(n for n in model.layers if n.name == "d")
    w, b = node.blobs
    assert w.shape == (3, 2, 3, 4, 4) and b.shape == (1, 1, 1, 1, 2)
    node.blobs = [w, rng(26).standard_normal(b.shape).astype(np.float32)]
    want = deconv3d_ref(x, w, node.blobs[1], stride, tstride, pad, tpad)
    assert model.blob_shapes["d"] == want.shape
    check_everywhere(model, {"x": x}, {"d": want}, tmp_path, atol=1e-5, rtol=1e-5)
    with pytest.raises(LayerError, match="no filter groups"):
        load_from_text(text.replace("pad: {pad} ".format(pad=pad), f"pad: {pad} filter_group: 2 ", 1))


def pool3d_ref(x, method, k, kd, s, ts, pad):
    """pool3d_layer.cpp Forward_cpu: ceil-rounded extents, windows never dropped."""
    n, c, length, h, w = x.shape
    ol = int(math.ceil((length - kd) / ts)) + 1
    oh = int(math.ceil((h + 2 * pad - k) / s)) + 1
    ow = int(math.ceil((w + 2 * pad - k) / s)) + 1
    out = np.zeros((n, c, ol, oh, ow))
    xd = x.astype(np.float64)
    for pl in range(ol):
        for ph in range(oh):
            for pw in range(ow):
                if method == "MAX":
                    ls, hs, ws = pl * ts, ph * s, pw * s
                    le, he, we = min(ls + kd, length), min(hs + k, h), min(ws + k, w)
                    win = xd[:, :, ls:le, hs:he, ws:we]
                    out[:, :, pl, ph, pw] = win.max(axis=(2, 3, 4)) if win.size else -FLT_MAX
                else:
                    hs, ws, ls = ph * s - pad, pw * s - pad, pl * ts
                    he, we, le = min(hs + k, h + pad), min(ws + k, w + pad), min(ls + kd, length)
                    size = (he - hs) * (we - ws) * (le - ls)
                    win = xd[:, :, ls:min(le, length), max(hs, 0):min(he, h), max(ws, 0):min(we, w)]
                    out[:, :, pl, ph, pw] = win.sum(axis=(2, 3, 4)) / size
    return out


@pytest.mark.parametrize("method, k, kd, s, ts, pad", [
    ("MAX", 2, 2, 2, 2, 0),      # C3D's pool2..pool5; H 7 -> 4 by ceil
    ("MAX", 2, 1, 2, 1, 0),      # pool1
    ("MAX", 1, 1, 3, 3, 0),      # stride > kernel: the last windows start past the input (-FLT_MAX)
    ("AVE", 3, 2, 2, 2, 1),      # padded cells count in the divisor
    ("AVE", 3, 3, 2, 1, 0),
])
def test_pooling3d(method, k, kd, s, ts, pad, tmp_path):
    x = rng(23).standard_normal((2, 3, 5, 7, 6)).astype(np.float32)
    text = v1_net(x.shape, f"layers {{ name: 'p' type: POOLING3D bottom: 'x' top: 'p'\n"
                           f"  pooling_param {{ pool: {method} kernel_size: {k} kernel_depth: {kd} stride: {s} "
                           f"temporal_stride: {ts} pad: {pad} }} }}")
    model = load_from_text(text)
    ref = pool3d_ref(x, method, k, kd, s, ts, pad)
    assert model.blob_shapes["p"] == ref.shape
    check_everywhere(model, {"x": x}, {"p": ref}, tmp_path, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("params, msg", [
    ("pool: MAX kernel_size: 2 kernel_depth: 2 pad: 1", "pads only AVE"),
    ("pool: STOCHASTIC kernel_size: 2 kernel_depth: 2", "MAX and AVE only"),
    ("pool: MAX kernel_size: 2", "kernel_depth"),
    ("pool: AVE kernel_size: 1 kernel_depth: 1 stride: 3", "divides by zero"),
])
def test_pooling3d_bad_params(params, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(v1_net((2, 3, 5, 7, 6), f"layers {{ name: 'p' type: POOLING3D bottom: 'x' top: 'p'\n"
                                               f"  pooling_param {{ {params} }} }}"))


def test_convolution3d_bad_params():
    with pytest.raises(LayerError, match="kernel_depth"):
        load_from_text(v1_net((2, 3, 5, 7, 6), "layers { name: 'c' type: CONVOLUTION3D bottom: 'x' top: 'c'\n"
                                               "  convolution_param { num_output: 4 kernel_size: 3 } }"))
    with pytest.raises(LayerError, match="5-axis"):
        load_from_text(v1_net((2, 3, 7, 6), "layers { name: 'c' type: CONVOLUTION3D bottom: 'x' top: 'c'\n"
                                            "  convolution_param { num_output: 4 kernel_size: 3 kernel_depth: 1 } }"))


def test_voxel_softmax_normalizes_each_voxels_channels(tmp_path):
    """C3D v1.0's VOXEL_SOFTMAX (voxel_wise_softmax_layer.cpp): exp(x - max over C) / sum over C, per voxel."""
    x = (rng(4).standard_normal((1, 4, 3, 5, 2)) * 3).astype(np.float32)
    model = load_from_text(v1_net(x.shape, "layers { name: 'p' type: VOXEL_SOFTMAX bottom: 'x' top: 'p' }"))
    assert model.net.layer[-1].type == "VoxelSoftmax"
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(axis=1, keepdims=True))
    check_everywhere(model, {"x": x}, {"p": e / e.sum(axis=1, keepdims=True)}, tmp_path, atol=1e-6, rtol=1e-6)
    with pytest.raises(LayerError, match=r"VoxelSoftmax takes C3D's 5-D blobs .N, C, L, H, W., got \[2, 3, 7, 6\]"):
        load_from_text(v1_net((2, 3, 7, 6), "layers { name: 'p' type: VOXEL_SOFTMAX bottom: 'x' top: 'p' }"))


def test_c3d_video_data_shapes_its_clip():
    text = ("name: 'v'\nlayers { name: 'data' type: VIDEO_DATA top: 'data' top: 'label'\n"
            "  image_data_param { source: 'list.txt' use_image: true batch_size: 3 crop_size: 11 new_height: 16\n"
            "    new_width: 20 new_length: 4 mirror: false show_data: 0 } }\n"
            "layers { name: 'c' type: CONVOLUTION3D bottom: 'data' top: 'c'\n"
            "  convolution_param { num_output: 2 kernel_size: 3 kernel_depth: 3 pad: 1 temporal_pad: 1 } }")
    model = load_from_text(text, random_weights=True)
    assert model.blob_shapes["data"] == (3, 3, 4, 11, 11)
    assert model.blob_shapes["label"] == (3, 1, 1, 1, 1)
    assert model.blob_shapes["c"] == (3, 2, 4, 11, 11)
    no_crop = load_from_text(text.replace("crop_size: 11 ", ""), random_weights=True)
    assert no_crop.blob_shapes["data"] == (3, 3, 4, 16, 20)


# ---- C3D v1.1 (V2 files: convolution3d_param / pooling3d_param / video_data_param 6660) and TSN ----

def v2_net(shape, *layers):
    dims = " ".join(f"dim: {d}" for d in shape)
    return f'name: "c3d11"\nlayer {{ name: "x" type: "Input" top: "x" input_param {{ shape {{ {dims} }} }} }}\n' + \
        "\n".join(layers)


def test_c3d_v11_convolution3d_and_pooling3d(tmp_path):
    """v1.1's Convolution3DParameter / Pooling3DParameter (scalar fields) give v1.0's numbers."""
    x = rng(31).standard_normal((2, 3, 5, 7, 6)).astype(np.float32)
    text = v2_net(x.shape,
                  'layer { name: "c" type: "Convolution3D" bottom: "x" top: "c"\n'
                  '  convolution3d_param { num_output: 4 kernel_size: 3 kernel_depth: 2 stride: 2 temporal_stride: 1 '
                  'pad: 1 temporal_pad: 1 filter_group: 2 } }',
                  'layer { name: "p" type: "Pooling3D" bottom: "c" top: "p"\n'
                  '  pooling3d_param { pool: AVE kernel_size: 2 kernel_depth: 2 stride: 2 temporal_stride: 2 pad: 1 } }')
    model = load_from_text(text, random_weights=True)
    node = next(n for n in model.layers if n.name == "c")
    w, b = node.blobs
    assert w.shape == (4, 3, 2, 3, 3) and b.shape == (1, 1, 1, 1, 4)
    node.blobs = [w, rng(32).standard_normal(b.shape).astype(np.float32)]
    conv = conv3d_ref(x, w, node.blobs[1], 2, 1, 1, 1)
    pool = pool3d_ref(conv.astype(np.float32), "AVE", 2, 2, 2, 2, 1)
    assert model.blob_shapes["c"] == conv.shape and model.blob_shapes["p"] == pool.shape
    assert_close(model.run({"x": x}, all_blobs=True)["c"], conv, 1e-5, 1e-5, "torch c")
    check_everywhere(model, {"x": x}, {"p": pool}, tmp_path, atol=1e-5, rtol=1e-5)


def test_c3d_v11_bad_params_name_the_v11_field():
    with pytest.raises(LayerError, match="pooling3d_param.pad"):
        load_from_text(v2_net((2, 3, 5, 7, 6), 'layer { name: "p" type: "Pooling3D" bottom: "x" top: "p"\n'
                                               '  pooling3d_param { pool: MAX kernel_size: 2 kernel_depth: 2 pad: 1 } }'))
    with pytest.raises(LayerError, match="convolution3d_param.kernel_depth"):
        load_from_text(v2_net((2, 3, 5, 7, 6), 'layer { name: "c" type: "Convolution3D" bottom: "x" top: "c"\n'
                                               '  convolution3d_param { num_output: 2 kernel_size: 3 } }'))


C3D11_DATA = ('layer { name: "data" type: "VideoData" top: "data" top: "label"\n'
              '  transform_param { crop_size: 11 mean_value: 128 }\n'
              '  video_data_param { source: "l.txt" root_folder: "" new_length: 4 sampling_rate: 2 new_height: 16 '
              'new_width: 20 use_image: true batch_size: 3 %s } }')


def test_c3d_v11_video_data_shapes():
    """video_data_layer.cpp: (batch, 3, new_length, crop, crop); label (batch) or (batch, num_of_labels)."""
    model = load_from_text(C3D11_DATA % "")
    assert model.blob_shapes["data"] == (3, 3, 4, 11, 11) and model.blob_shapes["label"] == (3,)
    multi = load_from_text(C3D11_DATA % "use_multiple_label: true num_of_labels: 5")
    assert multi.blob_shapes["label"] == (3, 5)
    no_crop = load_from_text((C3D11_DATA % "").replace("crop_size: 11 ", ""))
    assert no_crop.blob_shapes["data"] == (3, 3, 4, 16, 20)
    with pytest.raises(LayerError, match="exceeds"):
        load_from_text((C3D11_DATA % "").replace("crop_size: 11", "crop_size: 17"))
    with pytest.raises(LayerError, match="num_of_labels"):
        load_from_text(C3D11_DATA % "use_multiple_label: true")
    # 3DMM-ICME2024/tc3d: num_segments snippets stacked on the channels (with its crop fields beside C3D's)
    tc3d = load_from_text(C3D11_DATA % "sampling_rate: 2 use_image: true num_segments: 3 fix_crop: true "
                                       "scale_ratios: [1, 0.875] max_distort: 1")
    assert tc3d.blob_shapes["data"] == (3, 9, 4, 11, 11)


def tsn_data(params, transform="crop_size: 13"):
    return ('name: "tsn"\nlayer { name: "data" type: "VideoData" top: "data" top: "label"\n'
            f'  transform_param {{ {transform} }}\n  video_data_param {{ source: "l.txt" {params} }} }}')


@pytest.mark.parametrize("params, channels", [
    ("batch_size: 2 new_length: 1 num_segments: 3 modality: RGB", 3 * 1 * 3),
    ("batch_size: 2 new_length: 5 num_segments: 3 modality: FLOW", 2 * 5 * 3),
    ("batch_size: 2 new_length: 2 num_segments: 4 modality: RGB grayscale: true", 1 * 2 * 4),
    ("batch_size: 2 new_length: 5 num_segments: 3", 2 * 5 * 3),     # modality defaults to FLOW
    ("batch_size: 2 name_pattern: 'img_%05d.jpg'", 2 * 1 * 1),      # new_length, num_segments default 1
])
def test_tsn_video_data_stacks_segments_on_channels(params, channels):
    """yjxiong/caffe video_data_layer.cpp: (batch, per-frame channels x new_length x num_segments, crop, crop),
    label (batch, 1, 1, 1)."""
    model = load_from_text(tsn_data(params))
    assert model.blob_shapes["data"] == (2, channels, 13, 13)
    assert model.blob_shapes["label"] == (2, 1, 1, 1)


def test_tsn_training_transform_fields_and_resize():
    text = tsn_data("batch_size: 2 new_length: 1 num_segments: 2 modality: RGB new_height: 16 new_width: 19",
                    "mirror: true fix_crop: true more_fix_crop: true multi_scale: true max_distort: 1 "
                    "scale_ratios: [1, .875, .75] is_flow: false")
    from caffeq.io.prototxt import parse_prototxt_text
    model = load_from_text(text)
    assert model.blob_shapes["data"] == (2, 6, 16, 19)
    transform = parse_prototxt_text(text).layer[0].transform_param
    assert list(transform.scale_ratios) == pytest.approx([1, .875, .75]) and transform.more_fix_crop


@pytest.mark.parametrize("params, transform, shape", [
    # kevin-ssy/Optical-Flow-Guided-Feature's caffe-action: crop_height x crop_width first, one copy per is_roi
    ("batch_size: 1 num_segments: 25 modality: RGB roi_pool_flag: false video_id_path: 'ids.txt'",
     "crop_size: 13 crop_width: 224 crop_height: 200 num_ch_per_seg: 3 is_flow: false is_pose: false "
     "is_rgb_flow: false is_roi: false visualize: false use_zero: true oversample_type_path: 'o.txt'",
     (1, 75, 200, 224)),
    ("batch_size: 2 new_length: 2 num_segments: 3 modality: RGB_FLOW", "crop_size: 13 is_roi: false is_roi: true",
     (2, 2 * 8 * 2 * 3, 13, 13)),                   # two images and x, y flow a frame, two branches
    ("batch_size: 2 num_segments: 2 modality: RGB_POSE img_list_path: 'j.txt' select_joints: [1, 2] roi_w: 40",
     "crop_size: 13", (2, 3 * 2, 13, 13)),
])
def test_caffe_action_video_data_modalities_and_branches(params, transform, shape):
    """caffe-action video_data_layer.cpp DataLayerSetUp: (batch, is_roi_size() x datum channels, crop_height x
    crop_width, else crop_size); io.cpp's ReadSegment*ToDatum give 3, 2, 8 and 3 channels a frame."""
    model = load_from_text(tsn_data(params, transform))
    assert model.blob_shapes["data"] == shape
    assert model.blob_shapes["label"] == (shape[0], 1, 1, 1)


def test_video_data_param_is_read_by_its_fields():
    """One name, three forks: fields only C3D v1.1 / TSN / SSD declare pick the message; shared-only fields
    go by whether the net has 3-D layers, with a warning."""
    from caffeq.io.prototxt import parse_prototxt_text
    c3d = parse_prototxt_text(C3D11_DATA % "").layer[0]
    assert c3d.HasField("c3d_video_data_param") and c3d.c3d_video_data_param.sampling_rate == 2
    tsn = parse_prototxt_text(tsn_data("num_segments: 3 modality: RGB")).layer[0]
    assert tsn.HasField("tsn_video_data_param") and tsn.tsn_video_data_param.num_segments == 3
    ssd = parse_prototxt_text(tsn_data("").replace('source: "l.txt"', "video_type: VIDEO video_file: 'a.mp4'")).layer[0]
    assert ssd.HasField("video_data_param") and ssd.video_data_param.video_file == "a.mp4"
    shared = tsn_data("batch_size: 2 new_length: 4")
    warnings = []
    assert parse_prototxt_text(shared, warnings=warnings).layer[0].HasField("tsn_video_data_param")
    assert any("read as TSN" in w for w in warnings)
    with_3d = shared + ('\nlayer { name: "c" type: "Convolution3D" bottom: "data" top: "c"\n'
                        '  convolution3d_param { num_output: 2 kernel_size: 3 kernel_depth: 3 } }')
    warnings = []
    assert parse_prototxt_text(with_3d, warnings=warnings).layer[0].HasField("c3d_video_data_param")
    assert any("read as C3D v1.1" in w for w in warnings)
    # chuckcho/video-caffe's C3D nets: BVLC's N-D Convolution with three kernel sizes, on (N, 3, L, H, W) clips
    nd_conv = shared + ('\nlayer { name: "c" type: "Convolution" bottom: "data" top: "c"\n'
                        '  convolution_param { num_output: 2 kernel_size: 3\n    kernel_size: 3 kernel_size: 3 } }')
    warnings = []
    assert parse_prototxt_text(nd_conv, warnings=warnings).layer[0].HasField("c3d_video_data_param")
    assert any("read as C3D v1.1" in w for w in warnings)


# facebookarchive/C3D is CC BY-NC 3.0: its files stay out of tests/fixtures
C3D_NON_COMMERCIAL = pytest.mark.skip(reason="not shipped: licence (facebookarchive/C3D is CC BY-NC 3.0)")


@pytest.mark.parametrize("name, data_shape", [
    pytest.param("facebookarchive__C3D__C3D-v1.1__examples__c3d_ucf101_feature_extraction__"
                 "c3d_resnet18_ucf101_feature_extraction.prototxt", (30, 3, 8, 112, 112), marks=C3D_NON_COMMERCIAL),
    pytest.param("facebookarchive__C3D__C3D-v1.1__examples__c3d_ucf101_training__train_simple.prototxt",
                 (30, 3, 16, 112, 112), marks=C3D_NON_COMMERCIAL),
    ("yjxiong__temporal-segment-networks__models__ucf101__tsn_bn_inception_rgb_train_val.prototxt", (1, 9, 224, 224)),
])
def test_corpus_video_nets_read(name, data_shape):
    from caffeq.model import load
    path = str(REPO / "tests" / "fixtures" / "realworld" / name)
    model = load(path, stages=("test-on-train",)) if "train_simple" in name else load(path)
    assert model.blob_shapes["data"] == data_shape


# ---- P3D (ZhaofanQiu/pseudo-3d-residual-networks e91f95d): Pooling3D's l/h/w fields and 5-D BN ----

@pytest.mark.parametrize("method, params, kernel, stride, pad", [
    ("MAX", "kernel_size: 3 stride: 2 kernel_l: 2 stride_l: 2 pad_l: 0", (2, 3, 3), (2, 2, 2), (0, 0, 0)),
    ("MAX", "kernel_h: 3 kernel_w: 2 kernel_l: 3 stride: 2 stride_l: 2 pad_l: 1 pad_h: 1 pad_w: 0",
     (3, 3, 2), (2, 2, 2), (1, 1, 0)),
    ("AVE", "kernel_size: 3 kernel_l: 2 stride_h: 2 stride_w: 3 stride_l: 1 pad: 1 pad_l: 1", (2, 3, 3), (1, 2, 3),
     (1, 1, 1)),
], ids=["p3d_pool1", "max_pads", "ave_pads"])
def test_p3d_pooling3d(method, params, kernel, stride, pad, tmp_path):
    x = rng(41).standard_normal((2, 3, 5, 8, 7)).astype(np.float32)
    model = load_from_text(v2_net(x.shape, f'layer {{ name: "p" type: "Pooling3D" bottom: "x" top: "p" '
                                           f'pooling3d_param {{ pool: {method} {params} }} }}'))
    ref = bvlc_pool3d_ref(x, kernel, stride, pad, method == "AVE")   # P3D's pooling3d_layer.cpp
    assert model.blob_shapes["p"] == ref.shape
    check_everywhere(model, {"x": x}, {"p": ref}, tmp_path, atol=1e-6, rtol=1e-6)


def test_p3d_global_pooling3d_and_refusals(tmp_path):
    x = rng(42).standard_normal((2, 3, 4, 5, 6)).astype(np.float32)
    model = load_from_text(v2_net(x.shape, 'layer { name: "p" type: "Pooling3D" bottom: "x" top: "p" '
                                           'pooling3d_param { pool: AVE global_pooling: true } }'))
    check_everywhere(model, {"x": x}, {"p": x.astype(np.float64).mean(axis=(2, 3, 4), keepdims=True)}, tmp_path,
                     atol=1e-6, rtol=1e-6)
    for params, msg in (("kernel_size: 3 stride_l: 2", "needs kernel_l"),
                        ("kernel_size: 2 kernel_l: 2 pad_l: 2", "must be below the kernel"),
                        ("global_pooling: true stride_l: 2", "only pad 0 and stride 1")):
        with pytest.raises(LayerError, match=msg):
            load_from_text(v2_net(x.shape, f'layer {{ name: "p" type: "Pooling3D" bottom: "x" top: "p" '
                                           f'pooling3d_param {{ pool: MAX {params} }} }}'))


def test_p3d_bn_normalizes_a_video_blob_per_channel_with_flat_blobs(tmp_path):
    # P3D's bn_layer.cpp: PSPNet's fields, an (N, C, L, H, W) bottom read as (N, C, 1, L * H * W), blobs (1, C)
    x = (rng(43).standard_normal((2, 3, 4, 5, 6)) * 2 + 0.5).astype(np.float32)
    model = load_from_text(v2_net(x.shape, 'layer { name: "b" type: "BN" bottom: "x" top: "b" '
                                           'bn_param { frozen: true eps: 0.0001 } }'), random_weights=True)
    node = next(n for n in model.layers if n.name == "b")
    assert node.expected_param_shapes == [(1, 3)] * 4
    g = rng(44)
    node.blobs = [g.uniform(0.5, 2, (1, 3)).astype(np.float32), g.standard_normal((1, 3)).astype(np.float32),
                  g.standard_normal((1, 3)).astype(np.float32), g.uniform(0.1, 3, (1, 3)).astype(np.float32)]
    slope, bias, mean, var = (b.astype(np.float64).reshape(1, 3, 1, 1, 1) for b in node.blobs)
    ref = (x.astype(np.float64) - mean) * (var + np.float32(1e-4)) ** -0.5 * slope + bias
    check_everywhere(model, {"x": x}, {"b": ref}, tmp_path, atol=1e-5, rtol=1e-5)


def test_c3d_video_data_mean_value_is_one_value_for_every_voxel():
    # ZhaofanQiu/caffe-windows-3dConvNet video_data_layer.cpp: without a mean_file, data_mean_ is filled with
    # image_data_param.mean_value
    text = ("name: 'v'\nlayers { name: 'data' type: VIDEO_DATA top: 'data'\n"
            "  image_data_param { source: 'list.txt' use_image: true mean_value: 110 batch_size: 1 new_height: 24\n"
            "    new_width: 32 new_length: 16 use_temporal_jitter: false } }")
    model = load_from_text(text)
    assert model.blob_shapes["data"] == (1, 3, 16, 24, 32)
    data = node_of(model, "data")
    assert "subtract 110 from every value (image_data_param.mean_value)" in data.spec.preprocessing(data.attrs)
    with_file = node_of(load_from_text(text.replace("mean_value: 110", "mean_value: 110 mean_file: 'm.bin'")), "data")
    assert not any("110" in line for line in with_file.spec.preprocessing(with_file.attrs))
