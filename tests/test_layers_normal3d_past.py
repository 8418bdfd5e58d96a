"""rohitgirdhar-cmu-experimental/caffe-3dnormal_joint_past's surface-normal layers (caffeq/layers/normal3d_past.py).

References are numpy loops written here from the fork's C++ (98f0ab2 decode_layer.cpp, rescale_layer.cpp,
combine_layer.cpp; joint_image_data_layer.cpp and image_loc_data_layer.cpp for the data tops), on shapes whose
N, C, H and W differ.  The codebook, triangle and mean files the fork reads are written to tmp_path.
"""

import numpy as np
import pytest
from conftest import REPO, check_everywhere, inspect_corpus_file, net, rng

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text

CORPUS = REPO / "tests" / "fixtures" / "realworld"
PREFIX = "rohitgirdhar-cmu-experimental__caffe-3dnormal_joint_past__jointscript__"


# ---- numpy references from the fork's loops -----------------------------------------------------

def ref_decode(p, codebook, triangles, soft):
    """decode_layer.cpp Forward_cpu in float32: triangles hold the file's one-based ids."""
    n, c, h, w = p.shape
    out = np.zeros((n, 3, h, w), np.float32)
    for i in range(n):
        for y in range(h):
            for x in range(w):
                if soft:
                    ids = range(c)
                else:
                    maxp, maxtr = np.float32(0), 0
                    for tr, tri in enumerate(triangles):
                        pt = np.float32(0)
                        for t in tri:
                            pt = np.float32(pt + p[i, t - 1, y, x])
                        if pt > maxp:
                            maxp, maxtr = pt, tr
                    ids = [t - 1 for t in triangles[maxtr]]
                acc = np.zeros(3, np.float32)
                for k in ids:
                    acc = (acc + p[i, k, y, x] * codebook[k]).astype(np.float32)
                out[i, :, y, x] = acc
    return out


def ref_rescale(x, mean):
    flat = x.reshape(x.shape[0], -1)
    dim = flat.shape[1]
    out = np.empty_like(flat)
    for i in range(flat.size):
        a, j = divmod(i, dim)
        out[a, j] = np.float32(np.float32(flat[a, j] * np.float32(128)) + np.float32(128)) - np.float32(mean[i % dim])
    return out.reshape(x.shape)


def write_tables(folder, codebook, triangles):
    d, t = folder / "codebook.txt", folder / "triangles.txt"
    d.write_text("\n".join(" ".join(repr(float(v)) for v in row) for row in codebook) + "\n")
    t.write_text("\n".join(" ".join(str(int(v)) for v in row) for row in triangles) + "\n")
    return d, t


def decode_layer(d, t, soft=False, bottom="x", top="o"):
    extra = " usesoft: true" if soft else ""
    return (f'layer {{ name: "dec" type: "Decode" bottom: "{bottom}" top: "{top}" '
            f'decode_param {{ source_dict: "{d}" source_triids: "{t}"{extra} }} }}')


def tables(channels, g):
    codebook = g.standard_normal((channels, 3)).astype(np.float32)
    triangles = np.array([[1, 2, 3], [3, 5, 4], [6, 2, 7], [7, 1, 5], [4, 6, 2]])
    return codebook, triangles


# ---- Decode ------------------------------------------------------------------------------------------

def test_decode_picks_the_triangle_of_largest_probability(tmp_path):
    g = rng(1)
    codebook, triangles = tables(7, g)
    d, t = write_tables(tmp_path, codebook, triangles)
    p = g.uniform(0, 1, (2, 7, 5, 6)).astype(np.float32)
    p[0, :, 1, 2] = 0.25                           # every triangle ties: the first one
    p[1, :, 3, 4] = -np.arange(7, 0, -1)          # no sum above 0: triangle 0, not the largest sum
    sums = [p[1, [i - 1 for i in tri], 3, 4].sum() for tri in triangles]
    assert int(np.argmax(sums)) != 0
    model = load_from_text(net(decode_layer(d, t), inputs={"x": p.shape}))
    check_everywhere(model, {"x": p}, {"o": ref_decode(p, codebook, triangles, False)}, tmp_path)


