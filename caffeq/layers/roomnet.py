"""FengyangZhang/caffe_roomnet (5f05a94), the Caffe of RoomNet's room-layout nets.

- HeatmapVisualize (src/caffe/layers/heatmap_visualize_layer.cpp, include/caffe/layers/
  heatmap_visualize_layer.hpp): a LossLayer whose Reshape and LayerSetUp do nothing.  Each forward writes
  every channel of its one bottom, scaled by 255 / its maximum, as test/<image>-<channel>.png; its top
  stays an empty blob, with no loss weight.  caffeq writes no file: the top is empty here too, and the
  exports leave it out as they leave out the layers that only serve training and evaluation (a note says so).
"""
from .registry import Layer, register_layer


@register_layer("HeatmapVisualize")
class HeatmapVisualize(Layer):
    is_training_only = True
    bottoms, tops = 1, 1
    reading_note = ("HeatmapVisualize only writes its bottom's channels as PNG files (test/<image>-<channel>.png) "
                    "at every forward and leaves its top empty: caffeq writes no file, and exports leave it out")

    def infer(self, attrs, in_shapes):
        return [(0,)]   # Caffe never reshapes the top

    def forward(self, attrs, params, x):
        return x.new_zeros((0,))
