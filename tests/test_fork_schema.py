"""Fork schema: layer text from real fork models parses and reads back.

Each snippet is taken from a public model file of that fork (named above it),
trimmed to the layer(s) that use the fork's fields. proto/README.md cites the
fork's caffe.proto for every field.
"""
import pytest

from caffeq.io.prototxt import parse_prototxt_text
from caffeq.io.schema import caffe_pb2


def _layers(text):
    net = parse_prototxt_text(text)
    return {lp.name: lp for lp in net.layer}


# TimoSaemann/ENet prototxts/enet_deploy.prototxt (SegNet/ENet BNParameter).
ENET_BN = """
layer {
  name: "bn0_1"
  type: "BN"
  bottom: "conv0_1"
  top: "conv0_1"
  param { lr_mult: 1 decay_mult: 1 }
  param { lr_mult: 1 decay_mult: 0 }
  bn_param {
    scale_filler {
      type: "constant"
      value: 1
    }
    shift_filler {
      type: "constant"
      value: 0.001
    }
    bn_mode: INFERENCE
  }
}
"""

# hszhao/PSPNet evaluation/prototxt/pspnet50_ADE20K_473.prototxt (PSPNet BNParameter).
PSPNET_BN = """
layer {
  name: "conv1_1_3x3_s2/bn"
  type: "BN"
  bottom: "conv1_1_3x3_s2"
  top: "conv1_1_3x3_s2"
  bn_param {
    slope_filler {
      type: "constant"
      value: 1
    }
    bias_filler {
      type: "constant"
      value: 0
    }
    frozen: true
    momentum: 0.95
  }
}
"""


def test_bn_param_segnet_and_pspnet_variants():
    enet = _layers(ENET_BN)["bn0_1"].bn_param
    assert enet.bn_mode == caffe_pb2.BNParameter.INFERENCE
    assert enet.scale_filler.value == 1
    assert enet.shift_filler.value == pytest.approx(0.001)
    psp = _layers(PSPNET_BN)["conv1_1_3x3_s2/bn"].bn_param
    assert psp.frozen is True
    assert psp.momentum == pytest.approx(0.95)
    assert psp.slope_filler.type == "constant" and psp.bias_filler.value == 0
    # Unset fields keep each fork's defaults.
    assert psp.bn_mode == caffe_pb2.BNParameter.LEARN
    assert psp.eps == pytest.approx(1e-5)
    assert enet.momentum == pytest.approx(0.9)


# alexgkendall/SegNet-Tutorial Example_Models (Bayesian SegNet dropout, Upsample).
SEGNET = """
layer {
  name: "encdrop3"
  type: "Dropout"
  bottom: "pool3"
  top: "pool3"
  dropout_param {
    dropout_ratio: 0.5
    sample_weights_test: true
  }
}
layer {
  name: "upsample4"
  type: "Upsample"
  bottom: "pool4"
  bottom: "pool4_mask"
  top: "upsample4"
  upsample_param {
    scale: 2
    pad_out_h: true
  }
}
"""


def test_segnet_dropout_and_upsample():
    layers = _layers(SEGNET)
    assert layers["encdrop3"].dropout_param.sample_weights_test is True
    assert layers["encdrop3"].dropout_param.scale_train is True  # default
    up = layers["upsample4"].upsample_param
    assert (up.scale, up.pad_out_h, up.pad_out_w) == (2, True, False)


# shicai/DenseNet-Caffe DenseNet_121.prototxt (ceil_mode), py-R-FCN ZF test (scale_train).
CEIL_AND_SCALE_TRAIN = """
layer {
  name: "pool1"
  type: "Pooling"
  bottom: "conv1/bn"
  top: "pool1"
  pooling_param {
    pool: MAX
    kernel_size: 3
    stride: 2
    pad: 1
    ceil_mode: false
  }
}
layer {
  name: "drop6"
  type: "Dropout"
  bottom: "fc6"
  top: "fc6"
  dropout_param {
    dropout_ratio: 0.5
    scale_train: false
  }
}
"""


def test_ceil_mode_and_scale_train():
    layers = _layers(CEIL_AND_SCALE_TRAIN)
    pool = layers["pool1"].pooling_param
    assert pool.HasField("ceil_mode") and pool.ceil_mode is False
    assert not pool.HasField("round_mode")
    assert caffe_pb2.PoolingParameter().ceil_mode is True
    # ceil_mode does not take BVLC's round_mode number.
    fields = caffe_pb2.PoolingParameter.DESCRIPTOR.fields_by_name
    assert fields["round_mode"].number == 13 and fields["ceil_mode"].number != 13
    assert layers["drop6"].dropout_param.scale_train is False


# chuanqi305/MobileNet-SSD voc/MobileNetSSD_train.prototxt (SSD data + loss).
SSD_TRAIN = """
layer {
  name: "data"
  type: "AnnotatedData"
  top: "data"
  top: "label"
  include {
    phase: TRAIN
  }
  transform_param {
    scale: 0.007843
    mirror: true
    mean_value: 127.5
    mean_value: 127.5
    mean_value: 127.5
    resize_param {
      prob: 1.0
      resize_mode: WARP
      height: 300
      width: 300
      interp_mode: LINEAR
      interp_mode: AREA
    }
    emit_constraint {
      emit_type: CENTER
    }
    distort_param {
      brightness_prob: 0.5
      brightness_delta: 32.0
      contrast_prob: 0.5
      contrast_lower: 0.5
      contrast_upper: 1.5
      hue_prob: 0.5
      hue_delta: 18.0
      saturation_prob: 0.5
      saturation_lower: 0.5
      saturation_upper: 1.5
      random_order_prob: 0.0
    }
    expand_param {
      prob: 0.5
      max_expand_ratio: 4.0
    }
  }
  data_param {
    source: "trainval_lmdb/"
    batch_size: 24
    backend: LMDB
  }
  annotated_data_param {
    batch_sampler {
      max_sample: 1
      max_trials: 1
    }
    batch_sampler {
      sampler {
        min_scale: 0.3
        max_scale: 1.0
        min_aspect_ratio: 0.5
        max_aspect_ratio: 2.0
      }
      sample_constraint {
        min_jaccard_overlap: 0.1
      }
      max_sample: 1
      max_trials: 50
    }
    label_map_file: "labelmap.prototxt"
  }
}
layer {
  name: "mbox_loss"
  type: "MultiBoxLoss"
  bottom: "mbox_loc"
  bottom: "mbox_conf"
  bottom: "mbox_priorbox"
  bottom: "label"
  top: "mbox_loss"
  include {
    phase: TRAIN
  }
  loss_param {
    normalization: VALID
  }
  multibox_loss_param {
    loc_loss_type: SMOOTH_L1
    conf_loss_type: SOFTMAX
    loc_weight: 1.0
    num_classes: 21
    share_location: true
    match_type: PER_PREDICTION
    overlap_threshold: 0.5
    use_prior_for_matching: true
    background_label_id: 0
    use_difficult_gt: true
    neg_pos_ratio: 3.0
    neg_overlap: 0.5
    code_type: CENTER_SIZE
    ignore_cross_boundary_bbox: false
  }
}
"""


