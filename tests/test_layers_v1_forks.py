"""V1-format files of forks that added names to V1LayerParameter.LayerType: DeconvNet
(HyeonwooNoh/caffe), DeepLab v1 (TheLegendAli/DeepLab-Context) and C3D v1.0 (facebookarchive/C3D).

References are numpy loops written here from the forks' C++ (padding_layer.cpp, bn_layer.cpp,
conv_layer.cpp's hole), on shapes where N, C, H and W all differ.
"""
import numpy as np
import pytest
from conftest import assert_close, rng
from conftest import check_everywhere as shared_check

from caffeq.errors import CaffeqError, WeightsError
from caffeq.io.prototxt import parse_prototxt_text
from caffeq.io.upgrade import upgrade_net
from caffeq.layers import LayerError
from caffeq.model import load_from_text


def check_everywhere(model, feeds, refs, tmp_path, atol=0.0, rtol=0.0):
    """torch (every blob), onnxruntime (opset 13 and the default) and model.py against refs."""
    shared_check(model, feeds, refs, tmp_path, atol, rtol, all_blobs=True)


def v1_net(shape, *layers):
    dims = "".join(f"input_dim: {d}\n" for d in shape)
    return 'name: "v1"\ninput: "x"\n' + dims + "\n".join(layers)


# ---- enum names and the upgrade -------------------------------------------------------------

@pytest.mark.parametrize("name, v2", [("BN", "BN"), ("UNPOOLING", "Unpooling"),
                                      ("WINDOW_SEG_DATA", "WindowSegData"), ("IMAGE_SEG_DATA", "ImageSegData"),
                                      ("INTERP", "Interp"), ("PADDING", "Padding"), ("MAT_WRITE", "MatWrite"),
                                      ("CONVOLUTION3D", "Convolution3D"), ("POOLING3D", "Pooling3D"),
                                      ("VIDEO_DATA", "C3DVideoData"), ("ELTWISE_ACCURACY", "EltwiseAccuracy"),
                                      ("MCWINDOW_DATA", "MCWindowData"), ("NAMCWINDOW_DATA", "NAMCWindowData")])
def test_fork_enum_names_upgrade_to_type_strings(name, v2):
    net = parse_prototxt_text(f'layers {{ name: "l" type: {name} bottom: "a" top: "b" }}')
    upgrade_net(net)
    assert net.layer[0].type == v2


def test_deconvnet_bn_inference_in_a_v1_file(tmp_path):
    g = rng(11)
    x = g.standard_normal((2, 3, 5, 7)).astype(np.float32)
    text = v1_net(x.shape, "layers { bottom: 'x' top: 'b' name: 'bn' type: BN\n"
                           "  bn_param { scale_filler { type: 'constant' value: 1 }\n"
                           "             shift_filler { type: 'constant' value: 0.001 } bn_mode: INFERENCE } }")
    model = load_from_text(text, random_weights=True)
    scale, shift = g.uniform(0.5, 2, 3).astype(np.float32), g.standard_normal(3).astype(np.float32)
    node = next(n for n in model.layers if n.name == "bn")
    node.blobs = [scale.reshape(1, 3, 1, 1), shift.reshape(1, 3, 1, 1)]
    ref = np.empty_like(x)
    for c in range(3):   # bn_layer.cpp, INFERENCE: top = bottom * scale + shift
        ref[:, c] = x[:, c] * scale[c] + shift[c]
    check_everywhere(model, {"x": x}, {"b": ref}, tmp_path, atol=1e-6, rtol=1e-6)


# ---- DeepLab-Context Padding ----------------------------------------------------------------

def padding_ref(x, beg, end):
    """padding_layer.cpp: top[n, c, h, w] = bottom[n, c, h - pad_beg, w - pad_beg] where it exists, else 0."""
    n, c, h, w = x.shape
    oh, ow = h + beg + end, w + beg + end
    out = np.zeros((n, c, oh, ow), x.dtype)
    for i in range(oh):
        for j in range(ow):
            si, sj = i - beg, j - beg
            if 0 <= si < h and 0 <= sj < w:
                out[:, :, i, j] = x[:, :, si, sj]
    return out


