"""xingyizhou/DeepModel's DeepHandModel (fbfaec4, libs/src/caffe/deep_hand_model_layers.cpp and HandDefine.h,
a plug-in for BVLC Caffe with no CUDA code): a hand's forward kinematics, 47 degrees of freedom to 31 joints.

At setup the layer reads three text files from configuration/ under the working directory (demo.py runs in
testing/, which holds them): DofFixedId.txt (a count, then the ids of the DoFs the net does not drive),
InitialParameters.txt (47 values added to every DoF, translations included) and BoneLength.txt (30 bone
lengths).  Each sample's DoF d becomes theta = init (a fixed id) or d + init, in double.  Joint j is the
last column of a product of 4 x 4 matrices taken left to right: translations by theta 0..2, rotations Rz, Rx,
Ry by theta (radians; the fork's Ry is [[c, 0, -s], [0, 1, 0], [s, 0, c]], the transpose of the usual one)
and translations by the bone lengths, each chain extending its parent's (see HAND_CHAINS).  The top is
(N, 93): joints 0..30 by keypoint id, x, y, z each, rounded to float32 once.  No blobs; TRAIN and TEST
compute the same.  torch, ONNX (double MatMul) and model.py.
"""
import math
import os

import numpy as np
import torch

from .registry import Layer, LayerError, need_blobs, register_layer, torch_sources

DOFS, JOINTS, BONES = 47, 31, 30
CONFIG_LIMIT = 1 << 20   # bytes of one configuration file caffeq reads (the repository's are under 1 kB)

# (joint, parent joint or -1, its matrices after the parent's): ("t", axis, dof) a translation by theta[dof],
# ("r", axis, dof) a rotation by theta[dof], ("b", axis, bone, sign) a translation by sign * bone length
_GLOBAL = [("r", 2, 5), ("r", 0, 3), ("r", 1, 4)]
HAND_CHAINS = [(24, -1, [("t", 0, 0), ("t", 1, 1), ("t", 2, 2)]),
               (25, 24, _GLOBAL + [("r", 2, 8), ("r", 0, 6), ("r", 1, 7), ("b", 1, 24, -1)]),
               (26, 24, _GLOBAL + [("r", 2, 11), ("r", 0, 9), ("r", 1, 10), ("b", 1, 25, -1)]),
               (27, 24, _GLOBAL + [("r", 2, 14), ("r", 0, 12), ("r", 1, 13), ("b", 1, 26, -1)]),
               (28, 27, [("r", 2, 16), ("r", 1, 15), ("b", 0, 27, 1)]),
               (29, 28, [("r", 2, 17), ("b", 0, 28, 1)]),
               (30, 29, [("r", 2, 18), ("b", 0, 29, 1)])]
for _k in range(4):   # the four fingers: mcp, base, pip first, pip second, dip, tip
    HAND_CHAINS += [(20 + _k, 24, _GLOBAL + [("r", 2, 21 + 3 * _k), ("r", 0, 19 + 3 * _k), ("r", 1, 20 + 3 * _k),
                                             ("b", 1, 20 + _k, 1)]),
                    (4 + 5 * _k, 20 + _k, [("r", 2, 32 + 4 * _k), ("r", 0, 31 + 4 * _k), ("b", 1, 4 + 5 * _k, 1)]),
                    (3 + 5 * _k, 4 + 5 * _k, [("r", 0, 33 + 4 * _k), ("b", 1, 3 + 5 * _k, 1)]),
                    (2 + 5 * _k, 3 + 5 * _k, [("b", 1, 2 + 5 * _k, 1)]),
                    (1 + 5 * _k, 2 + 5 * _k, [("r", 0, 34 + 4 * _k), ("b", 1, 1 + 5 * _k, 1)]),
                    (5 * _k, 1 + 5 * _k, [("b", 1, 5 * _k, 1)])]


def hand_matrix_parts(op):
    """(base, cos part, sin part, value part): the op's matrix is base + cos(v) C + sin(v) S (a rotation)
    or base + v V (a translation), (4, 4) float64 tensors.  Every rotation puts -sin above the diagonal
    and +sin below it in its plane, so the fork's Ry is [[c, 0, -s], [0, 1, 0], [s, 0, c]]."""
    base, cos_part, sin_part, value_part = (torch.zeros((4, 4), dtype=torch.float64) for _ in range(4))
    if op[0] == "r":
        i, j = [a for a in range(3) if a != op[1]]           # the plane the rotation turns, i < j
        base[op[1], op[1]] = base[3, 3] = 1.0
        cos_part[i, i] = cos_part[j, j] = 1.0
        sin_part[i, j], sin_part[j, i] = -1.0, 1.0
    else:
        base += torch.eye(4, dtype=torch.float64)
        value_part[op[1], 3] = 1.0
    return base, cos_part, sin_part, value_part