def test_ssd_annotated_data_and_multibox_loss():
    layers = _layers(SSD_TRAIN)
    tp = layers["data"].transform_param
    assert len(tp.resize_param) == 1
    rp = tp.resize_param[0]
    assert (rp.height, rp.width, rp.resize_mode) == (300, 300, caffe_pb2.ResizeParameter.WARP)
    assert list(rp.interp_mode) == [caffe_pb2.ResizeParameter.LINEAR, caffe_pb2.ResizeParameter.AREA]
    assert tp.emit_constraint.emit_type == caffe_pb2.EmitConstraint.CENTER
    assert tp.distort_param.hue_delta == pytest.approx(18.0)
    assert tp.expand_param.max_expand_ratio == pytest.approx(4.0)
    adp = layers["data"].annotated_data_param
    assert len(adp.batch_sampler) == 2
    assert adp.batch_sampler[1].sample_constraint.min_jaccard_overlap == pytest.approx(0.1)
    assert adp.batch_sampler[1].max_trials == 50
    assert adp.label_map_file == "labelmap.prototxt"
    mb = layers["mbox_loss"].multibox_loss_param
    assert mb.num_classes == 21 and mb.code_type == caffe_pb2.PriorBoxParameter.CENTER_SIZE
    assert mb.mining_type == caffe_pb2.MultiBoxLossParameter.MAX_NEGATIVE  # default


# MhLiao/TextBoxes_plusplus models/deploy.prototxt (PriorBox + DetectionOutput fields).
TEXTBOXES = """
layer {
  name: "conv4_3_norm_mbox_priorbox"
  type: "PriorBox"
  bottom: "conv4_3_norm"
  bottom: "data"
  top: "conv4_3_norm_mbox_priorbox"
  prior_box_param {
    min_size: 30.0
    max_size: 60.0
    aspect_ratio: 2.0
    flip: false
    clip: false
    variance: 0.10000000149
    variance: 0.10000000149
    variance: 0.20000000298
    variance: 0.20000000298
    step: 8.0
    offset: 0.5
    denser_prior_boxes: true
  }
}
layer {
  name: "detection_out"
  type: "DetectionOutput"
  bottom: "mbox_loc"
  bottom: "mbox_conf_flatten"
  bottom: "mbox_priorbox"
  top: "detection_out"
  include {
    phase: TEST
  }
  detection_output_param {
    num_classes: 2
    share_location: true
    background_label_id: 0
    nms_param {
      nms_threshold: 0.449999988079
      top_k: 400
    }
    code_type: CENTER_SIZE
    keep_top_k: 200
    confidence_threshold: 0.00999999977648
    use_polygon: true
  }
}
"""


def test_textboxes_prior_box_and_detection_output():
    layers = _layers(TEXTBOXES)
    pb = layers["conv4_3_norm_mbox_priorbox"].prior_box_param
    assert pb.denser_prior_boxes is True and pb.step == pytest.approx(8.0)
    assert len(pb.offset_h) == 0  # the fork's number 14 is not confused with OpenCV's offset_h
    do = layers["detection_out"].detection_output_param
    assert do.use_polygon is True and do.keep_top_k == 200
    assert caffe_pb2.DetectionOutputParameter().use_polygon is False  # plain SSD files


# eric612/MobileNet-YOLO yolov3_lite_deploy_inference.prototxt and darknet19_deploy.prototxt.
YOLO = """
layer {
name: "reorg1"
type: "Reorg"
bottom: "scale21"
top: "reorg1"
reorg_param {
stride: 2
}
}
layer {
  name: "detection_out"
  type: "Yolov3DetectionOutput"
  bottom: "yolo/conv4"
  bottom: "yolo/conv5"
  top: "detection_out"
  include {
    phase: TEST
  }
  yolov3_detection_output_param {
    num_classes: 20
    confidence_threshold: 0.0099999998
    nms_threshold: 0.44999999
    biases: 20.0
    biases: 37.0
    biases: 49.0
    biases: 94.0
    anchors_scale: 32
    anchors_scale: 16
    mask_group_num: 2
    mask: 3
    mask: 4
    mask: 5
    mask: 0
    mask: 1
    mask: 2
  }
}
"""

# gklz1982/caffe-yolov2 examples/indoor/eval_detection_deploy_output.prototxt: YOLO v2
# output through detection_output_param with that fork's own field names.
YOLOV2_DETECTION_OUTPUT = """
layer {
  name: "detection_out"
  type: "DetectionOutput"
  bottom: "conv22"
  top: "detection_out"
  include {
	phase: TEST
  }
  detection_output_param {
    num_classes: 9
    coords: 4
    confidence_threshold: 0.60
    biases: 0.738768
    biases: 0.874946
  }
}
"""


def test_yolo_forks():
    layers = _layers(YOLO)
    assert layers["reorg1"].reorg_param.stride == 2
    assert layers["reorg1"].reorg_param.reverse is False
    y3 = layers["detection_out"].yolov3_detection_output_param
    assert y3.num_classes == 20 and y3.num_box == 3  # num_box: fork default
    assert list(y3.anchors_scale) == [32, 16]
    assert list(y3.mask) == [3, 4, 5, 0, 1, 2]
    assert y3.nms_threshold == pytest.approx(0.45)
    do = _layers(YOLOV2_DETECTION_OUTPUT)["detection_out"].detection_output_param
    assert (do.num_classes, do.coords, do.side) == (9, 4, 13)
    assert list(do.biases) == pytest.approx([0.738768, 0.874946])


# YuwenXiong/py-R-FCN models (R-FCN OHEM training, Faster R-CNN SmoothL1).
RFCN_TRAIN = """
layer {
   name: "annotator_detector"
   type: "BoxAnnotatorOHEM"
   bottom: "rois"
   bottom: "per_roi_loss"
   bottom: "labels"
   bottom: "bbox_inside_weights"
   top: "labels_ohem"
   top: "bbox_loss_weights_ohem"
   box_annotator_ohem_param {
        roi_per_img: 128
        ignore_label: -1
   }
}
layer {
   name: "loss_bbox"
   type: "SmoothL1LossOHEM"
   bottom: "bbox_pred"
   bottom: "bbox_targets"
   bottom: 'bbox_inside_weights'
   top: "loss_bbox"
   loss_weight: 1
   loss_param {
        normalization: PRE_FIXED
        pre_fixed_normalizer: 128
   }
}
layer {
  name: "rpn_loss_bbox"
  type: "SmoothL1Loss"
  bottom: "rpn_bbox_pred"
  bottom: "rpn_bbox_targets"
  top: "rpn_loss_bbox"
  loss_weight: 1
  smooth_l1_loss_param { sigma: 3.0 }
}
"""


