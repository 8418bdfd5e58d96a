"""RoomNet's HeatmapVisualize (FengyangZhang/caffe_roomnet 5f05a94): a PNG writer whose top Caffe never
shapes.  caffeq runs the rest of the net, gives the empty top, writes no file, and the exports leave it out."""
import os

import numpy as np
import onnx
from conftest import model_py_outputs

from caffeq.model import load_from_text

NET = """
layer { name: "in" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 5 dim: 7 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" convolution_param { num_output: 2 kernel_size: 1 } }
layer { name: "vis" type: "HeatmapVisualize" bottom: "conv" top: "vis" }
layer { name: "prob" type: "Softmax" bottom: "conv" top: "prob" }
"""


def test_heatmap_visualize_writes_nothing_and_leaves_its_top_empty(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = load_from_text(NET, random_weights=True)
    assert any("PNG files" in w for w in model.warnings)
    x = np.random.default_rng(0).random((2, 3, 5, 7)).astype(np.float32)
    exact = load_from_text(NET.replace('layer { name: "vis" type: "HeatmapVisualize" bottom: "conv" top: "vis" }', ""),
                           random_weights=True)
    out = model.run({"data": x})
    assert out["vis"].shape == (0,)
    np.testing.assert_array_equal(out["prob"], exact.run({"data": x})["prob"])
    assert not os.path.exists(tmp_path / "test")   # the fork's test/<image>-<channel>.png files
    model.export_onnx(str(tmp_path / "m.onnx"))
    assert [o.name for o in onnx.load(str(tmp_path / "m.onnx")).graph.output] == ["prob"]
    np.testing.assert_array_equal(model_py_outputs(model, {"data": x}, tmp_path)["prob"], out["prob"])