def mm4(a, b):
    """a @ b for (..., 4, 4) float64 stacks, each entry summed k = 0..3 in order as the fork's loop."""
    out = a[..., :, 0:1] * b[..., 0:1, :]
    for k in range(1, 4):
        out = out + a[..., :, k:k + 1] * b[..., k:k + 1, :]
    return out


def hand_joints(dof, fixed, init, bones, chains):
    """(N, 93) float32: the joints of each sample's DoF row (N, 47), in double as the fork computes them."""
    theta = torch.where(fixed, init, dof.to(torch.float64).reshape(-1, len(init)) + init)
    n = theta.shape[0]
    cached, points = {}, [None] * len(chains)
    for joint, parent, ops in chains:
        mat = cached[parent] if parent >= 0 else torch.eye(4, dtype=torch.float64, device=dof.device).expand(n, 4, 4)
        for op in ops:
            base, cos_part, sin_part, value_part = (p.to(dof.device) for p in hand_matrix_parts(op))
            if op[0] == "r":
                v = theta[:, op[2]][:, None, None]
                m = base + torch.cos(v) * cos_part + torch.sin(v) * sin_part
            else:
                v = theta[:, op[2]] if op[0] == "t" else torch.full((n,), op[3] * float(bones[op[2]]),
                                                                    dtype=torch.float64, device=dof.device)
                m = base + v[:, None, None] * value_part
            mat = mm4(mat, m)
        cached[joint] = mat
        points[joint] = mat[:, :3, 3]
    return torch.stack(points, 1).reshape(n, 3 * len(chains)).to(torch.float32)


TORCH_HAND = torch_sources(hand_matrix_parts, mm4, hand_joints)


# ---- the configuration files ---------------------------------------------------------------------

def _config_numbers(name, kind):
    path = os.path.join("configuration", name)
    try:
        with open(path, "rb") as f:
            data = f.read(CONFIG_LIMIT + 1)
    except OSError:
        return None, path
    if len(data) > CONFIG_LIMIT:
        raise LayerError(f"DeepHandModel: {path} is larger than {CONFIG_LIMIT} bytes")
    try:
        return [kind(t) for t in data.split()], path
    except ValueError:
        raise LayerError(f"DeepHandModel: {path} holds something other than numbers") from None


def read_hand_config():
    """(fixed ids, initial parameters, bone lengths), or a line saying which file is missing."""
    fixed, fixed_path = _config_numbers("DofFixedId.txt", int)
    init, init_path = _config_numbers("InitialParameters.txt", float)
    bones, bones_path = _config_numbers("BoneLength.txt", float)
    missing = [p for v, p in ((fixed, fixed_path), (init, init_path), (bones, bones_path)) if v is None]
    if missing:
        return None, (f"the layer reads {', '.join(missing)} under the working directory ({os.getcwd()}), as the "
                      f"fork does (DeepModel's demo runs in testing/, which holds configuration/); run from there")
    if not fixed or fixed[0] < 0 or len(fixed) < 1 + fixed[0] or any(not 0 <= i < DOFS for i in fixed[1:1 + fixed[0]]):
        raise LayerError(f"DeepHandModel: {fixed_path} must hold a count, then that many DoF ids from 0 to {DOFS - 1}")
    if len(init) < DOFS or len(bones) < BONES or not all(map(math.isfinite, init[:DOFS] + bones[:BONES])):
        raise LayerError(f"DeepHandModel: {init_path} needs {DOFS} numbers and {bones_path} {BONES} (finite)")
    return (sorted(set(fixed[1:1 + fixed[0]])), init[:DOFS], bones[:BONES]), None


# ---- the spec ---------------------------------------------------------------------------------------

