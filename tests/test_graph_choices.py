"""What the real Caffe accepts and users need to choose: duplicate layer names, nets whose
tops are all silenced, chosen outputs, input shapes given instead of a dataset, and fork
losses that inference drops."""
import importlib.util
import shutil
import sys

import numpy as np
import pytest
from conftest import REPO

import caffeq
from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

DIGITS = REPO / "examples" / "digits"


def rng(seed=0):
    return np.random.default_rng(seed)


def onnx_outputs(model, path, feeds):
    import onnxruntime as ort
    model.export_onnx(str(path))
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds)))


def pytorch_source_outputs(model, folder, feeds):
    caffeq.export_pytorch(model, str(folder))
    spec = importlib.util.spec_from_file_location(f"gen_{folder.name}", folder / "model.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    import torch
    net = mod.load(str(folder / "weights.safetensors"))
    with torch.no_grad():
        out = net(*[torch.from_numpy(feeds[k]) for k in model.inputs])
    return out


# ---- duplicate layer names (HED has two layers named "crop") ------------------------------

HED_LIKE = """
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 dim: 9 dim: 11 } } }
layer { name: "ref" type: "Input" top: "ref" input_param { shape { dim: 2 dim: 3 dim: 5 dim: 6 } } }
layer { name: "crop" type: "Crop" bottom: "x" bottom: "ref" top: "c1" crop_param { axis: 2 offset: 1 offset: 2 } }
layer { name: "crop" type: "Crop" bottom: "x" bottom: "ref" top: "c2" crop_param { axis: 2 offset: 3 offset: 4 } }
layer { name: "sum" type: "Eltwise" bottom: "c1" bottom: "c2" top: "sum" }
"""


def test_duplicate_layer_names_load_run_and_export(tmp_path):
    model = load_from_text(HED_LIKE)
    assert [n.name for n in model.layers if n.type == "Crop"] == ["crop", "crop#2"]
    assert any("two layers are named 'crop'" in w for w in model.warnings)
    x = rng().standard_normal((2, 3, 9, 11)).astype(np.float32)
    ref = np.zeros((2, 3, 5, 6), np.float32)
    want = x[:, :, 1:6, 2:8] + x[:, :, 3:8, 4:10]
    np.testing.assert_array_equal(model.run({"x": x, "ref": ref})["sum"], want)
    np.testing.assert_allclose(onnx_outputs(model, tmp_path / "m.onnx", {"x": x, "ref": ref})["sum"], want)
    out = pytorch_source_outputs(model, tmp_path / "pt", {"x": x, "ref": ref})
    np.testing.assert_allclose(out.numpy(), want)


def test_many_repeated_layer_names_are_one_note():
    # ECO's bn_inception_rgb_res3D repeats 47 names; one line names a few, the graph keeps every layer
    layers = [f'layer {{ name: "{n}" type: "ReLU" bottom: "{a}" top: "{b}" }}'
              for n, a, b in [("r", "x", "a"), ("r", "a", "b"), ("r", "b", "c"), ("s", "c", "d"), ("s", "d", "e"),
                              ("t", "e", "f"), ("u", "f", "g"), ("u", "g", "h"), ("t", "h", "i")]]
    model = load_from_text('layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 1 dim: 2 } } }\n'
                           + "\n".join(layers))
    notes = [w for w in model.warnings if "repeat" in w]
    assert len(notes) == 1 and "4 layer names repeat ('r', 's', 'u' (+1 more))" in notes[0]
    assert [n.name for n in model.layers if n.type == "ReLU"] == ["r", "r#2", "r#3", "s", "s#2", "t", "u", "u#2", "t#2"]


def test_weights_of_a_duplicate_name_go_to_the_first_layer():
    text = """
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "a" inner_product_param { num_output: 4 } }
layer { name: "ip" type: "ReLU" bottom: "a" top: "b" }
"""
    w = rng(1).standard_normal((4, 3)).astype(np.float32)
    b = rng(2).standard_normal(4).astype(np.float32)
    from caffeq.graph_weights import attach_weights
    model = load_from_text(text)
    attach_weights(model.graph, {"ip": [w, b]})
    x = rng(3).standard_normal((2, 3)).astype(np.float32)
    np.testing.assert_allclose(model.run({"x": x})["b"], np.maximum(x @ w.T + b, 0), rtol=1e-6, atol=1e-6)


def test_copy_postfix_name_initialises_layers_from_the_postfix_layer():
    # pose_action_caffe's CopyTrainedLayersFrom: with no layer named fc6, the weights file's fc6 goes to
    # every layer whose name ends with it and says copy_postfix_name: "fc6"; an exact name wins
    text = """
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }
layer { name: "primary_fc6" type: "InnerProduct" bottom: "x" top: "p" copy_postfix_name: "fc6"
        inner_product_param { num_output: 4 } }
layer { name: "secondary_fc6" type: "InnerProduct" bottom: "x" top: "s" copy_postfix_name: "fc6"
        inner_product_param { num_output: 4 } }
layer { name: "other_fc6" type: "InnerProduct" bottom: "x" top: "o" inner_product_param { num_output: 4 } }
"""
    from caffeq.errors import WeightsError
    from caffeq.graph_weights import attach_weights
    w, b = rng(1).standard_normal((4, 3)).astype(np.float32), rng(2).standard_normal(4).astype(np.float32)
    w2, b2 = rng(3).standard_normal((4, 3)).astype(np.float32), rng(4).standard_normal(4).astype(np.float32)
    model = load_from_text(text)
    attach_weights(model.graph, {"fc6": [w, b], "secondary_fc6": [w2, b2], "other_fc6": [w, b]})
    x = rng(5).standard_normal((2, 3)).astype(np.float32)
    out = model.run({"x": x})
    np.testing.assert_allclose(out["p"], x @ w.T + b, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out["s"], x @ w2.T + b2, rtol=1e-6, atol=1e-6)
    # a layer without the field never takes a postfix's weights
    with pytest.raises(WeightsError, match="'other_fc6'"):
        attach_weights(load_from_text(text).graph, {"fc6": [w, b]})


# ---- silenced nets (the colorization deploy file) and chosen outputs -----------------------

SILENCED = """
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 dim: 4 dim: 5 } } }
layer { name: "conv" type: "Convolution" bottom: "x" top: "conv" convolution_param { num_output: 6 kernel_size: 3 pad: 1 } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "scaled" type: "Power" bottom: "conv" top: "scaled" power_param { scale: 2.5 } }
layer { name: "silence" type: "Silence" bottom: "scaled" }
"""


def conv_relu_ref(model, x):
    w, b = model.params["conv"]
    import torch
    y = torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b), padding=1)
    return np.maximum(y.numpy(), 0)


def test_silenced_blobs_become_the_outputs(tmp_path):
    model = load_from_text(SILENCED, random_weights=True)
    assert model.outputs == ["scaled"]
    assert any("Silence" in w for w in model.warnings)
    x = rng().standard_normal((2, 3, 4, 5)).astype(np.float32)
    want = 2.5 * conv_relu_ref(model, x)
    np.testing.assert_allclose(model.run({"x": x})["scaled"], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(onnx_outputs(model, tmp_path / "m.onnx", {"x": x})["scaled"], want,
                               rtol=1e-5, atol=1e-5)
    out = pytorch_source_outputs(model, tmp_path / "pt", {"x": x})
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5)


def test_hdf5_output_writes_nothing_and_its_bottoms_become_the_outputs(tmp_path):
    # BVLC's HDF5Output (ybenigot/lrcn ends its net in one): no file is written, the blobs it would dump are
    # the outputs; the V1 type HDF5_OUTPUT reads as it
    text = ('layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }\n'
            'layer { name: "y" type: "Input" top: "y" input_param { shape { dim: 2 dim: 1 } } }\n'
            'layer { name: "p" type: "Power" bottom: "x" top: "p" power_param { scale: 2 } }\n'
            f'layer {{ name: "h" type: "HDF5Output" bottom: "p" bottom: "y" hdf5_output_param {{ '
            f'file_name: "{tmp_path}/out.h5" }} }}')
    model = load_from_text(text)
    assert model.outputs == ["p", "y"]
    x, y = rng(2).standard_normal((2, 3)).astype(np.float32), rng(3).standard_normal((2, 1)).astype(np.float32)
    got = model.run({"x": x, "y": y})
    np.testing.assert_array_equal(got["p"], 2 * x)
    assert not (tmp_path / "out.h5").exists()
    v1 = ('input: "x" input_dim: 2 input_dim: 3 input_dim: 1 input_dim: 1\n'
          'layers { name: "h" type: HDF5_OUTPUT bottom: "x" bottom: "x" }')
    assert [n.type for n in load_from_text(v1).layers if n.name == "h"] == ["HDF5Output"]


def test_every_blob_of_a_train_net_whose_label_nothing_reads():
    # a Data layer's label read only by the loss: with --outputs naming the scores, the label feeds nothing
    # the module computes, and all_blobs lists the blobs it does compute
    text = ('layer { name: "data" type: "Data" top: "data" top: "label" data_param { source: "missing" '
            'batch_size: 2 } transform_param { crop_size: 4 } }\n'
            'layer { name: "fc" type: "InnerProduct" bottom: "data" top: "fc" inner_product_param { num_output: 3 } }\n'
            'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "fc" bottom: "label" top: "loss" }')
    model = load_from_text(text, random_weights=True, input_shapes={"data": (2, 3, 4, 4)}, outputs=["fc"])
    x = rng(5).standard_normal((2, 3, 4, 4)).astype(np.float32)
    blobs = model.run({"data": x}, all_blobs=True)
    assert set(blobs) == {"data", "fc"}
    np.testing.assert_array_equal(blobs["fc"], model.run({"data": x})["fc"])


def test_chosen_outputs_prune_the_rest(tmp_path):
    model = load_from_text(SILENCED, random_weights=True, outputs=["conv"])
    assert model.outputs == ["conv"]
    assert [n.name for n in model.layers] == ["x", "conv", "relu"]
    x = rng(4).standard_normal((2, 3, 4, 5)).astype(np.float32)
    want = conv_relu_ref(model, x)   # the blob's final value: after the in-place ReLU
    np.testing.assert_allclose(model.run({"x": x})["conv"], want, rtol=1e-5, atol=1e-5)
    assert set(onnx_outputs(model, tmp_path / "m.onnx", {"x": x})) == {"conv"}
    np.testing.assert_allclose(onnx_outputs(model, tmp_path / "m.onnx", {"x": x})["conv"], want,
                               rtol=1e-5, atol=1e-5)
    out = pytorch_source_outputs(model, tmp_path / "pt", {"x": x})
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5)
    # transforms and a new batch keep the choice
    assert model.reshaped(3).outputs == ["conv"]
    from caffeq.transforms import fold_batchnorm, remove_identities
    assert fold_batchnorm(remove_identities(model)).outputs == ["conv"]


