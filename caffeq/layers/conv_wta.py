"""SpatialConvWta of t2mhanh/caffe_convLSTM_WTA (4f31996; the repository's only source commit is 3b257ec).

Two of the fork's nets (examples/mnist_wta_autoencoder/mnist_wta_autoencoder3.prototxt and
mnist_wta_autoencoder_test.prototxt) use a layer of type SpatialConvWta with no parameters.  The fork does not
implement it: src/caffe/layers/spatial_wta_layer.cpp / .cu and include/caffe/layers/spatial_wta_layer.hpp
register only SpatialWta (caffeq/layers/wta.py), and the SpatialConvWtaLayer in spatial_wta_layer.cu is
commented out and incomplete (its Forward_gpu launches a kernel without the top; a per-channel maximum
indexed by n * c; neither built), as is the MATLAB sketch spatial_conv_Wta_layer.m.  Caffe built from the fork
stops on these nets with "Unknown layer type".  So nothing is computed here either: caffeq reads the layer,
sizes its top as its bottom (the nets' Deconvolution then EuclideanLoss against the data holds only so) and
refuses to run or export it.  The fork's working spatial sparsity is SpatialWta with global_wta (its
mnist_wta.prototxt), which a net must name to run.
"""
from .registry import LayerError, ReadOnlyLayer, need_blobs, register_layer

FORK = "t2mhanh/caffe_convLSTM_WTA"


@register_layer("SpatialConvWta")
class SpatialConvWta(ReadOnlyLayer):
    def parse(self, lp):
        need_blobs(lp, f"SpatialConvWta ({FORK})", 1, 1)
        return {"name": lp.name}

    def infer(self, attrs, in_shapes):
        if len(in_shapes[0]) != 4:
            raise LayerError(f"SpatialConvWta takes (N, C, H, W), got {list(in_shapes[0])}")
        return [tuple(in_shapes[0])]

    def why_not_run(self, attrs):
        return (f"{FORK} declares no SpatialConvWta (only commented-out, unbuilt code; its Caffe stops on the "
                "type); caffeq sizes the top as the bottom but cannot compute it (the fork's SpatialWta with "
                "spatial_wta_param { global_wta: true } is the implemented winner-take-all)")
