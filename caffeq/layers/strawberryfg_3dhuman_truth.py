"""strawberryfg/c2f-3dhm-human-caffe 65da294's layers that read samples, build ground truth or score against it
(caffe_code/src/caffe/layers/Operations/{gen_sequential_index,gen_rand_index,gen_unified_data_and_label,
gen_heatmap_all_channels}_layer.cpp, DeepHumanModel/deep_human_model_{convert_2d,convert_3d,convert_depth,
h36m_gen_aug_3d,h36m_gen_pred_mono_3d,gen_3d_heatmap_in_more_detail_v3,output_joint_on_skeleton_map_h36m}_layer.cpp;
see caffeq/layers/strawberryfg_3dhuman.py).  Read and shaped as the fork's Reshape does; caffeq/training_layers.py
drops them from inference graphs (the index generators are ground-truth sources, `gives_ground_truth`; the
data layer's bottoms are not read, `bottoms_ignored_at_inference`); running one is refused in one line."""
from .registry import Layer, LayerError, need_blobs, positive_field, register_layer
from .strawberryfg_ops import WritesFilesOnly

#: the fork's h36m.h: JointNumAll_h36m, JointNumPart_h36m
ALL_JOINTS, PART_JOINTS = 32, 16


class _Truth(Layer):
    """A layer that needs the dataset's files or labels: read and shaped, never run."""
    why = "builds ground truth from the dataset"
    onnx_refusal = "reads the dataset's files or labels (ground truth), which no exported net has"

    def cannot_run(self, attrs, in_shapes):
        return f"{self.why}; caffeq runs it in no inference graph (read the net's prediction path)"

    def forward(self, attrs, params, *inputs):
        self.refuse_if_cannot_run(attrs.get("name", "?"), attrs, [tuple(x.shape) for x in inputs], LayerError)


class _Index(_Truth):
    gives_ground_truth = True
    field = ""
    why = "draws sample indexes of the dataset"

    def parse(self, lp):
        need_blobs(lp, self.types[0], 0, 1)
        p = getattr(lp, self.field)
        return {"name": lp.name, "batch": positive_field(p.batch_size, f"{self.field}.batch_size")}

    def infer(self, attrs, in_shapes):
        return [(attrs["batch"], 1)]


@register_layer("GenSequentialIndex")
class GenSequentialIndex(_Index):
    field = "gen_sequential_index_param"


@register_layer("GenRandIndex")
class GenRandIndex(_Index):
    field = "gen_rand_index_param"


@register_layer("GenUnifiedDataAndLabel")
class GenUnifiedDataAndLabel(_Truth):
    """The data layer: its tops image (N, 3, crop_size_y, crop_size_x) and 2-D label (N, 2 * num_parts)."""
    is_data = True
    bottoms_ignored_at_inference = True
    reading_note = ("GenUnifiedDataAndLabel crops and augments the image its sample index names: its image "
                    "(N, 3, crop_size_y, crop_size_x) is the net's input (N: the index's batch, 1 where the "
                    "index layer is gone; --input-shape or the batch option sets it)")

    def parse(self, lp):
        need_blobs(lp, "GenUnifiedDataAndLabel", range(0, 6), 2)
        t = lp.transform_param
        return {"name": lp.name, "crop_x": positive_field(t.crop_size_x, "transform_param.crop_size_x"),
                "crop_y": positive_field(t.crop_size_y, "transform_param.crop_size_y"),
                "joints": positive_field(t.num_parts, "transform_param.num_parts")}

    def infer(self, attrs, in_shapes):
        n = int(in_shapes[0][0]) if in_shapes and len(in_shapes[0]) else 1
        return [(n, 3, attrs["crop_y"], attrs["crop_x"]), (n, 2 * attrs["joints"])]

    def top_shapes(self, attrs, given):
        if 0 in given:
            n = int(given[0][0])
            return [tuple(given[0]), tuple(given.get(1, (n, 2 * attrs["joints"])))]
        return None


class _Joints(_Truth):
    """Top (N, width), N the first bottom's axis 0."""
    bottoms_count = 1

    def parse(self, lp):
        need_blobs(lp, self.types[0], self.bottoms_count, 1)
        return {"name": lp.name, **self.fields(lp)}

    def fields(self, lp):
        return {}

    def infer(self, attrs, in_shapes):
        if not len(in_shapes[0]):
            raise LayerError(f"{self.types[0]}: the bottom has no axes (the fork reads shape()[0])")
        return [(int(in_shapes[0][0]), self.width(attrs, in_shapes))]