def test_chosen_outputs_survive_the_caffeq_container(tmp_path):
    model = load_from_text(SILENCED, random_weights=True, outputs=["conv", "scaled"])
    from caffeq.io.container import save_caffeq
    save_caffeq(model, tmp_path / "m.caffeq")
    again = caffeq.load(tmp_path / "m.caffeq")
    assert again.outputs == ["conv", "scaled"]


def test_unknown_output_name_is_one_clear_error():
    with pytest.raises(CaffeqError, match=r"--outputs names 'scaleed'.*did you mean 'scaled'"):
        load_from_text(SILENCED, outputs=["scaleed"])


# ---- train_val nets without their datasets -------------------------------------------------

def copy_digits_without_lmdb(tmp_path):
    for f in ("train_val.prototxt", "mean.binaryproto"):
        shutil.copy(DIGITS / f, tmp_path / f)
    return tmp_path / "train_val.prototxt"


def test_data_shape_from_the_mean_file_without_the_lmdb(tmp_path):
    path = copy_digits_without_lmdb(tmp_path)
    model = caffeq.load(path, DIGITS / "model.caffemodel")
    assert model.inputs == {"data": (100, 1, 16, 16), "label": (100,)}
    # the same numbers as with the dataset beside it
    with_lmdb = caffeq.load(DIGITS / "train_val.prototxt", DIGITS / "model.caffemodel")
    assert with_lmdb.inputs == model.inputs
    x = rng().standard_normal((100, 1, 16, 16)).astype(np.float32)
    label = np.zeros(100, np.float32)
    np.testing.assert_array_equal(model.run({"data": x, "label": label})["accuracy"],
                                  with_lmdb.run({"data": x, "label": label})["accuracy"])


def test_missing_dataset_error_names_the_option_and_input_shape_fixes_it(tmp_path):
    text = """
layer { name: "mnist" type: "Data" top: "data" top: "label" include { phase: TEST }
  transform_param { scale: 0.00390625 } data_param { source: "examples/mnist/mnist_test_lmdb" batch_size: 100 backend: LMDB } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 10 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""
    with pytest.raises(CaffeqError, match=r"layer 'mnist' \(Data\).*mnist_test_lmdb.*--input-shape data=N,C,H,W"):
        load_from_text(text)
    model = load_from_text(text, input_shapes={"data": (4, 1, 28, 28)})
    assert model.inputs == {"data": (4, 1, 28, 28), "label": (4,)}
    assert model.blob_shapes["ip"] == (4, 10)


def test_crop_and_mean_values_give_the_shape_without_any_source():
    text = """
layer { name: "data" type: "Data" top: "data" top: "label" include { phase: TEST }
  transform_param { crop_size: 227 mean_value: 104 mean_value: 117 mean_value: 123 }
  data_param { source: "gone_lmdb" batch_size: 50 backend: LEVELDB } }
layer { name: "img" type: "ImageData" top: "img" top: "l2" include { phase: TEST }
  image_data_param { source: "gone.txt" batch_size: 5 new_height: 33 new_width: 44 } }
"""
    model = load_from_text(text)
    assert model.inputs == {"data": (50, 3, 227, 227), "label": (50,), "img": (5, 3, 33, 44), "l2": (5,)}


def test_input_shape_feeds_a_blob_no_layer_makes():
    # Coderx7/SimpleNet's SimpNet train_val files leave "#Put Your DataLayers Here#" where the data layers
    # go, and a fragment (ECO's residue net) starts from another net's blob: the user names the input
    text = ('layer { name: "conv" type: "Convolution" bottom: "data" top: "c" convolution_param { num_output: 2 '
            'kernel_size: 1 } }\n'
            'layer { name: "loss" type: "SoftmaxWithLoss" bottom: "c" bottom: "label" top: "loss" }')
    with pytest.raises(CaffeqError, match=r"bottom 'data' is not produced by any earlier layer \(undefined blob, "
                                          r"wrong order or a cycle; to feed it as an input, give its shape with "
                                          r"--input-shape data=N,C,H,W\)"):
        load_from_text(text)
    model = load_from_text(text, input_shapes={"data": (2, 3, 4, 5)}, random_weights=True)
    assert model.inputs == {"data": (2, 3, 4, 5)} and model.blob_shapes["c"] == (2, 2, 4, 5)
    assert any("no layer makes 'data' before a layer reads it: read as an input" in w for w in model.warnings)
    x = np.random.default_rng(3).standard_normal((2, 3, 4, 5)).astype(np.float32)
    w, b = model.graph.node("conv").blobs
    want = np.einsum("oc,nchw->nohw", w.reshape(2, 3), x) + b.reshape(1, 2, 1, 1)
    np.testing.assert_allclose(model.run({"data": x})["c"], want, rtol=1e-5, atol=1e-5)
    # a layer that works in place on it reads it first: still an input
    relu_first = 'layer { name: "r" type: "ReLU" bottom: "data" top: "data" }\n' + text
    model = load_from_text(relu_first, input_shapes={"data": (2, 3, 4, 5)}, random_weights=True)
    assert model.inputs == {"data": (2, 3, 4, 5)}


def test_input_shape_overrides_inputs_and_unknown_names_are_refused():
    model = load_from_text(SILENCED, input_shapes={"x": (1, 3, 8, 7)})
    assert model.inputs == {"x": (1, 3, 8, 7)} and model.blob_shapes["scaled"] == (1, 6, 8, 7)
    with pytest.raises(CaffeqError, match=r"--input-shape names 'y'.*inputs: x"):
        load_from_text(SILENCED, input_shapes={"y": (1, 3, 8, 7)})


# ---- fork losses are dropped from inference graphs -------------------------------------------

def test_fork_training_only_layers_are_dropped_with_a_note():
    text = """
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 dim: 8 } } }
layer { name: "label" type: "Input" top: "label" input_param { shape { dim: 2 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "ip" inner_product_param { num_output: 3 } }
layer { name: "mbox_loss" type: "MultiBoxLoss" bottom: "ip" bottom: "label" top: "mbox_loss" }
layer { name: "ctc" type: "CTCLoss" bottom: "ip" bottom: "label" top: "ctc" }
layer { name: "acc" type: "LabelsequenceAccuracy" bottom: "ip" bottom: "label" top: "acc" }
layer { name: "yolo_loss" type: "Yolov3" bottom: "ip" bottom: "label" top: "yolo_loss" }
layer { name: "seg_loss" type: "YoloSeg" bottom: "ip" bottom: "label" top: "seg_loss" }
layer { name: "seg_eval" type: "SegmentationEvaluate" bottom: "ip" bottom: "label" top: "seg_eval" }
layer { name: "tv_loss" type: "EuclideanLossWithTV" bottom: "ip" bottom: "label" top: "tv_loss" }
"""
    model = load_from_text(text, random_weights=True)
    assert [n.name for n in model.layers] == ["x", "label", "ip"]
    assert model.outputs == ["ip"]
    assert any("mbox_loss (MultiBoxLoss)" in w and "ctc (CTCLoss)" in w and "acc (LabelsequenceAccuracy)" in w
               and "yolo_loss (Yolov3)" in w and "seg_loss (YoloSeg)" in w for w in model.warnings)


def test_an_unknown_type_that_is_not_a_loss_still_stops_the_read():
    text = """
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 dim: 8 } } }
layer { name: "odd" type: "NoSuchLayer" bottom: "x" top: "y" }
"""
    with pytest.raises(CaffeqError, match="NoSuchLayer"):
        load_from_text(text)


def test_a_net_can_be_listed_with_unknown_data_shapes_but_not_run():
    text = """
