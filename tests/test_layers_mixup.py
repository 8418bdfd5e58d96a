"""Wheatly2/Bag-of-Tricks-for-Image-Classification's Mixup (mixup_layer.cpp): read, checked and sized as its
Reshape sizes the tops; running or exporting it is refused with the reason (a random augmentation)."""
from pathlib import Path

import pytest
from conftest import inputs_text

from caffeq.errors import CaffeqError
from caffeq.model import load_from_text


def mixup_net(labels_shape, params="cls_num: 10 alpha: 0.2"):
    return inputs_text(data=(3, 3, 7, 5), label=labels_shape) + (
        'layer { name: "mixup" type: "Mixup" bottom: "data" bottom: "label" top: "mixed" top: "soft" '
        f'mixup_param {{ {params} }} }}\n')


@pytest.mark.parametrize("labels,soft", [((3,), (3, 10)), ((3, 1, 1, 1), (3, 10)), ((3, 6), (3, 6))])
def test_mixup_tops_are_sized_as_its_reshape(labels, soft):
    """The mixed batch is the images' shape; index labels give (N, cls_num), one-hot labels keep their shape."""
    model = load_from_text(mixup_net(labels))
    assert model.blob_shapes["mixed"] == (3, 3, 7, 5)
    assert model.blob_shapes["soft"] == soft


def test_running_mixup_is_refused_with_the_reason(tmp_path):
    import numpy as np
    model = load_from_text(mixup_net((3,)))
    feeds = {"data": np.zeros((3, 3, 7, 5), np.float32), "label": np.zeros(3, np.float32)}
    with pytest.raises(CaffeqError, match="layer 'mixup' \\(Mixup\\): mixes each item with a randomly shuffled"):
        model.run(feeds)
    with pytest.raises(CaffeqError, match="Beta\\(alpha, alpha\\)"):
        model.export_onnx(tmp_path / "m.onnx")


@pytest.mark.parametrize("labels,params,words", [((3,), "cls_num: 1", "cls_num must be at least 2"),
                                                 ((3,), "alpha: 0 cls_num: 4", "alpha must be above 0"),
                                                 ((2,), "cls_num: 4", "have not the data's batch"),
                                                 ((3, 1), "", "at least 2 classes")])
def test_bad_mixup_settings_are_one_line_errors(labels, params, words):
    with pytest.raises(CaffeqError, match=words):
        load_from_text(mixup_net(labels, params))


def test_the_fork_train_net_reads():
    """The fork's own CIFAR-10 train net (the corpus file, copied byte for byte)."""
    path = Path(__file__).parent / "fixtures" / "realworld" / "Wheatly2__Bag-of-Tricks-for-Image-Classification__train.prototxt"
    from caffeq.model import load
    model = load(path, input_shapes={"data": (4, 3, 32, 32), "label": (4,)})
    assert model.blob_shapes["mixup_data"] == (4, 3, 32, 32)
    assert model.blob_shapes["mixup_label"] == (4, 10)