def test_rfcn_training_params():
    layers = _layers(RFCN_TRAIN)
    assert layers["annotator_detector"].box_annotator_ohem_param.roi_per_img == 128
    lp = layers["loss_bbox"].loss_param
    assert lp.normalization == caffe_pb2.LossParameter.PRE_FIXED
    assert lp.pre_fixed_normalizer == pytest.approx(128)
    # BVLC's NONE keeps its value; PRE_FIXED does not take it.
    assert caffe_pb2.LossParameter.NONE == 3 and caffe_pb2.LossParameter.PRE_FIXED != 3
    assert layers["rpn_loss_bbox"].smooth_l1_loss_param.sigma == pytest.approx(3.0)


# senlinuc/caffe_ocr examples/ocr/inception-bn/deploy.prototxt and
# jolibrain/caffe examples/warpctc/captcha/crnn/crnn.prototxt (CRNN forks).
CRNN = """
layer {
  name: "pool5_ave_transpose"
  top: "pool5_ave_transpose"
  bottom: "pool5_ave"
  type: "Transpose"
  transpose_param {
    dim: 3
    dim: 2
    dim: 0
    dim: 1
  }
}
layer {
    name: "indicator"
    type: "ContinuationIndicator"
    bottom: "permuted_data"
    top: "indicator"
    continuation_indicator_param {
        time_step:  32
	axis: 1
    }
}
layer {
	name: "ctc_loss"
	type: "CtcLoss"
	bottom: "fc1"
	bottom: "label"
	top: "ctc_loss"
	loss_weight: 1.0
	ctc_loss_param {
		blank_label: 10
		alphabet_size: 11
    	time_step: 32
	}
}
"""


def test_crnn_forks():
    layers = _layers(CRNN)
    assert list(layers["pool5_ave_transpose"].transpose_param.dim) == [3, 2, 0, 1]
    ci = layers["indicator"].continuation_indicator_param
    assert (ci.time_step, ci.axis) == (32, 1)
    ctc = layers["ctc_loss"].ctc_loss_param
    assert (ctc.blank_label, ctc.alphabet_size, ctc.time_step) == (10, 11, 32)


# ydwen/caffe-face face_example/face_train_test.prototxt and
# wy1iu/sphereface train/code/sphereface_model.prototxt.
FACE_LOSSES = """
layer {
  name: "center_loss"
  type: "CenterLoss"
  bottom: "fc5"
  bottom: "label"
  top: "center_loss"
  param {
    lr_mult: 1
    decay_mult: 2
  }
  center_loss_param {
    num_output: 10572
    center_filler {
      type: "xavier"
    }
  }
  loss_weight: 0.008
}
layer {
  name: "fc6"
  type: "MarginInnerProduct"
  bottom: "fc5"
  bottom: "label"
  top: "fc6"
  top: "lambda"
  margin_inner_product_param {
    num_output: 10572
    type: QUADRUPLE
    weight_filler {
      type: "xavier"
    }
    base: 1000
    gamma: 0.12
    power: 1
    lambda_min: 5
    iteration: 0
  }
}
"""


def test_face_losses():
    layers = _layers(FACE_LOSSES)
    assert layers["center_loss"].center_loss_param.num_output == 10572
    assert layers["center_loss"].center_loss_param.axis == 1
    m = layers["fc6"].margin_inner_product_param
    assert m.type == caffe_pb2.MarginInnerProductParameter.QUADRUPLE
    assert (m.base, m.lambda_min) == (1000, 5)


# lltcggie/waifu2x-caffe upresnet10 model and xmojiao/deeplab_v2 (DeepLab ImageSegData).
WAIFU2X_DEEPLAB = """
layer {
  name: "/res1/crop"
  type: "CropCenter"
  bottom: "/conv_pre_relu"
  top: "/res1/crop"
  crop_center_param {
    crop_size: 0
    crop_size: 0
    crop_size: 2
    crop_size: 2
  }
}
layer {
  name: "data"
  type: "ImageSegData"
  top: "data"
  transform_param {
    mirror: false
    crop_size: 513
    mean_value: 104.008
    scale_factors: 0.75
    scale_factors: 1
  }
  image_data_param {
    root_folder: "/data"
    source: "list/test.txt"
    batch_size: 1
    label_type: NONE
  }
}
"""


def test_waifu2x_and_deeplab():
    layers = _layers(WAIFU2X_DEEPLAB)
    assert list(layers["/res1/crop"].crop_center_param.crop_size) == [0, 0, 2, 2]
    data = layers["data"]
    assert data.image_data_param.label_type == caffe_pb2.ImageDataParameter.NONE
    assert data.image_data_param.ignore_label == 255
    assert list(data.transform_param.scale_factors) == pytest.approx([0.75, 1.0])


def test_fork_fields_keep_bvlc_numbers():
    """Fork additions never take a number BVLC uses (binary files stay readable)."""
    lp = caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name
    assert lp["clip_param"].number == 148 and lp["swish_param"].number == 147
    assert lp["norm_param"].number == 149 and lp["embed_param"].number == 137
    assert lp["multibox_loss_param"].number == 201  # SSD's own number
    assert lp["proposal_param"].number != 201
    numbers = [f.number for f in caffe_pb2.LayerParameter.DESCRIPTOR.fields]
    assert len(numbers) == len(set(numbers))


def test_region_loss_switches_read_as_0_1_and_true_false():
    """RegionLossParameter's switches: MobileNet-YOLO writes `softmax: 1`, MaskYolo_Caffe
    `softmax: false` and `bias_match: true`; bool takes both, and is the same varint on the wire."""
    for text, want in (("softmax: 1 rescore: 0 bias_match: 1", (True, False, True)),
                       ("softmax: false rescore: true bias_match: true absolute: false random: 0",
                        (False, True, True))):
        net = parse_prototxt_text('layer { name: "l" type: "RegionLoss" region_loss_param { ' + text + " } }")
        p = net.layer[0].region_loss_param
        assert (p.softmax, p.rescore, p.bias_match) == want
    as_uint = caffe_pb2.RegionLossParameter()
    as_uint.ParseFromString(bytes([6 << 3, 1]))   # softmax = 1, as a uint32 writer encodes it
    assert as_uint.softmax is True