layer { name: "mnist" type: "Data" top: "data" top: "label" data_param { source: "gone_lmdb" batch_size: 64 } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" convolution_param { num_output: 20 kernel_size: 5 } }
layer { name: "ip" type: "InnerProduct" bottom: "conv" top: "ip" inner_product_param { num_output: 10 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""
    model = load_from_text(text, unknown_shapes_ok=True)
    assert [n.type for n in model.layers] == ["Data", "Convolution", "InnerProduct", "SoftmaxWithLoss"]
    assert model.blob_shapes["data"] is None and model.blob_shapes["ip"] is None
    assert any("--input-shape data=N,C,H,W" in w for w in model.warnings)
    with pytest.raises(CaffeqError, match="--input-shape data=N,C,H,W"):
        model.run({"data": np.zeros((64, 1, 28, 28), np.float32)})


def test_undefined_bottom_names_the_layer_the_stage_rules_left_out():
    text = """
layer { name: "train_in" type: "Input" top: "data" include { phase: TRAIN } input_param { shape { dim: 2 dim: 3 } } }
layer { name: "test_in" type: "Input" top: "data" include { phase: TEST stage: "test-on-test" } input_param { shape { dim: 2 dim: 3 } } }
layer { name: "relu" type: "ReLU" bottom: "data" top: "out" }
"""
    with pytest.raises(CaffeqError, match=r"bottom 'data'.*at TEST: layer 'test_in' makes it.*test-on-test.*--stage"):
        load_from_text(text)
    assert load_from_text(text, stages=["test-on-test"]).inputs == {"data": (2, 3)}


# ---- fork data layers ----------------------------------------------------------------------

FORK_DATA = """
layer { name: "ssd" type: "AnnotatedData" top: "data" top: "label" include { phase: TEST }
  transform_param { mean_value: 104 mean_value: 117 mean_value: 123
    resize_param { prob: 1 resize_mode: WARP height: 300 width: 301 interp_mode: LINEAR } }
  data_param { source: "gone_lmdb" batch_size: 8 backend: LMDB } }
layer { name: "segnet" type: "DenseImageData" top: "img" top: "seg"
  dense_image_data_param { source: "gone.txt" batch_size: 4 new_height: 360 new_width: 480 } }
layer { name: "deeplab" type: "ImageSegData" top: "im" top: "lab"
  transform_param { crop_size: 321 } image_data_param { source: "gone.txt" batch_size: 2 } }
"""


def test_fork_data_layers_are_shaped_from_their_parameters():
    model = load_from_text(FORK_DATA)
    assert model.inputs == {"data": (8, 3, 300, 301), "label": (1, 1, 1, 8), "img": (4, 3, 360, 480),
                            "seg": (4, 1, 360, 480), "im": (2, 3, 321, 321), "lab": (2, 1, 321, 321)}


def test_enet_label_maps_are_divided_by_label_divide_factor():
    # TimoSaemann/caffe-enet dense_image_data_layer.cpp: label (N, 1, H / f, W / f), integer division,
    # unless a crop sets both tops
    text = ('layer { name: "enet" type: "DenseImageData" top: "data" top: "label" dense_image_data_param { '
            'source: "gone.txt" batch_size: 2 new_height: 100 new_width: 150 label_divide_factor: 8 } }')
    assert load_from_text(text).inputs == {"data": (2, 3, 100, 150), "label": (2, 1, 12, 18)}
    cropped = text.replace("label_divide_factor", "crop_height: 40 crop_width: 48 label_divide_factor")
    assert load_from_text(cropped).inputs == {"data": (2, 3, 40, 48), "label": (2, 1, 40, 48)}
    with pytest.raises(CaffeqError, match="label_divide_factor must be >= 1"):
        load_from_text(text.replace("label_divide_factor: 8", "label_divide_factor: 0"))


def test_a_fork_data_layer_without_sizes_needs_input_shape():
    text = 'layer { name: "hed" type: "ImageLabelmapData" top: "data" top: "label" image_data_param { source: "x.lst" } }'
    with pytest.raises(CaffeqError, match=r"layer 'hed' \(ImageLabelmapData\).*--input-shape data=N,C,H,W"):
        load_from_text(text)
    model = load_from_text(text, input_shapes={"data": (1, 3, 50, 60)})
    assert model.inputs == {"data": (1, 3, 50, 60), "label": (1, 1, 50, 60)}


# ---- SeLuDropout (jolibrain/caffe, synopsys-caffe) ------------------------------------------

def test_selu_dropout_copies_at_test_and_alpha_drops_in_training(tmp_path):
    """selu_dropout_layer.cpp: TEST copies; TRAIN gives a * x for kept units and a * alpha + b for
    dropped ones, a = (q (1 + alpha^2 (1 - q)))^-1/2, b = -a (1 - q) alpha, q = 1 - ratio."""
    import torch
    from conftest import check_everywhere
    text = """
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 dim: 40 dim: 50 } } }
layer { name: "drop" type: "SeLuDropout" bottom: "x" top: "y" selu_dropout_param { dropout_ratio: 0.2 alpha: -1.5 } }
"""
    model = load_from_text(text)
    x = np.random.default_rng(5).standard_normal((2, 3, 40, 50)).astype(np.float32)
    check_everywhere(model, {"x": x}, {"y": x}, tmp_path)
    q, alpha = 0.8, -1.5
    a = (q * (1 + alpha ** 2 * (1 - q))) ** -0.5
    b = -a * (1 - q) * alpha
    module = model.to_torch().train()
    torch.manual_seed(0)
    y = module(torch.from_numpy(x)).detach().numpy().astype(np.float64)
    kept = np.isclose(y, a * x + b, rtol=0, atol=1e-5)
    dropped = np.isclose(y, a * alpha + b, rtol=0, atol=1e-6)
    assert np.all(kept | dropped)
    assert abs(dropped.mean() - 0.2) < 0.02
    with pytest.raises(CaffeqError, match="dropout_ratio must be in"):
        load_from_text(text.replace("dropout_ratio: 0.2", "dropout_ratio: 1.0"))


# ---- Noise (sergeyk's layer, bnkang/caffe-windows-for-fr and other forks) ----------------------

@pytest.mark.parametrize("params, mean, std", [("gaussian_std: 0.5 bias: 2", 2.0, 0.5),
                                               ("uniform_range: 3 bias: -1", -1.0, 3 / 3 ** 0.5)])
def test_noise_copies_at_test_and_adds_its_noise_in_training(params, mean, std, tmp_path):
    """noise_layer.cpp: TEST copies; TRAIN adds gaussian(bias, gaussian_std) noise, or uniform noise in
    bias +- uniform_range (std range / sqrt(3)) when only that is set."""
    import torch
    from conftest import check_everywhere
    text = f"""
layer {{ name: "x" type: "Input" top: "x" input_param {{ shape {{ dim: 2 dim: 3 dim: 40 dim: 50 }} }} }}
layer {{ name: "data" type: "Noise" bottom: "x" top: "x" noise_param {{ {params} }} }}
layer {{ name: "relu" type: "ReLU" bottom: "x" top: "y" }}
"""
    model = load_from_text(text)
    x = np.random.default_rng(6).standard_normal((2, 3, 40, 50)).astype(np.float32)
    check_everywhere(model, {"x": x}, {"y": np.maximum(x, 0)}, tmp_path)
    noisy = load_from_text(text.replace('layer { name: "relu" type: "ReLU" bottom: "x" top: "y" }', ""))
    module = noisy.to_torch().train()
    torch.manual_seed(0)
    added = module(torch.from_numpy(x)).detach().numpy().astype(np.float64) - x
    assert abs(added.mean() - mean) < 0.05 and abs(added.std() - std) < 0.05
    if "uniform" in params:
        assert added.min() >= -4 - 1e-5 and added.max() <= 2 + 1e-5
    with pytest.raises(CaffeqError, match="must be a finite number >= 0"):
        load_from_text(text.replace("bias:", "gaussian_std: -1 bias:").replace("gaussian_std: 0.5 ", ""))


def test_fault_injection_is_sized_not_run(tmp_path):
    # cypox/reliable-net caffe_experiments/models/inject-net.prototxt: random faults at TEST, by an unpublished rule
    model = load_from_text('input: "input" input_shape { dim: 1 dim: 1 dim: 100 dim: 1 }\n'
                           'layer { name: "output" type: "Injection" bottom: "input" top: "output" }')
    assert model.blob_shapes["output"] == (1, 1, 100, 1)
    with pytest.raises(CaffeqError, match=r"layer 'output' \(Injection\): cypox/reliable-net's fault injection "
                                          r"flips random bits of its input"):
        model.run({"input": np.ones((1, 1, 100, 1), np.float32)})
    with pytest.raises(CaffeqError, match="does not run it"):
        model.export_onnx(str(tmp_path / "m.onnx"))
    assert not (tmp_path / "m.onnx").exists()
    # BraveApple/my_caffe's Box: per-box convolutions whose weights the fork never saves
    box_net = ('input: "x" input_shape { dim: 2 dim: 1 dim: 28 dim: 28 }\n'
               'layer { name: "box1" type: "Box" bottom: "x" top: "b" box_param { box_height: 12 box_width: 12 '
               'param { lr_mult: 1 } param { lr_mult: 2 } convolution_param { num_output: 20 kernel_size: 5 pad: 2 } '
               'pooling_param { pool: MAX kernel_size: 3 stride: 1 pad: 1 } } }')   # the fork's LeNet
    box = load_from_text(box_net)
    assert box.blob_shapes["b"] == (2, 20, 28, 28)
    with pytest.raises(CaffeqError, match=r"a 12 x 12 box comes out of its convolution and pooling 4 x 4"):
        load_from_text(box_net.replace(" pad: 2", "").replace("kernel_size: 3 stride: 1 pad: 1", "kernel_size: 2 stride: 2"))
    with pytest.raises(CaffeqError, match=r"the 12 x 12 box is larger than the 10 x 28 input"):
        load_from_text(box_net.replace("dim: 28 dim: 28", "dim: 10 dim: 28"))
    with pytest.raises(CaffeqError, match=r"layer 'box1' \(Box\): BraveApple/my_caffe's per-box convolutions keep "
                                          r"weights the fork never saves"):
        box.run({"x": np.zeros((2, 1, 28, 28), np.float32)})
    # Guanghan/GNet-caffe's Injection is a data layer without bottoms: still a graph input
    data = load_from_text('layer { name: "data" type: "Injection" top: "data" top: "label" }\n'
                          'layer { name: "relu" type: "ReLU" bottom: "data" top: "y" }',
                          input_shapes={"data": (1, 3, 8, 8), "label": (1,)})
    assert data.blob_shapes["y"] == (1, 3, 8, 8)


# ---- Faster R-CNN's Dropout scale_train ------------------------------------------------------

def test_dropout_scale_train_false_scales_at_test(tmp_path):
    text = """
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 dim: 4 } } }
layer { name: "drop" type: "Dropout" bottom: "x" top: "y" dropout_param { dropout_ratio: 0.3 scale_train: false } }
layer { name: "keep" type: "Dropout" bottom: "y" top: "z" dropout_param { dropout_ratio: 0.5 } }
"""
    model = load_from_text(text)
    x = rng().standard_normal((2, 3, 4)).astype(np.float32)
    # caffe-fast-rcnn: scale_ = 1 / (1 - threshold_) in float, then top = x * (1 / scale_)
    scale = np.float32(1.0 / (1.0 - float(np.float32(0.3))))
    want = x * np.float32(1.0 / float(scale))
    np.testing.assert_array_equal(model.run({"x": x})["z"], want)
    np.testing.assert_allclose(onnx_outputs(model, tmp_path / "m.onnx", {"x": x})["z"], want, rtol=1e-7)
    out = pytorch_source_outputs(model, tmp_path / "pt", {"x": x})
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-7)


def test_a_dropout_layer_with_its_own_train_phase_is_noted():
    # Caffe keeps a layer's own phase: such a Dropout drops at random even in a TEST net; caffeq copies, and says so
    text = """
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }
layer { name: "d" type: "Dropout" bottom: "x" top: "y" phase: TRAIN dropout_param { dropout_ratio: 0.5 } }
"""
    model = load_from_text(text)
    assert any("phase: TRAIN on the layer: Caffe drops units at random" in w for w in model.warnings)
    x = rng().standard_normal((2, 3)).astype(np.float32)
    np.testing.assert_array_equal(model.run({"x": x})["y"], x)
    assert not load_from_text(text.replace(" phase: TRAIN", "")).warnings


def test_bayesian_segnets_test_time_dropout_is_noted_and_run_as_its_expectation():
    # caffe-segnet's dropout_layer.cpp drops at TEST too with sample_weights_test (Bayesian SegNet's Monte Carlo
    # samples, x * mask / (1 - ratio), averaged by its script); caffeq copies (their expectation) and says so
    text = """
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }
layer { name: "d" type: "Dropout" bottom: "x" top: "y" dropout_param { dropout_ratio: 0.5 sample_weights_test: true } }
"""
    model = load_from_text(text)
    assert any("sample_weights_test: SegNet's Caffe drops units at random at TEST" in w for w in model.warnings)
    x = rng().standard_normal((2, 3)).astype(np.float32)
    np.testing.assert_array_equal(model.run({"x": x})["y"], x)
    assert not load_from_text(text.replace(" sample_weights_test: true", "")).warnings


def test_dropout_ratio_one_loads_as_release_caffe_does(tmp_path):
    # dropout_layer.cpp checks the ratio with DCHECK only: a release build loads 1.0 (epi-depth's deploy
    # net does); TEST copies the input, and with scale_train false multiplies by 1 / scale_ = 0
    text = """
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 dim: 4 } } }
layer { name: "all" type: "Dropout" bottom: "x" top: "y" dropout_param { dropout_ratio: 1.0 } }
layer { name: "fork" type: "Dropout" bottom: "x" top: "z" dropout_param { dropout_ratio: 1.0 scale_train: false } }
"""
    model = load_from_text(text)
    x = rng().standard_normal((2, 3, 4)).astype(np.float32)
    out = model.run({"x": x})
    np.testing.assert_array_equal(out["y"], x)
    np.testing.assert_array_equal(out["z"], np.zeros_like(x))
    np.testing.assert_array_equal(onnx_outputs(model, tmp_path / "m.onnx", {"x": x})["y"], x)
    with pytest.raises(CaffeqError, match=r"dropout_ratio must be in \[0, 1\], got 1.5"):
        load_from_text(text.replace("dropout_ratio: 1.0 }", "dropout_ratio: 1.5 }"))


def test_an_unknown_fork_data_layer_is_an_input_and_python_losses_are_dropped():
    text = """
layer { name: "box" type: "BoxData" top: "data" top: "label" transform_param { crop_size: 20 } data_param { source: "x" batch_size: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 3 } }
layer { name: "loss" type: "Python" bottom: "ip" bottom: "label" top: "loss" loss_weight: 1
  python_param { module: "pyloss" layer: "EuclideanLossLayer" } }
"""
    model = load_from_text(text, random_weights=True)
    assert model.inputs == {"data": (2, 3, 20, 20), "label": (2,)}
    assert model.outputs == ["ip"]
    assert any("loss (Python)" in w for w in model.warnings)
    # without loss_weight, a class named as a loss (pycaffe-yolo's YoloLossLayer) is one too
    named = text.replace(" loss_weight: 1", "").replace("EuclideanLossLayer", "YoloLossLayer")
    assert load_from_text(named, random_weights=True).outputs == ["ip"]
    # and so is a class named as a scorer (TextMaps' WebAccuracyLayer), as a type named "...Accuracy"
    scorer = named.replace("YoloLossLayer", "WebAccuracyLayer")
    assert load_from_text(scorer, random_weights=True).outputs == ["ip"]
    # as is any Python layer that reads the label and whose result nothing reads (a scorer by what it
    # reads, see the test below); one that does not read the label is still refused
    assert load_from_text(named.replace("YoloLossLayer", "YoloHeadLayer"), random_weights=True).outputs == ["ip"]
    with pytest.raises(CaffeqError, match="is a Python layer"):
        load_from_text(named.replace("YoloLossLayer", "YoloHeadLayer").replace(' bottom: "label" top: "loss"',
                                                                             ' top: "loss"'), random_weights=True)


def test_a_fork_data_layers_guessed_data_shape_names_input_shape_where_it_does_not_fit():
    # antran89/two-stream-fcan's FlowData stacks 16 two-channel flow maps; sized as Caffe's Data layer
    # (3 channels) the Reshape after it fails: a listing leaves the rest unsized, naming --input-shape
    text = """
layer { name: "flow" type: "FlowData" top: "data" top: "label" transform_param { crop_size: 4 }
        data_param { source: "x" batch_size: 2 } }
layer { name: "vol" type: "Reshape" bottom: "data" top: "vol" reshape_param { shape { dim: 0 dim: 2 dim: 16 dim: 4 dim: 4 } } }
"""
    why = (r"bottom 'data' is the data of 'flow', a fork's data layer \(FlowData\) that caffeq sizes as Caffe's "
           r"Data layer, \[2, 3, 4, 4\]; its own reader may give another shape: give it with --input-shape data=")
    with pytest.raises(CaffeqError, match=why):
        load_from_text(text)
    listed = load_from_text(text, unknown_shapes_ok=True)
    assert listed.blob_shapes["vol"] is None
    assert load_from_text(text, input_shapes={"data": (2, 32, 4, 4)}).blob_shapes["vol"] == (2, 2, 16, 4, 4)


def test_a_guessed_data_shape_that_fails_layers_later_names_input_shape_there_too():
    # antran89/two-stream-fcan's VideoSnippetData gives 3 x 100 frames on channels (its datum's shape),
    # which a Reshape turns into a clip; sized as Caffe's Data layer (3 channels) the clip is one frame
    # long and only a temporal pooling several layers later fails
    text = """
layer { name: "snip" type: "VideoSnippetData" top: "data" top: "label" transform_param { crop_size: 4 }
        data_param { source: "x" batch_size: 1 } }
layer { name: "clip" type: "Reshape" bottom: "data" top: "clip" reshape_param { shape { dim: 3 dim: -1 } axis: 1 num_axes: 1 } }
layer { name: "conv" type: "Convolution" bottom: "clip" top: "conv" convolution_param { num_output: 2 kernel_size: 1 axis: 1 } }
layer { name: "pool" type: "Pooling3D" bottom: "conv" top: "pool" pooling3d_param { pool: MAX kernel_size: 2 kernel_depth: 13 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip" inner_product_param { num_output: 5 } }
"""
    why = (r"layer 'pool' \(Pooling3D\): .*; bottom 'conv' is computed from 'data', which is the data of 'snip', a "
           r"fork's data layer \(VideoSnippetData\) that caffeq sizes as Caffe's Data layer, \[1, 3, 4, 4\]; its own "
           r"reader may give another shape: give it with --input-shape data=")
    with pytest.raises(CaffeqError, match=why):
        load_from_text(text)
    listed = load_from_text(text, unknown_shapes_ok=True)
    assert listed.blob_shapes["conv"] == (1, 2, 1, 4, 4) and listed.blob_shapes["pool"] is None
    assert any("the shapes after it are unknown" in w and "'pool'" in w for w in listed.warnings)
    sized = load_from_text(text, input_shapes={"data": (1, 3 * 26, 4, 4)})
    assert sized.blob_shapes["pool"] == (1, 2, 14, 3, 3)   # 26 frames, kernel 13, stride 1
    # in place on the guessed top, and trimmed in place by a Ristretto layer, the blob is still the guess
    snip = text[:text.index('layer { name: "clip"')]
    in_place = snip + ('layer { name: "relu" type: "ReLU" bottom: "data" top: "data" }\n'
                       'layer { name: "r" type: "Reshape" bottom: "data" top: "r" reshape_param { shape { dim: 0 dim: 5 dim: -1 } } }')
    with pytest.raises(CaffeqError, match=r"layer 'r' \(Reshape\): .*; bottom 'data' is the data of 'snip'"):
        load_from_text(in_place)
    trimmed = snip + ('layer { name: "a" type: "ConvolutionRistretto" bottom: "data" top: "a" convolution_param '
                      '{ num_output: 2 kernel_size: 1 } quantization_param { bw_layer_in: 8 fl_layer_in: 3 bw_params: 8 '
                      'fl_params: 4 bw_layer_out: 10 fl_layer_out: 3 } }\n'
                      'layer { name: "r" type: "Reshape" bottom: "data" top: "r" reshape_param { shape { dim: 0 dim: 5 dim: -1 } } }')
    with pytest.raises(CaffeqError, match=r"layer 'r' \(Reshape\): .*; bottom 'data' is the data of 'snip'"):
        load_from_text(trimmed)
    # a failure on no guessed top is still the net's own error
    with pytest.raises(CaffeqError, match=r"layer 'pool' \(Pooling3D\)") as e:
        load_from_text(text.replace("kernel_depth: 13", "kernel_depth: 13 stride: 0"),
                       input_shapes={"data": (1, 3 * 26, 4, 4)})
    assert "computed from" not in str(e.value)


def test_darknet_size_keeping_pools_are_still_found_after_a_fork_data_layer():
    # the fork formats a failing join detects come before the guessed-shape hint
    text = """
layer { name: "snip" type: "VideoSnippetData" top: "data" top: "label" transform_param { crop_size: 12 }
        data_param { source: "x" batch_size: 1 } }
layer { name: "c0" type: "Convolution" bottom: "data" top: "c0" convolution_param { num_output: 2 kernel_size: 1 } }
layer { name: "pool1" type: "Pooling" bottom: "c0" top: "pool1" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "pool2" type: "Pooling" bottom: "pool1" top: "pool2" pooling_param { pool: MAX kernel_size: 2 stride: 1 } }
layer { name: "up" type: "Upsample" bottom: "pool2" top: "up" upsample_param { scale: 2 } }
layer { name: "route" type: "Concat" bottom: "up" bottom: "c0" top: "o" }
"""
    model = load_from_text(text)
    assert model.blob_shapes["pool2"] == (1, 2, 6, 6) and model.blob_shapes["o"] == (1, 4, 12, 12)
    assert any("keep their map's size" in w for w in model.warnings)


def test_a_fork_data_layer_named_data_something_with_a_data_param_is_an_input():
    """RegNet's DenseRegisterDataXY: no bottoms, "Data" in the type and a *data_param message."""
    text = """
layer { name: "d" type: "DenseRegisterDataXY" top: "ref" top: "fl" dense_image_data_param { source: "x" batch_size: 2 } }
layer { name: "c" type: "Concat" bottom: "ref" bottom: "fl" top: "both" }
"""
    model = load_from_text(text, input_shapes={"ref": (2, 1, 8, 8), "fl": (2, 1, 8, 8)})
    assert model.inputs == {"ref": (2, 1, 8, 8), "fl": (2, 1, 8, 8)} and model.blob_shapes["both"] == (2, 2, 8, 8)
    # without a data parameter message the name alone does not make a data layer
    with pytest.raises(CaffeqError, match="unsupported layer type"):
        load_from_text(text.replace(' dense_image_data_param { source: "x" batch_size: 2 }', ""))
    # a transform_param says it too (ginobilinie's MULTI_TASK_DATA_LABEL, its own parameters unknown)
    text = text.replace('dense_image_data_param { source: "x" batch_size: 2 }', 'transform_param { mean_value: 134 }')
    model = load_from_text(text, input_shapes={"ref": (2, 1, 8, 8), "fl": (2, 1, 8, 8)})
    assert model.inputs == {"ref": (2, 1, 8, 8), "fl": (2, 1, 8, 8)} and model.blob_shapes["both"] == (2, 2, 8, 8)


def test_a_fork_data_layer_whose_type_starts_with_data_is_an_input():
    """tpfister/caffe-heatmap's DataHeatmap: its heatmap_data_param is unknown to caffe.proto (a warning,
    as caffeq reads none of its fields); the shapes come from --input-shape."""
    text = """
layer { name: "data" type: "DataHeatmap" top: "data" top: "label" visualise: false
  heatmap_data_param { source: "/data/tp/flic/test_shuffle.txt" batchsize: 1 cropsize: 248 outsize: 256 } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" convolution_param { num_output: 2 kernel_size: 3 } }
"""
    model = load_from_text(text, input_shapes={"data": (1, 3, 8, 8), "label": (1, 2, 6, 6)}, random_weights=True)
    assert model.inputs == {"data": (1, 3, 8, 8), "label": (1, 2, 6, 6)} and model.outputs == ["label", "conv"]
    assert any("'heatmap_data_param'" in w and "reads no parameters of type 'DataHeatmap'" in w
               for w in model.warnings)
    # with bottoms it is not a data layer (flownet2's DataAugmentation has its own spec)
    with pytest.raises(CaffeqError, match="unsupported layer type"):
        load_from_text(text.replace('top: "data" top: "label"', 'bottom: "x" top: "data" top: "label"'))


def test_a_bottomless_fork_layer_making_data_and_label_is_an_input():
    """aaalgo/kaggle-driver's PicPac: an image-database reader whose picpac_param caffe.proto does not
    declare; a layer without bottoms making "data" and "label" is a data layer, whatever its type."""
    text = """
layer { name: "data" type: "PicPac" top: "data" top: "label" picpac_param { path: "/db" batch: 32 channels: 3 } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" convolution_param { num_output: 2 kernel_size: 3 } }
"""
    model = load_from_text(text, input_shapes={"data": (2, 3, 8, 8)}, random_weights=True)
    assert model.inputs == {"data": (2, 3, 8, 8), "label": (2,)} and model.blob_shapes["conv"] == (2, 2, 6, 6)
    with pytest.raises(CaffeqError, match="unsupported layer type"):
        load_from_text(text.replace('top: "data" top: "label"', 'top: "data" top: "mask"'))


def test_a_python_layer_without_tops_only_observes_and_is_dropped():
    """PPR-FCN's test net ends in a debug Python layer that reads eight blobs and makes none: it
    cannot change any output, so it is dropped with its own note (not refused)."""
    text = """
layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 1 dim: 3 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "ip" inner_product_param { num_output: 2 } }
layer { name: "debug" type: "Python" bottom: "x" bottom: "ip" python_param { module: "layers.debug_layer" layer: "Dbg" } }
"""
    model = load_from_text(text, random_weights=True)
    assert model.outputs == ["ip"] and [n.name for n in model.layers] == ["in", "ip"]
    assert any("without tops" in w and "debug (layers.debug_layer.Dbg)" in w for w in model.warnings)


def test_a_python_layer_that_reads_the_label_and_feeds_nothing_is_a_scorer_and_dropped():
    """puneet1189/SVHN's train_test: a confusion-matrix accuracy of its own module reads the scores
    and the label, and no layer reads its top: a scorer, dropped with a note (not refused)."""
    text = """
layer { name: "data" type: "Data" top: "data" top: "label" data_param { source: "x" batch_size: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 3 } }
layer { type: 'Python' name: 'py_accuracy' top: 'py_accuracy' bottom: 'ip' bottom: 'label'
  python_param { module: 'confusion matrix' layer: 'PythonConfMat' } include { phase: TEST } }
"""
    model = load_from_text(text, input_shapes={"data": (2, 4)}, random_weights=True)
    assert [n.name for n in model.layers] == ["data", "ip"] and "ip" in model.outputs
    assert any("'py_accuracy' (Python confusion matrix.PythonConfMat) reads the label 'label' and only losses and "
               "scorers read what it gives, if anything: it only trains or scores the net" in w for w in model.warnings)
    # so is a layer of an unknown type that does the same (wzbazinga's misspelled `type: "Accutacy"`)
    typo = text.replace("type: 'Python'", 'type: "Accutacy"')
    assert [n.name for n in load_from_text(typo, input_shapes={"data": (2, 4)}, random_weights=True).layers] == \
        ["data", "ip"]
    # one whose result a kept layer reads computes the net: refused as any other Python layer
    feeding = text + 'layer { name: "s" type: "Scale" bottom: "py_accuracy" top: "s" }\n'
    with pytest.raises(CaffeqError, match="is a Python layer"):
        load_from_text(feeding, input_shapes={"data": (2, 4)}, random_weights=True)


def test_what_a_layer_computes_from_the_label_alone_is_label_too():
    """xinghaochen/caffe-pose's test net slices its label into the pose and the hand centre, which its
    PoseDistance scorer reads with the predictions: the scorer goes, and so does the Slice that only
    fed it, so the net's output is the prediction alone."""
    text = """
layer { name: "data" type: "Data" top: "data" top: "label" data_param { source: "x" batch_size: 2 } }
layer { name: "pose" type: "Slice" bottom: "label" top: "pose" top: "center" slice_param { slice_dim: 1 slice_point: 6 } }
layer { name: "fc" type: "InnerProduct" bottom: "data" top: "fc" inner_product_param { num_output: 6 } }
layer { name: "distance" type: "PoseDistance" bottom: "fc" bottom: "pose" bottom: "center" top: "distance" }
"""
    model = load_from_text(text, input_shapes={"data": (2, 4), "label": (2, 9)}, random_weights=True)
    assert [n.name for n in model.layers] == ["data", "fc"] and model.outputs == ["fc"]
    assert any("'distance' (PoseDistance) reads the label 'pose'" in w for w in model.warnings)
    # a Slice of the label that a kept layer reads stays (here a Concat with the prediction)
    kept = text + 'layer { name: "both" type: "Concat" bottom: "fc" bottom: "center" top: "both" }\n'
    model = load_from_text(kept, input_shapes={"data": (2, 4), "label": (2, 9)}, random_weights=True)
    assert "pose" in [n.name for n in model.layers] and set(model.outputs) == {"pose", "both"}



def test_an_unknown_layer_on_the_other_phases_label_only_trains():
    """IrisParseNet's train net: its data layer (image, mask, edge) is TRAIN-only, and its SliceLabel (a fork
    layer whose source is not public) splits the edge label into targets that only its losses read.  At TEST
    the label is made by no layer: the splitter trains only, and goes with its losses."""
    text = """
layer { name: "in" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } } }
layer { name: "lab" type: "Input" top: "edge" include { phase: TRAIN } input_param { shape { dim: 2 dim: 1 dim: 8 dim: 8 } } }
layer { name: "slice_label" type: "SliceLabel" bottom: "edge" top: "pupil_gt" top: "edge_gt" }
layer { name: "conv" type: "Convolution" bottom: "data" top: "mask" convolution_param { num_output: 1 kernel_size: 1 } }
layer { name: "loss1" type: "SigmoidCrossEntropyLoss" bottom: "mask" bottom: "pupil_gt" top: "l1" }
layer { name: "loss2" type: "SigmoidCrossEntropyLoss" bottom: "mask" bottom: "edge_gt" top: "l2" }
"""
    model = load_from_text(text, random_weights=True)
    assert [n.name for n in model.layers] == ["in", "conv"] and model.outputs == ["mask"]
    assert any("'slice_label' (SliceLabel) reads the label 'edge'" in w for w in model.warnings)
    # one whose result the net computes with stays unknown: refused
    feeding = text + 'layer { name: "use" type: "Eltwise" bottom: "mask" bottom: "pupil_gt" top: "both" }\n'
    with pytest.raises(CaffeqError, match="SliceLabel"):
        load_from_text(feeding, random_weights=True)

FASTER_RCNN_TRAIN = """
layer { name: "in" type: "Input" top: "data" top: "gt_boxes" top: "rpn_rois"
  input_param { shape { dim: 1 dim: 3 dim: 12 dim: 16 } shape { dim: 4 dim: 5 } shape { dim: 30 dim: 5 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" convolution_param { num_output: 8 kernel_size: 3 pad: 1 } }
layer { name: "rpn_score" type: "Convolution" bottom: "conv" top: "rpn_score" convolution_param { num_output: 18 kernel_size: 1 } }
layer { name: "rpn-data" type: "Python" bottom: "rpn_score" bottom: "gt_boxes" top: "rpn_labels" top: "rpn_targets"
  python_param { module: "rpn.anchor_target_layer" layer: "AnchorTargetLayer" param_str: "'feat_stride': 16" } }
layer { name: "rpn_loss" type: "SoftmaxWithLoss" bottom: "rpn_score" bottom: "rpn_labels" top: "rpn_loss" }
layer { name: "rpn_bbox_loss" type: "SmoothL1Loss" bottom: "rpn_score" bottom: "rpn_targets" top: "rpn_bbox_loss" }
layer { name: "roi-data" type: "Python" bottom: "rpn_rois" bottom: "gt_boxes" top: "rois" top: "labels"
  top: "bbox_targets" top: "bbox_inside_weights" top: "bbox_outside_weights"
  python_param { module: "rpn.proposal_target_layer" layer: "ProposalTargetLayer" param_str: "'num_classes': 3" } }
layer { name: "pool" type: "ROIPooling" bottom: "conv" bottom: "rois" top: "pool"
  roi_pooling_param { pooled_w: 2 pooled_h: 2 spatial_scale: 0.0625 } }
layer { name: "cls" type: "InnerProduct" bottom: "pool" top: "cls" inner_product_param { num_output: 3 } }
layer { name: "bbox_loss" type: "SmoothL1Loss" bottom: "cls" bottom: "bbox_targets" top: "bbox_loss" }
layer { name: "per_roi" type: "Eltwise" bottom: "bbox_loss" bottom: "bbox_loss" top: "per_roi" }
"""


def test_a_faster_rcnn_train_net_reads_without_its_training_layers():
    model = load_from_text(FASTER_RCNN_TRAIN, random_weights=True)
    dropped = next(w for w in model.warnings if "training-only" in w)
    # the anchor targets feed only losses: gone with them; the Eltwise read only a dropped loss
    for name in ("rpn-data (Python)", "rpn_loss (SoftmaxWithLoss)", "rpn_bbox_loss (SmoothL1Loss)",
                 "bbox_loss (SmoothL1Loss)", "per_roi (Eltwise)"):
        assert name in dropped
    # py-faster-rcnn's ProposalTargetLayer.setup shapes
    shapes = model.blob_shapes
    assert shapes["rois"] == (1, 5) and shapes["labels"] == (1, 1) and shapes["bbox_targets"] == (1, 12)
    assert shapes["pool"] == (1, 8, 2, 2)
    with pytest.raises(CaffeqError, match="samples training rois.*test or deploy prototxt"):
        model.run({"data": np.zeros((1, 3, 12, 16), np.float32), "gt_boxes": np.zeros((4, 5), np.float32),
                   "rpn_rois": np.zeros((30, 5), np.float32)})
    with pytest.raises(CaffeqError, match="'num_classes' must be a positive integer"):
        load_from_text(FASTER_RCNN_TRAIN.replace("'num_classes': 3", "'classes': 3"))
    # forks feed the sampler more inputs (fighting-liu's im_info, tszssong's flags): the same five tops
    extra = load_from_text(FASTER_RCNN_TRAIN.replace('bottom: "rpn_rois" bottom: "gt_boxes" top: "rois"',
                                                     'bottom: "rpn_rois" bottom: "gt_boxes" bottom: "data" top: "rois"'))
    assert extra.blob_shapes["rois"] == (1, 5) and extra.blob_shapes["bbox_targets"] == (1, 12)
    with pytest.raises(CaffeqError, match=r"ProposalTargetLayer takes 2, 3 or 4 bottoms .* got 1 and 5"):
        load_from_text(FASTER_RCNN_TRAIN.replace('bottom: "rpn_rois" bottom: "gt_boxes" top: "rois"',
                                                 'bottom: "rpn_rois" top: "rois"'))



def test_r_fcn_seg_mask_proposal_targets_add_segment_targets():
    # insmod-he/py-R-FCN's seg_mask branch: ProposalTargetLayer also takes the image id and, by its
    # setup, adds seg_targets and seg_weights of 2 seg_num + 2 per roi
    text = FASTER_RCNN_TRAIN.replace('top: "bbox_outside_weights"',
                                     'top: "bbox_outside_weights" top: "seg_targets" top: "seg_weights"')
    text = text.replace('bottom: "rpn_rois" bottom: "gt_boxes" top: "rois"',
                        'bottom: "rpn_rois" bottom: "gt_boxes" bottom: "data" top: "rois"')
    seg = load_from_text(text.replace("'num_classes': 3", "'num_classes': 3\\n'seg_num': 14"))
    shapes = seg.blob_shapes
    assert shapes["rois"] == (1, 5) and shapes["bbox_targets"] == (1, 12)
    assert shapes["seg_targets"] == shapes["seg_weights"] == (1, 30)
    with pytest.raises(CaffeqError, match="'seg_num' must be a non-negative integer"):
        load_from_text(text.replace("'num_classes': 3", "'num_classes': 3\\n'seg_num': 'x'"))
    # without seg_num or out_size, seven tops are affordance-net's, which takes five bottoms
    with pytest.raises(CaffeqError, match="takes 5 bottoms"):
        load_from_text(text)


def test_py_mask_rcnn_proposal_targets_add_mask_rois_and_targets():
    # VitoChien/py-mask-rcnn's end2end train net: the sampler takes the instance masks and, by its setup,
    # adds the mask rois and (1, out_size, out_size) mask targets
    text = FASTER_RCNN_TRAIN.replace('top: "bbox_outside_weights"',
                                     'top: "bbox_outside_weights" top: "mask_rois" top: "masks"')
    text = text.replace('bottom: "rpn_rois" bottom: "gt_boxes" top: "rois"',
                        'bottom: "rpn_rois" bottom: "gt_boxes" bottom: "data" top: "rois"')
    shapes = load_from_text(text.replace("'num_classes': 3", "'num_classes': 3\\n'out_size': 28")).blob_shapes
    assert shapes["rois"] == shapes["mask_rois"] == (1, 5) and shapes["bbox_targets"] == (1, 12)
    assert shapes["masks"] == (1, 1, 28, 28)
    with pytest.raises(CaffeqError, match="'out_size' must be a positive integer"):
        load_from_text(text.replace("'num_classes': 3", "'num_classes': 3\\n'out_size': 0"))


def test_person_search_oim_layers_train_on_the_proposal_targets_aux_label():
    # ShuangLI59/person_search: ProposalTargetLayer's sixth top is a pid label per roi, and the OIM
    # loss's LabeledMatching / UnlabeledMatching (no spec) train on it through Power and Concat
    text = FASTER_RCNN_TRAIN.replace('top: "bbox_outside_weights"', 'top: "bbox_outside_weights" top: "pid_label"')
    text += """
layer { name: "feat" type: "InnerProduct" bottom: "pool" top: "feat" inner_product_param { num_output: 4 } }
layer { name: "lm" type: "LabeledMatching" bottom: "feat" bottom: "pid_label" top: "lm_scores" top: "id_labels" }
layer { name: "um" type: "UnlabeledMatching" bottom: "feat" bottom: "pid_label" top: "um_scores" }
layer { name: "lm_scale" type: "Power" bottom: "lm_scores" top: "lm_scaled" power_param { scale: 10 } }
layer { name: "cat" type: "Concat" bottom: "lm_scaled" bottom: "um_scores" top: "id_scores" }
layer { name: "id_loss" type: "SoftmaxWithLoss" bottom: "id_scores" bottom: "id_labels" top: "id_loss" }
"""
    model = load_from_text(text, random_weights=True)
    assert model.blob_shapes["pid_label"] == (1, 1)
    readers = next(w for w in model.warnings if "reads the label" in w)
    for name in ("'lm' (LabeledMatching) reads the label 'pid_label'", "'um' (UnlabeledMatching) reads the label"):
        assert name in readers
    assert "feat" in model.blob_shapes and "id_scores" not in model.blob_shapes
    # the same layers reading something that is not a training target are still refused
    with pytest.raises(CaffeqError, match="LabeledMatching"):
        load_from_text(text.replace('bottom: "feat" bottom: "pid_label" top: "lm_scores"',
                                    'bottom: "feat" bottom: "feat" top: "lm_scores"'))


def test_an_unknown_python_layer_read_by_inference_is_still_refused():
    text = FASTER_RCNN_TRAIN.replace('layer { name: "rpn_loss"', 'layer { name: "use" type: "ReLU" bottom: '
                                     '"rpn_labels" top: "used" }\nlayer { name: "rpn_loss"')
    with pytest.raises(CaffeqError, match="Python layer .*rpn.anchor_target_layer"):
        load_from_text(text)


def test_a_python_layer_before_thousands_of_layers_is_refused_in_one_line():
    # converted TensorFlow nets (synopsys-caffe-models' resnet_v2_101) put a Python layer before
    # thousands of layers: deciding whether its results only train must not recurse down the chain
    chain = "\n".join(f'layer {{ name: "r{i}" type: "ReLU" bottom: "b{i}" top: "b{i + 1}" }}' for i in range(3000))
    text = ('layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 1 dim: 2 } } }\n'
            'layer { name: "pad" type: "Python" bottom: "x" top: "b0" python_param { module: "pad" layer: "PadTensor" } }\n'
            + chain)
    with pytest.raises(CaffeqError, match="'pad' is a Python layer"):
        load_from_text(text)
    # and when it reads the label and the chain ends in a loss the whole branch only trains and is dropped
    # (one that reads the batch itself transforms what the net runs on: refused, as above)
    lossy = text.replace('top: "x" input_param { shape { dim: 1 dim: 2 } }',
                         'top: "x" top: "lbl" input_param { shape { dim: 1 dim: 2 } shape { dim: 1 dim: 2 } }')
    lossy = lossy.replace('bottom: "x" top: "b0"', 'bottom: "lbl" top: "b0"') + \
        '\nlayer { name: "loss" type: "EuclideanLoss" bottom: "b3000" bottom: "x" top: "loss" }' + \
        '\nlayer { name: "keep" type: "ReLU" bottom: "x" top: "y" }'
    model = load_from_text(lossy)
    assert [n.name for n in model.layers] == ["x", "keep"]


def test_enet_spatial_dropout_python_layer(tmp_path):
    # TimoSaemann/ENet's spatial_dropout.py: with 'phase': 'TEST' it multiplies by 1 / (1 - p)
    text = """
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 dim: 4 dim: 5 } } }
layer { name: "d" type: "Python" bottom: "x" top: "y"
  python_param { module: "spatial_dropout" layer: "SpatialDropoutLayer" param_str: "{'phase': 'TEST', 'p': '0.01'}" } }
layer { name: "t" type: "Python" bottom: "y" top: "z"
  python_param { module: "spatial_dropout" layer: "SpatialDropoutLayer" param_str: "{'phase': 'TRAIN', 'p': '0.1'}" } }
"""
    model = load_from_text(text)
    x = rng(5).standard_normal((2, 3, 4, 5)).astype(np.float32)
    want = x * np.float32(1.0 / (1.0 - 0.01))
    np.testing.assert_array_equal(model.run({"x": x})["z"], want)
    np.testing.assert_allclose(onnx_outputs(model, tmp_path / "m.onnx", {"x": x})["z"], want, rtol=1e-7)
    np.testing.assert_allclose(pytorch_source_outputs(model, tmp_path / "pt", {"x": x}).numpy(), want, rtol=1e-7)
    with pytest.raises(CaffeqError, match="p must be between 0 and 1"):
        load_from_text(text.replace("'0.01'", "'1.5'"))


# ---- what the user chose survives every rebuild (reshaped, transforms, the ONNX export) -----------

STAGED_BN = """
name: "staged"
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 dim: 5 dim: 4 } } }
layer { name: "conv" type: "Convolution" bottom: "x" top: "c" convolution_param { num_output: 4 kernel_size: 3 } }
layer { name: "bn" type: "BatchNorm" bottom: "c" top: "c" batch_norm_param { use_global_stats: true } }
layer { name: "deploy_only" type: "ReLU" bottom: "c" top: "r" include { stage: "deploy" } }
"""


def test_the_batch_and_stages_survive_folding_and_the_onnx_export(tmp_path):
    import onnx

    from caffeq.transforms import fold_batchnorm
    model = load_from_text(STAGED_BN, random_weights=True, stages=["deploy"])
    assert "deploy_only" in [n.name for n in model.layers]
    folded = fold_batchnorm(model)
    assert "deploy_only" in [n.name for n in folded.layers] and "bn" not in [n.name for n in folded.layers]
    # a fixed ONNX batch on the optimized export: the file holds that batch, not the prototxt's
    model.export_onnx(str(tmp_path / "b5.onnx"), batch=5, optimize=True)
    g = onnx.load(str(tmp_path / "b5.onnx")).graph
    assert [d.dim_value for d in g.input[0].type.tensor_type.shape.dim] == [5, 3, 5, 4]
    assert [o.name for o in g.output] == ["r"]
    assert [d.dim_value for d in g.output[0].type.tensor_type.shape.dim] == [5, 4, 3, 2]
    assert fold_batchnorm(model.reshaped(7)).inputs == {"x": (7, 3, 5, 4)}


# -- unknown layers that read the label and only feed losses (margin layers) -----------------------

MARGIN_NET = """
layer { name: "d" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 3 dim: 2 dim: 4 dim: 5 } shape { dim: 3 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 6 } }
layer { name: "ip2" type: "CosinAddm" bottom: "ip" bottom: "label" top: "ip2" top: "lambda" }
layer { name: "scale" type: "Scale" bottom: "ip2" top: "ip2s" scale_param { bias_term: false } }
layer { name: "accuracy" type: "Accuracy" bottom: "ip2s" bottom: "label" top: "accuracy" }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2s" bottom: "label" top: "loss" }
"""


def test_an_unknown_label_reader_feeding_only_losses_is_dropped_with_them():
    # the label is an input's (or a data layer's) second top
    model = load_from_text(MARGIN_NET, random_weights=True)
    assert model.outputs == ["ip"]
    note = next(w for w in model.warnings if "reads the label" in w)
    assert "'ip2' (CosinAddm) reads the label 'label'" in note
    dropped = next(w for w in model.warnings if "dropped" in w)
    for name in ("ip2 (CosinAddm)", "scale (Scale)", "accuracy (Accuracy)", "loss (SoftmaxWithLoss)"):
        assert name in dropped
    # what is left computes the InnerProduct: x W^T + b
    x = np.random.default_rng(3).standard_normal((3, 2, 4, 5)).astype(np.float32)
    w, b = model.params["ip"]
    want = x.reshape(3, -1).astype(np.float64) @ w.T.astype(np.float64) + b
    got = model.run({"data": x, "label": np.zeros(3, np.float32)}, exact=True)["ip"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


DATA_LAYER = 'layer { name: "d" type: "Data" top: "data" top: "label" data_param { source: "x" batch_size: 3 } }'
SHAPES = {"data": (3, 2, 4, 5), "label": (3,)}


@pytest.mark.parametrize("change, why", [
    # a result that inference keeps (the Scale's top is a net output)
    ('layer { name: "accuracy"', 'layer { name: "keep" type: "ReLU" bottom: "ip2s" top: "kept" }\nlayer { name: "accuracy"'),
    # reads no label
    ('bottom: "ip" bottom: "label" top: "ip2"', 'bottom: "ip" bottom: "ip" top: "ip2"'),
])
def test_an_unknown_label_reader_is_kept_unless_every_read_top_only_trains(change, why):
    text = DATA_LAYER + MARGIN_NET.split("} } }", 1)[1].replace(change, why)
    with pytest.raises(CaffeqError, match="unsupported layer types: CosinAddm"):
        load_from_text(text, random_weights=True, input_shapes=SHAPES)


def test_an_unknown_label_reader_whose_top_nothing_reads_scores_the_net_and_is_dropped():
    # what only a label makes, and no layer reads, is an evaluation: a net without labels cannot compute it
    text = DATA_LAYER + MARGIN_NET.split("} } }", 1)[1].replace('bottom: "ip2" top: "ip2s"', 'bottom: "ip" top: "ip2s"')
    model = load_from_text(text, random_weights=True, input_shapes=SHAPES)
    assert "ip2" not in model.blob_shapes and "lambda" not in model.blob_shapes
    assert [n.name for n in model.layers] == ["d", "ip", "scale", "accuracy", "loss"]
    assert any("'ip2' (CosinAddm) reads the label 'label' and only losses and scorers read what it gives, if "
               "anything" in w for w in model.warnings)


def test_a_label_of_the_train_data_layer_counts_at_test():
    """A train_val file whose only data layer is TRAIN's: the margin layer goes, and the phase
    error that remains says what to choose."""
    text = DATA_LAYER.replace('batch_size: 3 }', 'batch_size: 3 } include { phase: TRAIN }') + \
        MARGIN_NET.split("} } }", 1)[1]
    with pytest.raises(CaffeqError, match="only under include { phase: TRAIN }"):
        load_from_text(text, random_weights=True)
    model = load_from_text(text, random_weights=True, phase="TRAIN", input_shapes=SHAPES)
    assert "ip2" not in model.blob_shapes


def test_a_python_layer_feeding_a_loss_through_a_known_layer_is_dropped():
    text = DATA_LAYER + """
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 6 } }
layer { name: "t" type: "Python" bottom: "ip" top: "targets" python_param { module: "m" layer: "TargetLayer" } }
layer { name: "s" type: "Power" bottom: "targets" top: "targets2" }
layer { name: "loss" type: "EuclideanLoss" bottom: "ip" bottom: "targets2" top: "loss" }
"""
    model = load_from_text(text, random_weights=True, input_shapes=SHAPES)
    assert "ip" in model.outputs and "targets" not in model.blob_shapes and "targets2" not in model.blob_shapes
    with pytest.raises(CaffeqError, match="Python layer"):
        load_from_text(text + 'layer { name: "r" type: "ReLU" bottom: "targets2" top: "out" }',
                       random_weights=True, input_shapes=SHAPES)


def test_parameters_of_a_type_caffeq_has_no_spec_for_never_stop_the_read():
    # xialuxi's margin layer carries its own parameter message: the layer only trains and is dropped
    text = MARGIN_NET.replace('top: "ip2" top: "lambda" }', 'top: "ip2" top: "lambda" cosin_add_m_param { m: 0.1 } }')
    model = load_from_text(text, random_weights=True)
    assert model.outputs == ["ip"]
    assert any("cosin_add_m_param" in w and "reads no parameters of type 'CosinAddm'" in w for w in model.warnings)
    # a spec-less type that inference would keep: one error naming the type, not its field
    kept = text.replace('layer { name: "accuracy"', 'layer { name: "keep" type: "ReLU" bottom: "ip2s" top: "kept" }\n'
                        'layer { name: "accuracy"')
    with pytest.raises(CaffeqError, match="unsupported layer types: CosinAddm"):
        load_from_text(kept, random_weights=True)
    # a known type keeps its strictness
    with pytest.raises(CaffeqError, match="unknown field 'kernal_size'"):
        load_from_text(text.replace("inner_product_param { num_output: 6 }",
                                    "inner_product_param { num_output: 6 kernal_size: 3 }"), random_weights=True)


def test_a_deploy_net_that_kept_its_scorer_reads_without_it():
    # AlfredXiangWu's LightenedCNN deploy file keeps an Accuracy layer reading a 'label' nothing makes
    text = """
layer { name: "in" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 4 dim: 5 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 6 } }
layer { name: "accuracy" type: "Accuracy" bottom: "ip" bottom: "label" top: "accuracy" }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""
    model = load_from_text(text, random_weights=True)
    assert model.outputs == ["ip"]
    note = next(w for w in model.warnings if "which no layer makes" in w)
    assert "'accuracy' (Accuracy) reads 'label'" in note and "'loss' (SoftmaxWithLoss)" in note
    # a scorer whose scores are missing too is still an error: the file is broken, not just a deploy file
    with pytest.raises(CaffeqError, match="bottom 'ipx' is not produced"):
        load_from_text(text.replace('bottom: "ip" bottom: "label" top: "accuracy"',
                                    'bottom: "ipx" bottom: "label" top: "accuracy"'))


def test_an_in_place_chain_on_a_dropped_training_branch_goes_with_it():
    # mscnn's trainval files: the detection branch computes from the sampled targets (a C++
    # ProposalTarget reading the ground truth) and ends in losses; its in-place ReLU/Dropout chain
    # must go with it, not stop the read
    text = """
layer { name: "data" type: "Input" top: "data" top: "gt" input_param { shape { dim: 1 dim: 3 dim: 6 dim: 6 } shape { dim: 4 dim: 5 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" convolution_param { num_output: 4 kernel_size: 1 } }
layer { name: "sample" type: "MyProposalTarget" bottom: "conv" bottom: "gt" top: "rois" top: "targets" }
layer { name: "fc" type: "InnerProduct" bottom: "rois" top: "fc" inner_product_param { num_output: 3 } }
layer { name: "relu" type: "ReLU" bottom: "fc" top: "fc" }
layer { name: "drop" type: "Dropout" bottom: "fc" top: "fc" }
layer { name: "loss" type: "SmoothL1Loss" bottom: "fc" bottom: "targets" top: "loss" }
"""
    text = text.replace('type: "Input" top: "data" top: "gt"', 'type: "Input" top: "data" top: "gt"', 1)
    model = load_from_text(text.replace('layer { name: "data" type: "Input"', 'layer { name: "data" type: "Input"'),
                           input_shapes=None, random_weights=True)
    assert model.outputs == ["conv"]
    dropped = next(w for w in model.warnings if "training-only" in w)
    for name in ("sample (MyProposalTarget)", "fc (InnerProduct)", "relu (ReLU)", "drop (Dropout)"):
        assert name in dropped, dropped


DETECTNET = """
layer { name: "in" type: "Input" top: "data" top: "coverage-label" top: "bbox-label"
  input_param { shape { dim: 2 dim: 3 dim: 32 dim: 48 } shape { dim: 2 dim: 2 dim: 2 dim: 3 } shape { dim: 2 dim: 4 dim: 2 dim: 3 } } }
layer { name: "coverage" type: "Convolution" bottom: "data" top: "coverage" convolution_param { num_output: 2 kernel_size: 16 stride: 16 } }
layer { name: "bboxes" type: "Convolution" bottom: "data" top: "bboxes" convolution_param { num_output: 4 kernel_size: 16 stride: 16 } }
layer { name: "cluster" type: "Python" bottom: "coverage" bottom: "bboxes" top: "bbox-list-class0" top: "bbox-list-class1"
  python_param { module: "caffe.layers.detectnet.clustering" layer: "ClusterDetections"
                 param_str: "48,32,16,0.05,3,0.2,10,2,40" } }
layer { name: "cluster_gt" type: "Python" bottom: "coverage-label" bottom: "bbox-label" top: "gt-list"
  python_param { module: "caffe.layers.detectnet.clustering" layer: "ClusterGroundtruth" param_str: "48,32,16" } }
layer { name: "score" type: "Python" bottom: "gt-list" bottom: "bbox-list-class0" top: "scored"
  python_param { module: "caffe.layers.detectnet.mean_ap" layer: "ScoreDetections" } }
layer { name: "mAP" type: "Python" bottom: "scored" top: "mAP" top: "precision" top: "recall"
  python_param { module: "caffe.layers.detectnet.mean_ap" layer: "mAP" param_str: "48,32,16" } }
"""


def test_detectnet_clustering_runs_and_its_scoring_layers_are_dropped():
    model = load_from_text(DETECTNET, random_weights=True)
    shapes = model.blob_shapes
    # clustering.py's reshape: one (N, 50, 5) list per class; its ninth value is not read
    assert shapes["bbox-list-class0"] == shapes["bbox-list-class1"] == (2, 50, 5)
    assert "mAP" not in shapes and "scored" not in shapes and "gt-list" not in shapes
    assert sorted(model.outputs) == ["bbox-list-class0", "bbox-list-class1"]
    feeds = {"data": np.zeros((2, 3, 32, 48), np.float32), "coverage-label": np.zeros((2, 2, 2, 3), np.float32),
             "bbox-label": np.zeros((2, 4, 2, 3), np.float32)}
    assert model.run(feeds)["bbox-list-class0"].shape == (2, 50, 5)   # the values: test_layers_detectnet_clustering
    with pytest.raises(CaffeqError, match="one top per class"):
        load_from_text(DETECTNET.replace('param_str: "48,32,16,0.05,3,0.2,10,2,40"', 'param_str: "48,32,16,0.05,3,0.2,10,3"'))
    with pytest.raises(CaffeqError, match="takes 'img_size_x"):
        load_from_text(DETECTNET.replace('param_str: "48,32,16,0.05,3,0.2,10,2,40"', 'param_str: "48,32"'))


def test_read_only_layers_refuse_every_backend_with_their_reason(tmp_path):
    from caffeq.backends.pytorch_source import export_pytorch
    from caffeq.errors import ExportError
    model = load_from_text(FASTER_RCNN_TRAIN, random_weights=True)
    with pytest.raises(ExportError, match="samples training rois"):
        export_pytorch(model, tmp_path / "py")
    with pytest.raises(ExportError, match="samples training rois"):
        model.export_onnx(tmp_path / "m.onnx")
    detect = load_from_text(DETECTNET, random_weights=True)
    with pytest.raises(ExportError, match="groupRectangles"):   # runs in torch and model.py, not in ONNX
        detect.export_onnx(tmp_path / "d.onnx")


def test_targets_read_only_by_losses_and_silence_train_only():
    """MaskYolo_Caffe's DecodeRois reads the label and makes rois for a mask loss plus targets that a
    Silence swallows: the whole branch only trains, so it is dropped (Silence adds no output)."""
    text = """
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 1 dim: 3 dim: 8 dim: 8 } shape { dim: 1 dim: 5 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" convolution_param { num_output: 4 kernel_size: 1 } }
layer { name: "decode" type: "DecodeRois" bottom: "conv" bottom: "label" top: "rois" top: "unused_targets" top: "mask_t" }
layer { name: "pool" type: "ROIPooling" bottom: "conv" bottom: "rois" top: "pool"
  roi_pooling_param { pooled_w: 2 pooled_h: 2 spatial_scale: 1 } }
layer { name: "loss" type: "EuclideanLoss" bottom: "pool" bottom: "mask_t" top: "loss" }
layer { name: "silence" type: "Silence" bottom: "unused_targets" }
"""
    model = load_from_text(text, random_weights=True)
    assert [n.name for n in model.layers] == ["data", "conv"] and model.outputs == ["conv"]
    assert any("decode (DecodeRois)" in w for w in model.warnings)


PAIRWISE_TRAIN = """
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 1 dim: 3 dim: 8 dim: 8 } shape { dim: 1 dim: 1 dim: 8 dim: 8 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" convolution_param { num_output: 4 kernel_size: 1 } }
layer { name: "pairwise" type: "Concat" bottom: "data" bottom: "conv" top: "pairwise" include { phase: TRAIN } }
layer { name: "sample" type: "RandomSample2D" bottom: "pairwise" top: "sample" top: "sample_index"
  include { phase: TRAIN } }
layer { name: "energy" type: "PairwiseEnergy" bottom: "sample" top: "energy" include { phase: TRAIN } }
layer { name: "gt" type: "PairwiseGT" bottom: "label" bottom: "sample_index" top: "gt" include { phase: TRAIN } }
layer { name: "pairwise_loss" type: "EuclideanLoss" bottom: "energy" bottom: "gt" top: "pairwise_loss"
  include { phase: TRAIN } }
layer { name: "score" type: "Convolution" bottom: "conv" top: "score" convolution_param { num_output: 2 kernel_size: 1 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "score" bottom: "label" top: "loss" }
"""


def test_unknown_layers_the_file_runs_only_at_train_and_that_feed_only_losses_are_dropped():
    # zbxzc35/deeplab_v2_python's pairwise-loss train net: a TRAIN-only branch of fork layers that
    # only its EuclideanLoss reads; the net itself ends in its SoftmaxWithLoss
    model = load_from_text(PAIRWISE_TRAIN, phase="TRAIN", random_weights=True)
    dropped = next(w for w in model.warnings if "training-only" in w)
    for name in ("pairwise (Concat)", "sample (RandomSample2D)", "energy (PairwiseEnergy)", "gt (PairwiseGT)"):
        assert name in dropped
    assert model.outputs == ["loss"] and "pairwise" not in model.blob_shapes
    # without the TRAIN rule nothing marks the fork layers as training's: refused as unknown
    with pytest.raises(CaffeqError, match="RandomSample2D"):
        load_from_text(PAIRWISE_TRAIN.replace('top: "sample_index"\n  include { phase: TRAIN }',
                                              'top: "sample_index"'), phase="TRAIN")
    # nor where an inference layer reads what the branch makes
    with pytest.raises(CaffeqError, match="PairwiseEnergy"):
        load_from_text(PAIRWISE_TRAIN + 'layer { name: "use" type: "ReLU" bottom: "energy" top: "used" '
                                        'include { phase: TRAIN } }', phase="TRAIN")


def test_a_listing_reads_past_a_python_layer_and_running_refuses_it(tmp_path, capsys):
    """py-faster-rcnn-style nets: a Python layer caffeq has no spec for, in the middle of the net.  inspect lists
    the whole net, sizes unknown from that layer on, with a warning naming it; loading to run refuses it."""
    from caffeq.__main__ import main
    text = """
input: "data" input_shape { dim: 1 dim: 3 dim: 8 dim: 8 }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" convolution_param { num_output: 4 kernel_size: 3 } }
layer { name: "proposal" type: "Python" bottom: "conv" top: "rois" python_param { module: "rpn.my_layer" layer: "Mine" } }
layer { name: "fc" type: "InnerProduct" bottom: "rois" top: "fc" inner_product_param { num_output: 2 } }
"""
    listed = load_from_text(text, unknown_shapes_ok=True)
    assert listed.blob_shapes["conv"] == (1, 4, 6, 6) and listed.blob_shapes["rois"] is None
    assert listed.blob_shapes["fc"] is None
    with pytest.raises(CaffeqError, match=r"layer 'proposal' is a Python layer \(module 'rpn.my_layer', class 'Mine'\)"):
        load_from_text(text)
    (tmp_path / "net.prototxt").write_text(text)
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "net.prototxt")]) == 0
    err = capsys.readouterr().err
    assert "layer 'proposal' (Python): a Python layer (module 'rpn.my_layer', class 'Mine') whose code caffeq never " \
           "imports or runs; the shapes after it are unknown" in err


def test_an_unnamed_python_layer_leaves_only_its_own_tops_unsized():
    """superpixelRefinement's test net: unnamed layers all carry the name ''.  Only the tops computed from the
    Python layer are unsized, not those of the other unnamed layers."""
    text = """
input: "data" input_shape { dim: 1 dim: 3 dim: 8 dim: 6 }
layer { type: "ReLU" bottom: "data" top: "r" }
layer { type: "Python" bottom: "r" top: "p" python_param { module: "my.mod" layer: "Foo" } }
layer { type: "ReLU" bottom: "p" top: "q" }
layer { type: "Sigmoid" bottom: "data" top: "s" }
"""
    listed = load_from_text(text, unknown_shapes_ok=True)
    assert listed.blob_shapes["r"] == (1, 3, 8, 6) and listed.blob_shapes["s"] == (1, 3, 8, 6)
    assert listed.blob_shapes["p"] is None and listed.blob_shapes["q"] is None
    unknown = [w for w in listed.warnings if "the shapes after it are unknown" in w]
    assert len(unknown) == 1 and "(Python)" in unknown[0]


def test_a_listing_reads_past_a_forks_variant_of_a_known_python_layer():
    """lilinhao/ShipDetection's rotated-box ProposalLayer: rpn.proposal_layer.ProposalLayer with 4 bottoms and 3
    tops, not the 3 and 1-2 of py-faster-rcnn's that caffeq runs.  The listing reads past it, naming why; loading
    it to run refuses it with the spec's own error."""
    text = """
input: "data" input_shape { dim: 1 dim: 3 dim: 8 dim: 8 }
input: "im_info" input_shape { dim: 1 dim: 3 }
layer { name: "score" type: "Convolution" bottom: "data" top: "score" convolution_param { num_output: 18 kernel_size: 1 } }
layer { name: "bbox" type: "Convolution" bottom: "data" top: "bbox" convolution_param { num_output: 36 kernel_size: 1 } }
layer { name: "heads" type: "Convolution" bottom: "data" top: "heads" convolution_param { num_output: 9 kernel_size: 1 } }
layer { name: "proposal" type: "Python" bottom: "score" bottom: "bbox" bottom: "im_info" bottom: "heads"
        top: "rois" top: "rois_r" top: "rois_h" python_param { module: "rpn.proposal_layer" layer: "ProposalLayer"
        param_str: "'feat_stride': 16" } }
layer { name: "fc" type: "InnerProduct" bottom: "rois" top: "fc" inner_product_param { num_output: 2 } }
"""
    listed = load_from_text(text, unknown_shapes_ok=True)
    notes = listed.warnings
    assert listed.blob_shapes["heads"] == (1, 9, 8, 8)
    assert listed.blob_shapes["rois"] is None and listed.blob_shapes["fc"] is None
    assert any("layer 'proposal' (Python): a Python layer (module 'rpn.proposal_layer', class 'ProposalLayer') in a "
               "form caffeq's spec of it does not read (region proposals takes 3 bottoms" in n for n in notes), notes
    with pytest.raises(CaffeqError, match=r"layer 'proposal' \(Python\).*takes 3 bottoms"):
        load_from_text(text, random_weights=True)