@register_layer("DeepHumanModelConvert2D")
class Convert2D(_Joints):
    why = "maps the dataset's 2-D joints between its 32 and 16 joint sets"

    def width(self, attrs, in_shapes):
        return 2 * (ALL_JOINTS if len(in_shapes[0]) > 1 and int(in_shapes[0][1]) == 2 * PART_JOINTS else PART_JOINTS)


@register_layer("DeepHumanModelConvert3D")
class Convert3D(_Joints):
    why = "maps the dataset's 3-D joints between its 32 and 16 joint sets"

    def width(self, attrs, in_shapes):
        return 3 * (ALL_JOINTS if len(in_shapes[0]) > 1 and int(in_shapes[0][1]) == 3 * PART_JOINTS else PART_JOINTS)


@register_layer("DeepHumanModelConvertDepth")
class ConvertDepth(_Joints):
    bottoms_count = 2
    why = "converts depths against the true root joint's depth (its second bottom, ground truth)"

    def fields(self, lp):
        return {"joints": positive_field(lp.convert_depth_param.joint_num, "convert_depth_param.joint_num")}

    def width(self, attrs, in_shapes):
        return attrs["joints"]


@register_layer("DeepHumanModelH36MGenAug3D")
class GenAug3D(_Joints):
    bottoms_count = 7
    why = "projects the true 3-D joints with camera files named by the sample index"

    def fields(self, lp):
        return {"joints": positive_field(lp.gen_aug_3d_param.joint_num, "gen_aug_3d_param.joint_num")}

    def width(self, attrs, in_shapes):
        return 3 * attrs["joints"]


@register_layer("DeepHumanModelH36MGenPredMono3D")
class GenPredMono3D(_Joints):
    bottoms_count = 7
    why = "back-projects the prediction with the bounding box and camera files named by the sample index"

    def fields(self, lp):
        return {"joints": positive_field(lp.gen_pred_mono_3d_param.joint_num, "gen_pred_mono_3d_param.joint_num")}

    def width(self, attrs, in_shapes):
        return 3 * attrs["joints"]


@register_layer("GenHeatmapAllChannels")
class GenHeatmapAllChannels(_Joints):
    why = "renders label heatmaps from the true 2-D joints"

    def fields(self, lp):
        p = lp.gen_heatmap_all_channels_param
        return {"joints": positive_field(p.joint_num, "gen_heatmap_all_channels_param.joint_num"),
                "size": positive_field(p.gen_size, "gen_heatmap_all_channels_param.gen_size")}

    def infer(self, attrs, in_shapes):
        return [(int(in_shapes[0][0]), attrs["joints"], attrs["size"], attrs["size"])]


@register_layer("DeepHumanModelGen3DHeatmapInMoreDetailV3")
class Gen3DHeatmapInMoreDetailV3(_Joints):
    bottoms_count = 2
    why = "renders label 3-D heatmaps from the true joints and depths"

    def fields(self, lp):
        p = lp.deep_human_model_gen_3d_heatmap_in_more_detail_v3_param
        what = "deep_human_model_gen_3d_heatmap_in_more_detail_v3_param."
        return {"joints": positive_field(p.joint_num, what + "joint_num"),
                "depth": positive_field(p.depth_dims, what + "depth_dims"),
                "size": positive_field(p.map_size, what + "map_size")}

    def infer(self, attrs, in_shapes):
        return [(int(in_shapes[0][0]), attrs["joints"] * attrs["depth"], attrs["size"], attrs["size"])]


@register_layer("DeepHumanModelOutputJointOnSkeletonMapH36M")
class OutputJointOnSkeletonMapH36M(WritesFilesOnly):
    """Draws joints on the image into picture files; no tops.  caffeq writes none."""
    reading_note = ("DeepHumanModelOutputJointOnSkeletonMapH36M draws joints into picture files; caffeq writes "
                    "no files: the layer computes nothing here")

    def parse(self, lp):
        need_blobs(lp, "DeepHumanModelOutputJointOnSkeletonMapH36M", range(3, 5), 0)
        return {}


__all__ = ["Convert2D", "Convert3D", "ConvertDepth", "Gen3DHeatmapInMoreDetailV3", "GenAug3D",
           "GenHeatmapAllChannels", "GenPredMono3D", "GenRandIndex", "GenSequentialIndex", "GenUnifiedDataAndLabel",
           "OutputJointOnSkeletonMapH36M"]
