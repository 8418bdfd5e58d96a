"""Layers keep their tensors on the blobs' device: a CUDA run emulated on the CPU (cuda_emulation.py)
finds any tensor a layer makes on the CPU and mixes with the GPU's, which PyTorch refuses on a real
GPU, so these run in every CI job, with or without one (test_cuda.py runs the real thing)."""
import numpy as np
import pytest
import torch
from cuda_emulation import DeviceTensor, EmulatedCuda, run_on_emulated_cuda
from test_realworld import REALWORLD, RUNNABLE, RUNNABLE_OUTPUTS

import caffeq


def test_the_emulation_finds_a_cpu_tensor_next_to_device_blobs():
    x = torch.zeros(2, 3).as_subclass(DeviceTensor)
    mode = EmulatedCuda()
    with mode:
        assert x.device.type == "cuda" and x.is_cuda
        fine = [x + torch.ones(3, device=x.device), x * torch.tensor(2.0), x + torch.ones(3).to(x.device),
                x + x.new_ones(3), x + torch.zeros_like(x), x[torch.tensor([1, 0])], x.cpu().numpy()]
        assert not mode.mixes and all(isinstance(t, DeviceTensor) for t in fine[:6])
        x + torch.ones(3)
        assert len(mode.mixes) == 1 and "add" in mode.mixes[0]
        x.numpy()
        torch.arange(3)[torch.tensor([0, 1]).to(x.device)]
        assert len(mode.mixes) == 3


# real nets whose layers make tensors of their own: anchors, proposals, NMS keeps, sequence markers,
# detection lists (the nets of test_realworld.RUNNABLE are checked too)
FORK_NETS = {
    "D-X-Y__caffe-faster-rcnn__models__FRCNN__zf_rpn__test.prototxt": {"data": (1, 3, 96, 128)},
    "MartinPlantinga__TomatoNet__models__tomato_db__VGG16__mask_rcnn_end2end__test.prototxt": {"data": (1, 3, 96, 128)},
    "Orpine__py-R-FCN__models__coco__ResNet-101__rfcn_alt_opt_5step_ohem__rpn_test.pt.prototxt": None,
    "Turoad__py-RFCN-priv__models__viva__ResNet-101_8_roialign__test.prototxt": {"data": (1, 3, 96, 128)},
    "afantideng__R-FCN-PSROIAlign__models__pascal_voc__1018b__test_agnostic.prototxt": None,
    "unsky__FPN__models__pascal_voc__FPN__FP_Net_end2end__test_mergercnn.prototxt": {"data": (1, 3, 128, 160)},
}
NETS = {**RUNNABLE, **FORK_NETS}


# the exact module of every net; Model.run's optimized one of the small nets and one proposal net
# (the emulation checks each op in Python: the large proposal nets take long)
def _case(name, exact):
    return pytest.param(name, exact, marks=[pytest.mark.slow] if name in FORK_NETS else [])


# e2e_face's projective SpatialTransformer reads the image at (x + 1) * (W - 1) / 2: the optimized module's
# last-bit differences in theta move its reads 64 times as far, past the comparison's tolerance
WARPS_LAST_BITS = {"mikuhatsune__e2e_face__shallow__net.prototxt"}
CASES = [_case(name, True) for name in sorted(NETS)] + [
    _case(name, False) for name in sorted(set(RUNNABLE) - WARPS_LAST_BITS)
    + ["D-X-Y__caffe-faster-rcnn__models__FRCNN__zf_rpn__test.prototxt"]]


@pytest.mark.parametrize("name, exact", CASES)
def test_real_net_keeps_every_tensor_on_the_blobs_device(name, exact):
    model = caffeq.load(REALWORLD / name, random_weights=True, input_shapes=NETS[name],
                        outputs=RUNNABLE_OUTPUTS.get(name))
    rng = np.random.default_rng(0)
    feeds = {k: rng.uniform(0, 1, size=s).astype(np.float32) for k, s in model.inputs.items()}
    if "im_info" in feeds:   # Faster R-CNN's [height, width, scale] of the image: proposals inside it
        height, width = model.inputs["data"][2:]
        feeds["im_info"] = np.array([[height, width, 1.0]], np.float32).reshape(model.inputs["im_info"])
    ref = model.run(feeds, exact=True)
    out, mixes = run_on_emulated_cuda(model, feeds, exact=exact)
    assert not mixes, "\n".join(sorted(set(mixes)))
    out = out if isinstance(out, dict) else {model.outputs[0]: out}
    assert set(out) == set(ref)
    if not exact and any(n.spec.data_dependent_shape for n in model.graph.nodes):
        return   # folded weights change the last bits, which can reorder proposals and detections
    for blob, want in ref.items():   # the same CPU arithmetic (last bits aside: kernels may differ)
        got = out[blob].as_subclass(torch.Tensor).numpy()
        scale = max(1.0, float(np.abs(want).max(initial=0.0)))
        rtol = 1e-5 if exact else 1e-4
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale / 10, err_msg=blob)


