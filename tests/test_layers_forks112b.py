"""corpus112b's fork layers: Gzzgz/master_thesis_code's BBTXTBB / BB3TXTBB deploy decoders (bbtxt_bb_layer.cpp,
bb3txt_bb_layer.cpp), Lucas2012/simplified-SIM-structure-inference-machine's EliwiseProduct
(eliwise_product_layer.cpp, strategy 2: one scalar weight) and PKU-ICST-MIPL/CCL_TMM2018's FuseInnerProduct
(fuse_inner_product_layer.cu: two tops, each the inner product).  References written from those forwards,
compared in torch, onnxruntime and the generated model.py."""
import numpy as np
import pytest
from conftest import REPO, assert_close, check_everywhere, inspect_corpus_file, net, node_of, onnx_outputs, rng

from caffeq.io.schema import caffe_pb2
from caffeq.layers import LayerError
from caffeq.model import load_from_text

f32 = np.float32
CORPUS = REPO / "tests" / "fixtures" / "realworld"


def box_decode_ref(x, ideal, down, x_channels, coded, keep):
    """Forward_cpu's loops: channels 1 .. coded-1 rewritten, the rest the bottom's (in place) or zeros."""
    top = x.copy() if keep else np.zeros_like(x)
    ideal, down = f32(ideal), f32(down)
    for b in range(x.shape[0]):
        for c in range(1, coded):
            for i in range(x.shape[2]):
                for j in range(x.shape[3]):
                    k = j if c in x_channels else i
                    offset = f32(int(down * (f32(k) + f32(0.5))))
                    top[b, c, i, j] = offset + ideal * (x[b, c, i, j] - f32(0.5))
    return top


@pytest.mark.parametrize("kind, coded, x_channels, channels", [("BBTXTBB", 5, (1, 3), 6),
                                                                ("BB3TXTBB", 8, (1, 3, 5), 9)])
@pytest.mark.parametrize("keep", [True, False])
def test_box_decoders(kind, coded, x_channels, channels, keep, tmp_path):
    top = "x" if keep else "y"
    shape = (2, channels, 5, 7)
    model = load_from_text(net(f'layer {{ name: "bb" type: "{kind}" bottom: "x" top: "{top}" '
                               f'bbtxt_bb_param {{ ideal_size: 33.333333 downsampling: 3 }} }}', inputs={"x": shape}))
    x = rng(1).uniform(-0.5, 1.5, shape).astype(f32)
    ref = box_decode_ref(x, 33.333333, 3, x_channels, coded, keep)
    if not keep:
        check_everywhere(model, {"x": x}, {top: ref}, tmp_path)
        return
    # in place: the ONNX graph names the decoded version of x after the layer ("x@bb")
    check_everywhere(model, {"x": x}, {top: ref}, tmp_path, opsets=())
    for opset in (13, None):
        got = onnx_outputs(model, {"x": x}, tmp_path, opset)
        assert list(got) == ["x@bb"]
        assert_close(got["x@bb"], ref, 0.0, 0.0, f"onnx opset {opset}")


def test_box_decoder_needs_its_fields():
    with pytest.raises(LayerError, match="needs bbtxt_bb_param.downsampling"):
        load_from_text(net('layer { name: "bb" type: "BBTXTBB" bottom: "x" top: "x" '
                           'bbtxt_bb_param { ideal_size: 33 } }', inputs={"x": (2, 5, 3, 4)}))
    with pytest.raises(LayerError, match="needs at least 8 channels, got 5"):
        load_from_text(net('layer { name: "bb" type: "BB3TXTBB" bottom: "x" top: "x" '
                           'bbtxt_bb_param { ideal_size: 33 downsampling: 2 } }', inputs={"x": (2, 5, 3, 4)}))


@pytest.mark.parametrize("axis, bias", [(1, ""), (2, "bias_term: true"), (-1, "")])
def test_eliwise_product_scales_by_one_weight(axis, bias, tmp_path):
    shape = (2, 3, 5, 4)
    model = load_from_text(net(f'layer {{ name: "w" type: "EliwiseProduct" bottom: "x" top: "y" '
                               f'eliwise_product_param {{ axis: {axis} {bias} }} }}', inputs={"x": shape}),
                           random_weights=True)
    node = node_of(model, "w")
    # the fork's bias blob is `vector<int> bias_shape(1)`: one axis of size 0
    assert [b.shape for b in node.blobs] == [(1,)] + ([(0,)] if bias else [])
    weight = f32(-1.7)
    node.blobs = [np.array([weight], f32)] + ([np.zeros(0, f32)] if bias else [])   # the bias is never added
    model.clear_cache()
    x = rng(2).standard_normal(shape).astype(f32)
    a = axis % 4
    ref = (x * weight).reshape(shape[:a] + (-1,))
    check_everywhere(model, {"x": x}, {"y": ref}, tmp_path)


