"""C's round() as the tests' scalar reference, in Python's exact float arithmetic: the nearest integer, a half
away from zero.  test_c_numerics.py checks caffeq's torch and ONNX c_round against it; the layer tests call it
where a fork's C++ calls round()."""
import math


def c_round(v) -> float:
    """round() of one real scalar (a Python or numpy float or int) as a Python float.  floor(|v|) and the
    fraction |v| - floor(|v|) are exact, where float32 floor(|v| + 0.5) rounds 0.49999997 up; non-finite values come
    back as they are, and -0.3 gives -0.0 as C's does."""
    v = float(v)
    if not math.isfinite(v):
        return v
    whole = math.floor(abs(v))
    return math.copysign(whole + (1.0 if abs(v) - whole >= 0.5 else 0.0), v)
