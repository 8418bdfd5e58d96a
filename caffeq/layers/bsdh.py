"""ruixuejianfei/BitScalableDeepHash's layers (its bundled 2013 Caffe, 3a9b658; V0 nets, upgraded by
caffeq/io/v0_forks.py, whose bsdh_param carries the fork's fields).

- BsdhTripletData (V0 "data" with img_files; data_layer.cpp): tops data (batchsize, 3, cropsize_h,
  cropsize_w) (each defaulting to cropsize) and l_matrix (1, 1, B, B), the triplet loss's Laplacian, all
  zeros at TEST.  The images are source/<name> for each name in img_files, read as BGR, centre-cropped at
  TEST, and stored as scale * (128 - pixel + mean).  At TRAIN the batch size depends on the image list
  (triplets drawn per class): --input-shape gives it.
- BsdhSigmoid (its "sigmoid", sigmoid_layer.cpp): 2 / (1 + exp(-s x)) - 1 with s = sigm_para (default 5), the
  exponential in double.  (s grows by sigm_decay every iter_decay backward passes in training; the grown
  value is not saved, and the fork's test tool uses 5.)
- ElewiseProduct (elewise_product.cpp): top (N, K, 1, 1) = x[n, k] * w[k] over the flattened bottom,
  K = C H W = num_output; blobs weight (1, 1, 1, K) and, with biasterm, a bias (1, 1, 1, K) that the forward
  never adds.  The fork's test tool ranks the hash bits by |w|.
- euclidean_triplet_loss only trains (dropped as a loss).
"""
import numpy as np
import torch

from .fork_data import ForkDataLayer
from .registry import Layer, LayerError, count, need_blobs, needs_input_shape, register_layer


@register_layer("BsdhTripletData")
class BsdhTripletData(ForkDataLayer):
    def parse(self, lp):
        need_blobs(lp, "BsdhTripletData", 0, 2)
        p = lp.bsdh_param
        return {"type": lp.type, "tops": list(lp.top), "num_tops": 2, "phase": None, "channels": 3,
                "batch_size": int(p.batch_size), "hw": (int(p.crop_h), int(p.crop_w)) if p.crop_h and p.crop_w else None,
                "scale": float(p.scale), "source": p.source, "img_files": p.img_files, "mean_file": p.mean_file}

    def data_shape(self, attrs):
        if attrs["phase"] == "TRAIN" or attrs["batch_size"] < 1:
            raise needs_input_shape(attrs, attrs["tops"][0], "BitScalableDeepHash's TRAIN batch (and a net without "
                                    "batchsize) is the triplets it draws from the image list")
        if not attrs["hw"]:
            raise needs_input_shape(attrs, attrs["tops"][0], "without cropsize the fork takes the first image's "
                                    "size")
        return super().data_shape(attrs)

    def label_shape(self, attrs, data):
        return (1, 1, data[0], data[0])     # l_matrix

    def guessed_label_tops(self, attrs, given):
        return ()

    def preprocessing(self, attrs):
        crop = "centre crop {} x {} at TEST".format(*attrs["hw"]) if attrs["hw"] else "uncropped"
        return [f"images source/<name> for the names in {attrs['img_files']!r}, read as BGR, {crop}",
                f"stored as {attrs['scale']:g} * (128 - pixel + mean) (the sign inverted; mean "
                f"{attrs['mean_file'] or '0'})",
                "l_matrix: zeros at TEST (only the triplet loss reads it)"]


# ---- torch (copied into model.py) ------------------------------------------------------------------

def bsdh_sigmoid(x, slope: float):
    """2 / (1 + exp(-slope x)) - 1: the float product, then double arithmetic stored as float."""
    t = (x * -slope).double()
    return (2.0 / (1.0 + torch.exp(t)) - 1.0).float()


def elewise_product(x, weight):
    """x flattened per item times one weight per value, shaped (N, K, 1, 1)."""
    k = weight.numel()
    return (x.reshape(x.shape[0], k) * weight.reshape(k)).reshape(x.shape[0], k, 1, 1)


@register_layer("BsdhSigmoid")
class BsdhSigmoid(Layer):
    bottoms = tops = 1

    def parse(self, lp):
        super().parse(lp)
        return {"slope": float(lp.bsdh_param.sigm_para)}

    def forward(self, attrs, params, x):
        return bsdh_sigmoid(x, attrs["slope"])

    def onnx(self, ctx, node):
        x, name = node.inputs[0], node.name
        t = ctx.op("Cast", [ctx.op("Mul", [x, ctx.f32(-node.attrs["slope"])], "scaled")], "wide", to=11)
        e = ctx.op("Exp", [t], "exp")
        y = ctx.op("Sub", [ctx.op("Div", [ctx.const(np.float64(2.0)), ctx.op("Add", [ctx.const(np.float64(1.0)), e], "denominator")], "ratio"),
                           ctx.const(np.float64(1.0))], "value")
        ctx.add_node("Cast", [y], [node.outputs[0]], name=name, to=1)

    def pytorch_source(self, node, emit):
        return f"{emit.helper(bsdh_sigmoid)}({emit.inputs[0]}, {emit.lit(node.attrs['slope'])})"


@register_layer("ElewiseProduct")
class ElewiseProduct(Layer):
    blob_names = ("weight", "bias")

    def parse(self, lp):
        need_blobs(lp, "ElewiseProduct", 1, 1)
        p = lp.inner_product_param
        if not p.HasField("num_output"):
            raise LayerError("elewise_product needs num_output (the fork CHECKs it equals the bottom's C H W)")
        return {"num_output": int(p.num_output), "bias_term": bool(p.bias_term)}

    def infer(self, attrs, in_shapes):
        s = in_shapes[0]
        k = count(s) // s[0] if s and s[0] else 0
        if k != attrs["num_output"]:
            raise LayerError(f"elewise_product's num_output {attrs['num_output']} must equal the bottom's "
                             f"values per item, {k}")
        return [(s[0], k, 1, 1)]

    def param_shapes(self, attrs, in_shapes):
        k = attrs["num_output"]
        return [(1, 1, 1, k)] + ([(1, 1, 1, k)] if attrs["bias_term"] else [])

    def forward(self, attrs, params, x):
        return elewise_product(x, params[0])

    def onnx(self, ctx, node):
        x, k, n = node.inputs[0], node.attrs["num_output"], ctx.shape(node.inputs[0])[0]
        flat = ctx.op("Reshape", [x, ctx.i64([n, k])], "flat")
        weight = ctx.op("Reshape", [ctx.weight(node, 0), ctx.i64([k])], "weight_row")
        product = ctx.op("Mul", [flat, weight], "product")
        ctx.add_node("Reshape", [product, ctx.i64([n, k, 1, 1])], [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        weight = emit.module(f"nn.Parameter(torch.zeros((1, 1, 1, {node.attrs['num_output']})))")
        emit.param("", 0)
        return f"{emit.helper(elewise_product)}({emit.inputs[0]}, {weight})"


__all__ = ["BsdhSigmoid", "BsdhTripletData", "ElewiseProduct", "bsdh_sigmoid", "elewise_product"]