def test_statistics_shared_by_param_name_follow_the_module_to_the_device():
    """Two BatchNorm layers naming the same param blobs (as the CVPR18 saliency nets do): the second
    reads the first's statistics, registered as its own buffers too so that .to(device) moves them."""
    from conftest import net

    from caffeq.model import load_from_text
    shared = ' '.join(f'param {{ name: "bn_{i}" lr_mult: 0 }}' for i in range(3))
    model = load_from_text(net(
        f'layer {{ name: "a" type: "BatchNorm" bottom: "x" top: "a" {shared} }}',
        f'layer {{ name: "b" type: "BatchNorm" bottom: "a" top: "b" {shared} }}',
        inputs={"x": (2, 3, 4, 5)}), random_weights=True)
    x = np.random.default_rng(1).standard_normal((2, 3, 4, 5)).astype(np.float32)
    ref = model.run({"x": x}, exact=True)
    out, mixes = run_on_emulated_cuda(model, {"x": x})
    assert not mixes, mixes
    np.testing.assert_allclose(out.as_subclass(torch.Tensor).numpy(), ref["b"], rtol=1e-6, atol=1e-6)


def test_this_sessions_fork_layers_make_their_constants_on_the_blobs_device():
    """RON's DetLayer (anchors), e2e_face's SpatialTransformer types (target grids) and yuqj1991's
    Yolov3Detection (cell offsets, anchors) build tensors of their own: on the emulated GPU they must
    follow the blobs."""
    from test_layers_ron import SHAPES, ron_net
    from test_layers_spatial_transformer_e2e import THETAS, e2e_net
    from test_layers_yuqj_yolo import yolo_net

    from caffeq.model import load_from_text
    rng = np.random.default_rng(2)
    models = [load_from_text(ron_net(SHAPES)), load_from_text(yolo_net())]
    models += [load_from_text(e2e_net(kind, (2, len(THETAS[kind][0])))) for kind in ("projective", "similarity+")]
    for model in models:
        feeds = {k: rng.standard_normal(model.inputs[k]).astype(np.float32) * 0.3 for k in model.inputs}
        ref = model.run(feeds, exact=True)
        out, mixes = run_on_emulated_cuda(model, feeds)
        assert not mixes, "\n".join(sorted(set(mixes)))
        out = out if isinstance(out, dict) else {model.outputs[0]: out}
        for blob, want in ref.items():
            np.testing.assert_allclose(out[blob].as_subclass(torch.Tensor).numpy(), want, rtol=1e-5, atol=1e-5)


def test_spatial_rnn_and_attention_sums_stay_on_the_blobs_device():
    """DSC's IRNN starts its sweeps from zeros of its own, and Bi-Real-net's Threshold makes its -1: on the
    emulated GPU they must follow the blobs (TransferNet's LinearSum and FilterSum ride along)."""
    from conftest import net

    from caffeq.model import load_from_text
    text = net('layer { name: "r" type: "IRNN" bottom: "x" top: "l" top: "u" top: "r" top: "d" }',
               'layer { name: "c" type: "Concat" bottom: "l" bottom: "r" bottom: "u" bottom: "d" top: "cat" }',
               'layer { name: "e" type: "EltwiseAdv" bottom: "cat" bottom: "att" top: "ctx" '
               'eltwise_param { operation: PROD } }',
               'layer { name: "ls" type: "LinearSum" bottom: "ctx" bottom: "att1" top: "soft" }',
               'layer { name: "fs" type: "FilterSum" bottom: "ctx" bottom: "soft" top: "map" }',
               'layer { name: "t" type: "Threshold" bottom: "map" top: "sign" threshold_param { below_value: -1 } }',
               inputs={"x": (1, 2, 5, 3), "att": (1, 4, 5, 3), "att1": (1, 1, 5, 3)})
    model = load_from_text(text, random_weights=True)
    rng = np.random.default_rng(3)
    feeds = {k: rng.standard_normal(s).astype(np.float32) for k, s in model.inputs.items()}
    ref = model.run(feeds, exact=True)
    out, mixes = run_on_emulated_cuda(model, feeds)
    assert not mixes, "\n".join(sorted(set(mixes)))
    np.testing.assert_allclose(out.as_subclass(torch.Tensor).numpy(), ref["sign"], rtol=1e-6, atol=1e-6)


