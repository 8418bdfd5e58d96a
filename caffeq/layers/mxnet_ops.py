"""Layers that MXNet-to-Caffe converters write for MXNet operators Caffe lacks.

- Broadcastmul (the mxnet2caffe converter's prototxt_basic.py, copied across many repositories,
  e.g. junqiangwu/Mxnet2Caffe-Tensor-RT-SEnet; `BroadcastMul` in TensorRT Caffe parsers that map it
  to a per-channel scale plugin): MXNet's broadcast_mul of its two bottoms, the squeeze-excitation
  product x (N, C, H, W) * s (N, C, 1, 1).  The top is shaped like bottom 0, as the TensorRT plugin
  gives it; the second bottom must broadcast to that shape.  The converter repository's own Caffe
  layer is a stub that copies bottom 0 (only TensorRT runs the product): caffeq computes the
  product, which is what the MXNet model and its TensorRT engine compute.
"""
from .registry import Layer, LayerError, need_blobs, register_layer


def _broadcasts_to(small, big):
    """NumPy's rule: small's axes, aligned at the end, are 1 or equal to big's."""
    if len(small) > len(big):
        return False
    return all(s in (1, b) for s, b in zip(reversed(small), reversed(big)))


@register_layer("Broadcastmul", "BroadcastMul")
class BroadcastMul(Layer):
    def parse(self, lp):
        need_blobs(lp, lp.type, 2, 1, "data, per-channel factors")
        if lp.type != "Broadcastmul":
            return {}
        return {"reading_notes": ["read as MXNet's broadcast_mul, which the converted model computes (the "
                                  "converter's Caffe layer is a stub that copies bottom 0 for TensorRT to replace)"]}

    def infer(self, attrs, in_shapes):
        x, s = tuple(in_shapes[0]), tuple(in_shapes[1])
        if not _broadcasts_to(s, x):
            raise LayerError(f"bottom 1 {list(s)} does not broadcast to bottom 0 {list(x)} "
                             f"(MXNet's broadcast_mul, shaped like bottom 0)")
        return [x]

    def forward(self, attrs, params, x, s):
        return x * s

    def onnx(self, ctx, node):
        ctx.add_node("Mul", list(node.inputs), [node.outputs[0]], name=node.name)

    def pytorch_source(self, node, emit):
        return f"{emit.inputs[0]} * {emit.inputs[1]}"

