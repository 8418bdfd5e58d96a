"""NVCaffe's TRT layer as cathy-kim/RefineDet carries it (7b7497e; src/caffe/layers/trt_layer.cpp,
include/caffe/layers/trt_layer.hpp; trt_param: src/caffe/proto/caffe.proto TRTParameter, 152 there, 50152 here).

LayerSetUp parses another deploy prototxt and caffemodel (trt_param.deploy, trt_param.model) with TensorRT's Caffe
parser, marks trt_param.deploy_outputs as the engine's outputs and builds an engine (FP32, FP16, or INT8 from the
calibration table trt_param.calibrator).  Bottoms: the data, fed to the engine, and the labels, of which forward
keeps the first for its top-k accuracy report (top_k).  Its one top is (1, the engine's output dims...): the
batch is fixed at 1 (batch_size is commented out of the fork's proto); forward never writes it, the engine's
output going to a buffer the solver holds for that report.

caffeq does not run TensorRT and never opens the files the layer names: it reads trt_param, makes the fork's
checks (deploy and model are `required` there; exactly one deploy output, as deploy_outputs(0) is read and the
engine must have 2 bindings; a calibration table in INT8 mode, the default, whose reader CHECKs that it opens;
Reshape's top_k <= count(data) / count(labels)), and leaves the top unsized unless --input-shape gives it.
"""
from .registry import LayerError, ReadOnlyLayer, count, need_blobs, needs_input_shape, register_layer

TRT_MODES = {0: "FP32", 1: "FP16", 2: "INT8"}


@register_layer("TRT")
class TRT(ReadOnlyLayer):
    # the engine's output shape: only the engine built from the deploy file tells it
    shape_from_user = True

    def parse(self, lp):
        need_blobs(lp, "TRT", 2, 1, "data, labels")
        p = lp.trt_param
        for field in ("deploy", "model"):
            if not getattr(p, field):
                raise LayerError(f"trt_param.{field} must name the {'prototxt' if field == 'deploy' else 'caffemodel'} "
                                 f"TensorRT builds its engine from (required in the fork's caffe.proto)")
        outputs = [str(o) for o in p.deploy_outputs]
        if len(outputs) != 1:
            raise LayerError(f"trt_param.deploy_outputs must name exactly one blob of the deploy net (the fork reads "
                             f"deploy_outputs(0) and CHECKs an engine of one input and one output), got {len(outputs)}")
        mode = TRT_MODES[int(p.trt_mode)]
        if mode == "INT8" and not p.calibrator:
            raise LayerError("trt_param.calibrator must name the INT8 calibration table (trt_mode INT8, the "
                             "default: the fork's calibrator CHECKs that the file opens)")
        return {"name": lp.name, "top": lp.top[0], "mode": mode, "top_k": int(p.top_k), "deploy": p.deploy,
                "model": p.model, "output": outputs[0], "calibrator": p.calibrator}

    def infer(self, attrs, in_shapes):
        self._check_top_k(attrs, in_shapes)
        raise needs_input_shape(attrs, attrs["top"], f"TRT's top is (1, the dims of output '{attrs['output']}' of "
                                f"the TensorRT engine built from {attrs['deploy']})",
                                lacking="without the TensorRT engine")

    def param_shapes(self, attrs, in_shapes):
        # the graph builder calls this for every sizing, also when --input-shape gives the top and infer is
        # skipped; the fork's Reshape CHECK holds whatever the engine's output is
        self._check_top_k(attrs, in_shapes)
        return None

    @staticmethod
    def _check_top_k(attrs, in_shapes):
        data, labels = count(in_shapes[0]), count(in_shapes[1])
        if labels == 0 or attrs["top_k"] > data // labels:
            raise LayerError(f"trt_param.top_k {attrs['top_k']} must be at most count(data) / count(labels) = "
                             f"{data} / {labels} (the fork's Reshape CHECK: the number of classes)")

    def why_not_run(self, attrs):
        return (f"runs a TensorRT engine ({attrs['mode']}) built from {attrs['deploy']} and {attrs['model']} "
                f"(output '{attrs['output']}'); caffeq does not run TensorRT")


__all__ = ["TRT"]
