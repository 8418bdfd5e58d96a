"""superxuang/caffe_triple-branch_FCN: a 3-D FCN that localizes organs in CT volumes from three projections.

Read from the fork at 996026a (src/caffe/proto/caffe.proto; src/caffe/layers/mhd_roi_data_layer.cpp,
multi_slice_predict_layer.cpp, pooling3d_layer.cpp/.cu and their headers in include/caffe/layers):
- MHDRoiData with this fork's mhd_data_param (resample_size_x/y/z and the other fields it adds): the
  same type as caffe_3d_faster_rcnn's (caffeq/layers/frcnn3d.py) with other tops.  A layer that sets one
  of this fork's fields, or has 5 tops, is read here.  Tops: data (batch_size, 3, resample_size_z,
  resample_size_y, resample_size_x) (the header defines USE_MULTI_CHANNEL: the clipped and rescaled CT,
  an enhanced window exp(-v^2) and a Sobel edge map), im_info (batch_size, 19) and, with 5 tops, the three
  projection labels (batch_size, 1, classes x resample_size_z / _y / _x), classes being the names in
  contour_name_list.  LayerSetUp sizes the tops with batch 1; each batch (load_batch) with batch_size:
  caffeq sizes the net with batch_size.  A graph input: caffeq reads no MetaImage files.
- MultiSlicePredict (slice_predict_param: source, output_path, contour_name_list; bottoms im_info and
  the axial, coronal and sagittal probabilities, no top): for each volume and class, the longest run of
  foreground probabilities > 0.5 along each axis gives a box, written with its mean probability to
  `<output_path><file name>.pred.txt`.  Its Forward CHECKs that each probability bottom's axis 2 is the
  volume's size (from im_info's values) times the classes.  Read and sized (no top), not run: caffeq does
  not write those files.
- Pooling3D with pooling_3d_param: the fork's pooling3d_layer.cpp/.cu are caffe_3d_faster_rcnn's (the
  method read from pooling_param.pool), read by frcnn3d.py's spec.
"""
from .data import DataLayer
from .registry import LayerError, ReadOnlyLayer, claim_layers, need_blobs, register_layer

#: the fields this fork adds to MHDDataParameter (caffe_3d_faster_rcnn's message has none of them)
FORK_FIELDS = ("resample_size_x", "resample_size_y", "resample_size_z", "buffer_path", "buffer_exist",
               "extract_direction", "shrink_factor_x", "shrink_factor_y", "shrink_factor_z",
               "resample_slice_spacing_x", "resample_slice_spacing_y")


def _is_triple_branch(lp):
    p = lp.mhd_data_param
    return len(lp.top) == 5 or any(p.HasField(f) for f in FORK_FIELDS)


@claim_layers("MHDRoiData", _is_triple_branch)
class TripleBranchMHDRoiData(DataLayer):
    """This fork's CT reader: tops data, im_info [, label_a, label_c, label_s]."""

    def parse(self, lp):
        if len(lp.bottom) or len(lp.top) not in (2, 5):
            raise LayerError(f"MHDRoiData (superxuang/caffe_triple-branch_FCN) takes no bottom and 2 tops (data, "
                             f"im_info) or 5 (and label_a, label_c, label_s), got {len(lp.bottom)} and {len(lp.top)}")
        p = lp.mhd_data_param
        size = (int(p.resample_size_z), int(p.resample_size_y), int(p.resample_size_x))
        for axis, value in zip("zyx", size):
            if value < 1:
                raise LayerError(f"mhd_data_param.resample_size_{axis} must be >= 1, got {value}")
        if p.batch_size < 1:
            raise LayerError(f"mhd_data_param.batch_size must be >= 1, got {p.batch_size}")
        classes = len(p.contour_name_list.name)
        if len(lp.top) == 5 and not classes:
            raise LayerError("mhd_data_param.contour_name_list names no class: the label tops would be empty")
        return {"type": lp.type, "tops": list(lp.top), "num_tops": len(lp.top), "source": p.source,
                "batch": int(p.batch_size), "size": size, "classes": classes,
                "intensity": (float(p.min_intensity), float(p.max_intensity))}

    def top_shapes(self, attrs, given):
        z, y, x = attrs["size"]
        data = tuple(given.get(0) or (attrs["batch"], 3, z, y, x))
        n = data[0]
        shapes = [data, tuple(given.get(1) or (n, 19))]
        if attrs["num_tops"] == 5:
            k = attrs["classes"]
            shapes += [tuple(given.get(i) or (n, 1, k * s)) for i, s in zip((2, 3, 4), (z, y, x))]
        return shapes

    def guessed_label_tops(self, attrs, given):
        return ()

    def preprocessing(self, attrs):
        z, y, x = attrs["size"]
        lo, hi = attrs["intensity"]
        return [f"MetaImage (.mhd) CT volumes listed in {attrs['source']!r}, resampled to {x} x {y} x {z} voxels",
                f"channel 0: intensities clipped to [{lo}, {hi}] and scaled to [0, 1]; channel 1: exp(-v^2) of "
                f"v = (x - (100 - min) / (max - min)) / (150 / (max - min)); channel 2: its Sobel edge magnitude",
                "im_info: 19 values (size, spacing and origin of the volume after and before resampling, then 1)"]


@register_layer("MultiSlicePredict")
class MultiSlicePredict(ReadOnlyLayer):
    """Writes each volume's organ boxes to text files (see the module doc): read and sized, not run."""

    def parse(self, lp):
        need_blobs(lp, "MultiSlicePredict", 4, 0, "im_info, axial, coronal and sagittal probabilities")
        p = lp.slice_predict_param
        classes = len(p.contour_name_list.name)
        if not classes:
            raise LayerError("slice_predict_param.contour_name_list names no class")
        return {"name": lp.name, "classes": classes, "output": p.output_path}

    def infer(self, attrs, in_shapes):
        info = in_shapes[0]
        if len(info) < 2 or info[1] < 18:
            raise LayerError(f"MultiSlicePredict reads 18 im_info values a volume, got im_info {list(info)}")
        k = attrs["classes"]
        for role, shape in zip(("axial", "coronal", "sagittal"), in_shapes[1:]):
            if len(shape) < 3:   # its Forward reads shape(2)
                raise LayerError(f"MultiSlicePredict: the {role} probabilities need 3 axes (N, 2, classes x size), "
                                 f"got {list(shape)}")
            n, c, length = shape[:3]
            if n != info[0]:
                raise LayerError(f"MultiSlicePredict: the {role} probabilities have {n} volumes, im_info {info[0]}")
            if c < 2 or length % k:
                raise LayerError(f"MultiSlicePredict: the {role} probabilities must be (N, 2, {k} x size) "
                                 f"(background, foreground), got {list(shape)}")
        return []

    def why_not_run(self, attrs):
        return (f"writes each volume's organ boxes to text files under {attrs['output']!r} (named from "
                f"slice_predict_param.source's list): it has no top, and caffeq does not write those files")
