"""hshustc/ECCV18_Lifelong_Learning's KnowledgeDistillation (a LossLayer: training-only, dropped at inference)."""
import numpy as np
from conftest import check_everywhere, node_of, rng

from caffeq.io.prototxt import parse_prototxt_text
from caffeq.model import load_from_text
from caffeq.training_layers import is_training_only_type

F32 = np.float32

# the shape of the fork's alexnet_KD_from_imagenet train_val: a shared trunk, the old task's head (the teacher)
# and the new task's head (the student); KD compares the student's logits with the teacher's
KD_NET = """name: "kd"
layer { name: "data" type: "Data" top: "data" top: "label" include { phase: TRAIN }
  data_param { source: "train_lmdb" batch_size: 8 backend: LMDB } }
layer { name: "data" type: "Data" top: "data" top: "label" include { phase: TEST }
  data_param { source: "test_lmdb" batch_size: 2 backend: LMDB } }
layer { name: "fc7" type: "InnerProduct" bottom: "data" top: "fc7" inner_product_param { num_output: 6 } }
layer { name: "relu7" type: "ReLU" bottom: "fc7" top: "fc7" }
layer { name: "fc8_task1" type: "InnerProduct" bottom: "fc7" top: "fc8_task1"
  param { lr_mult: 0 } param { lr_mult: 0 } inner_product_param { num_output: 4 } }
layer { name: "fc8_task2" type: "InnerProduct" bottom: "fc7" top: "fc8_task2" inner_product_param { num_output: 4 } }
layer { name: "KD_loss" type: "KnowledgeDistillation" bottom: "fc8_task2" bottom: "fc8_task1"
  propagate_down: true propagate_down: false top: "KD_loss"
  knowledge_distillation_param { temperature: 2 } loss_weight: 0.25 }
"""


def test_knowledge_distillation_param_reads_with_the_forks_default():
    net = parse_prototxt_text(KD_NET, path="t.prototxt")
    kd = next(lp for lp in net.layer if lp.type == "KnowledgeDistillation")
    assert kd.knowledge_distillation_param.temperature == 2
    assert type(kd.knowledge_distillation_param)().temperature == 1   # the fork's default
    assert is_training_only_type("KnowledgeDistillation")


def test_a_kd_train_val_net_reads_with_its_kd_layer_dropped(tmp_path):
    model = load_from_text(KD_NET, input_shapes={"data": (2, 5, 3, 1)}, random_weights=True)
    names = [n.name for n in model.layers]
    assert "KD_loss" not in names
    assert names == ["data", "fc7", "relu7", "fc8_task1", "fc8_task2"]
    assert any("dropped 1 training-only layer(s) that inference does not use: KD_loss (KnowledgeDistillation)" in w
               for w in model.warnings)
    # the teacher's and the student's logits, which only KD read, are now the net's outputs
    assert [o for o in model.outputs if o != "label"] == ["fc8_task1", "fc8_task2"]
    x = rng(1).standard_normal((2, 5, 3, 1)).astype(F32)
    w7, b7 = (node_of(model, "fc7").blobs[i] for i in (0, 1))
    h = np.maximum(x.reshape(2, -1).astype(np.float64) @ w7.T.astype(np.float64) + b7, 0)
    refs = {}
    for top in ("fc8_task1", "fc8_task2"):
        w, b = node_of(model, top).blobs[0], node_of(model, top).blobs[1]
        refs[top] = h @ w.T.astype(np.float64) + b
    label = np.array([2, 0], F32).reshape(model.blob_shapes["label"])   # a Data top, read by nothing here
    check_everywhere(model, {"data": x, "label": label}, refs, tmp_path, atol=1e-5, rtol=1e-5)

