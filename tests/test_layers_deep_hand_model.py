"""xingyizhou/DeepModel's DeepHandModel (caffeq/layers/deep_hand_model.py): forward kinematics against the
spec's worked examples (an independent transcription of deep_hand_model_layers.cpp) and a float64 numpy
reference written here from the fork's joint chains, in torch, onnxruntime and model.py."""
import numpy as np
import pytest
from conftest import check_everywhere, net, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

FIXED = "21\n6 7 8 9 10 11 12 13 14 19 20 21 22 23 24 25 26 27 28 29 30\n"
INIT = """0.042313 0.168748 -0.062570 0.051048 -0.345204 0.320722 0.055796 0.664386 -0.808264 -0.158652
0.317870 -0.422344 -0.097648 -0.367517 0.250647 0.117380 -0.097744 0.381956 0.023330 -0.678930
-0.442156 0.603580 -0.275470 0.792167 -0.075140 0.018048 0.785952 -0.809975 0.497464 0.489220
-1.400722 0.900472 -0.817935 -0.306642 -0.155388 0.200158 -0.353116 -0.438606 -0.332003 0.381438
0.304229 -0.248315 -0.490005 -0.281830 0.952836 -0.051108 -0.098447
"""
BONES = """0.085923 0.108540 0.084017 0.071077 0.137063 0.113072 0.141786 0.088964 0.132802 0.132348
0.121807 0.156680 0.099374 0.177123 0.166251 0.094302 0.129795 0.112639 0.164585 0.200816
0.309180 0.227411 0.202826 0.231032 0.542076 0.542249 0.412973 0.190017 0.307286 0.158311
"""
LAYER = 'layer { name: "DeepHandModel" type: "DeepHandModel" bottom: "DoF" top: "pred" }'


@pytest.fixture
def configuration(tmp_path, monkeypatch):
    folder = tmp_path / "configuration"
    folder.mkdir()
    (folder / "DofFixedId.txt").write_text(FIXED)
    (folder / "InitialParameters.txt").write_text(INIT)
    (folder / "BoneLength.txt").write_text("\n".join(" " + v for v in BONES.split()) + "\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def rot(axis, t):
    c, s = np.cos(t), np.sin(t)
    m = np.eye(4)
    if axis == "x":
        m[1:3, 1:3] = [[c, -s], [s, c]]
    elif axis == "y":                     # the fork's Ry: -sin at [0][2], +sin at [2][0]
        m[0, 0], m[0, 2], m[2, 0], m[2, 2] = c, -s, s, c
    else:
        m[0:2, 0:2] = [[c, -s], [s, c]]
    return m


def trans(axis, v):
    m = np.eye(4)
    m["xyz".index(axis), 3] = v
    return m


def hand_ref(d):
    """The joints of one DoF row: the chains of SetupTransformation, evaluated from the identity."""
    fixed = {int(v) for v in FIXED.split()[1:]}
    init = np.array(INIT.split(), float)
    bone = np.array(BONES.split(), float)
    th = np.array([init[i] if i in fixed else float(d[i]) + init[i] for i in range(47)])
    palm = trans("x", th[0]) @ trans("y", th[1]) @ trans("z", th[2])
    g = palm @ rot("z", th[5]) @ rot("x", th[3]) @ rot("y", th[4])
    m = {24: palm,
         25: g @ rot("z", th[8]) @ rot("x", th[6]) @ rot("y", th[7]) @ trans("y", -bone[24]),
         26: g @ rot("z", th[11]) @ rot("x", th[9]) @ rot("y", th[10]) @ trans("y", -bone[25]),
         27: g @ rot("z", th[14]) @ rot("x", th[12]) @ rot("y", th[13]) @ trans("y", -bone[26])}
    m[28] = m[27] @ rot("z", th[16]) @ rot("y", th[15]) @ trans("x", bone[27])
    m[29] = m[28] @ rot("z", th[17]) @ trans("x", bone[28])
    m[30] = m[29] @ rot("z", th[18]) @ trans("x", bone[29])
    for k in range(4):
        m[20 + k] = g @ rot("z", th[21 + 3 * k]) @ rot("x", th[19 + 3 * k]) @ rot("y", th[20 + 3 * k]) \
            @ trans("y", bone[20 + k])
        m[4 + 5 * k] = m[20 + k] @ rot("z", th[32 + 4 * k]) @ rot("x", th[31 + 4 * k]) @ trans("y", bone[4 + 5 * k])
        m[3 + 5 * k] = m[4 + 5 * k] @ rot("x", th[33 + 4 * k]) @ trans("y", bone[3 + 5 * k])
        m[2 + 5 * k] = m[3 + 5 * k] @ trans("y", bone[2 + 5 * k])
        m[1 + 5 * k] = m[2 + 5 * k] @ rot("x", th[34 + 4 * k]) @ trans("y", bone[1 + 5 * k])
        m[5 * k] = m[1 + 5 * k] @ trans("y", bone[5 * k])
    return np.concatenate([m[j][:3, 3] for j in range(31)])


def test_the_worked_examples(configuration):
    model = load_from_text(net(LAYER, inputs={"DoF": (3, 47)}))
    d = np.zeros((3, 47), np.float32)
    d[1, [0, 5, 33]] = [0.1, 0.5, 0.3]
    d[2, 6] = 5.0                       # a fixed DoF: the net's value is ignored
    out = model.run({"DoF": d})["pred"].reshape(3, 31, 3)
    spec = {0: (-0.241718, 0.770115, -0.278354), 5: (0.029635, 0.925903, -0.301712),
            24: (0.042313, 0.168748, -0.062570), 26: (0.030084, -0.357604, 0.067191),
            30: (0.642818, 0.230310, -0.418782)}
    for joint, xyz in spec.items():
        np.testing.assert_allclose(out[0, joint], xyz, atol=1e-6)
    moved = {24: (0.142313, 0.168748, -0.062570), 25: (0.161347, -0.366320, 0.022203),
             3: (-0.247016, 0.343754, -0.169971), 0: (-0.393514, 0.579676, -0.176019)}
    for joint, xyz in moved.items():
        np.testing.assert_allclose(out[1, joint], xyz, atol=1e-6)
    np.testing.assert_array_equal(out[2], out[0])


def test_deep_hand_model_matches_the_chains(configuration, tmp_path):
    d = (rng(8).standard_normal((4, 47)) * 0.5).astype(np.float32)
    model = load_from_text(net(LAYER, inputs={"DoF": d.shape}))
    assert model.blob_shapes["pred"] == (4, 93)
    ref = np.stack([hand_ref(row) for row in d]).astype(np.float32)
    check_everywhere(model, {"DoF": d}, {"pred": ref}, tmp_path, atol=1e-6, rtol=1e-6)


def test_without_its_configuration_it_reads_but_does_not_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = load_from_text(net(LAYER, inputs={"DoF": (1, 47)}))
    assert model.blob_shapes["pred"] == (1, 93)
    with pytest.raises(CaffeqError, match="configuration/DofFixedId.txt"):
        model.run({"DoF": np.zeros((1, 47), np.float32)})


def test_a_bottom_of_other_than_47_dofs_is_refused(configuration):
    with pytest.raises(CaffeqError, match="reads 47 DoFs per sample"):
        load_from_text(net(LAYER, inputs={"DoF": (1, 46)}))
