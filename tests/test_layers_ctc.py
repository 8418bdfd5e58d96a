"""CTCGreedyDecoder (caffe_ocr, TextBoxes++, Caffe_SSD_LSTM_LPR).

The references are loops written here from the forks' ctc_decoder_layer.cpp: per item and step the
first class of maximal score (strict '>'), skip the blank and, with merge_repeated, the class of the
step before; the top is N x T filled with -1 and the labels written at the front.  TextBoxes++'s
sequence indicators end an item before the first step t >= 1 whose indicator is 0, and its scores
top sums minus the maximal score over the item's steps.  caffe_ocr's label form gives
[1 - mean(edit distance / longer length), fraction of exact items].
"""

import numpy as np
import pytest
import torch
from conftest import REPO, inputs_text, load_model_py, onnx_run_by_blob, onnx_session

from caffeq.layers import LayerError
from caffeq.model import load, load_from_text

T, N, C = 7, 3, 5  # asymmetric: time, batch, classes


def decoder_text(bottoms=("x",), tops=("y",), param=""):
    b = " ".join(f'bottom: "{x}"' for x in bottoms)
    t = " ".join(f'top: "{x}"' for x in tops)
    p = f" ctc_decoder_param {{ {param} }}" if param else ""
    return f'layer {{ name: "ctc" type: "CTCGreedyDecoder" {b} {t}{p} }}\n'


def scores_for(best, seed, classes=C):
    """Scores (T, N, C) whose maximal class per (t, n) is best[t, n] (a tie where best is a pair:
    both classes get the same maximal score, the lower one is then the answer)."""
    g = np.random.default_rng(seed)
    steps, batch = best.shape[:2]
    x = g.uniform(-2.0, 0.0, (steps, batch, classes)).astype(np.float32)
    for t in range(steps):
        for n in range(batch):
            for c in np.atleast_1d(best[t, n]):
                if c >= 0:
                    x[t, n, c] = 1.5
    return x


# classes per (t, n); -1 entries are unused.  Item 0: blank at start and end with repeats on both
# sides of a blank; item 1: all blank (class 0, the caffe_ocr default); item 2: repeats, last class.
BEST = np.array([[0, 0, 2], [3, 0, 2], [3, 0, 2], [0, 0, 4], [3, 0, 4], [1, 0, 2], [0, 0, 2]]).reshape(T, N)


def decode_ref(x, blank, merge, ends=None):
    """The forks' Decode loop; ends[n] = number of steps of item n (all T without indicators)."""
    steps, batch, classes = x.shape[:3]
    probs = x.reshape(steps, batch, -1)
    out = np.full((batch, steps, 1, 1), -1.0, np.float32)
    scores = np.zeros((batch, 1, 1, 1), np.float32)
    for n in range(batch):
        prev, seq = -1, []
        for t in range(steps if ends is None else ends[n]):
            best, best_c = probs[t, n, 0], 0
            for c in range(1, classes):
                if probs[t, n, c] > best:
                    best, best_c = probs[t, n, c], c
            scores[n, 0, 0, 0] += -best
            if best_c != blank and not (merge and best_c == prev):
                seq.append(best_c)
            prev = best_c
        out[n, :len(seq), 0, 0] = seq
    return out, scores


def indicator_ends(ind):
    """TextBoxes++: item n stops after step t when t + 1 == T or ind[t + 1, n] == 0."""
    steps, batch = ind.shape[:2]
    ends = []
    for n in range(batch):
        t = 0
        while not (t + 1 == steps or ind[t + 1, n] == 0):
            t += 1
        ends.append(t + 1)
    return ends


def edit_distance_ref(a, b):
    d = np.zeros((len(a) + 1, len(b) + 1), np.int64)
    d[:, 0] = np.arange(len(a) + 1)
    d[0, :] = np.arange(len(b) + 1)
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            d[i, j] = min(d[i - 1, j] + 1, d[i, j - 1] + 1, d[i - 1, j - 1] + (a[i - 1] != b[j - 1]))
    return int(d[len(a), len(b)])


def accuracy_ref(decoded, labels, blank):
    """caffe_ocr's label form: decoded (N, T, 1, 1) from decode_ref, labels (N, L)."""
    batch = decoded.shape[0]
    edit, exact = 0.0, 0
    for n in range(batch):
        got = [int(v) for v in decoded[n, :, 0, 0] if v >= 0]
        want = []
        for v in labels[n]:
            if v < 0:
                break
            if int(0.5 + v) != blank:
                want.append(int(0.5 + v))
        if max(len(got), len(want)) == 0:
            continue
        ed = edit_distance_ref(want, got)
        edit += ed / max(len(got), len(want))
        exact += ed == 0
    return np.array([1 - edit / batch, exact / batch], np.float32).reshape(1, 2, 1, 1)


# ---- one bottom (caffe_ocr deploy) ------------------------------------------------------------

BLANKS = [("", 0), ("blank_index: -1", C - 1), ("blank_index: 2", 2)]


