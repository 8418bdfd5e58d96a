"""cswaynecool/DRT's Wtf, Wtfsecond, Wtfthird and Wtffourth (324241c; caffe/src/caffe/layers/Wtf_layer.cpp /
.cu, Wtfsecond_layer.cpp / .cu, Wtfthird_layer.cpp / .cu, Wtffourth_layer.cpp / .cu, their shapes in
base_conv_layer.cpp, the classes in caffe/include/caffe/vision_layers.hpp, the mylayer* fields of
ConvolutionParameter in caffe/src/caffe/proto/caffe.proto).

Not convolutions at TEST, or at all as DRT runs them.  They subclass BaseConvolutionLayer and their CPU
forwards are BVLC's convolution, but the tracker runs the GPU forwards, which never convolve the bottom:
they are steps of DRT's correlation-filter solver in the Fourier domain (cuFFT), driven from MATLAB through
static Layer<Dtype> state that matcaffe sets before each call (feature_num, frame, sample_weight, the
shift masks, the filters and samples in the frequency domain); Wtf updates its own blobs (the filters) and
writes no top, Wtfthird writes a scalar inner product into its (1, 1, 1, 1) top, Wtfsecond and Wtffourth
the filter's response maps.  LayerSetUp and Reshape also read the feature sizes from ./data.txt.

So caffeq reads these layers, checks their convolution_param as BaseConvolutionLayer does and sizes the tops
the fork's Reshape gives, chosen by the mylayer* field (not the type): mylayerone (50, 1, 19, 19),
mylayertwo (2, c1, h1, h2) from data.txt (give it with --input-shape), mylayerthird (1, 1, 1, 1), anything
else (mylayerfourth) Convolution's (N, num_output, H_out, W_out) with the kernel spread by kstride.  Its blobs
(LayerSetUp): mylayerone or else mylayerfourth four or five filters sized by data.txt (left unsized),
else mylayerseventh one (1, 1, 9, 4) blob, else Convolution's weights; a bias when bias_term.  It
refuses to run or export them: nothing in a prototxt or caffemodel holds what their forwards read.
"""
from .conv import conv_out_size
from .registry import (
    LayerError,
    MissingInputShape,
    ReadOnlyLayer,
    four_axes,
    need_blobs,
    register_layer,
    spatial_params,
)

FORK = "cswaynecool/DRT"


@register_layer("Wtf", "Wtfsecond", "Wtfthird", "Wtffourth")
class DrtCorrelationFilter(ReadOnlyLayer):
    shape_from_user = True   # mylayertwo's top comes from the tracker's data.txt

    def parse(self, lp):
        need_blobs(lp, f"{lp.type} ({FORK})", range(1, 1 << 30), len(lp.bottom))
        p = lp.convolution_param
        if p.num_output < 1:
            raise LayerError(f"convolution_param.num_output must be >= 1, got {p.num_output}")
        kernel = spatial_params(p, 2, "kernel_size", None, min_value=1)
        stride = spatial_params(p, 2, "stride", 1, min_value=1)
        pad = spatial_params(p, 2, "pad", 0)
        ks = [int(v) for v in p.kstride] or [1]
        if len(ks) > 1 or p.HasField("kstride_h") != p.HasField("kstride_w") or (len(p.kstride) and p.HasField("kstride_h")):
            raise LayerError("convolution_param: kstride is kstride OR kstride_h and kstride_w (the fork's CHECK)")
        kstride = (int(p.kstride_h), int(p.kstride_w)) if p.HasField("kstride_h") else (ks[0], ks[0])
        if kstride[0] != 1 and tuple(stride) != (1, 1):
            raise LayerError("convolution_param: with kstride the stride must be 1 (the fork's CHECK)")
        group = int(p.group)
        if group < 1 or p.num_output % group:
            raise LayerError(f"convolution_param.num_output {p.num_output} must be a multiple of group {group}")
        flags = [f for f in ("mylayerone", "mylayertwo", "mylayerthird") if getattr(p, f)]
        return {"name": lp.name, "kind": lp.type, "mode": flags[0] if flags else "conv", "tops": list(lp.top),
                "num_output": int(p.num_output), "kernel": tuple(kernel), "stride": tuple(stride),
                "pad": tuple(pad), "kstride": kstride, "group": group, "bias": bool(p.bias_term),
                "blobs_from_file": bool(p.mylayerone or p.mylayerfourth), "dt_weights": bool(p.mylayerseventh)}

    def infer(self, attrs, in_shapes):
        n, c, h, w = four_axes(in_shapes[0], attrs["kind"])
        for s in in_shapes[1:]:
            if tuple(s) != (n, c, h, w):
                raise LayerError(f"{attrs['kind']}: every bottom must be shaped as the first, {[n, c, h, w]}, got "
                                 f"{list(s)} (the fork's CHECKs)")
        if c % attrs["group"]:
            raise LayerError(f"{attrs['kind']}: the bottom's {c} channels must be a multiple of group {attrs['group']}")
        attrs["_channels"] = c
        mode = attrs["mode"]
        if mode == "mylayerone":
            return [(50, 1, 19, 19)] * len(attrs["tops"])
        if mode == "mylayerthird":
            return [(1, 1, 1, 1)] * len(attrs["tops"])
        if mode == "mylayertwo":
            raise MissingInputShape(f"{attrs['kind']} with mylayertwo shapes its top (2, c1, h1, h2) from the "
                                    f"tracker's ./data.txt; give it with --input-shape {attrs['tops'][0]}=2,C,H,W")
        out = [conv_out_size(size, k, st, pd, ks) for size, k, st, pd, ks in zip(
            (h, w), attrs["kernel"], attrs["stride"], attrs["pad"], attrs["kstride"])]
        if min(out) < 1:
            raise LayerError(f"{attrs['kind']}: the output would be empty for a {h} x {w} bottom")
        return [(n, attrs["num_output"], out[0], out[1])] * len(attrs["tops"])

    def param_shapes(self, attrs, in_shapes):
        if attrs["blobs_from_file"]:
            return None   # four or five (2, c_i, h_i, (w_i + 1) / 2) filters sized by ./data.txt
        c = int(in_shapes[0][1])
        if attrs.get("dt_weights"):   # mylayerseventh: the distance transform's (1, 1, 9, 4) variables
            shapes = [(1, 1, 9, 4)]
        else:
            shapes = [(attrs["num_output"], c // attrs["group"]) + tuple(attrs["kernel"])]
        return shapes + [(attrs["num_output"],)] if attrs["bias"] else shapes

    def why_not_run(self, attrs):
        return (f"{FORK}'s correlation-filter solver step, not a convolution: its GPU forward reads the MATLAB "
                "tracker's frequency-domain filters, samples and masks from static layer state and ./data.txt, "
                "none of which a prototxt or caffemodel holds")


__all__ = ["DrtCorrelationFilter"]