def test_decode_soft_sums_every_codeword(tmp_path):
    g = rng(2)
    codebook, triangles = tables(7, g)
    d, t = write_tables(tmp_path, codebook, triangles)
    p = g.uniform(0, 1, (2, 7, 3, 5)).astype(np.float32)
    model = load_from_text(net(decode_layer(d, t, soft=True), inputs={"x": p.shape}))
    check_everywhere(model, {"x": p}, {"o": ref_decode(p, codebook, triangles, True)}, tmp_path)


def test_decode_reads_its_tables_as_the_forks_fscanf(tmp_path):
    # the fork's loops: fscanf("%f") for the codebook, fscanf("%d") for the triangles, each the longest number
    # after white space: "0.5-0.25" is 0.5 then -0.25, "1+2+3" is 1, 2, 3 (split() and float() read neither)
    g = rng(5)
    codebook, triangles = tables(7, g)
    d, t = tmp_path / "codebook.txt", tmp_path / "triangles.txt"
    d.write_text(" ".join(repr(float(v)) for v in codebook.reshape(-1)).replace(" -", "-") + "\nend 1 2 3\n")
    t.write_text("\n".join("+".join(str(int(v)) for v in row) for row in triangles) + "\n")
    assert any("-" in w[1:] for w in d.read_text().split()) and "+" in t.read_text()
    p = g.uniform(0, 1, (2, 7, 3, 4)).astype(np.float32)
    model = load_from_text(net(decode_layer(d, t), inputs={"x": p.shape}))
    check_everywhere(model, {"x": p}, {"o": ref_decode(p, codebook, triangles, False)}, tmp_path)
    t.write_text("1.0 2 3\n")                     # %d reads 1, then fails on ".0": the reading ends
    with pytest.raises(CaffeqError, match=r"triangles.txt holds 1 integers, not rows of 3") as e:
        load_from_text(net(decode_layer(d, t), inputs={"x": p.shape}))
    assert "\n" not in str(e.value)


def test_the_forks_float_files_round_once_to_float(tmp_path):
    # fscanf("%f") is strtof: the decimal rounded once to float32, not to double and then to float
    from caffeq.layers.normal3d_past import read_numbers
    path = tmp_path / "m.txt"
    path.write_text("1.000000059604644775390625000000001 1,5 2")
    values = read_numbers(path, "%f", "decode_param.source_dict")
    assert values == [1 + 2.0 ** -23, 1.0]      # "1,5": 1 is the last number read (',' stops the loop)
    assert np.float32(float("1.000000059604644775390625000000001")) == 1.0
    path.write_text("1 2 3 4294967297")
    with pytest.raises(CaffeqError, match=r"m.txt: the integer at byte 6 is outside int's 32 bits"):
        read_numbers(path, "%d", "decode_param.source_triids")
    path.write_text("1 2 3e")
    with pytest.raises(CaffeqError, match=r"m.txt: the number at byte 4 is followed by 'e'"):
        read_numbers(path, "%f", "decode_param.source_dict")


def test_decode_without_its_files_reads_but_does_not_run(tmp_path):
    model = load_from_text(net(decode_layer(tmp_path / "none.txt", tmp_path / "none2.txt"),
                               inputs={"x": (2, 7, 3, 5)}))
    assert model.graph.tensors["o"].shape == (2, 3, 3, 5)
    with pytest.raises(CaffeqError, match=r"layer 'dec' \(Decode\): decode_param's codebook .* not found"):
        model.run({"x": np.zeros((2, 7, 3, 5), np.float32)})
    with pytest.raises(CaffeqError, match="not found"):
        model.export_onnx(str(tmp_path / "m.onnx"))


def test_decode_checks_its_tables(tmp_path):
    g = rng(3)
    codebook, triangles = tables(7, g)
    d, t = write_tables(tmp_path, codebook, triangles)
    with pytest.raises(CaffeqError, match="holds 7 codewords; the bottom has 6 channels"):
        load_from_text(net(decode_layer(d, t), inputs={"x": (1, 6, 2, 3)}))
    d2, t2 = write_tables(tmp_path, codebook, np.array([[1, 2, 8]]))
    with pytest.raises(CaffeqError, match="codeword ids run from 1 to 7, got 1 to 8"):
        load_from_text(net(decode_layer(d2, t2), inputs={"x": (1, 7, 2, 3)}))
    with pytest.raises(CaffeqError, match="needs decode_param.source_dict and source_triids"):
        load_from_text(net('layer { name: "dec" type: "Decode" bottom: "x" top: "o" }', inputs={"x": (1, 7, 2, 3)}))