def test_wk910930_roi_align_pooling_samples_on_the_blobs_device():
    from test_layers_roi_align_pooling import ROIS, X_SHAPE, align_net

    from caffeq.model import load_from_text
    model = load_from_text(align_net("pooled_h: 3 pooled_w: 2 spatial_scale: 0.25 sample_num: 2"))
    feeds = {"x": np.random.default_rng(4).standard_normal(X_SHAPE).astype(np.float32), "rois": ROIS}
    ref = model.run(feeds, exact=True)
    out, mixes = run_on_emulated_cuda(model, feeds)
    assert not mixes, "\n".join(sorted(set(mixes)))
    np.testing.assert_array_equal(out.as_subclass(torch.Tensor).numpy(), ref["o"])


@pytest.mark.parametrize("layers, inputs, tops", [
    # MTCNN v2's PredictBox (coordinates, thresholds and its list), SubCNN's pyramid and heatmap
    (['layer { name: "b" type: "PredictBox" bottom: "s" bottom: "r" top: "bb" top: "list" '
      'predict_box_param { positive_thresh: 0.3 bbreg_exp: false } }'],
     {"s": (1, 2, 4, 5), "r": (1, 4, 4, 5)}, ["bb", "list"]),
    (['layer { name: "f" type: "FeatureExtrapolating" bottom: "x" top: "o" feature_extrapolating_param { '
      'scale_string: "0.5 1 2" num_scale_base: 3 num_per_octave: 2 } }',
      'layer { name: "h" type: "HeatmapGenerating" bottom: "o" top: "heat" }'],
     {"x": (3, 3, 4, 5)}, ["heat"]),
    # XNOR-Net's K window and the bilinear pooling layers
    (['layer { name: "a" type: "BinActiv" bottom: "x" top: "s" top: "k" convolution_param { num_output: 1 '
      'kernel_size: 3 pad: 1 weight_filler { type: "constant" value: 1 } bias_term: false } }',
      'layer { name: "q" type: "SignedSqrt" bottom: "k" top: "q" }',
      'layer { name: "n" type: "L2Normalize" bottom: "q" top: "n" }'],
     {"x": (2, 3, 4, 5)}, ["s", "n"]),
])
def test_round_40_layers_stay_on_the_blobs_device(layers, inputs, tops):
    from conftest import net

    from caffeq.model import load_from_text
    model = load_from_text(net(*layers, inputs=inputs), random_weights=True)
    rng = np.random.default_rng(5)
    feeds = {k: rng.uniform(0, 1, s).astype(np.float32) for k, s in model.inputs.items()}
    if "s" in feeds and "r" in feeds:   # PredictBox scores as a softmax gives them
        feeds["s"][:, 0] = 1 - feeds["s"][:, 1]
    ref = model.run(feeds, exact=True)
    out, mixes = run_on_emulated_cuda(model, feeds)
    assert not mixes, "\n".join(sorted(set(mixes)))
    got = out if isinstance(out, (tuple, list)) else [out]
    got = dict(zip(model.outputs, got)) if not isinstance(out, dict) else out
    for top in tops:
        np.testing.assert_allclose(got[top].as_subclass(torch.Tensor).numpy(), ref[top], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layers, inputs, tops", [
    # AutoDIAL's Dial (stored statistics, then the batch's), and a 4-axis-era join
    (['layer { name: "d" type: "Dial" bottom: "x" top: "y" }',
      'layer { name: "e" type: "Dial" bottom: "y" top: "z" dial_param { use_global_stats: false slice_point: 1 } }'],
     {"x": (3, 4, 2, 5)}, ["z"]),
    (['layer { name: "c" type: "Concat" bottom: "a" bottom: "b" top: "c" }',
      'layer { name: "e" type: "Eltwise" bottom: "a" bottom: "m" top: "p" eltwise_param { operation: PROD } }'],
     {"a": (2, 3), "b": (2, 4, 1, 1), "m": (2, 3, 1, 1)}, ["c", "p"]),
    # segaware's window layers (their masks)
    (['layer { name: "d" type: "Im2dist" bottom: "x" top: "d" convolution_param { kernel_size: 3 pad: 2 } '
      'im2dist_param { remove_center: true remove_bounds: true } }',
      'layer { name: "q" type: "Im2parity" bottom: "x" top: "q" convolution_param { kernel_size: 3 pad: 2 } '
      'im2parity_param { ignore_label: 255 } }'],
     {"x": (2, 3, 4, 5)}, ["d", "q"]),
])
def test_round_41_layers_stay_on_the_blobs_device(layers, inputs, tops):
    test_round_40_layers_stay_on_the_blobs_device(layers, inputs, tops)


