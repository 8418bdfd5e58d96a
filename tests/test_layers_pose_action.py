"""zimenglan-sysu-512/pose_action_caffe's pose layers (caffeq/layers/pose_action.py).

References are numpy loops written here from the fork's C++ (resize_layer.cpp with util_img.cpp's
BiLinearResizeMat_cpu, coords_from_heat_map_layer.cpp, rescaled_pose_coords_layer.cpp,
coords_to_bboxes_masks_layer.cpp) on shapes whose N, C, H and W all differ.  The FLIC "ddk" deploy
and train_val files of the fork are in tests/fixtures/realworld/.
"""
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_close, check_everywhere, model_py_outputs, onnx_outputs, rng

import caffeq
from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

REALWORLD = Path(__file__).parent / "fixtures" / "realworld"
DEPLOY = REALWORLD / "zimenglan-sysu-512__pose_action_caffe__models__Pose__FLIC__ddk__lecun-8x-2b-sd5_5-marks__deploy.prototxt"
TRAIN_VAL = REALWORLD / ("zimenglan-sysu-512__pose_action_caffe__models.baks__Pose__FLIC__ddk__"
                         "lecun1-8x-2b-sd5_5-marks1__train_val.prototxt")


def net(inputs, *layers):
    head = "".join(f'input: "{k}"\ninput_shape {{ {" ".join(f"dim: {d}" for d in s)} }}\n' for k, s in inputs.items())
    return 'name: "pose"\n' + head + "\n".join(layers)


# ---- numpy references from the fork's loops ----------------------------------------------------

def ref_resize(x, oh, ow):
    n, c, h, w = x.shape
    sh, sw = np.float32(h) / np.float32(oh), np.float32(w) / np.float32(ow)
    y = np.zeros((n, c, oh, ow), np.float64)
    for i in range(oh):
        fh = np.float32(i) * sh
        h0 = int(np.floor(fh))
        fh = float(fh - h0)
        for j in range(ow):
            fw = np.float32(j) * sw
            w0 = int(np.floor(fw))
            fw = float(fw - w0)
            v = (1 - fh) * (1 - fw) * x[:, :, h0, w0]
            if w0 + 1 < w:
                v = v + (1 - fh) * fw * x[:, :, h0, w0 + 1]
            if h0 + 1 < h:
                v = v + fh * (1 - fw) * x[:, :, h0 + 1, w0]
            if w0 + 1 < w and h0 + 1 < h:
                v = v + fh * fw * x[:, :, h0 + 1, w0 + 1]
            y[:, :, i, j] = v
    return y.astype(np.float32)


