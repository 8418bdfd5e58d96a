"""CRF-RNN's MultiStageMeanfield: mean-field inference of a dense CRF as a layer (Zheng et al., ICCV 2015).

torrvision/crfasrnn caffe-crfrnn (zimenglan-sysu-512/crfasrnn 4606956 and thuanvh/crfasrnn carry it):
src/caffe/layers/multi_stage_meanfield.cpp, meanfield_iteration.cpp, util/modified_permutohedral.cpp.
Bottoms (unary U, Q0, image), top = U's shape (N, C, H, W); blobs spatial weights Ws, bilateral weights
Wb and compatibility mu, each (1, 1, C, C) and used as C x C matrices.  For each image, with P = H x W
pixels at (x, y) = (p mod W, p div W):
- a spatial lattice over (x / theta_gamma, y / theta_gamma) and a bilateral one over (x / theta_alpha,
  y / theta_alpha, r / theta_beta, g / theta_beta, b / theta_beta), r g b the image's channels 0, 1, 2
  as they are (the deploy nets feed the mean-subtracted BGR data);
- their normalizers 1 / (filter(1) + 1e-20);
- num_iterations times, from Q = Q0: prob = softmax over channels of Q;
  message = Ws (norm_s filter_s(prob)) + Wb (norm_b filter_b(prob)); Q = U - mu message.
The top is the last Q, not normalized.  The lattice and its filter are permutohedral.py's.  The GPU
forward of later versions (modified_permutohedral.cu) builds the same lattice; its sums run in another
order.

jasonbunk/caffe (3b8bb55: src/caffe/layers/multi_stage_meanfield.cpp, meanfield_iteration.cpp) adds
do_softmax (default true): false copies Q in place of its softmax before the messages
(MeanfieldIteration::Forward_cpu); only a file that sets it false reads differently.

ZhiwenShao/ARL's MultiStageMeanfieldAU3 (au_forks.py) is the same inference with its third bottom's
every channel as the bilateral features (over theta_beta): crf_rnn_meanfield serves both.

danxuhk/ContinuousCRF-CNN's continuous CRF (CVPR 2017; its deploy files say MultiStageMeanfield with
spatial_weight / bilateral_weight; the repository's code, b73cdef, renamed the layer
MultiContinuousMeanfield: src/caffe/layers/multi_continuous_meanfield.cpp,
continuous_meanfield_iteration.cpp, the same ModifiedPermutohedral): bottoms (hidden variables Z0,
observations U, image), two blobs Ws, Wb (1, 1, C, C) whose diagonals start at spatial_weight and
bilateral_weight; num_iterations times Z = (U + message(Z)) x 1 / (message(1) + 1), message as above
with the C x P ones as the values (no softmax, no compatibility); the top is the last Z.

nathanin/caffe-segnet-crf (41e60779, CRF-RNN's caffe-crfrnn variant) adds spatial_filter_weights_str and
bilateral_filter_weights_str: space-separated values whose first C seed the diagonals of blobs 0 and 1
when no weights are loaded (CommonUtils::read_into_the_diagonal; fewer than C values is the fork's
"malformed string" error), the compatibility blob starting at -identity (Potts); force_cpu only picks
the CPU lattice.  The blobs stay three (1, 1, C, C).

ONNX (opset 16 and later): the bilateral lattice is built in the graph from the image with Unique and
ScatterElements(add) (permutohedral_onnx.py); the spatial one, which the shapes alone decide, is a constant.
"""
import numpy as np
import torch

from ..errors import ExportError
from .permutohedral import LATTICE_HELPERS, permutohedral_filter, permutohedral_lattice, pixel_xy
from .permutohedral_onnx import OnnxLattice
from .registry import Layer, LayerError, need_blobs, register_layer