@pytest.mark.parametrize("beg, end", [(-2, -3), (1, 2), (0, -1), (3, 0)])
def test_padding(beg, end, tmp_path):
    x = rng(12).standard_normal((2, 3, 9, 11)).astype(np.float32)
    model = load_from_text(v1_net(x.shape, f"layers {{ name: 'p' type: PADDING bottom: 'x' top: 'p'\n"
                                           f"  padding_param {{ pad_beg: {beg} pad_end: {end} }} }}"))
    assert model.blob_shapes["p"] == (2, 3, 9 + beg + end, 11 + beg + end)
    check_everywhere(model, {"x": x}, {"p": padding_ref(x, beg, end)}, tmp_path)


@pytest.mark.parametrize("beg, end, msg", [(-1, 2, "both >= 0 or both <= 0"), (-5, -5, "leave nothing")])
def test_padding_bad_values(beg, end, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(v1_net((2, 3, 9, 11), f"layers {{ name: 'p' type: PADDING bottom: 'x' top: 'p'\n"
                                              f"  padding_param {{ pad_beg: {beg} pad_end: {end} }} }}"))


def test_mat_write_is_a_sink_whose_bottom_is_the_output():
    text = v1_net((2, 3, 9, 11), "layers { name: 'p' type: PADDING bottom: 'x' top: 'p'\n"
                                 "  padding_param { pad_beg: -1 pad_end: -1 } }\n"
                                 "layers { name: 'w' type: MAT_WRITE bottom: 'p'\n"
                                 "  mat_write_param { prefix: 'out/' source: 'ids.txt' } }")
    model = load_from_text(text)
    x = rng(13).standard_normal((2, 3, 9, 11)).astype(np.float32)
    out = model.run({"x": x})
    assert list(out) == ["p"]
    np.testing.assert_array_equal(out["p"], x[:, :, 1:-1, 1:-1])


# ---- DeepLab v1 hole ------------------------------------------------------------------------

def conv_hole_ref(x, w, b, pad, hole, stride=1):
    """conv_layer.cpp with holes: kernel taps hole apart, effective kernel k + (k - 1)(hole - 1)."""
    n, _, h, wd = x.shape
    o, _, k, _ = w.shape
    ext = k + (k - 1) * (hole - 1)
    oh, ow = (h + 2 * pad - ext) // stride + 1, (wd + 2 * pad - ext) // stride + 1
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    out = np.zeros((n, o, oh, ow))
    for i in range(oh):
        for j in range(ow):
            patch = xp[:, :, i * stride:i * stride + ext:hole, j * stride:j * stride + ext:hole]
            out[:, :, i, j] = np.einsum("nckl,ockl->no", patch, w) + b
    return out


def test_deeplab_hole_is_dilation(tmp_path):
    x = rng(14).standard_normal((2, 3, 13, 10)).astype(np.float32)
    text = v1_net(x.shape, "layers { name: 'c' type: CONVOLUTION bottom: 'x' top: 'c' strict_dim: false\n"
                           "  convolution_param { num_output: 4 kernel_size: 3 pad: 2 hole: 3 } }")
    model = load_from_text(text, random_weights=True)
    node = next(n for n in model.layers if n.name == "c")
    w, b = node.blobs
    assert model.blob_shapes["c"] == (2, 4, 13 + 4 - 7 + 1, 10 + 4 - 7 + 1)
    check_everywhere(model, {"x": x}, {"c": conv_hole_ref(x, w, b, 2, 3)}, tmp_path, atol=1e-5, rtol=1e-5)


def test_hole_and_dilation_together_are_refused():
    with pytest.raises(LayerError, match="dilation or DeepLab's hole"):
        load_from_text(v1_net((2, 3, 13, 10), "layers { name: 'c' type: CONVOLUTION bottom: 'x' top: 'c'\n"
                                              "  convolution_param { num_output: 4 kernel_size: 3 hole: 2 "
                                              "dilation: 2 } }"))


# ---- strict_dim: false (weights of another shape, same count) -------------------------------

def test_strict_dim_false_loads_weights_by_count(tmp_path):
    from caffeq.io.schema import caffe_pb2
    text = v1_net((2, 3, 4, 4), "layers { name: 'fc' type: CONVOLUTION bottom: 'x' top: 'fc' STRICT\n"
                                "  convolution_param { num_output: 5 kernel_size: 4 } }")
    g = rng(15)
    weight, bias = g.standard_normal((1, 1, 5, 48)).astype(np.float32), g.standard_normal(5).astype(np.float32)
    saved = caffe_pb2.NetParameter()
    layer = saved.layer.add(name="fc", type="Convolution")
    for arr in (weight, bias):   # an InnerProduct-shaped blob for the convolution, as DeepLab's init models
        blob = layer.blobs.add()
        blob.shape.dim.extend(arr.shape)
        blob.data.extend(arr.ravel().tolist())
    path = tmp_path / "w.caffemodel"
    path.write_bytes(saved.SerializeToString())
    x = g.standard_normal((2, 3, 4, 4)).astype(np.float32)
    model = load_from_text(text.replace("STRICT", "strict_dim: false"), weights=str(path))
    ref = x.reshape(2, 48).astype(np.float64) @ weight.reshape(5, 48).T.astype(np.float64) + bias
    assert_close(model.run({"x": x})["fc"], ref.reshape(2, 5, 1, 1), 1e-5, 1e-5, "fc")
    with pytest.raises(WeightsError, match="shape"):
        load_from_text(text.replace("STRICT", ""), weights=str(path))


# ---- DeconvNet / FCN CROP: offsets from the coordinate maps ----------------------------------

CROP_NET = ("layers { name: 'c' type: CONVOLUTION bottom: 'x' top: 'c'\n"
            "  convolution_param { num_output: 2 kernel_size: 3 stride: 2 } }\n"
            "layers { name: 'r' type: RELU bottom: 'c' top: 'c' }\n"
            "layers { name: 'd' type: DECONVOLUTION bottom: 'c' top: 'd'\n"
            "  convolution_param { num_output: 4 kernel_size: K stride: 2 } }\n"
            "layers { name: 'crop' type: CROP bottom: 'd' bottom: 'x' top: 'o' }")


def test_coord_map_crop_takes_the_forks_offset(tmp_path):
    # coords.hpp: conv k3 s2 p0 maps by FilterMap^-1 = (1/2, -1/2), deconv k5 s2 p0 by (2, 2);
    # bottom 0's map (2, 2) o (1/2, -1/2) = (1, 1), bottom 1 is the meeting blob (identity):
    # crop = identity o (1, 1)^-1 = (1, -1), so offset 1 on H and W
    x = rng(16).standard_normal((2, 3, 13, 11)).astype(np.float32)
    model = load_from_text(v1_net(x.shape, CROP_NET.replace("K", "5")), random_weights=True)
    assert model.blob_shapes["d"] == (2, 4, 15, 13) and model.blob_shapes["o"] == (2, 4, 13, 11)
    deconv = model.run({"x": x}, all_blobs=True)["d"]
    # the crop copies exactly; the tolerance is onnxruntime's own deconvolution rounding
    check_everywhere(model, {"x": x}, {"o": deconv[:, :, 1:14, 1:12]}, tmp_path, atol=1e-6, rtol=1e-6)


def test_coord_map_crop_needs_a_whole_shift():
    # deconv k4: (2, 3/2) o (1/2, -1/2) = (1, 1/2): the fork refuses a half-pixel crop
    with pytest.raises(CaffeqError, match="layer 'crop'.*whole shift"):
        load_from_text(v1_net((2, 3, 13, 11), CROP_NET.replace("K", "4")))


def test_coord_map_crop_through_a_layer_without_a_map_is_refused():
    # an in-place layer is not on the chain (the fork maps each blob to its first writer), this BN is
    text = v1_net((2, 3, 13, 11), CROP_NET.replace("K", "5").replace(
        "type: RELU bottom: 'c' top: 'c' }", "type: BN bottom: 'c' top: 'cb' bn_param { bn_mode: INFERENCE } }")
        .replace("type: DECONVOLUTION bottom: 'c'", "type: DECONVOLUTION bottom: 'cb'"))
    with pytest.raises(CaffeqError, match="layer 'crop'.*'r' \\(BN\\) .*no coordinate map"):
        load_from_text(text)


def test_coord_map_crop_type_in_a_v2_file_is_refused_by_name():
    text = ('input: "x" input_shape { dim: 2 dim: 3 dim: 9 dim: 11 }\n'
            'layer { name: "crop" type: "CoordMapCrop" bottom: "x" bottom: "x" top: "o" }')
    with pytest.raises(CaffeqError, match="layer 'crop'.*coordinate maps"):
        load_from_text(text)


# ---- DeconvNet's ReLU mask and its data layers -------------------------------------------------

@pytest.mark.parametrize("in_place", [True, False])
def test_deconvnet_relu_mask_top(in_place, tmp_path):
    """relu_layer.cpp: top[1][i] = bottom_data[i] > 0 ? 1 : 0, read after top_data[i] is written (the
    same buffer in place); DecoupledNet multiplies its backward branch by it."""
    top = "x" if in_place else "r"
    text = v1_net((2, 3, 4, 5), f'layers {{ name: "relu" type: RELU bottom: "x" top: "{top}" top: "mask" '
                                f'relu_param {{ negative_slope: 0.1 }} }}',
                  f'layers {{ name: "gate" type: ELTWISE bottom: "{top}" bottom: "mask" top: "o" '
                  f'eltwise_param {{ operation: PROD }} }}')
    model = load_from_text(text, outputs=["mask", "o"])
    x = rng(3).standard_normal((2, 3, 4, 5)).astype(np.float32)
    x[0, 0, 0, :2] = 0.0
    y = np.where(x > 0, x, np.float32(0.1) * x)
    mask = ((y if in_place else x) > 0).astype(np.float32)
    check_everywhere(model, {"x": x}, {"mask": mask, "o": y * mask}, tmp_path)


def test_relu_takes_at_most_two_tops():
    with pytest.raises(LayerError, match="ReLU takes"):
        load_from_text(v1_net((1, 2, 3, 3), 'layers { name: "r" type: RELU bottom: "x" top: "a" top: "b" top: "c" }'))


@pytest.mark.parametrize("kind, tops, shapes", [
    ("WINDOW_CLS_DATA", 3, [(2, 3, 6, 6), (2, 20, 1, 1), (2, 1, 1, 2)]),
    ("SELECT_SEG_BINARY", 3, [(2, 3, 6, 6), (2, 1, 6, 6), (2, 20, 1, 1)]),
    ("WINDOW_SEG_BINARY", 2, [(2, 3, 6, 6), (2, 1, 6, 6)]),
])
def test_deconvnet_data_layers_are_shaped_as_their_reshape(kind, tops, shapes):
    """select_seg_binary_layer.cpp, window_cls_data_layer.cpp, window_seg_binary_layer.cpp DataLayerSetUp."""
    names = ["data", "a", "b"][:tops]
    text = ('name: "d"\nlayers { name: "data" type: %s %s\n'
            '  image_data_param { source: "list.txt" batch_size: 2 new_height: 9 new_width: 9 }\n'
            '  transform_param { crop_size: 6 } window_cls_data_param { label_dim: 20 } }\n'
            'layers { name: "c" type: CONVOLUTION bottom: "data" top: "c" convolution_param { num_output: 2 kernel_size: 3 } }\n'
            % (kind, " ".join(f'top: "{n}"' for n in names)))
    model = load_from_text(text, random_weights=True)
    assert [model.blob_shapes[n] for n in names] == shapes


# ---- xiaolonw's MultiSoftmax ------------------------------------------------------------------

def multi_softmax_ref(x):
    """multi_softmax_layer.cpp: per (n, h, w), exp(x - max over channels) / their sum, in float64."""
    x = x.astype(np.float64)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def test_multi_softmax_over_the_channels_of_a_4_axis_blob(tmp_path):
    x = rng(13).standard_normal((2, 5, 3, 4)).astype(np.float32) * 4
    text = v1_net(x.shape, "layers { bottom: 'x' top: 'p' name: 'sm' type: MULTI_SOFTMAX }",
                  "layers { bottom: 'x' top: 'ip' name: 'ip' type: INNER_PRODUCT inner_product_param { num_output: 6 } }",
                  "layers { bottom: 'ip' top: 'q' name: 'sm2' type: MULTI_SOFTMAX }")
    model = load_from_text(text, random_weights=True)
    assert model.blob_shapes["p"] == (2, 5, 3, 4) and model.blob_shapes["q"] == (2, 6, 1, 1)   # 4-axis, as in 2014
    w, b = (np.asarray(v, np.float64) for v in next(n for n in model.layers if n.name == "ip").blobs)
    ip = x.reshape(2, -1).astype(np.float64) @ w.T + b
    check_everywhere(model, {"x": x}, {"p": multi_softmax_ref(x), "q": multi_softmax_ref(ip.reshape(2, 6, 1, 1))},
                     tmp_path, atol=1e-6, rtol=1e-5)


# ---- s9xie/DSN's V0 dialect: cccp and its dropout ------------------------------------------------

DSN = """name: "dsn"
input: "x"
input_dim: 2 input_dim: 4 input_dim: 3 input_dim: 5
input: "label"
input_dim: 2 input_dim: 1 input_dim: 1 input_dim: 1
layers { layer { name: "cccp1" type: "cccp" num_output: 3 group: 2 blobs_lr: 1 blobs_lr: 2
                 blobs_lr_policy: "nothing" blobs_lr_policy: "nothing"
                 weight_filler { type: "gaussian" std: 0.05 } } bottom: "x" top: "c" }
layers { layer { name: "drop" type: "dropout" dropout_ratio: 0.25 mean_on_test: true mean_on_train: false }
         bottom: "c" top: "c" }
layers { layer { name: "loss" type: "squaredhingeloss" } bottom: "c" bottom: "label" }
"""


def test_dsn_cccp_is_a_grouped_1x1_convolution_and_its_dropout_scales_at_test(tmp_path):
    """cccp_layer.cpp: per group g, top[g N + o] = sum_c W[(g N + o), c] x[g C/G + c] + b; dropout_layer.cpp
    with mean_on_test: top = bottom * (1 - dropout_ratio) (its training never scales the kept units)."""
    x = rng(14).standard_normal((2, 4, 3, 5)).astype(np.float32)
    model = load_from_text(DSN, random_weights=True)
    assert model.blob_shapes["c"] == (2, 6, 3, 5)
    assert any("SquaredHingeLoss" in w for w in model.warnings)
    w, b = (np.asarray(v, np.float64) for v in next(n for n in model.layers if n.name == "cccp1").blobs)
    assert w.shape == (6, 2) and b.shape == (6,)
    ref = np.zeros((2, 6, 3, 5))
    for g in range(2):
        for o in range(3):
            k = g * 3 + o
            ref[:, k] = np.einsum("c,nchw->nhw", w[k], x[:, 2 * g:2 * g + 2].astype(np.float64)) + b[k]
    feeds = {"x": x, "label": np.zeros((2, 1, 1, 1), np.float32)}
    check_everywhere(model, {k: v for k, v in feeds.items() if k in model.inputs}, {"c": ref * 0.75}, tmp_path,
                     atol=1e-6, rtol=1e-6)
    # BVLC's V0 dropout (no mean_on_test) is the identity at TEST
    plain = load_from_text(DSN.replace(" mean_on_test: true", ""), random_weights=True)
    for node in plain.layers:
        if node.name == "cccp1":
            node.blobs = [w.astype(np.float32), b.astype(np.float32)]
    assert_close(plain.run({k: v for k, v in feeds.items() if k in plain.inputs})["c"], ref, 1e-6, 1e-6,
                 "BVLC dropout")


def test_v1_cccp_param_is_the_same_grouped_1x1_convolution(tmp_path):
    # amsword/caffe-parallel's V1 CCCP (roxanneluo/rcnn's NIN nets): cccp_param's num_output per group, group,
    # bias_term; its blobs (1, 1, G N, C / G) and (1, 1, 1, G N)
    text = """input: "x" input_dim: 1 input_dim: 4 input_dim: 3 input_dim: 2
layers { name: "cccp1" type: CCCP bottom: "x" top: "c" blobs_lr: 1 blobs_lr: 2 weight_decay: 1 weight_decay: 0
  cccp_param { num_output: 3 group: 2 weight_filler { type: "gaussian" std: 0.05 } bias_filler { type: "constant" } } }
"""
    x = rng(15).standard_normal((1, 4, 3, 2)).astype(np.float32)
    model = load_from_text(text, random_weights=True)
    w, b = (np.asarray(v, np.float64) for v in next(n for n in model.layers if n.name == "cccp1").blobs)
    assert model.blob_shapes["c"] == (1, 6, 3, 2) and w.shape == (6, 2)
    ref = np.stack([np.einsum("c,nchw->nhw", w[k], x[:, 2 * (k // 3):2 * (k // 3) + 2].astype(np.float64)) + b[k]
                    for k in range(6)], axis=1)
    check_everywhere(model, {"x": x}, {"c": ref}, tmp_path, atol=1e-6, rtol=1e-6)
    no_bias = load_from_text(text.replace("group: 2", "group: 2 bias_term: false"), random_weights=True)
    assert len(next(n for n in no_bias.layers if n.name == "cccp1").blobs) == 1
    with pytest.raises(CaffeqError, match="cccp_param and convolution_param both set"):
        load_from_text(text.replace("cccp_param {", "convolution_param { num_output: 3 } cccp_param {"))


# ---- Robert0812/deepsaldet's caffe-sal window data layers --------------------------------------

DEEPSALDET_WINDOWS = """name: "sal"
layers { name: "data" type: %s top: "data" top: "%s" top: "label"
  %s { source: "windows.txt" batch_size: 4 crop_size: 7 %s shuffle: false mirror: false } }
layers { name: "flat" type: FLATTEN bottom: "%s" top: "flat" }
layers { name: "fc" type: INNER_PRODUCT bottom: "flat" top: "fc" inner_product_param { num_output: 2 } }
"""


def test_deepsaldet_mcwindow_data_masks_come_from_the_user():
    # mcwindow_data_layer.cpp SetUp: data (N, C, crop, crop), masks (N, M, mask_crop, mask_crop), label (N, 1, 1, 1)
    text = DEEPSALDET_WINDOWS % ("MCWINDOW_DATA", "mask", "mcwindow_data_param", "mask_crop_size: 5", "mask")
    model = load_from_text(text, input_shapes={"mask": (4, 2, 5, 5)}, random_weights=True)
    assert model.blob_shapes["data"] == (4, 3, 7, 7)
    assert model.blob_shapes["mask"] == (4, 2, 5, 5) and model.blob_shapes["label"] == (4, 1, 1, 1)
    assert model.blob_shapes["fc"] == (4, 2)
    with pytest.raises(CaffeqError, match=r"top 'mask'.*window file 'windows.txt'.*--input-shape mask=N,C,H,W"):
        load_from_text(text, random_weights=True)
    with pytest.raises(CaffeqError, match=r"mcwindow_data_param.mask_crop_size is required"):
        load_from_text(DEEPSALDET_WINDOWS % ("MCWINDOW_DATA", "mask", "mcwindow_data_param", "", "mask"))


def test_deepsaldet_namcwindow_data_and_window_data_shuffle():
    # namcwindow_data_layer.cpp SetUp: two (N, C, crop, crop) windows and the label (N, 1, 1, 1)
    text = DEEPSALDET_WINDOWS % ("NAMCWINDOW_DATA", "context", "namcwindow_data_param", "", "context")
    model = load_from_text(text, random_weights=True)
    assert model.blob_shapes["context"] == (4, 3, 7, 7) and model.blob_shapes["label"] == (4, 1, 1, 1)
    assert model.blob_shapes["fc"] == (4, 2)
    # the fork's WindowDataParameter.shuffle
    window = load_from_text('layer { name: "d" type: "WindowData" top: "d" top: "l" window_data_param { '
                            'source: "w.txt" batch_size: 2 crop_size: 5 shuffle: true } }')
    assert window.blob_shapes["d"] == (2, 3, 5, 5)
