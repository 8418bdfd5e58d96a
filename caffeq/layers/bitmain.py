"""Bitmain's BM1880 toolchain (BM1880-BIRD/bm1880-bmnnsdk-usb's bmtap2): BMNet, a sub-graph compiled into a
.bmodel file that the chip (or its simulator) runs, read and sized, not run.  bmnet_param.output_shape gives one
shape per top (data_type_size only says how the chip stores it); the bottoms go in as input_shape says, int8
ones quantized by in_threshold.  The weights live only in the .bmodel (bmnet_param.bmodel), so no forward can
be computed from the prototxt; the sub-graph's float net is the prototxt it was compiled from.
"""
from .registry import LayerError, ReadOnlyLayer, register_layer


@register_layer("BMNet")
class BMNet(ReadOnlyLayer):
    def parse(self, lp):
        p = lp.bmnet_param
        if not lp.top:
            raise LayerError("BMNet needs at least one top")
        if len(p.output_shape) != len(lp.top):
            raise LayerError(f"bmnet_param gives {len(p.output_shape)} output_shape(s) for {len(lp.top)} tops "
                             "(one per top, in top order)")
        shapes = [tuple(int(d) for d in s.dim) for s in p.output_shape]
        for top, shape in zip(lp.top, shapes):
            if not shape or min(shape) < 1:
                raise LayerError(f"bmnet_param.output_shape of top '{top}' must have dimensions >= 1, got {list(shape)}")
        inputs = [tuple(int(d) for d in s.dim) for s in p.input_shape]
        if inputs and len(inputs) != len(lp.bottom):
            raise LayerError(f"bmnet_param gives {len(inputs)} input_shape(s) for {len(lp.bottom)} bottoms")
        return {"name": lp.name, "outputs": shapes, "inputs": inputs, "bmodel": p.bmodel}

    def infer(self, attrs, in_shapes):
        for i, (want, got) in enumerate(zip(attrs["inputs"], in_shapes)):
            if want and tuple(got) != want:
                raise LayerError(f"bottom {i} is {list(got)}; bmnet_param.input_shape says {list(want)} (the shape "
                                 "the bmodel was compiled for)")
        return list(attrs["outputs"])

    def why_not_run(self, attrs):
        where = f" ({attrs['bmodel']})" if attrs["bmodel"] else ""
        return (f"a sub-graph compiled for Bitmain's BM1880 chip{where}: its weights are in the .bmodel, not the "
                "prototxt; caffeq reads and sizes it but cannot run it")


__all__ = ["BMNet"]
