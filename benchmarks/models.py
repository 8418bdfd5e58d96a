"""Benchmark models: VGG16- and ResNet-50-shaped Caffe nets with random weights.

The prototxts follow the published deploy files' layer structure; weights are
random (N(0, 1/fan_in)) and written with caffeq's own caffemodel writer.
"""
import os


def _conv(name, bottom, top, n, k, s=1, p=0, bias=True):
    bias_s = "" if bias else " bias_term: false"
    return (f'layer {{ name: "{name}" type: "Convolution" bottom: "{bottom}" top: "{top}" '
            f'convolution_param {{ num_output: {n} kernel_size: {k} stride: {s} pad: {p}{bias_s} }} }}\n')


def _relu(name, blob):
    return f'layer {{ name: "{name}" type: "ReLU" bottom: "{blob}" top: "{blob}" }}\n'


def _bn_scale(name, blob):
    return (f'layer {{ name: "bn_{name}" type: "BatchNorm" bottom: "{blob}" top: "{blob}" '
            f'batch_norm_param {{ use_global_stats: true }} }}\n'
            f'layer {{ name: "scale_{name}" type: "Scale" bottom: "{blob}" top: "{blob}" '
            f'scale_param {{ bias_term: true }} }}\n')


def _input(batch, c, h, w):
    return (f'layer {{ name: "data" type: "Input" top: "data" '
            f'input_param {{ shape {{ dim: {batch} dim: {c} dim: {h} dim: {w} }} }} }}\n')


def vgg16_prototxt(batch=1):
    text = 'name: "VGG16"\n' + _input(batch, 3, 224, 224)
    bottom = "data"
    cfg = [(64, 2), (128, 2), (256, 3), (512, 3), (512, 3)]
    for i, (n, reps) in enumerate(cfg, 1):
        for j in range(1, reps + 1):
            name = f"conv{i}_{j}"
            text += _conv(name, bottom, name, n, 3, 1, 1) + _relu(f"relu{i}_{j}", name)
            bottom = name
        text += (f'layer {{ name: "pool{i}" type: "Pooling" bottom: "{bottom}" top: "pool{i}" '
                 f'pooling_param {{ pool: MAX kernel_size: 2 stride: 2 }} }}\n')
        bottom = f"pool{i}"
    for name, n in (("fc6", 4096), ("fc7", 4096), ("fc8", 1000)):
        text += (f'layer {{ name: "{name}" type: "InnerProduct" bottom: "{bottom}" top: "{name}" '
                 f'inner_product_param {{ num_output: {n} }} }}\n')
        if name != "fc8":
            text += _relu(f"relu{name[2:]}", name)
            text += (f'layer {{ name: "drop{name[2:]}" type: "Dropout" bottom: "{name}" top: "{name}" '
                     f'dropout_param {{ dropout_ratio: 0.5 }} }}\n')
        bottom = name
    text += 'layer { name: "prob" type: "Softmax" bottom: "fc8" top: "prob" }\n'
    return text


def resnet50_prototxt(batch=1):
    text = 'name: "ResNet-50"\n' + _input(batch, 3, 224, 224)
    text += _conv("conv1", "data", "conv1", 64, 7, 2, 3, bias=False) + _bn_scale("conv1", "conv1")
    text += _relu("conv1_relu", "conv1")
    text += ('layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1" '
             'pooling_param { pool: MAX kernel_size: 3 stride: 2 } }\n')
    bottom = "pool1"
    stages = [(64, 3), (128, 4), (256, 6), (512, 3)]
    for si, (width, blocks) in enumerate(stages, 2):
        for b in range(blocks):
            tag = f"res{si}{chr(ord('a') + b)}"
            stride = 2 if (b == 0 and si > 2) else 1
            if b == 0:
                text += _conv(f"{tag}_branch1", bottom, f"{tag}_branch1", width * 4, 1, stride, 0, bias=False)
                text += _bn_scale(f"{tag}_branch1", f"{tag}_branch1")
                shortcut = f"{tag}_branch1"
            else:
                shortcut = bottom
            text += _conv(f"{tag}_branch2a", bottom, f"{tag}_branch2a", width, 1, stride, 0, bias=False)
            text += _bn_scale(f"{tag}_branch2a", f"{tag}_branch2a") + _relu(f"{tag}_branch2a_relu", f"{tag}_branch2a")
            text += _conv(f"{tag}_branch2b", f"{tag}_branch2a", f"{tag}_branch2b", width, 3, 1, 1, bias=False)
            text += _bn_scale(f"{tag}_branch2b", f"{tag}_branch2b") + _relu(f"{tag}_branch2b_relu", f"{tag}_branch2b")
            text += _conv(f"{tag}_branch2c", f"{tag}_branch2b", f"{tag}_branch2c", width * 4, 1, 1, 0, bias=False)
            text += _bn_scale(f"{tag}_branch2c", f"{tag}_branch2c")
            text += (f'layer {{ name: "{tag}" type: "Eltwise" bottom: "{shortcut}" bottom: "{tag}_branch2c" '
                     f'top: "{tag}" }}\n') + _relu(f"{tag}_relu", tag)
            bottom = tag
    text += ('layer { name: "pool5" type: "Pooling" bottom: "%s" top: "pool5" '
             'pooling_param { pool: AVE kernel_size: 7 stride: 1 } }\n' % bottom)
    text += ('layer { name: "fc1000" type: "InnerProduct" bottom: "pool5" top: "fc1000" '
             'inner_product_param { num_output: 1000 } }\n')
    text += 'layer { name: "prob" type: "Softmax" bottom: "fc1000" top: "prob" }\n'
    return text


def write_model(folder, name, prototxt_text, seed=0):
    """Write NAME.prototxt and NAME.caffemodel (random weights, caffeq's writer) into folder."""
    import caffeq
    from caffeq.io.writer import write_model_caffemodel

    proto = os.path.join(folder, f"{name}.prototxt")
    with open(proto, "w") as f:
        f.write(prototxt_text)
    model = caffeq.load(proto, random_weights=True, seed=seed)
    weights = os.path.join(folder, f"{name}.caffemodel")
    write_model_caffemodel(model, weights)
    return proto, weights