@pytest.mark.parametrize("merge", [True, False])
@pytest.mark.parametrize("param, blank", BLANKS)
def test_decode_matches_the_loops(merge, param, blank):
    x = scores_for(BEST, 1)
    text = inputs_text(x=x.shape) + decoder_text(param=f"{param} ctc_merge_repeated: {str(merge).lower()}")
    model = load_from_text(text)
    assert model.blob_shapes["y"] == (N, T, 1, 1)
    got = model.run({"x": x})["y"]
    want, _ = decode_ref(x, blank, merge)
    np.testing.assert_array_equal(got, want)


def test_the_example_sequences_decode_as_expected():
    # a hand check of the loops on the fixed classes: blank 0, merging repeats
    want, _ = decode_ref(scores_for(BEST, 1), 0, True)
    assert want[0, :, 0, 0].tolist() == [3, 3, 1, -1, -1, -1, -1]  # "3 3 - 3 1": the blank keeps a repeat
    assert want[1, :, 0, 0].tolist() == [-1] * T  # all blank
    assert want[2, :, 0, 0].tolist() == [2, 4, 2, -1, -1, -1, -1]


def test_ties_take_the_first_maximal_class():
    best = np.empty((T, N), object)
    for t in range(T):
        for n in range(N):
            best[t, n] = (1 + (t + n) % 3, 4) if (t + n) % 2 else ((t * 3 + n) % C,)
    x = scores_for(best, 2)
    model = load_from_text(inputs_text(x=x.shape) + decoder_text(param="blank_index: 0"))
    got = model.run({"x": x})["y"]
    want, _ = decode_ref(x, 0, True)
    np.testing.assert_array_equal(got, want)
    assert (got >= 0).sum() > 0


def test_random_scores_with_trailing_axes():
    # a T x N x C x 1 blob (an InnerProduct with axis 2 gives T x N x C)
    x = np.random.default_rng(3).standard_normal((9, 2, 4, 1)).astype(np.float32)
    model = load_from_text(inputs_text(x=x.shape) + decoder_text(param="blank_index: -1"))
    np.testing.assert_array_equal(model.run({"x": x})["y"], decode_ref(x, 3, True)[0])


@pytest.mark.parametrize("opset", [13, 21])
@pytest.mark.parametrize("merge", [True, False])
def test_onnx_and_model_py_match_the_loops(merge, opset, tmp_path):
    x = scores_for(BEST, 4)
    text = inputs_text(x=x.shape) + decoder_text(param=f"blank_index: -1 ctc_merge_repeated: {str(merge).lower()}")
    model = load_from_text(text)
    want, _ = decode_ref(x, C - 1, merge)
    got = onnx_run_by_blob(onnx_session(model, tmp_path / "c.onnx", opset), model, {"x": x})[0]
    np.testing.assert_array_equal(got, want)
    net, info = load_model_py(model, tmp_path / f"ctc_{merge}_{opset}")
    with torch.no_grad():
        out = net(*[torch.from_numpy({"x": x}[b]) for b in info["inputs"]])
    np.testing.assert_array_equal(out.numpy(), want)


# ---- two bottoms: TextBoxes++'s sequence indicators ---------------------------------------------

def indicators():
    ind = np.ones((T, N), np.float32)
    ind[0, :] = 0      # step 0 counts whatever its indicator says
    ind[4, 0] = 0      # item 0 ends after 4 steps
    ind[1, 1] = 0      # item 1 ends after 1 step
    ind[6, 2] = 0      # item 2 ends after 6 steps
    ind[3, 2] = 2.0    # non-zero keeps going
    return ind


@pytest.mark.parametrize("param, blank", [("", C - 1), ("blank_index: 0", 0)])
def test_sequence_indicators_and_scores_match_the_loops(param, blank, tmp_path):
    x = scores_for(BEST, 5)
    ind = indicators()
    ends = indicator_ends(ind)
    assert ends == [4, 1, 6]
    text = inputs_text(x=x.shape, ind=ind.shape) + decoder_text(("x", "ind"), ("y", "s"), param)
    model = load_from_text(text)
    assert model.blob_shapes["s"] == (N, 1, 1, 1)
    want, want_scores = decode_ref(x, blank, True, ends)
    out = model.run({"x": x, "ind": ind})
    np.testing.assert_array_equal(out["y"], want)
    np.testing.assert_allclose(out["s"], want_scores, rtol=1e-6)
    feeds = {"x": x, "ind": ind}
    got = onnx_run_by_blob(onnx_session(model, tmp_path / "i.onnx"), model, feeds)
    np.testing.assert_array_equal(got[0], want)
    np.testing.assert_allclose(got[1], want_scores, rtol=1e-6)
    net, info = load_model_py(model, tmp_path / f"ctc_ind_{blank}")
    with torch.no_grad():
        out = net(*[torch.from_numpy(feeds[b]) for b in info["inputs"]])  # a dict by blob name
    np.testing.assert_array_equal(out["y"].numpy(), want)
    np.testing.assert_allclose(out["s"].numpy(), want_scores, rtol=1e-6)


