"""C's round() for the forks that call it: halves away from zero, where torch.round and ONNX Round, like rint,
round them to even.  One exact form for torch, the generated PyTorch source and ONNX."""
import numpy as np
import torch


def c_round(v):
    """C's round() of a float tensor, exact in its own dtype: |v| - floor(|v|) is exact, where floor(|v| + 0.5)
    would round 0.49999997 up."""
    a = torch.abs(v)
    whole = torch.floor(a)
    return torch.copysign(whole + (a - whole >= 0.5).to(v.dtype), v)


def onnx_c_round(ctx, x, in_double: bool = False):
    """c_round as ONNX nodes on float32 x; with in_double, x is first cast to double and the result stays double
    (the ROI forks round a float32 product promoted to double)."""
    dtype, onnx_type = (np.float64, 11) if in_double else (np.float32, 1)
    if in_double:
        x = ctx.op("Cast", [x], "in_double", to=onnx_type)
    whole = ctx.op("Floor", [ctx.op("Abs", [x], "abs")], "whole")
    frac = ctx.op("Sub", [ctx.op("Abs", [x], "abs"), whole], "frac")
    up = ctx.op("Cast", [ctx.op("GreaterOrEqual", [frac, ctx.const(np.array(0.5, dtype))], "half")], "up",
                to=onnx_type)
    return ctx.op("Mul", [ctx.op("Sign", [x], "sign"), ctx.op("Add", [whole, up], "magnitude")], "rounded")