def test_opencv_ports_bn_scale_and_shift_are_initial_values():
    warnings = []
    net = parse_prototxt_text('layer { name: "bn" type: "BN" bn_param { scale: 1.0 shift: 0.001 bn_mode: INFERENCE } }',
                              warnings=warnings)
    assert net.layer[0].bn_param.bn_mode == caffe_pb2.BNParameter.INFERENCE
    assert any("'scale'" in w and "filler" in w for w in warnings)


def test_doobnet_label_files_read_from_h5():
    # GuoxiaWang/DOOBNet's train_val (and yuzhegao/ofnet's): ImageLabelmapData with h5 label files
    layers = _layers('''layer { name: "data" type: "ImageLabelmapData" top: "data" top: "label"
  image_data_param { source: "train.lst" batch_size: 1 data_type: "h5" gt_edge_sampling_threshold: 0.3 } }''')
    p = layers["data"].image_data_param
    assert (p.data_type, p.gt_edge_sampling_threshold) == ("h5", pytest.approx(0.3))
    assert caffe_pb2.ImageDataParameter().data_type == "img"


def test_caffe_jacinto_image_label_data_shapes_from_its_crop():
    # tidsp/caffe-jacinto's segmentation nets (mathmanu/caffe-jacinto-models): images and label maps
    # from two LMDBs; data (N, 3, crop, crop), label (N, 1, crop, crop), without opening either
    from caffeq.errors import CaffeqError
    from caffeq.model import load_from_text
    text = '''layer { name: "data" type: "ImageLabelData" top: "data" top: "label"
  transform_param { mirror: false crop_size: 72 mean_value: 0 }
  image_label_data_param { image_list_path: "data/val-image-lmdb" label_list_path: "data/val-label-lmdb"
                           batch_size: 4 threads: 4 backend: LMDB } }'''
    shapes = load_from_text(text).blob_shapes
    assert shapes["data"] == (4, 3, 72, 72) and shapes["label"] == (4, 1, 72, 72)
    with pytest.raises(CaffeqError, match="--input-shape data="):
        load_from_text(text.replace("crop_size: 72 ", ""))


def test_thuml_multi_label_data_shapes_its_labels():
    # thuml/TAH's train nets: two MultiLabelData image lists (batch 64, 12 labels a line) beside DummyData of
    # batch 64, concatenated; without the lists the shapes come from the batch, the crop and label_num
    from caffeq.errors import CaffeqError
    from caffeq.model import load_from_text
    text = '''layer { name: "data1" type: "MultiLabelData" top: "data" top: "label"
  transform_param { mirror: true crop_size: 227 mean_file: "missing.binaryproto" }
  multi_label_data_param { source: "missing.txt" batch_size: 64 shuffle: true label_num: 12 new_height: 256
                           new_width: 256 } }
layer { name: "dummy" type: "DummyData" top: "d" dummy_data_param { shape { dim: 64 dim: 1 } } }
layer { name: "both" type: "Concat" bottom: "label" bottom: "d" top: "both" }'''
    assert _layers(text)["data1"].multi_label_data_param.label_num == 12
    shapes = load_from_text(text).blob_shapes
    assert shapes["data"] == (64, 3, 227, 227) and shapes["label"] == (64, 12) and shapes["both"] == (64, 13)
    assert load_from_text(text.replace("crop_size: 227 ", "")).blob_shapes["data"] == (64, 3, 256, 256)
    with pytest.raises(CaffeqError, match="new_height and new_width must be set together"):
        load_from_text(text.replace("new_width: 256", ""))


def test_itlab_deeplab_prefetch_and_max_labels_read():
    # itlab-vision/ITLab-Vision-deeplab's msc_largefov test/train files set prefetch on ImageSegData;
    # both fields only tune the dataset reader, so the net's shapes come from transform_param as before
    from caffeq.model import load_from_text
    text = '''layer { name: "data" type: "ImageSegData" top: "data" top: "label"
  image_data_param { source: "missing.txt" batch_size: 1 has_label: false prefetch: 3 max_labels: 2 }
  transform_param { crop_size: 481 } include: { phase: TEST } }'''
    p = _layers(text)["data"].image_data_param
    assert (p.prefetch, p.max_labels) == (3, 2)
    assert caffe_pb2.ImageDataParameter().prefetch == 1
    assert load_from_text(text).blob_shapes["data"] == (1, 3, 481, 481)


def test_video_triplet_pair_size_only_groups_the_shuffle():
    # xiaolonw/caffe-video_triplet's ImageData: pair_size keeps pairs together when shuffling; the data
    # keeps BVLC's shape (batch_size, C, new_height, new_width)
    from caffeq.model import load_from_text
    text = '''layer { name: "data" type: "ImageData" top: "data" top: "label"
  image_data_param { source: "missing.txt" batch_size: 6 new_height: 9 new_width: 7 shuffle: true pair_size: 3 } }'''
    assert _layers(text)["data"].image_data_param.pair_size == 3
    assert load_from_text(text).blob_shapes["data"] == (6, 3, 9, 7)


def test_sophon_umodel_metadata_reads_and_the_net_stays_float():
    # sophon-ai-algo/examples nntc/bmnetu/models/mobilenet/mobilenet_deploy_int8_unique_top.prototxt (trimmed):
    # the int8 compiler's model_type, int8_scale and ReLU's following_special are metadata only
    from caffeq.model import load_from_text
    text = '''name: "MOBILENET"
model_type: BMNETC2UModel
state { phase: TEST }
int8_scale: 46.774544
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 8 dim: 8 } } }
layer { name: "relu1" type: "ReLU" bottom: "data" top: "relu1" phase: TEST relu_param { following_special: false } }'''
    net = parse_prototxt_text(text)
    assert net.model_type == caffe_pb2.BMNETC2UModel and net.int8_scale == pytest.approx(46.774544)
    assert net.layer[1].relu_param.HasField("following_special")
    model = load_from_text(text)
    assert model.blob_shapes["relu1"] == (1, 3, 8, 8) and not model.warnings


