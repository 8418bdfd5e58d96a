"""ConvolutionLSTM of zachluo/convlstm_anomaly_detection (d86b4ea; src/caffe/layers/conv_lstm_layer.cpp,
conv_lstm_unit_layer.cpp/.cu, include/caffe/layers/conv_lstm_layer.hpp, src/caffe/layers/recurrent_layer.cpp;
fields in src/caffe/proto/caffe.proto RecurrentParameter 6/7, here 10006/10007).

Like BVLC's RecurrentLayer the fork unrolls a net over T (x: T x N x C_in x H x W, cont: T x N; one top
h: T x N x D x H' x W', D = recurrent_param.num_output):
    W_xc_x = conv(x, W_xc) + b_c            (wxc_convolution_param, num_output 4D, bias always on)
    gates_t = conv(cont_t h_{t-1}, W_hc) + W_xc_x_t   (whh_convolution_param, num_output 4D, never a bias)
    i, f, o = sigmoid(gates i, f, o), g = tanh(gate g)     (4 blocks of D channels in that order)
    c_t = cont_t f c_{t-1} + i g,  h_t = o tanh(c_t)
This is the GPU unit (conv_lstm_unit_layer.cu) and agrees with caffeq's ConvLSTM (caffeq/layers/conv_lstm.py,
whose helpers run it) with no peepholes, no exposed states, and the bias on the input convolution instead
of the hidden one (the same sum).  The fork's CPU unit indexes X[d + idx] and steps its pointers by
hidden_dim + H*W (not times): it reads the wrong elements whenever D, H or W > 1, so the GPU unit is the one
this follows.  Blobs: W_xc (4D, C_in, k, k), b_c (4D), W_hc (4D, D, k, k), in that order.

The initial h_0 and c_0 are zero (the fork's Forward copies the previous Forward's h_T / c_T into them;
they matter only where the first cont is non-zero; caffeq's nets are stateless).  caffeq reads the
convolutions that keep H x W (the fork's shapes need W_hc to keep the input convolution's size; the
corpus's 3 x 3, pad 1, stride 1 blocks keep it).  expose_hidden and a static input are refused (the fork
leaves static input unimplemented).
"""
from __future__ import annotations

from .conv_lstm import ConvLSTM, _read_conv
from .registry import LayerError, need_blobs, register_layer


@register_layer("ConvolutionLSTM")
class ConvolutionLSTM(ConvLSTM):
    def parse(self, lp):
        rp = lp.recurrent_param
        need_blobs(lp, "ConvolutionLSTM", 2, 1, roles="x, cont")
        if rp.expose_hidden:
            raise LayerError("ConvolutionLSTM: recurrent_param.expose_hidden is not read by caffeq")
        if rp.num_output < 1:
            raise LayerError("ConvolutionLSTM: recurrent_param.num_output must be positive "
                             "(the fork CHECKs it)")
        for f in ("wxc_convolution_param", "whh_convolution_param"):
            if not rp.HasField(f):
                raise LayerError(f"ConvolutionLSTM needs recurrent_param.{f}")
        # conv_lstm_layer.cpp's RecurrentInputShapes sizes h_0/c_0 from kernel_size(0), pad(0), stride(0)
        why = "conv_lstm_layer.cpp sizes h_0 and c_0 from kernel_size, pad and stride"
        conv_x = _read_conv(rp.wxc_convolution_param, "x", "recurrent_param.wxc_convolution_param", why)
        conv_h = _read_conv(rp.whh_convolution_param, "h", "recurrent_param.whh_convolution_param", why)
        # the fork forces bias_term true on W_xc and false on W_hc; "bias" here marks b_c
        conv_x["bias"] = False
        conv_h["bias"] = True
        return {"num_output": int(rp.num_output), "expose_hidden": False, "expose": [],
                "ignore_x": False, "hadamard": False, "conv_x": conv_x, "conv_h": conv_h,
                "axis_hadamard": 3, "num_axes_hadamard": 2}

    def _check(self, attrs, in_shapes):
        try:
            return super()._check(attrs, in_shapes)
        except LayerError as e:
            msg = str(e).replace("lstm_conv_param (input)", "recurrent_param.wxc_convolution_param")
            msg = msg.replace("lstm_conv_param (hidden)", "recurrent_param.whh_convolution_param")
            raise LayerError(msg.replace("the fork's ConvLSTM needs", "caffeq reads ConvolutionLSTM with")) from None

    def blob_names_for(self, attrs):
        # W_xc, b_c, W_hc (conv_lstm_layer.cpp's param names); b_c is added once per step like b_h
        return ("W_x", "b_h", "W_h")

    def param_shapes(self, attrs, in_shapes):
        _, _, c_in, c, _, _ = self._check(attrs, in_shapes)
        cx, ch = attrs["conv_x"], attrs["conv_h"]
        return [(4 * c, c_in // cx["group"]) + cx["kernel"], (4 * c,), (4 * c, c // ch["group"]) + ch["kernel"]]
