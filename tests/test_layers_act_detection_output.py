"""vkalogeiton/caffe (act-detector a431461)'s ACTDetectionOutput, from its GPU forward
(ACT_detection_output_layer.cu, ACT_cuboid_util.cu / .cpp): tubes decoded frame by frame against the
priors, NMS by the frames' mean Jaccard overlap, SSD's rows and keep_top_k; save_full's per-prior rows.
The reference loops as the fork does, in float32; exp differs between libraries (and CUDA's expf) by an
ulp, so the decoded coordinates compare to 1e-6, the rows' images, labels and scores exactly."""
import numpy as np
import pytest
from conftest import check_everywhere, model_py_outputs, net, onnx_outputs, rng
from ssd_reference import apply_keep_top_k, center_size_decode

from caffeq.errors import ExportError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

F = np.float32


def jaccard(a, b):
    if b[0] > a[2] or b[2] < a[0] or b[1] > a[3] or b[3] < a[1]:
        return F(0)
    iw = F(min(a[2], b[2]) - max(a[0], b[0]))
    ih = F(min(a[3], b[3]) - max(a[1], b[1]))
    inter = F(iw * ih)

    def size(x):
        return F(0) if x[2] < x[0] or x[3] < x[1] else F(F(x[2] - x[0]) * F(x[3] - x[1]))
    return F(inter / F(F(size(a) + size(b)) - inter))


def act_ref(loc, conf, prior, classes, share, length, thr, top_k, keep_top_k, conf_thr, background=0):
    n, n_priors = loc.shape[0], prior.shape[2] // 4
    n_loc = 1 if share else classes
    boxes, variances = prior[0, 0].reshape(-1, 4), prior[0, 1].reshape(-1, 4)
    offsets = loc.reshape(n, n_priors, n_loc, length, 4)
    tubes = np.array([[[[center_size_decode(boxes[p], variances[p], offsets[i, p, c, j]) for j in range(length)]
                        for p in range(n_priors)] for c in range(n_loc)] for i in range(n)], F)
    scores = conf.reshape(n, n_priors, classes)
    rows = []
    for i in range(n):
        kept = {}
        for c in range(classes):
            if c == background:
                continue
            s = scores[i, :, c]
            order = sorted([p for p in range(n_priors) if s[p] > F(conf_thr)], key=lambda p: -s[p])
            order = order[:top_k] if top_k > -1 else order
            keep = []
            for p in order:
                t = tubes[i, 0 if share else c]
                if all(F(sum_f32([jaccard(t[p, j], t[k, j]) for j in range(length)]) / F(length)) <= F(thr)
                       for k in keep):
                    keep.append(p)
            kept[c] = keep
        kept = apply_keep_top_k(kept, scores[i], keep_top_k)
        for c in sorted(kept):
            for p in kept[c]:
                rows.append([i, c, scores[i, p, c]] + list(tubes[i, 0 if share else c, p].reshape(-1)))
    if not rows:
        out = np.full((n, 3 + 4 * length), -1, F)
        out[:, 0] = np.arange(n)
        return out[None, None]
    return np.array(rows, F)[None, None]


def sum_f32(values):
    total = F(0)
    for v in values:
        total = F(total + v)
    return total


def inputs(n, n_priors, classes, n_loc, length, seed):
    g = rng(seed)
    centres = g.uniform(0.25, 0.75, (n_priors, 2))
    half = g.uniform(0.1, 0.25, (n_priors, 2))
    boxes = np.concatenate([centres - half, centres + half], 1).astype(F)
    prior = np.stack([boxes.reshape(-1), np.tile(F([0.1, 0.1, 0.2, 0.2]), n_priors)])[None].astype(F)
    loc = (g.standard_normal((n, n_priors * n_loc * 4 * length)) * 0.5).astype(F)
    z = g.standard_normal((n, n_priors, classes)).astype(F) * 2
    conf = (np.exp(z) / np.exp(z).sum(2, keepdims=True)).astype(F).reshape(n, -1)
    return loc, conf, prior