def ref_coords(maps, a=1, b=0):
    n, k, h, w = maps.shape
    coords, scores = np.zeros((n, 2 * k, 1, 1), np.float32), np.zeros((n, k, 1, 1), np.float32)
    for i in range(n):
        for j in range(k):
            best, at = -np.inf, -1
            for p, s in enumerate(maps[i, j].reshape(-1)):
                if best < s:
                    best, at = s, p
            coords[i, 2 * j] = (at % w) * a + b
            coords[i, 2 * j + 1] = (at // w) * a + b
            scores[i, j] = best
    return coords, scores


def ref_rescaled(coords, aux):
    out = np.zeros_like(coords)
    for i in range(coords.shape[0]):
        _, width, height, scale, flip = aux[i].reshape(5)
        for j in range(0, coords.shape[1], 2):
            x = coords[i, j].item() / scale
            out[i, j] = -1 if x >= width else (width - 1 - x if flip else x)
            y = coords[i, j + 1].item() / scale
            out[i, j + 1] = -1 if y >= height else y
    return out


def ref_masks(coords, aux, joints, value):
    n = coords.shape[0]
    p = coords.reshape(n, -1)
    width = int(max(-1, max(aux[i, 1, 0, 0] * aux[i, 3, 0, 0] for i in range(n))))
    height = int(max(-1, max(aux[i, 2, 0, 0] * aux[i, 3, 0, 0] for i in range(n))))
    out = np.zeros((n, 1, height, width), np.float32)
    for i in range(n):
        if joints is None:
            x1 = x2 = p[i, 0]
            y1 = y2 = p[i, 1]
            for c in range(0, p.shape[1], 2):
                x1, x2 = min(x1, p[i, c]), max(x2, p[i, c])
                y1, y2 = min(y1, p[i, c + 1]), max(y2, p[i, c + 1])
        else:
            t, b = 2 * joints[0], 2 * joints[1]
            x1, y1, x2, y2 = p[i, t], p[i, t + 1], p[i, b], p[i, b + 1]
        if x1 <= 0 and y1 <= 0 and x2 <= 0 and y2 <= 0:
            continue
        if x1 >= width and y1 >= height and x2 >= width and y2 >= height:
            continue
        x1, x2 = min(x1, x2), max(x1, x2)
        y1, y2 = min(y1, y2), max(y1, y2)
        if not (0 <= x1 < width and 0 <= x2 < width and 0 <= y1 < height and 0 <= y2 < height):
            continue
        h = int(y1)
        while h <= y2:
            w = int(x1)
            while w <= x2:
                out[i, 0, h, w] = value
                w += 1
            h += 1
    return out


# ---- Resize ---------------------------------------------------------------------------------

@pytest.mark.parametrize("param, oh, ow", [("height_fac: 0.5 width_fac: 0.5", 3, 4),
                                           # xiaolonw's (and MaskYolo_Caffe's) factors, the same resize
                                           ("is_pyramid_test: true out_height_scale: 2.0 out_width_scale: 1.5", 14, 13),
                                           ("height: 11 width: 13", 11, 13),
                                           # zhjwustc/cvpr18_rnn_deblur_matcaffe's copy: type BILINEAR, resize_ratio
                                           ("is_pyramid_test: true out_height_scale: 2.0 out_width_scale: 2.0 "
                                            "type: BILINEAR", 14, 18),
                                           ("resize_ratio: 1.5", 10, 13),
                                           ("height: 4 width: 3", 4, 3)])
def test_resize_by_param_matches_the_forks_bilinear(tmp_path, param, oh, ow):
    x = rng(1).standard_normal((2, 3, 7, 9)).astype(np.float32)
    model = load_from_text(net({"x": x.shape}, f'layer {{ name: "r" type: "Resize" bottom: "x" top: "o" '
                                               f'resize_param {{ {param} }} }}'))
    assert model.graph.shape("o") == (2, 3, oh, ow)
    check_everywhere(model, {"x": x}, {"o": ref_resize(x, oh, ow)}, tmp_path, atol=2e-5, rtol=1e-5)


def test_resize_to_a_second_bottoms_size(tmp_path):
    g = rng(2)
    x = g.standard_normal((2, 3, 5, 6)).astype(np.float32)
    like = g.standard_normal((2, 4, 12, 17)).astype(np.float32)
    model = load_from_text(net({"x": x.shape, "like": like.shape},
                               'layer { name: "r" type: "Resize" bottom: "x" bottom: "like" top: "o" }'))
    check_everywhere(model, {"x": x, "like": like}, {"o": ref_resize(x, 12, 17)}, tmp_path, atol=2e-5, rtol=1e-5)


def test_xiaolonws_v1_resize_layer(tmp_path):
    """xiaolonw/caffe-3dnormal_joint_pose's V1 `type: RESIZE` with its resize_param (V1 field 25 there)."""
    x = rng(3).standard_normal((1, 3, 8, 6)).astype(np.float32)
    text = ('name: "v1"\ninput: "x"\ninput_dim: 1\ninput_dim: 3\ninput_dim: 8\ninput_dim: 6\n'
            'layers { name: "resize-data" type: RESIZE bottom: "x" top: "o" resize_param { height: 5 width: 4 } }\n')
    model = load_from_text(text)
    check_everywhere(model, {"x": x}, {"o": ref_resize(x, 5, 4)}, tmp_path, atol=2e-5, rtol=1e-5)
    with pytest.raises(CaffeqError, match="is_pyramid_test needs out_height_scale and out_width_scale"):
        load_from_text(text.replace("height: 5 width: 4", "is_pyramid_test: true out_height_scale: 2"))


def test_the_deblur_forks_nearest_resize_is_refused():
    with pytest.raises(CaffeqError, match="resize_param.type NEAREST .* is not supported"):
        load_from_text(net({"x": (1, 3, 8, 6)}, 'layer { name: "r" type: "Resize" bottom: "x" top: "o" '
                                                'resize_param { resize_ratio: 2 type: NEAREST } }'))


def test_resize_needs_exactly_one_size_source():
    with pytest.raises(CaffeqError, match="either resize_param"):
        load_from_text(net({"x": (1, 1, 4, 4), "y": (1, 1, 2, 2)},
                           'layer { name: "r" type: "Resize" bottom: "x" bottom: "y" top: "o" '
                           'resize_param { height: 2 width: 2 } }'))
    with pytest.raises(CaffeqError, match="exactly one of the two pairs"):
        load_from_text(net({"x": (1, 1, 4, 4)}, 'layer { name: "r" type: "Resize" bottom: "x" top: "o" '
                                                'resize_param { height: 2 width_fac: 0.5 } }'))


# ---- SpatialDropout -------------------------------------------------------------------------

def test_spatial_dropout_copies_at_test(tmp_path):
    x = rng(3).standard_normal((2, 3, 4, 5)).astype(np.float32)
    model = load_from_text(net({"x": x.shape}, 'layer { name: "d" type: "SpatialDropout" bottom: "x" top: "o" '
                                               'spatial_dropout_param { dropout_ratio: 0.5 } }'))
    check_everywhere(model, {"x": x}, {"o": x}, tmp_path)


def test_spatial_dropout_drops_whole_maps_in_training():
    import torch

    from caffeq.layers import get_spec
    spec = get_spec("SpatialDropout")
    x = torch.ones(4, 6, 3, 5)
    torch.manual_seed(0)
    y = spec.forward({"ratio": 0.5}, None, x, training=True)
    per_map = y.reshape(4, 6, -1)
    assert torch.all(per_map.amin(2) == per_map.amax(2))          # a whole map at once
    assert set(per_map[:, :, 0].unique().tolist()) <= {0.0, 2.0}  # kept maps scaled by 1 / (1 - 0.5)


def test_channel_dropout_copies_at_test_and_drops_whole_maps_in_training(tmp_path):
    # artiit/caffe-pose's ChannelDropout (lsp_2limb.prototxt's drop5): dropout_param, SpatialDropout's maps
    import torch
    x = rng(4).standard_normal((2, 3, 4, 5)).astype(np.float32)
    model = load_from_text(net({"x": x.shape}, 'layer { name: "d" type: "ChannelDropout" bottom: "x" top: "o" '
                                               'dropout_param { dropout_ratio: 0.25 } }'))
    check_everywhere(model, {"x": x}, {"o": x}, tmp_path)
    module = model.to_torch().train()
    torch.manual_seed(0)
    y = module(torch.ones(6, 40, 3, 5)).detach().reshape(6, 40, -1)
    assert torch.all(y.amin(2) == y.amax(2))
    assert set(y[:, :, 0].unique().tolist()) == {0.0, float(np.float32(1 / 0.75))}
    assert abs((y[:, :, 0] == 0).float().mean().item() - 0.25) < 0.08
    zero = load_from_text(net({"x": x.shape}, 'layer { name: "d" type: "ChannelDropout" bottom: "x" top: "o" '
                                              'dropout_param { dropout_ratio: 0 } }'))
    np.testing.assert_array_equal(zero.to_torch().train()(torch.from_numpy(x)).detach().numpy(), x)
    with pytest.raises(CaffeqError, match=r"dropout_param.dropout_ratio must be in \[0, 1\), got 1.0"):
        load_from_text(net({"x": x.shape}, 'layer { name: "d" type: "ChannelDropout" bottom: "x" top: "o" '
                                           'dropout_param { dropout_ratio: 1 } }'))


# ---- CoordsFromHeatMaps ---------------------------------------------------------------------

def test_coords_from_heat_maps_two_tops_with_param(tmp_path):
    maps = rng(4).standard_normal((2, 3, 5, 7)).astype(np.float32)
    maps[1, 2, 3, 1] = maps[1, 2, 0, 4] = 9.0    # a tie: the first maximum wins
    model = load_from_text(net({"m": maps.shape},
                               'layer { name: "c" type: "CoordsFromHeatMaps" bottom: "m" top: "xy" top: "s" '
                               'pose_coords_from_heat_maps_param { heat_map_a: 4 heat_map_b: -2 } }'))
    xy, s = ref_coords(maps, 4, -2)
    assert xy[1, 4, 0, 0] == 4 * 4 - 2 and xy[1, 5, 0, 0] == -2
    check_everywhere(model, {"m": maps}, {"xy": xy, "s": s}, tmp_path)


def test_coords_from_heat_maps_scale_from_a_bottom(tmp_path):
    g = rng(5)
    maps = g.standard_normal((3, 2, 4, 6)).astype(np.float32)
    ab = np.array([3.7, 1.2, 0, 0], np.float32).reshape(4, 1, 1, 1)   # truncated to 3 and 1
    model = load_from_text(net({"m": maps.shape, "ab": ab.shape},
                               'layer { name: "c" type: "CoordsFromHeatMaps" bottom: "m" bottom: "ab" top: "xy" }'))
    check_everywhere(model, {"m": maps, "ab": ab}, {"xy": ref_coords(maps, 3, 1)[0]}, tmp_path)


def ref_coords_top_k(maps, top_k, a, b):
    """coords_from_heat_map_layer.cpp (d397a23) CreateCoordsFromHeatMapFromTopK_cpu."""
    n, k, h, w = maps.shape
    coords, scores = np.zeros((n, 2 * k, 1, 1), np.float32), np.zeros((n, k, 1, 1), np.float32)
    kk = min(top_k, h * w)
    for i in range(n):
        for j in range(k):
            pairs = sorted(((float(s), p) for p, s in enumerate(maps[i, j].reshape(-1))), reverse=True)[:kk]
            sx = sum(p % w for _, p in pairs) // kk
            sy = sum(p // w for _, p in pairs) // kk
            coords[i, 2 * j], coords[i, 2 * j + 1] = sx * a + b, sy * a + b
            scores[i, j] = np.float32(sum(s for s, _ in pairs)) / kk
    return coords, scores


@pytest.mark.parametrize("top_k", [3, 500])
def test_coords_from_heat_maps_top_k(tmp_path, top_k):
    maps = rng(6).standard_normal((2, 3, 5, 7)).astype(np.float32)
    maps[0, 1, 4, 6] = maps[0, 1, 0, 0] = maps[0, 1, 2, 3] = maps[0, 1, 1, 5] = 8.0   # ties: later index first
    model = load_from_text(net({"m": maps.shape},
                               'layer { name: "c" type: "CoordsFromHeatMaps" bottom: "m" top: "xy" top: "s" '
                               f'pose_coords_from_heat_maps_param {{ heat_map_a: 4 heat_map_b: 1 top_k: {top_k} }} }}'))
    xy, s = ref_coords_top_k(maps, top_k, 4, 1)
    if top_k == 3:
        assert xy[0, 2, 0, 0] == (6 + 3 + 5) // 3 * 4 + 1   # (4, 6), (2, 3), (1, 5), not (0, 0)
    check_everywhere(model, {"m": maps}, {"xy": xy, "s": s}, tmp_path, atol=1e-5)


def test_coords_from_heat_maps_negative_top_k():
    with pytest.raises(CaffeqError, match="top_k must be >= 0"):
        load_from_text(net({"m": (1, 2, 3, 4)}, 'layer { name: "c" type: "CoordsFromHeatMaps" bottom: "m" top: "xy" '
                                                'pose_coords_from_heat_maps_param { heat_map_a: 1 heat_map_b: 0 top_k: -2 } }'))


# ---- RescaledPoseCoords ---------------------------------------------------------------------

def test_rescaled_pose_coords(tmp_path):
    g = rng(6)
    coords = g.uniform(0, 60, (3, 8, 1, 1)).astype(np.float32)
    aux = np.array([[0, 40, 30, 1.5, 0], [1, 25, 35, 0.8, 1], [2, 50, 20, 2.0, 1]], np.float32).reshape(3, 5, 1, 1)
    model = load_from_text(net({"c": coords.shape, "aux": aux.shape},
                               'layer { name: "r" type: "RescaledPoseCoords" bottom: "c" bottom: "aux" top: "o" }'))
    ref = ref_rescaled(coords, aux)
    assert (ref == -1).any() and (ref > 0).any()
    check_everywhere(model, {"c": coords, "aux": aux}, {"o": ref}, tmp_path, atol=1e-5, rtol=1e-6)


# ---- CoordsToBboxesMasks --------------------------------------------------------------------

MASK = ('layer {{ name: "m" type: "CoordsToBboxesMasks" bottom: "c" bottom: "aux" top: "mask" '
        'coord_to_bbox_masks_param {{ top_id: {} bottom_id: {} top_id2: {} bottom_id2: {} value: 7 }} }}')


@pytest.mark.parametrize("ids, joints", [((1, 3, 1, 3), (1, 3)), ((2, 2, 2, 2), None)])
def test_coords_to_bboxes_masks(tmp_path, ids, joints):
    coords = np.array([[3.5, 2.2, 9.1, 4.9, 1.0, 7.6, 6.2, 1.4],
                       [0, 0, 0, 0, 0, 0, 0, 0],            # all zero: skipped
                       [2.0, 8.0, 14.0, 1.0, 5.5, 5.5, 3.0, 30.0]], np.float32).reshape(3, 8, 1, 1)
    aux = np.array([[0, 10, 12, 1.0, 0], [1, 20, 4, 0.5, 0], [2, 6, 5, 1.6, 0]], np.float32).reshape(3, 5, 1, 1)
    text = net({"c": coords.shape, "aux": aux.shape}, MASK.format(*ids))
    with pytest.raises(CaffeqError, match="--input-shape mask=3,1,H,W"):
        load_from_text(text)
    ref = ref_masks(coords, aux, joints, 7.0)
    assert ref.shape == (3, 1, 12, 10) and ref.any()
    model = load_from_text(text, input_shapes={"mask": ref.shape})
    feeds = {"c": coords, "aux": aux}
    assert_close(model.run(feeds)["mask"], ref, 0, 0, "torch")
    assert_close(model_py_outputs(model, feeds, tmp_path)["mask"], ref, 0, 0, "model.py")
    with pytest.raises(CaffeqError, match="aux_info's values"):
        onnx_outputs(model, feeds, tmp_path, 13)


def test_coords_to_bboxes_masks_with_two_pairs_is_read_not_run():
    text = net({"c": (2, 8, 1, 1), "aux": (2, 5, 1, 1)}, MASK.format(0, 2, 1, 3))
    model = load_from_text(text, input_shapes={"mask": (2, 1, 5, 6)})
    with pytest.raises(CaffeqError, match="at random"):
        model.run({"c": np.ones((2, 8, 1, 1), np.float32), "aux": np.ones((2, 5, 1, 1), np.float32)})


# ---- the fork's files -------------------------------------------------------------------------

def test_deploy_file_runs_end_to_end():
    with pytest.raises(CaffeqError, match="--input-shape data_masks"):
        caffeq.load(str(DEPLOY), random_weights=True)
    model = caffeq.load(str(DEPLOY), random_weights=True, input_shapes={"data_masks": (5, 1, 100, 100)})
    g = rng(7)
    aux = np.zeros((5, 5, 1, 1), np.float32)
    aux[:, 1:4, 0, 0] = [200, 200, 0.5]      # width and height * im_scale: the image's own 100 x 100
    feeds = {"data": g.standard_normal((5, 3, 100, 100)).astype(np.float32), "aux_info": aux,
             "gt_pose_coords": g.uniform(0, 99, (5, 28, 1, 1)).astype(np.float32)}
    out = model.run(feeds)
    coords = out["pred_pose_coords"]
    assert coords.shape == (5, 28, 1, 1)
    assert np.all((coords == -1) | ((coords >= 0) & (coords < 200)))


def test_train_val_file_reads():
    shapes = {"data": (8, 3, 256, 240), "data_masks": (8, 1, 256, 240), "heat_maps": (8, 14, 256, 240)}
    for phase in ("TEST", "TRAIN"):
        model = caffeq.load(str(TRAIN_VAL), random_weights=True, input_shapes=shapes, phase=phase)
        assert model.graph.shape("gt_pose_coords") == (8, 28, 1, 1)
        assert model.graph.shape("aux_info") == (8, 5, 1, 1)
    assert model.graph.shape("re_heat_maps") == (8, 14, 32, 30)
