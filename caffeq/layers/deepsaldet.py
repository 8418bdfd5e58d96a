"""Robert0812/deepsaldet's data layers (296c03c, caffe-sal: mcwindow_data_layer.cpp, namcwindow_data_layer.cpp).

Both read a window file as BVLC's WindowData does (each image's channels and size, then its windows),
and give, as their SetUp sizes them:
- MCWindowData (V1 MCWINDOW_DATA): data (N, C, crop, crop), then the image's saliency masks warped to
  (N, M, mask_crop_size, mask_crop_size), M the mask files the window file lists per image, then
  the label (N, 1, 1, 1);
- NAMCWindowData (V1 NAMCWINDOW_DATA): data and a second window of the image, both (N, C, crop, crop),
  then the label (N, 1, 1, 1).
C (3 for colour images) and M are in the window file only: C is taken as 3, as for WindowData; M must
be given with --input-shape.  Neither file is read while shapes are inferred.
"""
from .data import DataLayer, transform_attrs
from .registry import LayerError, needs_input_shape, register_layer


@register_layer("MCWindowData", "NAMCWindowData")
class SaliencyWindowData(DataLayer):
    def parse(self, lp):
        masks = lp.type == "MCWindowData"
        p = lp.mcwindow_data_param if masks else lp.namcwindow_data_param
        field = "mcwindow_data_param" if masks else "namcwindow_data_param"
        if not p.crop_size:
            raise LayerError(f"{field}.crop_size is required (the fork checks it is > 0)")
        if masks and not p.mask_crop_size:
            raise LayerError(f"{field}.mask_crop_size is required (the fork checks it is > 0)")
        return {"masks": masks, "batch_size": int(p.batch_size), "crop": int(p.crop_size),
                "mask_crop": int(p.mask_crop_size) if masks else 0, "source": p.source, "tops": list(lp.top),
                "num_tops": len(lp.top), "transform": transform_attrs(lp)}

    def data_shape(self, attrs):
        return (attrs["batch_size"], 3, attrs["crop"], attrs["crop"])

    def top_shapes(self, attrs, given):
        data = tuple(given.get(0) or self.data_shape(attrs))
        shapes = [data]
        if attrs["num_tops"] > 1:
            if 1 in given:
                shapes.append(tuple(given[1]))
            elif attrs["masks"]:
                raise needs_input_shape(attrs, attrs["tops"][1], f"the number of saliency masks per image is in "
                                        f"the window file '{attrs['source'] or '?'}', which is not read to infer "
                                        f"shapes")
            else:
                shapes.append(data)
        if attrs["num_tops"] > 2:
            shapes.append(tuple(given.get(2) or (data[0], 1, 1, 1)))
        return shapes

    def guessed_label_tops(self, attrs, given):
        return (0,) if 0 not in given else ()   # C = 3, as for WindowData: the window file tells