def test_eliwise_product_reads_the_forks_caffemodel(tmp_path):
    # a caffemodel as the fork writes it: the scalar weight (1,) and, with bias_term, an empty (0,) bias
    text = ('layer { name: "w" type: "EliwiseProduct" bottom: "x" top: "y" '
            'eliwise_product_param { bias_term: true } }')
    params = caffe_pb2.NetParameter()
    layer = params.layer.add(name="w", type="EliwiseProduct")
    layer.blobs.add(data=[2.5]).shape.dim.append(1)
    layer.blobs.add().shape.dim.append(0)
    weights = tmp_path / "w.caffemodel"
    weights.write_bytes(params.SerializeToString())
    model = load_from_text(net(text, inputs={"x": (2, 3, 5)}), weights=str(weights))
    x = rng(4).standard_normal((2, 3, 5)).astype(f32)
    check_everywhere(model, {"x": x}, {"y": (x * f32(2.5)).reshape(2, 15)}, tmp_path)


def test_fuse_inner_product_gives_the_product_twice(tmp_path):
    shape = (2, 3, 5, 3)
    model = load_from_text(net('layer { name: "f" type: "FuseInnerProduct" bottom: "x" top: "a" top: "b" '
                               'inner_product_param { num_output: 7 } }', inputs={"x": shape}), random_weights=True)
    r = rng(3)
    w = r.standard_normal((7, 45)).astype(f32)
    b = r.standard_normal(7).astype(f32)
    node_of(model, "f").blobs = [w, b]
    model.clear_cache()
    x = r.standard_normal(shape).astype(f32)
    ref = (x.reshape(2, -1).astype(np.float64) @ w.T.astype(np.float64) + b).astype(f32)
    check_everywhere(model, {"x": x}, {"a": ref, "b": ref}, tmp_path, atol=1e-5)


def test_fuse_inner_product_needs_two_tops():
    with pytest.raises(LayerError, match="FuseInnerProduct takes one bottom and 2 tops, got 1 and 1"):
        load_from_text(net('layer { name: "f" type: "FuseInnerProduct" bottom: "x" top: "a" '
                           'inner_product_param { num_output: 7 } }', inputs={"x": (2, 3)}))


@pytest.mark.parametrize("name, args, needle", [
    ("Gzzgz__master_thesis_code__caffe__models__macc__macc_0.3_r2_x2_to_x16_s2_deploy.prototxt", (),
     "BBTXTBB      acc_x16 -> acc_x16        1x5x8x16"),
    ("Gzzgz__master_thesis_code__caffe__models__macc3d__macc3d_0.3_r2_x2_to_x16_s2_deploy.prototxt", (),
     "BB3TXTBB     acc_x16 -> acc_x16        1x8x8x16"),
    ("Lucas2012__simplified-SIM-structure-inference-machine__experiments__prototxts__old_exp__test_print_4.prototxt",
     ("--input-shape", "data_action=70,3,227,227", "--input-shape", "data_frame=5,3,227,227"),
     "EliwiseProduct  fc8_CAD_action -> fc8_CAD_prob_weighted   70x7"),
    ("Lucas2012__simplified-SIM-structure-inference-machine__experiments__prototxts__old_exp__try_2_ensemble"
     ".prototxt", ("--input-shape", "data_action=70,3,227,227", "--input-shape", "data_frame=5,3,227,227"),
     "EliwiseProduct  fc8_CAD_frame_prob -> fc8_CAD_frame_prob_weighted  5x5"),
] + [(f"PKU-ICST-MIPL__CCL_TMM2018__caffe-master__examples__CCL__CCL_trip_{s}.prototxt",
      ("--input-shape", "img_data=80,4096,1,1", "--input-shape", "txt_data=80,3000,1,1"),
      "FuseInnerProduct  feat_prob_img -> inter1_img,intra1_img  80x1024; 80x1024") for s in ("test", "train", "val")])
def test_corpus_files_read(name, args, needle):
    assert needle in inspect_corpus_file(CORPUS / name, *args)