def test_lisa_caffe_video_clip_data_layer_shapes_its_four_tops():
    # olivernina/lisa-caffe-public (LRCN_model) examples/lstm_deploy/LCRN_activity_RGB_train_test.prototxt:
    # the data layer gives frame-major clips with clip markers (and loss weights), each (batch_size, 1, 1, 1)
    from caffeq.model import load_from_text
    text = '''layers { top: "data" top: "label" top: "clip_markers" top: "weights" name: "data" type: DATA
  data_param { source: "RGB_video_test_split1_leveldb" batch_size: 48 clip_length: 16 clip_mode: LSTM
    LSTM_clip: true LSTM_clip_length: 16 weight_loss: true batch_videos: 3 }
  transform_param { mirror: true flow: false crop_size: 227 mean_value: 103.939 mean_value: 116.779
    mean_value: 128.68 } }'''
    shapes = load_from_text(text).blob_shapes
    assert shapes["data"] == (48, 3, 227, 227)
    assert shapes["label"] == shapes["clip_markers"] == shapes["weights"] == (48, 1, 1, 1)
    p = parse_prototxt_text(text).layers[0].data_param
    assert (p.clip_length, p.clip_mode, p.batch_videos) == (16, caffe_pb2.DataParameter.LSTM, 3)


def test_lisa_caffe_data_layer_checks_the_videos_divide_the_batch():
    from caffeq.layers import LayerError
    from caffeq.model import load_from_text
    text = '''layer { name: "data" type: "Data" top: "data" top: "label" top: "clip_markers"
  data_param { source: "x" batch_size: 50 batch_videos: 3 } transform_param { crop_size: 8 mean_value: 1 mean_value: 2 mean_value: 3 } }'''
    with pytest.raises(LayerError, match="batch_size 50 must be divisible by batch_videos 3"):
        load_from_text(text)


def test_xilinx_ml_suite_thresholds_read_on_float_layers():
    # Xilinx/ml-suite models/caffe/vgg16/int8/vgg16_quantized_train_val.prototxt (trimmed): the xfDNN
    # quantizer's calibration thresholds ride on plain layers, which Caffe runs in float
    from caffeq.model import load_from_text
    text = '''layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 8 dim: 8 } }
  quantization_param { bw_layer_out: 8 th_layer_out: 150.845214844 } }
layer { name: "conv1_1" type: "Convolution" bottom: "data" top: "conv1_1" convolution_param { num_output: 2 kernel_size: 3 }
  quantization_param { bw_layer_in: 8 bw_layer_out: 8 bw_params: 8 th_layer_in: 150.845214844
    th_layer_out: 430.794403076 th_params: 0.55037945509 th_params: 0.20229844749 } }'''
    p = parse_prototxt_text(text).layer[1].quantization_param
    assert p.th_layer_in == pytest.approx(150.845214844) and list(p.th_params) == pytest.approx([0.5503795, 0.2022984])
    model = load_from_text(text)
    assert model.blob_shapes["conv1_1"] == (1, 2, 6, 6) and model.graph.node("conv1_1").type == "Convolution"


def test_eco_video_data_length_first_and_scnn_overlap_top():
    # mzolfaghari/ECO-efficient-video-understanding models/C3D_finetune_sport1m/train.prototxt (trimmed): TSN's
    # VideoData with ECO's length_first; zhengshou/scnn's localization net: a third top, the overlap
    from caffeq.model import load_from_text
    eco = '''layer { name: "data" type: "VideoData" top: "data" top: "label"
  video_data_param { source: "list.lst" batch_size: 7 new_width: 171 new_height: 128 new_length: 16
    num_segments: 3 modality: RGB length_first: true }
  transform_param { crop_size: 112 } }'''
    p = parse_prototxt_text(eco).layer[0].tsn_video_data_param
    assert p.length_first and p.new_length == 16
    shapes = load_from_text(eco).blob_shapes
    assert shapes["data"] == (7, 144, 112, 112) and shapes["label"] == (7, 1, 1, 1)
    scnn_v10 = '''layers { name: "data" type: VIDEO_DATA top: "data" top: "label" top: "overlap"
  image_data_param { source: "list.lst" batch_size: 3 crop_size: 112 new_height: 128 new_width: 171 new_length: 16 } }'''
    shapes = load_from_text(scnn_v10).blob_shapes
    assert shapes["data"] == (3, 3, 16, 112, 112) and shapes["overlap"] == shapes["label"] == (3, 1, 1, 1, 1)
    scnn_v11 = '''layer { name: "data" type: "VideoData" top: "data" top: "label" top: "overlap"
  video_data_param { source: "list.lst" batch_size: 4 new_length: 8 sampling_rate: 1 new_height: 128 new_width: 171
    use_image: true }
  transform_param { crop_size: 112 } }'''
    shapes = load_from_text(scnn_v11).blob_shapes
    assert shapes["data"] == (4, 3, 8, 112, 112) and shapes["label"] == shapes["overlap"] == (4,)


def test_lrcn_video_hash_clips_stack_their_frames_on_axis_0():
    # apir8181/caffe_lrcn examples/video_hash/train_val.prototxt (trimmed): clip_size frames per clip, every
    # clip's frames one after another; data, label and the clip marker
    from caffeq.errors import CaffeqError
    from caffeq.model import load_from_text
    text = '''layer { name: "data" type: "VideoData" top: "data" top: "label" top: "marker"
  transform_param { crop_size: 227 mean_value: 104 mean_value: 117 mean_value: 123 }
  video_data_param { source: "list.txt" root_folder: "/CCV/" clip_size: 16 batch_size: 3 shuffle: true
    new_height: 256 new_width: 256 } }'''
    p = parse_prototxt_text(text).layer[0].lrcn_video_data_param
    assert p.clip_size == 16 and p.root_folder == "/CCV/"
    shapes = load_from_text(text).blob_shapes
    assert shapes["data"] == (48, 3, 227, 227) and shapes["label"] == shapes["marker"] == (48,)
    shapes = load_from_text(text.replace("crop_size: 227", "")).blob_shapes
    assert shapes["data"] == (48, 3, 256, 256)
    with pytest.raises(CaffeqError, match=r"caffe_lrcn's VideoData has three tops \(data, label, marker\), got 2"):
        load_from_text(text.replace(' top: "marker"', ""))
    # clip_size has a default (8): without it, the three tops and the missing new_length tell the fork
    model = load_from_text(text.replace("clip_size: 16 ", ""))
    assert model.blob_shapes["data"] == (24, 3, 227, 227)
    assert any("read as apir8181/caffe_lrcn's (three tops, no 3-D layers" in w for w in model.warnings)


