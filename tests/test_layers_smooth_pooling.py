"""wanglijun1989/caffe-cvpr17's SmoothPooling (caffeq/layers/smooth_pooling.py) against its Forward_cpu and
project_simplex written out here (the pivot search over index sets, in double), on asymmetric shapes, in torch,
onnxruntime and model.py; and the fork's other fields its train_val uses (ReLU upper_bound, Eltwise
cross_channel, Data multi_label)."""
import numpy as np
import pytest
from conftest import check_everywhere, net, node_of, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

F = np.float32
FLT_MIN = np.finfo(F).tiny


def project_simplex(v, mu, z, dummy_max):
    """smooth_pooling_layer.cpp's project_simplex, loop for loop: -> (w, dummy_w)."""
    v_tmp = (v / (F(mu) + FLT_MIN)).astype(F)
    max_value = v_tmp.max()
    s = ds = ro = dro = 0.0
    dummy_tmp = F(F(dummy_max) / (F(mu) + FLT_MIN))
    if dummy_tmp > 0 and dummy_tmp > max_value:
        s, ro, dummy_w = float(dummy_tmp), 1.0, 1.0
    else:
        dummy_w = 0.0
    U = list(range(len(v_tmp)))
    while len(U) > 0:
        k = len(U) - 1
        G, L, ds = [], [], 0.0
        for i in U:
            if v_tmp[i] >= v_tmp[U[k]]:
                G.append(i)
                ds += float(v_tmp[i])
            else:
                L.append(i)
        dro = float(len(G))
        if (s + ds) - (ro + dro) * float(v_tmp[U[k]]) < z:
            s, ro, U = s + ds, ro + dro, L
        else:
            U = G[:-1]
    theta = (s - z) / (ro + np.finfo(np.float64).tiny)
    w = np.maximum(v_tmp.astype(np.float64) - theta, 0).astype(F)
    if dummy_w > 0:
        dummy_w = max(float(dummy_tmp) - theta, 0.0)
    return w, F(dummy_w)


def ref_smooth_pool(x, mu_of, z, max_value, fix_smooth):
    n, c, h, w = x.shape
    top, weights = np.zeros((n, c, 1, 1), F), np.zeros_like(x)
    for i in range(n):
        for j in range(c):
            mu = max(F(mu_of(i, j)), F(0.01))
            row = x[i, j].reshape(-1)
            wt, dw = project_simplex(row, mu, z, max_value)
            norm = F(np.dot(wt, wt) + dw * dw)
            out = F(np.dot(row, wt) + F(max_value) * dw)
            if not fix_smooth:
                out = F(out - F(0.5) * mu * norm)
            top[i, j], weights[i, j] = out, wt.reshape(h, w)
    return top, weights


@pytest.mark.parametrize("max_value, fix_smooth", [(0.0, False), (2.5, False), (2.5, True)])
def test_smooth_pooling_with_a_smoothness_blob_per_channel(max_value, fix_smooth, tmp_path):
    x = rng(31).standard_normal((2, 3, 4, 5)).astype(F)
    x[1, 2] = 0.25                                   # ties everywhere: every value kept, theta in the middle
    x[0, 1, 0, 0] = 9                                # one value far above: the projection keeps it alone
    text = net(f'layer {{ name: "p" type: "SmoothPooling" bottom: "x" top: "y" top: "w" smooth_pooling_param {{ '
               f'unique_smooth: false max_value: {max_value} fix_smooth: {str(fix_smooth).lower()} z: 1.5 '
               f'smooth_filler {{ type: "constant" value: 1 }} }} }}', inputs={"x": x.shape})
    model = load_from_text(text, random_weights=True)
    mu = np.array([0.5, 0.005, 3.0], F).reshape(1, 3, 1, 1)     # 0.005 is clamped to 0.01
    node_of(model, "p").blobs = [mu]
    model.clear_cache()
    top, weights = ref_smooth_pool(x, lambda i, j: mu.reshape(-1)[j], 1.5, max_value, fix_smooth)
    if max_value == 0:                               # each channel's weights lie on the simplex of size z
        np.testing.assert_allclose(weights.reshape(6, -1).sum(axis=1), 1.5, rtol=1e-5)
    assert weights[0, 1, 0, 0] == 1.5 and (weights[0, 1].reshape(-1)[1:] == 0).all()
    check_everywhere(model, {"x": x}, {"y": top, "w": weights}, tmp_path, atol=2e-5, rtol=2e-5)


def test_smooth_pooling_with_the_smoothness_as_bottom(tmp_path):
    x = (rng(32).standard_normal((3, 2, 3, 4)) * 3).astype(F)
    mu = np.array([0.2, 1.0, 40.0], F).reshape(3, 1, 1, 1)
    text = net('layer { name: "p" type: "SmoothPooling" bottom: "x" bottom: "mu" top: "y" smooth_pooling_param { '
               'has_smooth_blobs: false } }', inputs={"x": x.shape, "mu": mu.shape})
    model = load_from_text(text)
    top, _ = ref_smooth_pool(x, lambda i, j: mu.reshape(-1)[i], 1.0, 0.0, False)
    check_everywhere(model, {"x": x, "mu": mu}, {"y": top}, tmp_path, atol=2e-5, rtol=2e-5)
    with pytest.raises(CaffeqError, match=r"bottom 1 \(the smoothness\) must be \[3, 1, 1, 1\]"):
        load_from_text(text, input_shapes={"mu": (3, 2, 1, 1)})


def test_caffe_cvpr17s_relu_bound_cross_channel_product_and_multi_label_data(tmp_path):
    x = (rng(33).standard_normal((2, 4, 3, 5)) * 20).astype(F)
    mask = rng(34).standard_normal((2, 1, 3, 5)).astype(F)
    text = net('layer { name: "r" type: "ReLU" bottom: "x" top: "r" relu_param { engine: CAFFE upper_bound: 15 '
               'negative_slope: 0.1 } }\n'
               'layer { name: "m" type: "Eltwise" bottom: "r" bottom: "mask" top: "y" eltwise_param { operation: PROD '
               'cross_channel: true } }', inputs={"x": x.shape, "mask": mask.shape})
    model = load_from_text(text, outputs=["r", "y"])
    relu = np.minimum(np.maximum(x, 0) + F(0.1) * np.minimum(x, 0), F(15))
    check_everywhere(model, {"x": x, "mask": mask}, {"r": relu, "y": relu * mask}, tmp_path, atol=1e-5, rtol=1e-6)
    with pytest.raises(CaffeqError, match=r"cross_channel multiplies bottom 0 \[2, 4, 3, 5\] by \(N, 1, H, W\)"):
        load_from_text(text, input_shapes={"mask": (2, 2, 3, 5)})
    with pytest.raises(CaffeqError, match="cross_channel needs operation PROD"):
        load_from_text(text.replace("operation: PROD", "operation: SUM"))
    data = load_from_text('layer { name: "data" type: "Data" top: "data" top: "label" transform_param { crop_size: 224 '
                          'mirror: true } data_param { source: "gone" batch_size: 32 multi_label: true label_size: 12 } '
                          'include { phase: TEST } }', input_shapes={"data": (32, 3, 224, 224)})
    assert data.blob_shapes["label"] == (32, 12, 1, 1)
    from caffeq.data.plan import data_layer, plan_data
    with pytest.raises(CaffeqError, match=r"layer 'data' \(Data\): data_param.multi_label gives each record's class "
                                          r"ids, 12 per item"):
        plan_data(data_layer(data), {}, str(tmp_path), data=str(tmp_path))
