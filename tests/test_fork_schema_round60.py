"""Fork fields and layer names met in the round-60 corpora: Intel Caffe's MKL engines and BatchNorm fields
(intel/caffe 44d5363), SkimCaffe's MKL layer names, steflee/mpi-caffe's MPI rank rules and layers,
mhauskn/caffe's V1 reshape_param, bogger/caffe-multigpu's V1 label_size, Deep3DPose's GRL switches.
Each reads as its fork's Caffe reads it and computes what the fork computes (the BVLC layer's numbers
where the fork's layer is BVLC's under another name or engine)."""
import numpy as np
import pytest
from conftest import check_everywhere, net, node_of, rng

from caffeq.errors import CaffeqError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32

CONV_RELU_POOL = ('layer {{ name: "c" type: "Convolution" bottom: "x" top: "c" convolution_param {{ num_output: 4 '
                  'kernel_size: 3 pad: 1 {conv_engine} weight_filler {{ type: "gaussian" std: 0.5 }} }} }}\n'
                  'layer {{ name: "r" type: "ReLU" bottom: "c" top: "c" relu_param {{ negative_slope: 0.1 {engine} }} }}\n'
                  'layer {{ name: "p" type: "Pooling" bottom: "c" top: "p" pooling_param {{ pool: MAX kernel_size: 3 '
                  'stride: 2 {engine} }} }}\n'
                  'layer {{ name: "n" type: "LRN" bottom: "p" top: "n" lrn_param {{ local_size: 3 {engine} }} }}\n'
                  'layer {{ name: "b" type: "BatchNorm" bottom: "n" top: "o" batch_norm_param {{ {engine} '
                  'use_weight_bias: true bias_term: true filler {{ value: 1 }} bias_filler {{ value: 0 }} }} }}')


@pytest.mark.parametrize("engine", ["MKL2017", "MKLDNN"])
def test_intel_engines_are_the_same_layers(engine, tmp_path):
    # heagoo/intel_caffe_ssd writes `engine: MKL2017` inside the layers' own parameters; the MKL code computes
    # the CAFFE engine's function.  Intel's BatchNorm fields are read; with a separate Scale (as its files
    # write) they change nothing
    shape = {"x": (2, 3, 7, 6)}
    plain = load_from_text(net(CONV_RELU_POOL.format(engine="", conv_engine=""), inputs=shape),
                           random_weights=True)
    intel = load_from_text(net(CONV_RELU_POOL.format(engine=f"engine: {engine}", conv_engine=f"engine: {engine}"),
                               inputs=shape), random_weights=True)
    x = rng(1).standard_normal(shape["x"]).astype(F)
    for name in ("c", "b"):
        node_of(intel, name).blobs = node_of(plain, name).blobs
    want = plain.run({"x": x})["o"]
    check_everywhere(intel, {"x": x}, {"o": want}, tmp_path, atol=1e-6, rtol=1e-6)   # ORT's own LRN rounding


def test_intel_engine_enums_of_concat_eltwise_and_inner_product_read():
    text = net('layer { name: "e" type: "Eltwise" bottom: "x" bottom: "x" top: "e" eltwise_param { engine: MKL2017 } }',
               'layer { name: "c" type: "Concat" bottom: "e" bottom: "x" top: "c" concat_param { engine: MKLDNN } }',
               'layer { name: "i" type: "InnerProduct" bottom: "c" top: "o" inner_product_param { num_output: 2 '
               'engine: MKLDNN } }', inputs={"x": (1, 3)})
    model = load_from_text(text)
    assert model.blob_shapes["o"] == (1, 2)


def test_intel_batch_norm_fused_relu_is_refused():
    with pytest.raises(LayerError, match="batch_norm_param.relu .*write a ReLU layer after"):
        load_from_text(net('layer { name: "b" type: "BatchNorm" bottom: "x" top: "o" batch_norm_param { relu: true } }',
                           inputs={"x": (1, 3, 2, 2)}))


MKL_NET = ('layer {{ name: "c" type: "{conv}" bottom: "x" top: "c" convolution_param {{ num_output: 4 kernel_size: 3 '
           'weight_filler {{ type: "gaussian" std: 0.5 }} bias_filler {{ type: "gaussian" std: 0.5 }} }} }}\n'
           'layer {{ name: "r" type: "{relu}" bottom: "c" top: "c" relu_param {{ negative_slope: 0.25 }} }}\n'
           'layer {{ name: "n" type: "{lrn}" bottom: "c" top: "n" lrn_param {{ local_size: 3 alpha: 0.5 }} }}\n'
           'layer {{ name: "p" type: "{pool}" bottom: "n" top: "p" pooling_param {{ pool: MAX kernel_size: 3 stride: 2 }} }}\n'
           'layer {{ name: "a" type: "{pool}" bottom: "p" top: "o" pooling_param {{ pool: AVE kernel_size: 2 }} }}')