def test_casenet_multi_label_edge_maps_shape_the_label():
    # merlresearch/CASENet CASENet/sbd/config/train_Basic.prototxt (trimmed; num_label_chn raised to show it)
    from caffeq.model import load_from_text
    text = '''layer { name: "data" type: "ImageSegData" top: "data" top: "label" include { phase: TRAIN }
  transform_param { mirror: true crop_size: 352 mean_value: 104.008 mean_value: 116.669 mean_value: 122.675 }
  image_data_param { root_folder: "/data/SBD_Aug" source: "/data/SBD_Aug/train_aug.txt" batch_size: 1
    shuffle: true label_type: PIXELML num_label_chn: 2 } }'''
    p = parse_prototxt_text(text).layer[0].image_data_param
    assert p.label_type == caffe_pb2.ImageDataParameter.PIXELML and p.num_label_chn == 2
    shapes = load_from_text(text, phase="TRAIN").blob_shapes
    assert shapes["data"] == (1, 3, 352, 352) and shapes["label"] == (1, 2, 352, 352)


def test_kitti_ssd_video_source_names():
    # manutdzou/KITTI_SSD models/VGGNet/KITTI/SSD_600x150_webcam/test.prototxt (trimmed): SSD's VideoData with
    # the fork's LOCAL_SOURCE (SSD's VIDEO) and `source` for the video file
    text = '''layer { name: "data" type: "VideoData" top: "data"
  transform_param { resize_param { height: 150 width: 600 } }
  video_data_param { video_type: LOCAL_SOURCE device_id: 0 source: "/home/bsl/04050833_2639.MP4" } }'''
    p = _layers(text)["data"].video_data_param
    assert p.video_type == caffe_pb2.VideoDataParameter.VIDEO and p.source.endswith(".MP4")


def test_increg_prune_param_only_steers_the_solver():
    # MingSun-Tse/Caffe_IncReg compression_experiments/vgg16/train_val.prototxt: the pruning target of a
    # layer; the fork's forward uses the weights as loaded (pruned ones are zeros), so the blobs stay BVLC's
    from caffeq.model import load_from_text
    text = '''input: "data" input_shape { dim: 1 dim: 3 dim: 8 dim: 8 }
layer { name: "conv1_2" type: "Convolution" bottom: "data" top: "conv1_2"
  param { lr_mult: 1 decay_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
  prune_param { prune_ratio: 0.9 prune_ratio_step: 0.5372 }
  convolution_param { num_output: 4 pad: 1 kernel_size: 3 } }'''
    p = _layers(text)["conv1_2"].prune_param
    assert (round(p.prune_ratio, 4), round(p.prune_ratio_step, 4), p.IF_update_row_col) == (0.9, 0.5372, True)
    model = load_from_text(text, random_weights=True)
    assert [n.expected_param_shapes for n in model.layers if n.type == "Convolution"] == [[(4, 3, 3, 3), (4,)]]


def test_jolibrain_soft_nms_switch():
    # jolibrain/deepdetect's templates (mobilenet_v2_ssd): nms_param { soft_nms: false theta: 0.5 } is SSD's NMS;
    # soft NMS itself is refused by name
    from caffeq.layers import LayerError
    from caffeq.model import load_from_text
    text = '''input: "loc" input_shape { dim: 1 dim: 8 } input: "conf" input_shape { dim: 1 dim: 6 }
input: "prior" input_shape { dim: 1 dim: 2 dim: 8 }
layer { name: "d" type: "DetectionOutput" bottom: "loc" bottom: "conf" bottom: "prior" top: "o"
  detection_output_param { num_classes: 3 nms_param { nms_threshold: 0.45 soft_nms: false theta: 0.5 } } }'''
    assert parse_prototxt_text(text).layer[0].detection_output_param.nms_param.theta == pytest.approx(0.5)
    assert load_from_text(text).blob_shapes["o"][3] == 7
    with pytest.raises(LayerError, match="soft_nms"):
        load_from_text(text.replace("soft_nms: false", "soft_nms: true"))


def test_caffe_multilabel_mem_group_size_only_sizes_a_buffer(tmp_path):
    # bogger/caffe-multilabel's overfeat nets: conv_layer.cpp batches mem_group_size images per im2col
    # buffer; the convolution computes the same values
    import numpy as np
    from conftest import check_everywhere, conv_ref, net, node_of, rng

    from caffeq.model import load_from_text
    x = rng(3).standard_normal((3, 2, 6, 5)).astype(np.float32)
    model = load_from_text(net('layer { name: "c" type: "Convolution" bottom: "x" top: "y" convolution_param { '
                               'num_output: 4 kernel_size: 3 stride: 2 mem_group_size: 8 } }', inputs={"x": x.shape}),
                           random_weights=True)
    assert {lp.name: lp for lp in model.net.layer}["c"].convolution_param.mem_group_size == 8
    w, b = (np.asarray(v) for v in node_of(model, "c").blobs)
    check_everywhere(model, {"x": x}, {"y": conv_ref(x, w, b, (2, 2), (0, 0))}, tmp_path, atol=1e-5, rtol=1e-5)


def test_srgan_gan_phase_switches_leave_the_forward_alone(tmp_path):
    # ShenghaiRong/caffe_srgan: gen_mode / dis_mode / weight_fixed only gate the backward's weight updates
    import numpy as np
    from conftest import check_everywhere, conv_ref, net, node_of, rng

    from caffeq.model import load_from_text
    x = rng(5).standard_normal((1, 2, 5, 5)).astype(np.float32)
    model = load_from_text(net('layer { name: "c" type: "Convolution" bottom: "x" top: "c" convolution_param { '
                               'num_output: 3 kernel_size: 3 gen_mode: true weight_fixed: false } }',
                               'layer { name: "ip" type: "InnerProduct" bottom: "c" top: "y" inner_product_param { '
                               'num_output: 2 dis_mode: true } }',
                               'layer { name: "s" type: "Scale" bottom: "y" top: "z" scale_param { gen_mode: true } }',
                               inputs={"x": x.shape}), random_weights=True)
    w, b = (np.asarray(v) for v in node_of(model, "c").blobs)
    wi, bi = (np.asarray(v, np.float64) for v in node_of(model, "ip").blobs)
    s = np.asarray(node_of(model, "s").blobs[0], np.float64)
    ref = (conv_ref(x, w, b, (1, 1), (0, 0)).reshape(1, -1) @ wi.T + bi) * s
    check_everywhere(model, {"x": x}, {"z": ref}, tmp_path, atol=1e-5, rtol=1e-5)


