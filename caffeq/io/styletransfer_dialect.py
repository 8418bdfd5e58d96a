"""shenfalong/styletransfer's own Caffe dialect at the net level (its caffe.proto, cebf7e2): `input_blob` net
inputs, memory-flow fields, and the defaults of its convolutions and inner products (bias_term) and of its
Pooling.  Its string `pool` values are read token by token in io/prototxt.py's parser.

Pooling (src/caffe/proto/caffe.proto PoolingParameter: `optional string pool = 1 [default = "ave"]`;
src/caffe/layers/activation/pooling_layer.cpp Reshape and pooling_layer.cu Forward_gpu): a Pooling without a
`pool` line averages, and every Pooling sizes its output (H + 2 pad - kernel) / stride + 1 in integer division
(floor), whatever the method; its AVE divides by the window clipped at H + pad (never short under floor) and its
MAX starts from -FLT_MAX, both as BVLC.  In the fork's dialect a Pooling that leaves `pool` unset reads as AVE,
and one that leaves the rounding unset as round_mode FLOOR; elsewhere BVLC's MAX and CEIL stay."""
from ..errors import ParseError
from .schema import caffe_pb2


def styletransfer_inputs(net, path, warnings):
    """shenfalong/styletransfer's `input_blob { name num channels height width }` (its NetParameter; its pycaffe
    makes one input blob of that shape for each) as `input` / `input_shape`; its layers' bottom_flow / top_flow
    (which memory buffer a blob shares) leave the numbers alone and are ignored, with a note.  Either marks the
    fork's dialect, whose convolutions and inner products have no bias unless bias_term says so, and whose
    Pooling averages unless `pool` says otherwise and always rounds down."""
    had_input_blob = bool(len(net.input_blob))
    if had_input_blob:
        if len(net.input) or len(net.input_dim) or len(net.input_shape):
            raise ParseError(f"{path}: sets both input_blob (shenfalong/styletransfer's net inputs) and "
                             f"input / input_dim / input_shape; give the inputs one way")
        for blob in net.input_blob:
            if not blob.name:
                raise ParseError(f"{path}: an input_blob without a name")
            net.input.append(blob.name)
            net.input_shape.add().dim.extend([blob.num, blob.channels, blob.height, blob.width])
        net.ClearField("input_blob")
        if warnings is not None:
            warnings.append(f"{path}: input_blob (shenfalong/styletransfer's net inputs) read as input / input_shape")
    flows = any(len(lp.bottom_flow) or len(lp.top_flow) for lp in net.layer)
    if warnings is not None and flows:
        warnings.append(f"{path}: bottom_flow / top_flow (shenfalong/styletransfer's sharing of blob memory between "
                        f"layers) ignored: the same numbers without it")
    if had_input_blob or flows:
        _styletransfer_bias_defaults(net, path, warnings)
        _styletransfer_pooling_defaults(net, path, warnings)


# the fork's ConvolutionParameter / InnerProductParameter: bias_term [default = false]
_STYLETRANSFER_BIAS = {"CuDNNConvolution": "convolution_param", "CuDNNDeConvolution": "convolution_param",
                       "Convolution": "convolution_param", "DeConvolution": "convolution_param",
                       "Deconvolution": "convolution_param", "InnerProduct": "inner_product_param"}


def _styletransfer_bias_defaults(net, path, warnings):
    """In a net of shenfalong/styletransfer's dialect (input_blob or flows), a convolution or inner product that
    leaves bias_term unset has no bias (the fork's default); elsewhere BVLC's default (a bias) stays, e.g. for
    strawberryfg's CuDNNConvolution nets, whose caffe.proto is BVLC's."""
    unset = []
    for lp in net.layer:
        field = _STYLETRANSFER_BIAS.get(lp.type)
        if field and not getattr(lp, field).HasField("bias_term"):
            getattr(lp, field).bias_term = False
            unset.append(lp.name)
    if unset and warnings is not None:
        warnings.append(f"{path}: {len(unset)} layer(s) without bias_term ({', '.join(map(repr, unset[:3]))}"
                        f"{', ...' if len(unset) > 3 else ''}) read with shenfalong/styletransfer's default "
                        f"bias_term: false")


# rounding fields caffeq's PoolingParameter reads (pooling.py _round_mode); the fork has none of them
_ROUNDING_FIELDS = ("round_mode", "ceil_mode", "cmp_out_shape_floor_as_conv")


def _styletransfer_pooling_defaults(net, path, warnings):
    """In a net of shenfalong/styletransfer's dialect, a Pooling without `pool` is the fork's default "ave", and one
    without a rounding field rounds down as the fork's Reshape does (a `pool: "max"` / `"ave"` line already set
    FLOOR in the parser)."""
    averaged, floored = [], []
    for lp in net.layer:
        if lp.type != "Pooling":
            continue
        p = lp.pooling_param
        if not p.HasField("pool"):
            p.pool = caffe_pb2.PoolingParameter.AVE
            averaged.append(lp.name)
        if not any(f in p.DESCRIPTOR.fields_by_name and p.HasField(f) for f in _ROUNDING_FIELDS):
            p.round_mode = caffe_pb2.PoolingParameter.FLOOR
            floored.append(lp.name)
    if warnings is None:
        return
    if averaged:
        warnings.append(f"{path}: {len(averaged)} Pooling layer(s) without pool ({_names(averaged)}) read with "
                        f"shenfalong/styletransfer's default pool: \"ave\" (AVE), not BVLC's MAX")
    if floored:
        warnings.append(f"{path}: {len(floored)} Pooling layer(s) without a rounding field ({_names(floored)}) read "
                        f"with shenfalong/styletransfer's floor rounding (its Reshape), not BVLC's ceil")


def _names(names):
    return ", ".join(map(repr, names[:3])) + (", ..." if len(names) > 3 else "")