def crf_rnn_meanfield(first, second, guide, spatial_weight, bilateral_weight, compatibility, iterations: int,
                      theta_alpha: float, theta_beta: float, theta_gamma: float, continuous: bool = False,
                      softmax: bool = True):
    """CRF-RNN's mean-field iterations on (N, C, H, W) unaries `first` from Q0 `second`, or ContinuousCRF-CNN's
    from hidden variables `first` and observations `second` (continuous; compatibility unused); guide
    (N, K, H, W) holds the channels that the bilateral kernel compares.  softmax=False (jasonbunk/caffe's
    do_softmax: false) passes Q to the messages as it is.  Computed in float32 as the forks; the top takes
    the first bottom's dtype."""
    n, c, h, w = first.shape
    f32, dev = torch.float32, first.device
    xy = pixel_xy(h, w, dev)
    ones = torch.ones(1, h * w, dtype=f32, device=dev)

    def theta(value):
        return torch.tensor(value, dtype=f32, device=dev)

    spatial = permutohedral_lattice(xy / theta(theta_gamma))
    spatial_norm = 1 / (permutohedral_filter(ones, *spatial) + 1e-20)
    ws, wb = (m.reshape(c, c).to(f32) for m in (spatial_weight, bilateral_weight))
    tops = []
    for b in range(n):
        features = torch.cat([xy / theta(theta_alpha), guide[b].reshape(guide.shape[1], -1).t().to(f32)
                              / theta(theta_beta)], 1)
        bilateral = permutohedral_lattice(features)
        bilateral_norm = 1 / (permutohedral_filter(ones, *bilateral) + 1e-20)

        def message(x):   # the two kernels' normalized filters, weighted
            return (ws @ (spatial_norm * permutohedral_filter(x, *spatial))
                    + wb @ (bilateral_norm * permutohedral_filter(x, *bilateral)))

        start, given = first[b].reshape(c, -1).to(f32), second[b].reshape(c, -1).to(f32)
        if continuous:   # Z = (observations + message(Z)) / (1 + message(1))
            scale = 1 / (message(torch.ones(c, h * w, dtype=f32, device=dev)) + 1)
            z = start
            for _ in range(iterations):
                z = (given + message(z)) * scale
        else:   # Q = U - mu message(softmax(Q))
            mu = compatibility.reshape(c, c).to(f32)
            z = given
            for _ in range(iterations):
                z = start - mu @ message(torch.softmax(z, 0) if softmax else z)
        tops.append(z.reshape(c, h, w))
    return torch.stack(tops).to(first.dtype)


def meanfield_attrs(lp, p, param_field):
    """The settings every CRF-RNN mean-field variant reads from its parameter message `p`."""
    if p.num_iterations <= 1:
        raise LayerError(f"{param_field}.num_iterations must be > 1 (the fork's check), got {p.num_iterations}")
    return {"name": lp.name, "iterations": int(p.num_iterations), "theta_alpha": float(p.theta_alpha),
            "theta_beta": float(p.theta_beta), "theta_gamma": float(p.theta_gamma)}