def test_caffe_heatmap_data_fields_read_and_the_net_infers_without_its_labels():
    # George-Tech/Caffe-Heatmap: annotated_data_param's heatmap_* shape the TRAIN label maps (its numbers 4-8
    # are other forks' fields here); the deploy part is BVLC's
    from conftest import net

    from caffeq.model import load_from_text
    text = net('layer { name: "data" type: "AnnotatedData" top: "data" top: "label" include { phase: TRAIN } '
               'annotated_data_param { heatmap_c: 1 heatmap_h: 72 heatmap_w: 60 heatmap_visual: 0 heatmap_sigma: 1 } '
               'data_param { source: "train_lmdb" batch_size: 4 } }',
               'layer { name: "c" type: "Convolution" bottom: "x" top: "conv_out_f" convolution_param { num_output: 1 '
               'kernel_size: 1 } }',
               'layer { name: "loss" type: "EuclideanLoss" bottom: "conv_out_f" bottom: "label" top: "loss_E" }',
               inputs={"x": (1, 3, 8, 6)})
    model = load_from_text(text)
    p = {lp.name: lp for lp in model.net.layer}["data"].annotated_data_param
    assert (p.heatmap_c, p.heatmap_h, p.heatmap_w, p.heatmap_sigma) == (1, 72, 60, 1.0)
    assert p.yolo_data_type == 0 and p.seg_scales == 8   # the other forks' fields at 4-8 keep their defaults
    assert model.blob_shapes["conv_out_f"] == (1, 1, 8, 6)


def test_the_opencl_branchs_intel_spatial_engine_is_the_same_convolution():
    # fangpin/yolo-caffe's tiny YOLO: engine INTEL_SPATIAL (conv_layer_spatial.cpp computes Caffe's convolution)
    import numpy as np
    from conftest import net, rng

    from caffeq.model import load_from_text
    conv = 'layer {{ name: "c" type: "Convolution" bottom: "x" top: "y" convolution_param {{ num_output: 3 ' \
           'kernel_size: 3 pad: 1 {} }} }}'
    x = rng(9).standard_normal((1, 2, 5, 4)).astype(np.float32)
    spatial = load_from_text(net(conv.format("engine: INTEL_SPATIAL"), inputs={"x": x.shape}), random_weights=True)
    plain = load_from_text(net(conv.format(""), inputs={"x": x.shape}), random_weights=True)
    np.testing.assert_array_equal(spatial.run({"x": x})["y"], plain.run({"x": x})["y"])


def test_happynears_softmax_normalize_type_reads_and_the_normalize_ignores_it():
    # GuohongWu/caffe-windows src/caffe/test/normalize_layer.prototxt: happynear's SoftmaxParameter.normalize_type
    # (read by its SoftmaxWithLoss only) on a Normalize, which reads SSD's norm_param defaults
    import numpy as np
    from conftest import net, rng

    from caffeq.model import load_from_text
    x = rng(3).standard_normal((1, 4, 3, 2)).astype(np.float32)
    text = 'layer {{ name: "n" type: "Normalize" bottom: "x" top: "y" {} }}'
    model = load_from_text(net(text.format('softmax_param { normalize_type: "L2" }'), inputs={"x": x.shape}),
                           random_weights=True)
    assert model.net.layer[-1].softmax_param.normalize_type == "L2"
    plain = load_from_text(net(text.format(""), inputs={"x": x.shape}), random_weights=True)
    np.testing.assert_array_equal(model.run({"x": x})["y"], plain.run({"x": x})["y"])


def test_hli2020s_bias_channel_shared(tmp_path):
    # hli2020/caffe (MBA) train_val.prototxt: four Bias layers of one input, concatenated; its Bias adds a (C,)
    # blob per channel, or with channel_shared one value
    import numpy as np
    from conftest import check_everywhere, net, rng

    from caffeq.layers import LayerError
    from caffeq.model import load_from_text
    x = rng(4).standard_normal((2, 3, 4, 5)).astype(np.float32)
    text = net('layer { name: "b1" type: "Bias" bottom: "x" top: "b1" bias_param { filler { type: "constant" '
               'value: 1 } channel_shared: false } }',
               'layer { name: "b2" type: "Bias" bottom: "x" top: "b2" bias_param { channel_shared: true } }',
               inputs={"x": x.shape})
    model = load_from_text(text, random_weights=True, outputs=["b1", "b2"])
    blobs = {n.name: n for n in model.layers if n.name in ("b1", "b2")}
    assert blobs["b1"].blobs[0].shape == (3,) and blobs["b2"].blobs[0].shape == ()
    per_channel, shared = np.array([0.5, -1.0, 2.0], np.float32), np.array(0.25, np.float32)
    blobs["b1"].blobs[0], blobs["b2"].blobs[0] = per_channel, shared
    check_everywhere(model, {"x": x}, {"b1": x + per_channel[:, None, None], "b2": x + shared}, tmp_path)
    with pytest.raises(LayerError, match="come from different forks"):
        load_from_text(net('layer { name: "b" type: "Bias" bottom: "x" top: "b" bias_param { num_axes: 0 '
                           'channel_shared: true } }', inputs={"x": x.shape}))


def test_convolution_scaling_is_the_forks_gpu_convolution(tmp_path):
    # Jaekyumkim/ssd-caffe-test's RGB-D SSD: ConvolutionScaling on the depth image, Caffe's convolution on the GPU
    import numpy as np
    from conftest import check_everywhere, conv_ref, net, rng

    from caffeq.model import load_from_text
    x = rng(8).standard_normal((1, 1, 6, 7)).astype(np.float32)
    model = load_from_text(net('layer { name: "c" type: "ConvolutionScaling" bottom: "x" top: "y" convolution_param '
                               '{ num_output: 4 pad: 1 kernel_size: 3 } }', inputs={"x": x.shape}), random_weights=True)
    assert any("its CPU forward first rescales" in w for w in model.warnings)
    w, b = (np.asarray(v, np.float32) for v in model.layers[-1].blobs)
    check_everywhere(model, {"x": x}, {"y": conv_ref(x, w, b, (1, 1), (1, 1))}, tmp_path, atol=1e-5, rtol=1e-5)


def test_v1_gradient_scaler_param_upgrades_and_the_layer_is_the_identity(tmp_path):
    # madiken/skaffe_private_old examples/mnist_adaptation/lenet_train_test.prototxt (trimmed): a V1 layer the
    # fork's own V1 message cannot hold; its schedule shapes the backward only
    import numpy as np

    from caffeq.model import load_from_text
    text = '''input: "pool2" input_dim: 2 input_dim: 3 input_dim: 4 input_dim: 5
layers { name: "grl" type: GRADIENT_SCALER bottom: "pool2" top: "grl"
  gradient_scaler_param { lower_bound: 0.3 upper_bound: 1.0 alpha: 10.0 max_iter: 10000 } }'''
    model = load_from_text(text)
    node = next(n for n in model.layers if n.name == "grl")
    assert node.type == "GradientScaler"
    p = parse_prototxt_text(text).layers[0].gradient_scaler_param
    assert (round(p.lower_bound, 4), p.upper_bound, p.alpha, p.max_iter) == (0.3, 1.0, 10.0, 10000)
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 5)).astype(np.float32)
    np.testing.assert_array_equal(model.run({"pool2": x})["grl"], x)