# ---- Rescale and Combine --------------------------------------------------------------------------

def test_the_forks_rescale_subtracts_the_mean_file(tmp_path):
    g = rng(4)
    x = g.standard_normal((2, 3, 5, 4)).astype(np.float32)
    mean = g.uniform(0, 255, 3 * 5 * 4 + 2).astype(np.float32)     # extra numbers are not read
    path = tmp_path / "mean.txt"
    path.write_text(" ".join(repr(float(v)) for v in mean))
    model = load_from_text(net(f'layer {{ name: "s" type: "Rescale" bottom: "x" top: "o" '
                               f'decode_param {{ source_dict: "{path}" }} }}', inputs={"x": x.shape}))
    check_everywhere(model, {"x": x}, {"o": ref_rescale(x, mean)}, tmp_path)
    path.write_text("1 2 3")
    with pytest.raises(CaffeqError, match="holds 3 numbers; one sample of the bottom"):
        load_from_text(net(f'layer {{ name: "s" type: "Rescale" bottom: "x" top: "o" '
                           f'decode_param {{ source_dict: "{path}" }} }}', inputs={"x": x.shape}))


def test_combine_lays_each_samples_bottoms_one_after_another(tmp_path):
    g = rng(5)
    xs = {"a": g.standard_normal((2, 3, 5, 4)), "b": g.standard_normal((2, 1, 5, 4)),
          "c": g.standard_normal((2, 2, 5, 4))}
    xs = {k: v.astype(np.float32) for k, v in xs.items()}
    ref = np.stack([np.concatenate([xs[k][i].ravel() for k in "abc"]) for i in range(2)]).reshape(2, 6, 5, 4)
    model = load_from_text(net('layer { name: "cmb" type: "Combine" bottom: "a" bottom: "b" bottom: "c" top: "o" }',
                               inputs={k: v.shape for k, v in xs.items()}))
    check_everywhere(model, xs, {"o": ref}, tmp_path)
    with pytest.raises(CaffeqError, match="Combine's bottoms must share num, height and width"):
        load_from_text(net('layer { name: "cmb" type: "Combine" bottom: "a" bottom: "b" top: "o" }',
                           inputs={"a": (2, 3, 5, 4), "b": (2, 3, 4, 5)}))


# ---- the V1 chain of the fork's nets ---------------------------------------------------------------

def test_v1_multisoftmax_decode_norm_rescale_combine(tmp_path):
    """The fork's test net chain, V1 types: MULTI_SOFTMAX, DECODE, NORM, RESCALE, then COMBINE with the image."""
    g = rng(6)
    codebook, triangles = tables(7, g)
    d, t = write_tables(tmp_path, codebook, triangles)
    mean = g.uniform(0, 255, 3 * 4 * 5).astype(np.float32)
    m = tmp_path / "mean.txt"
    m.write_text("\n".join(repr(float(v)) for v in mean))
    text = (f'name: "v1"\ninput: "x"\ninput_dim: 2\ninput_dim: 7\ninput_dim: 4\ninput_dim: 5\n'
            f'input: "img"\ninput_dim: 2\ninput_dim: 3\ninput_dim: 4\ninput_dim: 5\n'
            f'layers {{ name: "prob" type: MULTI_SOFTMAX bottom: "x" top: "prob" }}\n'
            f'layers {{ name: "dec" type: DECODE bottom: "prob" top: "dec" '
            f'decode_param {{ source_dict: "{d}" source_triids: "{t}" }} }}\n'
            f'layers {{ name: "nrm" type: NORM bottom: "dec" top: "nrm" }}\n'
            f'layers {{ name: "scl" type: RESCALE bottom: "nrm" top: "scl" decode_param {{ source_dict: "{m}" }} }}\n'
            f'layers {{ name: "cmb" type: COMBINE bottom: "img" bottom: "scl" top: "o" }}\n')
    x = g.standard_normal((2, 7, 4, 5)).astype(np.float32)
    img = g.uniform(0, 255, (2, 3, 4, 5)).astype(np.float32)
    e = np.exp(x - x.max(1, keepdims=True))
    prob = (e / e.sum(1, keepdims=True)).astype(np.float32)
    dec = ref_decode(prob, codebook, triangles, False)
    nrm = (dec / (np.sqrt((dec * dec).sum(1, keepdims=True)) + np.float32(1e-6))).astype(np.float32)
    ref = np.concatenate([img, ref_rescale(nrm, mean)], 1)
    model = load_from_text(text)
    # numpy's exp and sqrt may differ from torch's by an ulp, which Rescale multiplies by 128 (1 ulp at 255: 1.5e-5)
    check_everywhere(model, {"x": x, "img": img}, {"o": ref}, tmp_path, atol=4e-5)


