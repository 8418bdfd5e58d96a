"""sophgo/caffe's YoloDetection and RetinaFaceDetection (cvitek-mlir/models' nets): sized as their
Reshape does, refused at run and export time with the reason (their keep_topk shrinks for good)."""
import numpy as np
import pytest
from conftest import net

from caffeq.errors import CaffeqError, ExportError
from caffeq.layers import LayerError
from caffeq.model import load_from_text

YOLO = ('layer {{ name: "output" type: "YoloDetection" bottom: "p3" bottom: "p4" bottom: "p5" top: "output" '
        'yolo_detection_param {{ net_input_h: 64 net_input_w: 96 nms_threshold: 0.4 obj_threshold: 0.5 {extra} }} }}')
SHAPES = {"p3": (2, 255, 8, 12), "p4": (2, 255, 4, 6), "p5": (2, 255, 2, 3)}


def test_yolo_detection_is_sized_and_refused(tmp_path):
    model = load_from_text(net(YOLO.format(extra="keep_topk: 200"), inputs=SHAPES))
    assert model.blob_shapes["output"] == (2, 1, 200, 6)
    feeds = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    with pytest.raises(CaffeqError, match=r"'output' \(YoloDetection\): .*keep_topk.*--outputs"):
        model.run(feeds)
    with pytest.raises(ExportError, match=r"'output' \(YoloDetection\)"):
        model.export_onnx(str(tmp_path / "m.onnx"))
    up_to = load_from_text(net(YOLO.format(extra="keep_topk: 200"), inputs=SHAPES), outputs=["p3"])
    assert up_to.outputs == ["p3"]


@pytest.mark.parametrize("extra, msg", [("", "keep_topk must be >= 1"),
                                        ("keep_topk: 5 tiny: true", "tiny has anchors for 2 scales")])
def test_yolo_detection_refusals(extra, msg):
    with pytest.raises(LayerError, match=msg):
        load_from_text(net(YOLO.format(extra=extra), inputs=SHAPES))


def test_retinaface_detection_takes_nine_bottoms():
    names = [f"{kind}{s}" for s in (8, 16, 32) for kind in ("cls", "box", "lmk")]
    channels = {"cls": 4, "box": 8, "lmk": 20}
    shapes = {n: (1, channels[n.rstrip("0123456789")], 64 // int(n.lstrip("clsboxmk")), 64 // int(n.lstrip("clsboxmk")))
              for n in names}
    bottoms = " ".join(f'bottom: "{n}"' for n in names)
    text = (f'layer {{ name: "output" type: "RetinaFaceDetection" {bottoms} top: "output" '
            f'retinaface_detection_param {{ nms_threshold: 0.4 confidence_threshold: 0.5 keep_topk: 5 }} }}')
    assert load_from_text(net(text, inputs=shapes)).blob_shapes["output"] == (1, 1, 5, 15)
    with pytest.raises(LayerError, match="RetinaFaceDetection takes 9 bottoms"):
        load_from_text(net(text.replace(f'bottom: "{names[-1]}" ', ""), inputs=shapes))