# ---- two bottoms: caffe_ocr's label accuracy ------------------------------------------------------

def test_label_accuracy_matches_the_loops(tmp_path):
    x = scores_for(BEST, 6)
    decoded, _ = decode_ref(x, 0, True)  # [3 3 1], [], [2 4 2]
    labels = np.array([[3, 3, 1, -1], [0, -1, 2, 2], [2.2, 1, 0, 2]], np.float32)  # exact; all blank; 2.2 rounds to 2 and 0 (blank) is dropped: [2 1 2] vs [2 4 2], one edit
    model = load_from_text(inputs_text(x=x.shape, label=labels.shape) + decoder_text(("x", "label"), ("acc",)))
    assert model.blob_shapes["acc"] == (1, 2, 1, 1)
    got = model.run({"x": x, "label": labels})["acc"]
    want = accuracy_ref(decoded, labels, 0)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(want.ravel(), [1 - (1 / 3) / 3, 1 / 3], rtol=1e-6)
    from caffeq.errors import ExportError
    with pytest.raises(ExportError, match="edit-distance accuracy"):
        model.export_onnx(str(tmp_path / "a.onnx"), optimize=False)
    from caffeq.backends.pytorch_source import export_pytorch
    with pytest.raises(ExportError, match="CTCGreedyDecoder"):
        export_pytorch(model, tmp_path / "a")


# ---- bad input ----------------------------------------------------------------------------------

@pytest.mark.parametrize("shapes, bottoms, tops, param, msg", [
    ({"x": (T, N)}, ("x",), ("y",), "", "T x N x C"),
    ({"x": (T, N, C)}, ("x",), ("y",), "blank_index: 5", "blank_index 5 is out of range for 5 classes"),
    ({"x": (T, N, C)}, ("x",), ("y", "s"), "", "produces 1 top"),
    ({"x": (T, N, C), "a": (T, N), "b": (T, N)}, ("x", "a", "b"), ("y",), "", "not supported"),
    ({"x": (T, N, C), "a": (4, 4)}, ("x", "a"), ("y",), "", "second bottom"),
])
def test_bad_input_is_a_clear_error(shapes, bottoms, tops, param, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(inputs_text(**shapes) + decoder_text(bottoms, tops, param))


# ---- the real deploy files -------------------------------------------------------------------------

CORPUS = REPO / "tests" / "fixtures" / "realworld"
DEPLOYS = ["senlinuc__caffe_ocr__examples__ocr__inception-bn__deploy.prototxt",
           "senlinuc__caffe_ocr__examples__ocr__resnet__deploy.prototxt",
           "warrentdrew__Caffe_SSD_LSTM_LPR__models__ResNet_CTC__deploy.prototxt",
           "warrentdrew__Caffe_SSD_LSTM_LPR__models__ResNet_LSTM_CTC__deploy.prototxt"]


@pytest.mark.parametrize("name", DEPLOYS)
def test_corpus_deploy_runs_end_to_end(name):
    path = CORPUS / name
    model = load(str(path), random_weights=True)
    node = next(n for n in model.layers if n.type == "CTCGreedyDecoder")
    steps, batch, classes = model.blob_shapes[node.bottoms[0]][:3]
    assert model.blob_shapes[node.tops[0]] == (batch, steps, 1, 1)
    # caffe_ocr leaves blank_index unset (its default 0); the LPR files ask for the last class
    assert node.attrs["_blank"] == (classes - 1 if "warrentdrew" in name else 0)
    x = np.random.default_rng(7).uniform(0, 255, model.blob_shapes["data"]).astype(np.float32)
    out = model.run({"data": x}, all_blobs=True)
    want, _ = decode_ref(out[node.bottoms[0]], node.attrs["_blank"], True)
    np.testing.assert_array_equal(out[node.tops[0]], want)


@pytest.mark.parametrize("name", [DEPLOYS[1], DEPLOYS[2]])
def test_corpus_deploy_in_onnx_and_model_py(name, tmp_path):
    path = CORPUS / name
    model = load(str(path), random_weights=True)
    node = next(n for n in model.layers if n.type == "CTCGreedyDecoder")
    feeds = {"data": np.random.default_rng(8).uniform(0, 255, model.blob_shapes["data"]).astype(np.float32)}
    out = model.run(feeds, all_blobs=True)
    scores = np.sort(out[node.bottoms[0]].reshape(-1, model.blob_shapes[node.bottoms[0]][2]), axis=1)
    # another backend's rounding upstream may only swap two classes whose scores nearly tie
    assert (scores[:, -1] - scores[:, -2]).min() > 1e-5 * np.abs(scores).max()
    want = out[node.tops[0]]
    np.testing.assert_array_equal(onnx_run_by_blob(onnx_session(model, tmp_path / "d.onnx"), model, feeds)[0], want)
    net, info = load_model_py(model, tmp_path / "ctc_deploy")
    with torch.no_grad():
        got = net(*[torch.from_numpy(feeds[b]) for b in info["inputs"]])
    np.testing.assert_array_equal(got.numpy(), want)
