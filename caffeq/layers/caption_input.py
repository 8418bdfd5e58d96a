"""fanchenyou/deepdiary's CaptionInput (dba4d93, caption_input_layer.cpp/.cu; its lifelog captioning nets):
the rows its Lstm reads, (T * N, H) time-major, T = sequence_len + 1.

Bottoms: image features (N, P = image_size) and the sentence's word ids (N, T - 1).  Row t = 0 of stream
n is We img[n] + be; row t >= 1 is the word embedding Ws[int(sent[n, t - 1])] (the id truncated).  Blobs:
We (H, P), be (H), Ws (V, H).  An id below 0 leaves its row unwritten on the CPU (0 on a first forward)
and reads outside the table on the GPU; caffeq gives 0 there, and refuses an id past the vocabulary.
TRAIN and TEST compute the same.  torch, ONNX, model.py.
"""
import math

import torch
from torch import nn

from ..errors import DataError
from .misc import eager_checks
from .registry import Layer, LayerError, need_blobs, register_layer, torch_sources


def caption_rows(img, sent, w_e, b_e, w_s):
    """(T * N, H): the image's projection, then each step's word embedding (0 for ids below 0)."""
    n = img.shape[0]
    first = torch.matmul(img.reshape(n, -1), w_e.t()) + b_e                     # (N, H)
    ids = torch.trunc(sent.reshape(n, -1)).long()                                # (N, T - 1)
    words = w_s[ids.clamp(0, w_s.shape[0] - 1)] * (ids >= 0).unsqueeze(-1).to(w_s.dtype)
    steps = torch.cat([first.unsqueeze(1), words], 1)                            # (N, T, H)
    return steps.transpose(0, 1).reshape(-1, w_s.shape[1])


class CaptionInput(nn.Module):
    def __init__(self, hidden: int, image: int, vocabulary: int):
        super().__init__()
        self.We = nn.Parameter(torch.zeros(hidden, image))
        self.be = nn.Parameter(torch.zeros(hidden))
        self.Ws = nn.Parameter(torch.zeros(vocabulary, hidden))

    def forward(self, img, sent):
        return caption_rows(img, sent, self.We, self.be, self.Ws)


TORCH_CAPTION = torch_sources(caption_rows, CaptionInput)


@register_layer("CaptionInput")
class CaptionInputLayer(Layer):
    blob_names = ("We", "be", "Ws")
    weight_axes = {0: 0, 2: 1}

    def parse(self, lp):
        need_blobs(lp, "CaptionInput", 2, 1, roles="image features, word ids")
        p = lp.caption_input_param
        for field in ("hidden_size", "vocabulary_size", "image_size", "sequence_len"):
            if getattr(p, field) <= 0:
                raise LayerError(f"caption_input_param.{field} must be > 0, got {getattr(p, field)}")
        return {"hidden": int(p.hidden_size), "vocabulary": int(p.vocabulary_size), "image": int(p.image_size),
                "steps": int(p.sequence_len) + 1, "name": lp.name}

    def infer(self, attrs, in_shapes):
        img, sent = (tuple(s) for s in in_shapes)
        if not img or not sent or img[0] != sent[0]:
            raise LayerError(f"CaptionInput's bottoms need one num, got {list(img)} and {list(sent)}")
        if math.prod(img[1:]) != attrs["image"] or math.prod(sent[1:]) + 1 != attrs["steps"]:
            raise LayerError(f"CaptionInput takes (N, image_size {attrs['image']}) features and (N, sequence_len "
                             f"{attrs['steps'] - 1}) word ids, got {list(img)} and {list(sent)}")
        return [(attrs["steps"] * img[0], attrs["hidden"])]

    def param_shapes(self, attrs, in_shapes):
        return [(attrs["hidden"], attrs["image"]), (attrs["hidden"],), (attrs["vocabulary"], attrs["hidden"])]

    def macs(self, attrs, in_shapes, out_shapes):
        return in_shapes[0][0] * attrs["hidden"] * attrs["image"]

    def forward(self, attrs, params, img, sent):
        if eager_checks() and sent.numel() and bool((torch.trunc(sent) >= attrs["vocabulary"]).any()):
            raise DataError(f"layer '{attrs['name']}' (CaptionInput): a word id past vocabulary_size "
                            f"{attrs['vocabulary']} reads outside the embedding table")
        return caption_rows(img, sent, *params)

    def pytorch_source(self, node, emit):
        a = node.attrs
        m = emit.instance(CaptionInput, a["hidden"], a["image"], a["vocabulary"], needs=[caption_rows])
        for i, blob in enumerate(self.blob_names):
            emit.param(blob, i)
        return f"{m}({emit.inputs[0]}, {emit.inputs[1]})"

    def onnx(self, ctx, node):
        a = node.attrs
        img, sent = node.inputs
        n = ctx.shape(img)[0]
        first = ctx.op("Add", [ctx.op("MatMul", [ctx.op("Reshape", [img, ctx.i64([n, -1])], "img"),
                                                 ctx.weight(node, 0, transpose=True)], "proj"),
                               ctx.weight(node, 1)], "first")
        ids = ctx.op("Cast", [ctx.op("Reshape", [sent, ctx.i64([n, -1])], "ids")], "ids64", to=7)   # truncates
        safe = ctx.op("Clip", [ids, ctx.i64(0), ctx.i64(a["vocabulary"] - 1)], "safe")
        words = ctx.op("Gather", [ctx.weight(node, 2), safe], "words", axis=0)                     # (N, T-1, H)
        kept = ctx.op("Cast", [ctx.op("GreaterOrEqual", [ids, ctx.i64(0)], "kept")], "kept_f", to=1)
        words = ctx.op("Mul", [words, ctx.op("Unsqueeze", [kept, ctx.i64([2])], "kept3")], "words_kept")
        steps = ctx.op("Concat", [ctx.op("Unsqueeze", [first, ctx.i64([1])], "first3"), words], "steps", axis=1)
        rows = ctx.op("Transpose", [steps], "time_major", perm=[1, 0, 2])
        ctx.add_node("Reshape", [rows, ctx.i64([-1, a["hidden"]])], [node.outputs[0]], name=node.name)