@register_layer("MultiStageMeanfield")
class MultiStageMeanfield(Layer):
    blob_names = ("spatial_weight", "bilateral_weight", "compatibility")
    guide = "image"   # what the third bottom holds, for the messages
    #: how many of the guide's channels the bilateral kernel reads (None: all)
    guide_channels = 3

    def parse(self, lp):
        need_blobs(lp, "MultiStageMeanfield", 3, 1, "unary, Q0, image")
        p = lp.multi_stage_meanfield_param
        continuous = p.HasField("spatial_weight") or p.HasField("bilateral_weight")
        return dict(meanfield_attrs(lp, p, "multi_stage_meanfield_param"),
                    # ContinuousCRF-CNN's continuous CRF keeps two kernel weights and no compatibility matrix
                    continuous=continuous,
                    start_diagonals=[float(p.spatial_weight), float(p.bilateral_weight)] if continuous else None,
                    diagonals=[p.spatial_filter_weights_str, p.bilateral_filter_weights_str]
                    if p.spatial_filter_weights_str or p.bilateral_filter_weights_str else None,
                    # jasonbunk/caffe's do_softmax: false skips each iteration's softmax
                    no_softmax=p.HasField("do_softmax") and not p.do_softmax)

    def infer(self, attrs, in_shapes):
        unary, q0, guide = (tuple(s) for s in in_shapes)
        what = self.types[0]
        if len(unary) != 4:
            raise LayerError(f"{what} needs a 4-axis unary (N, C, H, W), got {list(unary)}")
        if q0 != unary:
            raise LayerError(f"{what}'s Q0 must have the unary's shape {list(unary)}, got {list(q0)}")
        if len(guide) != 4 or guide[0] != unary[0] or guide[2:] != unary[2:]:
            raise LayerError(f"{what}'s {self.guide} must share the unary's N, H and W "
                             f"{list(unary)}, got {list(guide)}")
        return [unary]

    def param_shapes(self, attrs, in_shapes):
        c = in_shapes[0][1]
        return [(1, 1, c, c)] * (2 if attrs.get("continuous") else 3)

    def blob_names_for(self, attrs):
        return self.blob_names[:2] if attrs.get("continuous") else self.blob_names

    def init_params(self, attrs, shapes, rng):
        """The forks' start without weights: ContinuousCRF-CNN's diagonals spatial_weight and
        bilateral_weight; caffe-segnet-crf's kernel weights' diagonals from the two strings, the
        compatibility -identity; other variants: the default fill."""
        c = shapes[0][-1]
        if attrs.get("continuous"):
            return [(np.eye(c, dtype=np.float32) * np.float32(v)).reshape(1, 1, c, c)
                    for v in attrs["start_diagonals"]]
        if not attrs.get("diagonals"):
            return super().init_params(attrs, shapes, rng)
        blobs = []
        for field, text in zip(("spatial_filter_weights_str", "bilateral_filter_weights_str"), attrs["diagonals"]):
            tokens = text.split(" ")[:c]
            try:
                values = [float(t) for t in tokens]
            except ValueError:
                values = []
            if len(values) < c:
                raise LayerError(f"multi_stage_meanfield_param.{field} {text!r}: the fork reads {c} "
                                 f"space-separated numbers into the diagonal (one per class)")
            blobs.append(np.diag(np.array(values, np.float32)).reshape(1, 1, c, c))
        blobs.append(-np.eye(c, dtype=np.float32).reshape(1, 1, c, c))
        return blobs

    def cannot_run(self, attrs, in_shapes):
        if self.guide_channels and in_shapes[2][1] < self.guide_channels:
            return (f"the bilateral kernel reads the {self.guide}'s first {self.guide_channels} channels, "
                    f"and it has {in_shapes[2][1]} (the fork would read past the blob)")
        return None

    def _call_args(self, attrs):
        return (attrs["iterations"], attrs["theta_alpha"], attrs["theta_beta"], attrs["theta_gamma"],
                bool(attrs.get("continuous"))) + ((False,) if attrs.get("no_softmax") else ())

    def forward(self, attrs, params, first, second, guide):
        self.refuse_if_cannot_run(attrs["name"], attrs, [first.shape, second.shape, guide.shape], LayerError)
        if self.guide_channels:
            guide = guide[:, :self.guide_channels]
        weights = list(params) + [None] * (3 - len(params))   # the continuous CRF has no compatibility
        return crf_rnn_meanfield(first, second, guide, *weights, *self._call_args(attrs))

    def macs(self, attrs, in_shapes, out_shapes):
        n, c, h, w = in_shapes[0]
        return n * attrs["iterations"] * 3 * c * c * h * w

    def onnx(self, ctx, node):
        a = node.attrs
        shapes = [ctx.shape(t) for t in node.inputs]
        self.refuse_if_cannot_run(node.name, a, shapes, ExportError)
        (n, c, h, w), k = shapes[0], self.guide_channels or shapes[2][1]
        p, f32 = h * w, np.float32
        xy = pixel_xy(h, w, "cpu").numpy()
        with torch.no_grad():
            spatial = permutohedral_lattice(torch.from_numpy(xy / f32(a["theta_gamma"])))
            spatial_norm = 1 / (permutohedral_filter(torch.ones(1, p), *spatial) + 1e-20)
        spatial = OnnxLattice(ctx, "spatial").constant(*spatial)
        spatial_norm = ctx.const(spatial_norm.numpy().reshape(p, 1))
        ws, wb, mu = (ctx.op("Transpose", [ctx.op("Reshape", [ctx.weight(node, i), ctx.i64([c, c])], "w")], "wt")
                      if i < len(node.blobs) else None for i in range(3))   # (P, C) rows: x W^T

        def image(x, b, channels):   # image b of x as (P, channels)
            one = ctx.op("Slice", [x, ctx.i64([b, 0]), ctx.i64([b + 1, channels]), ctx.i64([0, 1])], "img")
            return ctx.op("Transpose", [ctx.op("Reshape", [one, ctx.i64([channels, p])], "img")], "pc")

        tops = []
        for b in range(n):
            lattice = OnnxLattice(ctx, f"bilateral{b}")
            features = ctx.op("Concat", [ctx.const(xy / f32(a["theta_alpha"])),
                                         ctx.op("Div", [image(node.inputs[2], b, k), ctx.f32(a["theta_beta"])], "rgb")],
                              "features", axis=1)
            bilateral = lattice.build(lattice.padded(features, ctx.i64([p]), 2 + k), p, 2 + k)
            ones = ctx.const(np.ones((p, 1), f32))
            norm = ctx.op("Reciprocal", [ctx.op("Add", [lattice.filter(bilateral, ones, 1, 2 + k), ctx.f32(1e-20)],
                                                "norm")], "norm")

            def message(x):
                near = ctx.op("Mul", [spatial_norm, lattice.filter(spatial, x, c, 2)], "spatial")
                alike = ctx.op("Mul", [norm, lattice.filter(bilateral, x, c, 2 + k)], "bilateral")
                return ctx.op("Add", [ctx.op("MatMul", [near, ws], "ms"), ctx.op("MatMul", [alike, wb], "mb")],
                              "message")

            start, given = image(node.inputs[0], b, c), image(node.inputs[1], b, c)
            if a.get("continuous"):
                scale = ctx.op("Reciprocal", [ctx.op("Add", [message(ctx.const(np.ones((p, c), f32))), ctx.f32(1.0)],
                                                     "den")], "scale")
                z = start
                for _ in range(a["iterations"]):
                    z = ctx.op("Mul", [ctx.op("Add", [given, message(z)], "sum"), scale], "z")
            else:
                z = given
                for _ in range(a["iterations"]):
                    prob = z if a.get("no_softmax") else ctx.op("Softmax", [z], "prob", axis=1)
                    pairwise = ctx.op("MatMul", [message(prob), mu], "pairwise")
                    z = ctx.op("Sub", [start, pairwise], "q")
            tops.append(ctx.op("Reshape", [ctx.op("Transpose", [z], "cp"), ctx.i64([1, c, h, w])], "top"))
        ctx.add_node("Concat", tops, [node.outputs[0]], axis=0)

    def pytorch_source(self, node, emit):
        shapes = [emit.in_shape(i) for i in range(3)]
        self.refuse_if_cannot_run(node.name, node.attrs, shapes, ExportError)
        m = emit.module("torch.nn.ParameterDict()")
        c = shapes[0][1]
        names = self.blob_names_for(node.attrs)
        for i, name in enumerate(names):
            emit.init(f"{m}['{name}'] = torch.nn.Parameter(torch.zeros(1, 1, {c}, {c}))")
            emit.param(name, i)
        for helper in LATTICE_HELPERS:
            emit.helper(helper)
        fn = emit.helper(crf_rnn_meanfield)
        guide = emit.inputs[2] + (f"[:, :{self.guide_channels}]" if self.guide_channels else "")
        weights = ", ".join([f"{m}['{name}']" for name in names] + ["None"] * (3 - len(names)))
        args = ", ".join(emit.lit(v) for v in self._call_args(node.attrs))
        return f"{fn}({emit.inputs[0]}, {emit.inputs[1]}, {guide}, {weights}, {args})"