def test_pmls_shared_file_system_is_read():
    # XinYao1994/pmls-caffe models/bvlc_alexnet/train_val.prototxt (trimmed): Poseidon's sharding switch
    text = '''layer { name: "data" type: "Data" top: "data" top: "label"
  data_param { source: "examples/imagenet/ilsvrc12_train_lmdb" batch_size: 256 backend: LMDB
    shared_file_system: true } }'''
    assert _layers(text)["data"].data_param.shared_file_system is True


def test_deepem3d_predict_phase_layers_compute_test_and_label_select_reads(tmp_path):
    # divelab/deepem3d inception_residual_train_prediction_1fm deploy (trimmed): a layer's phase: PREDICT is
    # TEST's forward in Xiaomi2008/caffe_nd_sense_segmentation; label_select_param only steers training
    import numpy as np

    from caffeq.model import load_from_text
    text = '''input: "data" input_shape { dim: 1 dim: 1 dim: 6 dim: 5 }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1" phase: PREDICT
  convolution_param { num_output: 2 kernel_size: 3 pad: 1 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "conv1" bottom: "conv1" top: "loss" include { phase: TRAIN }
  label_select_param { balance: true num_labels: 2 num_top_label_balance: 2 reorder_label: false
    class_prob_mapping_file: "label_class_selection.prototxt" } }'''
    assert _layers(text)["conv1"].phase == caffe_pb2.PREDICT
    assert _layers(text)["loss"].label_select_param.num_labels == 2
    model = load_from_text(text, random_weights=True)
    plain = load_from_text(text.replace(" phase: PREDICT", ""), random_weights=True)
    x = np.random.default_rng(1).standard_normal((1, 1, 6, 5)).astype(np.float32)
    np.testing.assert_array_equal(model.run({"data": x})["conv1"], plain.run({"data": x})["conv1"])


def test_network_slimming_l1_lambda_only_trains(tmp_path):
    # eezywu/Pruned-MobileNet_v2 models/1_mobilenet_v2_train.prototxt (trimmed): the L1 penalty network slimming
    # adds to the scale's gradient; the forward is BVLC's Scale
    import numpy as np

    from caffeq.model import load_from_text
    text = '''input: "x" input_shape { dim: 1 dim: 3 dim: 2 dim: 2 }
layer { name: "conv1/scale" type: "Scale" bottom: "x" top: "y"
  scale_param { filler { value: 1 } bias_term: true bias_filler { value: 0 } l1_lambda: 0.001 } }'''
    assert _layers(text)["conv1/scale"].scale_param.l1_lambda == pytest.approx(0.001)
    model = load_from_text(text, random_weights=True)
    x = np.random.default_rng(2).standard_normal((1, 3, 2, 2)).astype(np.float32)
    gamma, beta = next(n for n in model.layers if n.name == "conv1/scale").blobs
    np.testing.assert_allclose(model.run({"x": x})["y"], x * gamma.reshape(1, 3, 1, 1) + beta.reshape(1, 3, 1, 1),
                               rtol=1e-6)


def test_nnpack_engines_read_and_compute_caffes_layers():
    # fengggli/caffe models/resnet_simple/resnet_cifar_nnpack.prototxt (trimmed): engine NNPACK on the convolutions;
    # NNPACK's convolution, product and ReLU are Caffe's, its CPU max pooling sizes windows its own way (a note)
    import numpy as np

    from caffeq.model import load_from_text
    text = '''input: "x" input_shape { dim: 2 dim: 3 dim: 7 dim: 6 }
layer { name: "conv1" type: "Convolution" bottom: "x" top: "conv1"
  convolution_param { num_output: 4 bias_term: false pad: 1 kernel_size: 3 stride: 1 engine: NNPACK } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" relu_param { engine: NNPACK } }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param { pool: MAX kernel_size: 2 stride: 2 engine: NNPACK } }
layer { name: "ip" type: "InnerProduct" bottom: "pool1" top: "ip" inner_product_param { num_output: 5 engine: NNPACK }
  nnpack_convolution_param { algorithm: WINOGRAD kernel_transform_strategy: REUSE } }'''
    layers = _layers(text)
    assert layers["conv1"].convolution_param.engine == caffe_pb2.ConvolutionParameter.NNPACK
    assert layers["ip"].nnpack_convolution_param.algorithm == caffe_pb2.NNPACKConvolutionParameter.WINOGRAD
    model = load_from_text(text, random_weights=True)
    plain = load_from_text(text.replace(" engine: NNPACK", "").replace("relu_param { }", ""), random_weights=True)
    notes = [w for w in model.warnings if "NNPACK" in w]
    assert len(notes) == 1 and "'pool1'" in notes[0] and "without Caffe's last-window rule" in notes[0]
    assert not [w for w in plain.warnings if "NNPACK" in w]
    assert model.blob_shapes["pool1"] == plain.blob_shapes["pool1"] == (2, 4, 4, 3)   # Caffe's ceil and clip
    x = np.random.default_rng(3).standard_normal((2, 3, 7, 6)).astype(np.float32)
    np.testing.assert_array_equal(model.run({"x": x})["ip"], plain.run({"x": x})["ip"])
    # a biased stride-1 grouped convolution would take NNPACK's path, which ignores the group: noted
    grouped = load_from_text(text.replace("bias_term: false", "group: 2 bias_term: true"
                                          ).replace("num_output: 4 ", "num_output: 6 ").replace("dim: 3", "dim: 4"))
    assert any("'conv1'" in w and "ignores group and dilation" in w for w in grouped.warnings)


def test_caffe_server_print_net_info_is_logging_only():
    # nbadalls/caffe-server distill_deploy_lib/FaceDistill-MobileFaceNet-...-add128_deploy.prototxt (trimmed):
    # a NetParameter flag for Net::Init's log; the net reads with no word about it
    from caffeq.model import load_from_text
    text = '''name: "student/facenet_nn1_001||"
input: "data" input_dim: 1 input_dim: 3 input_dim: 112 input_dim: 96
print_net_info: false
layer { name: "student/conv1_1" type: "Convolution" bottom: "data" top: "student/conv1_1"
  convolution_param { num_output: 4 kernel_size: 3 stride: 2 } }'''
    net = parse_prototxt_text(text)
    assert net.HasField("print_net_info") and not net.print_net_info
    model = load_from_text(text, random_weights=True)
    assert model.blob_shapes["student/conv1_1"] == (1, 4, 55, 47)
    assert not [w for w in model.warnings if "print_net_info" in w]