# ---- the data layers ---------------------------------------------------------------------------------

JOINT = ('layers {{ name: "d" type: JOINT_IMAGE_DATA top: "full" top: "label" top: "small" '
         'image_data_param {{ source: "list.txt" mean_file: "m.binaryproto" mean_file_2: "m2.binaryproto" '
         'batch_size: 3 new_height: 13 new_width: 17 new_height_2: 5 new_width_2: 7 {extra} }} }}\n'
         'layers {{ name: "c" type: CONVOLUTION bottom: "small" top: "o" convolution_param {{ num_output: 2 '
         'kernel_size: 1 }} }}\n')


def test_joint_image_data_tops_from_its_params():
    model = load_from_text(JOINT.format(extra=""), random_weights=True)
    shapes = {k: model.graph.tensors[k].shape for k in ("full", "label", "small", "o")}
    assert shapes == {"full": (3, 3, 13, 17), "label": (3, 1, 13, 17), "small": (3, 3, 5, 7), "o": (3, 2, 5, 7)}
    with pytest.raises(CaffeqError, match="JointImageData does not crop"):
        load_from_text(JOINT.format(extra="crop_size: 5"))
    with pytest.raises(CaffeqError, match="image_data_param.new_height_2 must be >= 1"):
        load_from_text(JOINT.format(extra="").replace("new_height_2: 5", ""))


LOC = ('layers {{ name: "d" type: IMAGE_LOC_DATA top: "data" top: "label" image_loc_data_param {{ '
       'source: "list.txt" batch_size: {batch} crop_size: 11 source_num: 2 slide_stride: 4 new_height: 13 '
       'new_width: 9 }} }}\n'
       'layers {{ name: "c" type: CONVOLUTION bottom: "data" top: "o" convolution_param {{ num_output: 2 '
       'kernel_size: 3 }} }}\n')


def test_image_loc_data_gives_one_window_per_item():
    model = load_from_text(LOC.format(batch=6), random_weights=True)
    assert model.graph.tensors["data"].shape == (6, 6, 11, 11)
    assert model.graph.tensors["label"].shape == (6, 1, 1, 1)
    with pytest.raises(CaffeqError, match=r"= 6 windows must be batch_size 5 \(the fork's CHECK\)"):
        load_from_text(LOC.format(batch=5))


# ---- the fork's own files ----------------------------------------------------------------------------

@pytest.mark.parametrize("name, args, row", [
    ("joint_fusion__seg_test_3dnormal_joint.prototxt", (), "prob_3dnorm_fusion -> decode_fusion       5x3x195x260"),
    ("joint_fusion__seg_train_3dnormal_joint.prototxt", (), "data_full,scale_global,scale_local -> cmb_fusion  5x9x195x260"),
    ("joint_fusion_prop__seg_train_3dnormal_multiloss.prototxt", (), "prob_3dnorm_global -> decode_coarse_global  5x3x195x260"),
    # the fork's Accuracy does nothing (its checks commented out); BVLC's needs a label per prediction
    ("loc_slide_window__seg_test_2fc_3dnormal.prototxt", ("--input-shape", "label_3dnorm=300,1,13,13"),
     "prob_3dnorm -> decode_local          300x3x13x13"),
])
def test_the_forks_nets_read(name, args, row):
    out = inspect_corpus_file(CORPUS / (PREFIX + name), *args)
    assert row in out, out