def test_skimcaffe_mkl_layer_names_compute_bvlcs_layers(tmp_path):
    # ChanganVR/SkimCaffe's ResNet test net writes MKLReLU and MKLPooling (MAX 3x3/2 and AVE without padding)
    shape = {"x": (2, 3, 9, 8)}
    bvlc = load_from_text(net(MKL_NET.format(conv="Convolution", relu="ReLU", lrn="LRN", pool="Pooling"),
                              inputs=shape), random_weights=True)
    mkl = load_from_text(net(MKL_NET.format(conv="MKLConvolution", relu="MKLReLU", lrn="MKLLRN", pool="MKLPooling"),
                             inputs=shape))
    node_of(mkl, "c").blobs = node_of(bvlc, "c").blobs
    x = rng(2).standard_normal(shape["x"]).astype(F)
    check_everywhere(mkl, {"x": x}, {"o": bvlc.run({"x": x})["o"]}, tmp_path, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("layer, message", [
    ('type: "MKLPooling" bottom: "x" top: "o" pooling_param { pool: AVE kernel_size: 3 pad: 1 }', "excludes the padding"),
    ('type: "MKLPooling" bottom: "x" top: "o" pooling_param { pool: STOCHASTIC kernel_size: 3 }', "MAX or AVE"),
    ('type: "MKLLRN" bottom: "x" top: "o" lrn_param { local_size: 3 norm_region: WITHIN_CHANNEL }', "ACROSS_CHANNELS only"),
    ('type: "MKLConvolution" bottom: "x" top: "o" convolution_param { num_output: 2 kernel_size: 3 dilation: 2 }',
     "dilation must be 1"),
])
def test_skimcaffe_mkl_layers_refuse_what_mkl_computes_otherwise(layer, message):
    with pytest.raises(LayerError, match=message):
        load_from_text(net(f'layer {{ name: "m" {layer} }}', inputs={"x": (1, 2, 8, 8)}))


MPI_NET = ('layer {{ name: "c" type: "Convolution" bottom: "x" top: "c" convolution_param {{ num_output: 2 kernel_size: 1 '
           'weight_filler {{ type: "gaussian" std: 1 }} }} include {{ mpi_rank: {rank} }} }}\n'
           'layer {{ name: "b" type: "MPIBroadcast" bottom: "c" top: "o" mpi_param {{ root: 0 }} }}')


def test_mpi_rank_rules_keep_rank_zeros_layers_and_broadcast_is_a_copy(tmp_path):
    # steflee/mpi-caffe's cifar10 example: the convolutions run on rank 0, MPIBroadcast hands their output on
    model = load_from_text(net(MPI_NET.format(rank="0 mpi_rank: 2"), inputs={"x": (1, 3, 4, 4)}), random_weights=True)
    x = rng(3).standard_normal((1, 3, 4, 4)).astype(F)
    w = np.asarray(node_of(model, "c").blobs[0]).reshape(2, 3)
    check_everywhere(model, {"x": x}, {"o": np.einsum("oc,nchw->nohw", w, x)}, tmp_path, atol=1e-5, rtol=1e-5)
    with pytest.raises(CaffeqError, match="bottom 'c' is not produced"):   # a layer of rank 1 only: not here
        load_from_text(net(MPI_NET.format(rank="1"), inputs={"x": (1, 3, 4, 4)}))


def test_mpi_gather_is_read_not_run():
    text = net('layer { name: "g" type: "MPIGather" bottom: "x" top: "a" top: "b" top: "c" }', inputs={"x": (2, 5)})
    model = load_from_text(text)
    assert [model.blob_shapes[t] for t in "abc"] == [(2, 5)] * 3
    with pytest.raises(CaffeqError, match="3 tops are the bottoms of 3 MPI processes"):
        model.run({"x": np.zeros((2, 5), F)})
    with pytest.raises(LayerError, match="root is rank 1"):
        load_from_text(net('layer { name: "b" type: "MPIBroadcast" bottom: "x" top: "o" mpi_param { root: 1 } }',
                           inputs={"x": (2, 5)}))


def test_v1_reshape_param_of_mhauskns_fork(tmp_path):
    # DuWeiQiang/dqn's mdl.prototxt: an inner product's (N, 324) reshaped to (N, 4, 9, 9) before a deconvolution
    text = ('name: "m" input: "x" input_dim: 2 input_dim: 324 input_dim: 1 input_dim: 1\n'
            'layers { name: "reshape" type: RESHAPE bottom: "x" top: "o" reshape_param { channels: 4 height: 9 width: 9 } }')
    model = load_from_text(text)
    assert model.blob_shapes["o"] == (2, 4, 9, 9)
    x = rng(4).standard_normal((2, 324, 1, 1)).astype(F)
    check_everywhere(model, {"x": x}, {"o": x.reshape(2, 4, 9, 9)}, tmp_path)


def test_v1_label_size_of_bogger_caffe_multigpu_shapes_the_label():
    def data(kind, param):
        return (f'layers {{ name: "data" type: {kind} top: "data" top: "label" label_size: 3 {param} {{ '
                'source: "list.txt" batch_size: 10 } transform_param { crop_size: 224 multiscale: false } }')
    model = load_from_text(data("IMAGE_DATA", "image_data_param"))
    assert model.blob_shapes["label"] == (10, 3, 1, 1)
    assert model.blob_shapes["data"] == (10, 3, 224, 224)
    with pytest.raises(CaffeqError, match="label_size .* IMAGE_DATA layers only"):
        load_from_text(data("DATA", "data_param"))


def test_deep3dpose_grl_switches_only_train(tmp_path):
    text = net('layer { name: "c" type: "Convolution" bottom: "x" top: "c" convolution_param { num_output: 2 '
               'kernel_size: 1 is_grl_layer: 2 } }',
               'layer { name: "i" type: "InnerProduct" bottom: "c" top: "o" inner_product_param { num_output: 3 '
               'is_grl_layer: 1 } }', inputs={"x": (1, 2, 3, 3)})
    assert load_from_text(text).blob_shapes["o"] == (1, 3)


def test_three_top_accuracy_is_read_and_sized_not_run():
    # knub/sentence-boundary-detection-nn's TEST scorer: accuracy, recall_per_class, precision_per_class
    text = net('layer { name: "fc" type: "InnerProduct" bottom: "x" top: "fc" inner_product_param { num_output: 2 } }',
               'layer { name: "accuracy" type: "Accuracy" bottom: "fc" bottom: "label" top: "accuracy" '
               'top: "recall_per_class" top: "precision_per_class" }', inputs={"x": (4, 3), "label": (4,)})
    model = load_from_text(text, random_weights=True)
    assert [model.blob_shapes[t] for t in ("accuracy", "recall_per_class", "precision_per_class")] == [(), (2,), (2,)]
    with pytest.raises(CaffeqError, match="Accuracy with 3 tops.*not public"):
        model.run({"x": np.zeros((4, 3), F), "label": np.zeros(4, F)})


BN_SCALE = ('layer {{ name: "c" type: "Convolution" bottom: "x" top: "c" convolution_param {{ num_output: 3 '
            'kernel_size: 1 }} }}\n'
            'layer {{ name: "bn" type: "BatchNorm" bottom: "c" top: "c" batch_norm_param {{ engine: MKLDNN }} }}\n'
            'layer {{ name: "sc" type: "Scale" bottom: "c" top: "c" scale_param {{ bias_term: {bias} }} }}')


@pytest.mark.parametrize("bias", ["true", "false"])
def test_intel_caffemodels_batch_norm_holding_its_scale(bias, tmp_path):
    # intel/caffe's MKL BatchNorm takes the next Scale's gamma (and beta) when the net loads, and the caffemodel
    # it saves holds [mean, variance, factor, gamma(, beta)] and no Scale layer: read back into the Scale
    from caffeq.io.caffemodel import BlobData
    from caffeq.io.prototxt import parse_prototxt_text
    from caffeq.io.writer import write_caffemodel
    from caffeq.model import load
    text = net(BN_SCALE.format(bias=bias), inputs={"x": (2, 2, 3, 3)})
    g = rng(6)
    conv = [g.standard_normal((3, 2, 1, 1)).astype(F), g.standard_normal(3).astype(F)]
    mean, var = g.standard_normal(3).astype(F), g.uniform(0.5, 2, 3).astype(F)
    factor = np.array([2.0], F)
    gamma, beta = g.standard_normal(3).astype(F), g.standard_normal(3).astype(F)
    scale = [gamma] + ([beta] if bias == "true" else [])
    (tmp_path / "net.prototxt").write_text(text)
    write_caffemodel(parse_prototxt_text(text), {"c": [BlobData(a) for a in conv],
                                                 "bn": [BlobData(a) for a in [mean, var, factor] + scale]},
                     str(tmp_path / "intel.caffemodel"))
    model = load(str(tmp_path / "net.prototxt"), str(tmp_path / "intel.caffemodel"))
    assert any("holds the scale" in w and "Scale 'sc'" in w for w in model.warnings)
    x = g.standard_normal((2, 2, 3, 3)).astype(F)
    y = np.einsum("oc,nchw->nohw", conv[0].reshape(3, 2), x) + conv[1].reshape(1, 3, 1, 1)
    y = (y - (mean / 2).reshape(1, 3, 1, 1)) / np.sqrt((var / 2).reshape(1, 3, 1, 1) + 1e-5)
    y = y * gamma.reshape(1, 3, 1, 1) + (beta.reshape(1, 3, 1, 1) if bias == "true" else 0)
    check_everywhere(model, {"x": x}, {"c": y.astype(F)}, tmp_path, atol=1e-5, rtol=1e-5)
    # a BatchNorm with 5 blobs whose Scale has weights of its own is no merged one: the usual error
    write_caffemodel(parse_prototxt_text(text), {"c": [BlobData(a) for a in conv],
                                                 "bn": [BlobData(a) for a in [mean, var, factor] + scale],
                                                 "sc": [BlobData(a) for a in scale]}, str(tmp_path / "both.caffemodel"))
    with pytest.raises(CaffeqError, match="layer 'bn' .*the weights file has [45] blob"):
        load(str(tmp_path / "net.prototxt"), str(tmp_path / "both.caffemodel"))


def test_a_dynamic_input_dimension_is_left_to_input_shape():
    # CenterFace converted from ONNX: Input shape [1, 3, -1, -1] (Caffe refuses -1; OpenCV reads the file)
    text = ('layer { name: "input.1" type: "Input" top: "input.1" input_param { shape { dim: 1 dim: 3 dim: -1 dim: -1 } } }\n'
            'layer { name: "c" type: "Convolution" bottom: "input.1" top: "o" convolution_param { num_output: 2 '
            'kernel_size: 3 stride: 2 } }')
    with pytest.raises(CaffeqError, match=r"dynamic shape \[1, 3, -1, -1\].*--input-shape input.1="):
        load_from_text(text)
    assert load_from_text(text, input_shapes={"input.1": (1, 3, 9, 7)}).blob_shapes["o"] == (1, 2, 4, 3)
    # a dynamic batch alone reads as one item, or --batch's
    batch_only = text.replace("dim: 1 dim: 3 dim: -1 dim: -1", "dim: -1 dim: 3 dim: 9 dim: 7")
    model = load_from_text(batch_only)
    assert model.blob_shapes["o"] == (1, 2, 4, 3)
    assert any("dynamic batch (-1): read as 1" in w for w in model.warnings)
    assert load_from_text(batch_only, batch=4).blob_shapes["o"] == (4, 2, 4, 3)
    with pytest.raises(LayerError, match="negative dimension"):
        load_from_text(text.replace("dim: -1 dim: -1", "dim: -2 dim: 5"))


def test_intel_int8_calibration_fields_are_read_and_the_float_model_runs():
    # intel/caffe's int8 nets (calibrator.py's output): scales its MKL-DNN engine applies; its CAFFE engine ignores them
    text = net('layer { name: "c" type: "Convolution" bottom: "x" top: "o" convolution_param { num_output: 2 '
               'kernel_size: 1 } quantization_param { precision: DYNAMIC_FIXED_POINT bw_layer_in: 8 bw_layer_out: 8 '
               'bw_params: 8 scale_in: 64.5 scale_out: 30.1 scale_params: 120.0 scale_params: 99.5 '
               'is_negative_input: true } }', inputs={"x": (1, 3, 2, 2)}).replace(
        'kernel_size: 1 }', 'kernel_size: 1 conv_algorithm: "winograd" }')
    model = load_from_text(text)
    assert any("is_negative_input" in w and "int8 calibration scales" in w for w in model.warnings)
    assert any("conv_algorithm" in w and "the same convolution" in w for w in model.warnings)
    assert model.blob_shapes["o"] == (1, 2, 2, 2)
    with pytest.raises(LayerError, match="per_fla_fuse .* not supported"):
        load_from_text(net('layer { name: "c" type: "Concat" bottom: "x" bottom: "x" top: "o" '
                           'concat_param { axis: 1 per_fla_fuse: true } }', inputs={"x": (1, 3, 2, 2)}))


def test_yuqj1991_annotation_sampling_fields_are_read_for_training():
    text = ('layer { name: "data" type: "AnnotatedData" top: "data" top: "label" include { phase: TRAIN } '
            'transform_param { resize_param { height: 32 width: 32 resize_mode: WARP } } '
            'annotated_data_param { yoloformat: false crop_type: CROP_JITTER has_landmarks: false '
            'data_anchor_sampler { scale: 16 scale: 32 sample_constraint { min_object_coverage: 0.75 } max_sample: 1 } '
            'bbox_sampler { max_sample: 1 } } data_param { source: "lmdb" batch_size: 2 } }\n'
            'layer { name: "c" type: "Convolution" bottom: "data" top: "o" convolution_param { num_output: 2 kernel_size: 1 } }')
    model = load_from_text(text, phase="TRAIN")
    assert model.blob_shapes["o"] == (2, 2, 32, 32)
    assert any("yuqj1991/caffe_train's annotation reading and sampling" in w for w in model.warnings)