@register_layer("DeepHandModel")
class DeepHandModel(Layer):
    def parse(self, lp):
        need_blobs(lp, "DeepHandModel", 1, 1)
        config, missing = read_hand_config()
        attrs = {"axis": int(lp.inner_product_param.axis), "missing": missing}
        if config is not None:
            attrs["fixed"], attrs["init"], attrs["bones"] = config
        return attrs

    def infer(self, attrs, in_shapes):
        s = tuple(in_shapes[0])
        axis = attrs["axis"] + len(s) if attrs["axis"] < 0 else attrs["axis"]
        if len(s) < 2 or axis != 1:
            raise LayerError(f"DeepHandModel writes {3 * JOINTS} values per sample into a top shaped by "
                             f"inner_product_param.axis; only axis 1 of an (N, {DOFS}, ...) bottom holds them, got "
                             f"axis {attrs['axis']} of {list(s)}")
        if math.prod(s[1:]) != DOFS:
            raise LayerError(f"DeepHandModel reads {DOFS} DoFs per sample, got {list(s)}")
        return [(s[0], 3 * JOINTS)]

    def cannot_run(self, attrs, in_shapes):
        return attrs["missing"]

    def _tensors(self, attrs, device):
        fixed = torch.zeros(DOFS, dtype=torch.bool, device=device)
        fixed[attrs["fixed"]] = True
        return fixed, torch.tensor(attrs["init"], dtype=torch.float64, device=device), attrs["bones"]

    def forward(self, attrs, params, dof):
        self.refuse_if_cannot_run("DeepHandModel", attrs, [tuple(dof.shape)])
        return hand_joints(dof, *self._tensors(attrs, dof.device), HAND_CHAINS)

    def pytorch_source(self, node, emit):
        from ..errors import ExportError
        self.refuse_if_cannot_run(node.name, node.attrs, [emit.in_shape(0)], ExportError)
        a = node.attrs
        fixed = [i in a["fixed"] for i in range(DOFS)]
        fn = emit.helper(TORCH_HAND)
        return (f"{fn}({emit.inputs[0]}, torch.tensor({fixed!r}), torch.tensor({emit.lit(a['init'], exact=True)}, "
                f"dtype=torch.float64), {emit.lit(a['bones'], exact=True)}, {HAND_CHAINS!r})")

    def onnx(self, ctx, node):
        from ..errors import ExportError
        a = node.attrs
        self.refuse_if_cannot_run(node.name, a, [ctx.shape(node.inputs[0])], ExportError)
        f64 = 11
        fixed = np.array([i in a["fixed"] for i in range(DOFS)])
        init = np.array(a["init"], np.float64)
        dof = ctx.op("Cast", [ctx.op("Reshape", [node.inputs[0], ctx.i64([-1, DOFS])], "dof")], "dof64", to=f64)
        theta = ctx.op("Where", [ctx.const(fixed), ctx.const(init), ctx.op("Add", [dof, ctx.const(init)], "free")],
                       "theta")
        column = ctx.i64([-1, 1, 1])
        eye = ctx.op("Expand", [ctx.const(np.eye(4)[None]), ctx.op("Concat", [
            ctx.op("Slice", [ctx.op("Shape", [theta], "n"), ctx.i64([0]), ctx.i64([1])], "n"), ctx.i64([4, 4])],
            "eye_shape", axis=0)], "eye")
        cached, points = {}, {}
        for joint, parent, ops in HAND_CHAINS:
            mat = cached[parent] if parent >= 0 else eye
            for k, op in enumerate(ops):
                base, cos_part, sin_part, value_part = (p.numpy() for p in hand_matrix_parts(op))
                hint = f"j{joint}_{k}"
                if op[0] == "b":
                    m = ctx.const((base + op[3] * a["bones"][op[2]] * value_part)[None])
                else:
                    v = ctx.op("Reshape", [ctx.op("Gather", [theta, ctx.i64(op[2])], hint, axis=1), column], hint)
                    if op[0] == "r":
                        m = ctx.op("Add", [ctx.op("Add", [
                            ctx.const(base[None]), ctx.op("Mul", [ctx.op("Cos", [v], hint), ctx.const(cos_part[None])],
                                                          hint)], hint),
                            ctx.op("Mul", [ctx.op("Sin", [v], hint), ctx.const(sin_part[None])], hint)], hint)
                    else:
                        m = ctx.op("Add", [ctx.const(base[None]), ctx.op("Mul", [v, ctx.const(value_part[None])], hint)],
                                   hint)
                mat = ctx.op("MatMul", [mat, m], hint)
            cached[joint] = mat
            points[joint] = ctx.op("Slice", [mat, ctx.i64([0, 3]), ctx.i64([3, 4]), ctx.i64([1, 2])], f"p{joint}")
        stacked = ctx.op("Concat", [points[j] for j in range(JOINTS)], "joints", axis=2)     # (N, 3, 31)
        xyz = ctx.op("Transpose", [stacked], "xyz", perm=[0, 2, 1])
        flat = ctx.op("Reshape", [ctx.op("Cast", [xyz], "xyz32", to=1), ctx.i64([-1, 3 * JOINTS])], "flat")
        ctx.add_node("Identity", [flat], [node.outputs[0]], name=node.name)