@pytest.mark.parametrize("layers, inputs, tops", [
    # CRF-RNN's mean-field and ARL's: the lattices' index tensors, constants and lookups
    (['layer { name: "c" type: "MultiStageMeanfield" bottom: "u" bottom: "q" bottom: "i" top: "o" '
      'multi_stage_meanfield_param { num_iterations: 3 theta_alpha: 2 theta_beta: 0.3 theta_gamma: 1 } }',
      'layer { name: "a" type: "MultiStageMeanfieldAU3" bottom: "u" bottom: "q" bottom: "i" top: "a" '
      'multi_stage_meanfield_au3_param { num_iterations: 2 theta_alpha: 2 theta_beta: 0.3 theta_gamma: 1 } }'],
     {"u": (2, 3, 4, 5), "q": (2, 3, 4, 5), "i": (2, 4, 4, 5)}, ["o", "a"]),
])
def test_crf_rnn_layers_stay_on_the_blobs_device(layers, inputs, tops):
    test_round_40_layers_stay_on_the_blobs_device(layers, inputs, tops)


@pytest.mark.parametrize("layers, inputs, tops", [
    # DeepLab's DenseCRF (its region from the size bottom), the steganalysis forks' DCT and rounding
    (['layer { name: "c" type: "DenseCRF" bottom: "s" bottom: "d" bottom: "i" top: "o" dense_crf_param { '
      'max_iter: 2 pos_w: 3 pos_xy_std: 3 bi_w: 4 bi_xy_std: 5 bi_rgb_std: 0.2 } }'],
     {"s": (2, 3, 4, 5), "d": (2, 2), "i": (2, 3, 4, 5)}, ["o"]),
    (['layer { name: "b" type: "BdctToSpatial" bottom: "x" top: "s" }',
      'layer { name: "q" type: "QuantTruncAbs" bottom: "s" top: "s" quant_trunc_abs_param { threshold: 2 } }',
      'layer { name: "w" type: "SpatialWta" bottom: "s" top: "w" top: "m" spatial_wta_param { kernel_size: 3 stride: 2 } }'],
     {"x": (2, 64, 2, 3)}, ["w", "m"]),
    # the MPI forks' warping and LSTM (uniform markers: every state kept)
    (['layer { name: "w" type: "Warping" bottom: "i" bottom: "f" top: "w" }',
      'layer { name: "l" type: "SLLSTM" bottom: "x" bottom: "c" top: "h" recurrent_param { num_output: 3 } }'],
     {"i": (2, 3, 4, 5), "f": (2, 2, 4, 5), "x": (3, 2, 4), "c": (3, 2)}, ["w", "h"]),
])
def test_round_44_layers_stay_on_the_blobs_device(layers, inputs, tops):
    test_round_40_layers_stay_on_the_blobs_device(layers, inputs, tops)


def test_act_tubes_stay_on_the_blobs_device():
    from test_layers_act_detection_output import act_net, inputs
    loc, conf, prior = inputs(2, 6, 3, 1, 2, seed=4)
    model = act_net(loc, conf, prior, "num_classes: 3 code_type: CENTER_SIZE nms_param { nms_threshold: 0.4 } "
                    "confidence_threshold: 0.1", "sequence_length: 2")
    feeds = {"loc": loc, "conf": conf, "prior": prior}
    ref = model.run(feeds, exact=True)
    out, mixes = run_on_emulated_cuda(model, feeds)
    assert not mixes, "\n".join(sorted(set(mixes)))
    np.testing.assert_array_equal(out.as_subclass(torch.Tensor).numpy(), ref["o"])