def act_net(loc, conf, prior, param, act):
    return load_from_text(net('layer { name: "d" type: "ACTDetectionOutput" bottom: "loc" bottom: "conf" '
                              f'bottom: "prior" top: "o" detection_output_param {{ {param} }} '
                              f'act_detection_output_param {{ {act} }} }}',
                              inputs={"loc": loc.shape, "conf": conf.shape, "prior": prior.shape}))


@pytest.mark.parametrize("share, keep_top_k", [(True, 200), (True, 5), (False, -1)])
def test_tubes_after_nms(share, keep_top_k, tmp_path):
    n_priors, classes, length = 12, 3, 3
    loc, conf, prior = inputs(2, n_priors, classes, 1 if share else classes, length, seed=int(share) + keep_top_k + 2)
    param = (f"num_classes: {classes} share_location: {str(share).lower()} background_label_id: 0 "
             f"nms_param {{ nms_threshold: 0.3 top_k: 8 }} code_type: CENTER_SIZE keep_top_k: {keep_top_k} "
             f"confidence_threshold: 0.2")
    model = act_net(loc, conf, prior, param, f"sequence_length: {length}")
    want = act_ref(loc, conf, prior, classes, share, length, 0.3, 8, keep_top_k, 0.2)
    assert 2 < want.shape[2] and (keep_top_k != 5 or want.shape[2] == 10)
    feeds = {"loc": loc, "conf": conf, "prior": prior}
    for got in (model.run(feeds)["o"], model_py_outputs(model, feeds, tmp_path)["o"]):
        assert got.shape == want.shape
        np.testing.assert_array_equal(got[..., :3], want[..., :3])
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    with pytest.raises(ExportError, match="mean overlap"):
        onnx_outputs(model, feeds, tmp_path, 13)


def test_nothing_above_the_threshold_gives_one_row_per_image(tmp_path):
    loc, conf, prior = inputs(2, 4, 3, 1, 2, seed=7)
    model = act_net(loc, conf, prior, "num_classes: 3 code_type: CENTER_SIZE confidence_threshold: 0.999 "
                    "nms_param { nms_threshold: 0.45 }", "sequence_length: 2")
    want = np.full((1, 1, 2, 11), -1, F)
    want[0, 0, :, 0] = [0, 1]
    np.testing.assert_array_equal(model.run({"loc": loc, "conf": conf, "prior": prior})["o"], want)


def test_save_full_rows(tmp_path):
    # the ACT FLOW5 deploy: every prior's tube and its class scores, everywhere (ONNX included)
    n_priors, classes, length = 5, 4, 2
    loc, conf, prior = inputs(2, n_priors, classes, 1, length, seed=9)
    model = act_net(loc, conf, prior, f"num_classes: {classes} code_type: CENTER_SIZE",
                    f"sequence_length: {length} save_full: true")
    boxes, variances = prior[0, 0].reshape(-1, 4), prior[0, 1].reshape(-1, 4)
    offsets = loc.reshape(2, n_priors, length, 4)
    rows = [[i] + [v for j in range(length) for v in center_size_decode(boxes[p], variances[p], offsets[i, p, j])]
            + list(conf.reshape(2, n_priors, classes)[i, p]) for i in range(2) for p in range(n_priors)]
    want = np.array(rows, F)[None, None]
    assert model.blob_shapes["o"] == want.shape
    check_everywhere(model, {"loc": loc, "conf": conf, "prior": prior}, {"o": want}, tmp_path, atol=1e-6)


@pytest.mark.parametrize("param, act, msg", [
    ("num_classes: 3 code_type: CORNER", "sequence_length: 2", "CENTER_SIZE"),
    ("num_classes: 3 code_type: CENTER_SIZE", "", "sequence_length"),
    ("num_classes: 3 code_type: CENTER_SIZE share_location: false", "sequence_length: 2 save_full: true",
     "needs share_location"),
    ("num_classes: 3 code_type: CENTER_SIZE", "sequence_length: 3", "must hold 4 priors"),
])
def test_refusals(param, act, msg):
    loc, conf, prior = inputs(1, 4, 3, 1, 2, seed=1)
    with pytest.raises(LayerError, match=msg):
        act_net(loc, conf, prior, param, act)
