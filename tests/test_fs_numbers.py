"""caffeq/fs.py's reader of numbers from small text files, the way C's fscanf reads them ("%f" strtof, "%lf"
strtod, "%d" strtol base 10), and its safe file-head reader.  Where this machine's C library can be called
(ctypes), its sscanf is the reference on inputs every C library reads alike."""
import ctypes
import ctypes.util
import math
import os
import struct

import numpy as np
import pytest

from caffeq.errors import CaffeqError
from caffeq.fs import fscanf_numbers, read_file_head, read_text_numbers


def scan(text, conversion="%lf", **kw):
    return fscanf_numbers(text.encode(), conversion, "f.txt", **kw)


def libc_sscanf(text, conversion):
    """Every number the C library's sscanf(text, conversion) calls read, each call from where the last one stopped."""
    name = ctypes.util.find_library("c")
    if not name:
        pytest.skip("no C library to call")
    libc = ctypes.CDLL(name)
    kind = {"%f": ctypes.c_float, "%lf": ctypes.c_double, "%d": ctypes.c_int}[conversion]
    data, pos, out = text.encode(), 0, []
    while True:
        value, used = kind(), ctypes.c_int(0)
        if libc.sscanf(data[pos:], (conversion + "%n").encode(), ctypes.byref(value), ctypes.byref(used)) != 1:
            return out
        out.append(value.value)
        pos += used.value


@pytest.mark.parametrize("text, want", [
    ("1-2", [1.0, -2.0]),
    ("\t0x1.8p1 -2.5e-1+4\n.5e2 5. INFINITY -inf nan(abc) 1_0 99", [3.0, -0.25, 4.0, 50.0, 5.0, math.inf, -math.inf,
                                                                   math.nan, 1.0]),
    ("1,2", [1.0]),
    ("1.5.5", [1.5, 0.5]),
    ("  \v\f\r\n", []),
    ("x 1", []),
    ("1 2 -x 3", [1.0, 2.0]),                    # no number at "-x": the reading ends
    ("1e400 -1e-400", [math.inf, -0.0]),         # strtod: +-HUGE_VAL, and a signed zero
])
def test_lf_reads_as_strtod(text, want):
    got = scan(text)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (math.isnan(g) and math.isnan(w)) or (g == w and math.copysign(1, g) == math.copysign(1, w))


def test_d_reads_as_strtol_base_10():
    assert scan("1-2 +3\n-0 007 0x5", "%d") == [1, -2, 3, 0, 7, 0]      # "0x5" is 0, then "x5" ends it
    assert scan("1.5 2", "%d") == [1]
    assert scan("1e5", "%d") == [1]
    assert scan("2147483647 -2147483648", "%d") == [2**31 - 1, -2**31]
    assert all(type(v) is int for v in scan("1 2", "%d"))


def test_count_stops_early():
    assert scan("1 2 3 x", count=2) == [1.0, 2.0]
    assert scan("1 2 0x", count=2) == [1.0, 2.0]      # never reaches the unclear "0x"
    assert scan("1", count=3) == [1.0]


def test_f_rounds_once_to_float32():
    # 1 + 2**-24 is the float32 midpoint of 1 and 1 + 2**-23: a hair above it rounds up, a hair below down;
    # through a double (float() then float32) both land on the midpoint and go to even (1.0)
    above, below = "1.000000059604644775390625000000001", "1.000000059604644775390624999999999"
    assert scan(above, "%f") == [1 + 2.0 ** -23] and scan(below, "%f") == [1.0]
    assert np.float32(float(above)) == np.float32(float(below)) == 1.0
    assert scan("1.000000059604644775390625 0x1.000001p0 0x1.0000010000000000000001p0", "%f") == [1.0, 1.0,
                                                                                               1 + 2.0 ** -23]
    flt_max = float(np.finfo(np.float32).max)
    assert scan("3.4028235e38 3.4028235677973366e38 3.4028235677973367e38 -1e39", "%f") == [flt_max, flt_max,
                                                                                          math.inf, -math.inf]
    assert scan("1e-46 7.0064923216240862e-46 -1e-45", "%f") == [0.0, 2.0 ** -149, -(2.0 ** -149)]
    assert scan("0.1", "%f") == [float(np.float32(0.1))] and scan("0.1", "%lf") == [0.1]


def test_agrees_with_the_c_library():
    text = ("1-2 +.5e+1 0x1.8p-3 -7. 1.000000059604644775390625000000001 3.4028235677973366e38 1e-46 "
            "0.1 16777217 9e9 1,5")
    for conversion in ("%f", "%lf"):
        got = scan(text, conversion)
        want = libc_sscanf(text, conversion)
        assert [struct.pack("<d", v) for v in got] == [struct.pack("<d", v) for v in want]
    ints = "12-3 +4\n0009 -2147483648 7x 8"
    assert scan(ints, "%d") == libc_sscanf(ints, "%d") == [12, -3, 4, 9, -2**31, 7]


@pytest.mark.parametrize("text, conversion, needle", [
    ("1 2e", "%lf", "the number at byte 2 is followed by 'e'"),
    ("1 2e+", "%f", "followed by 'e'"),
    ("0x", "%lf", "followed by 'x'"),
    ("0x1p", "%lf", "followed by 'p'"),
    ("infin", "%lf", "followed by 'i'"),
    ("nan(", "%lf", "followed by '('"),
    ("1 2147483648", "%d", "the integer at byte 2 is outside int's 32 bits"),
])
def test_readings_that_differ_between_c_libraries_are_refused(text, conversion, needle):
    with pytest.raises(CaffeqError, match=r"^f\.txt: ") as e:
        scan(text, conversion)
    assert needle in str(e.value) and "differs between C libraries" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("text", ["1 2 3", "1 2 ", "1 2 -", "1 2 0x1"])
def test_a_head_whose_last_number_may_go_on_is_refused(text):
    with pytest.raises(CaffeqError, match="f.txt: its numbers are not within its first"):
        scan(text, count=4, truncated=True)
    assert scan("1 2 3 x", count=3, truncated=True) == [1.0, 2.0, 3.0]
    assert scan("1 2 xy", count=3, truncated=True) == [1.0, 2.0]       # "xy..." is no number, however it goes on


def test_read_file_head(tmp_path):
    path = tmp_path / "n.txt"
    path.write_bytes(b"0123456789")
    assert read_file_head(path, 4, "n") == (b"0123", True)
    assert read_file_head(path, 10, "n") == (b"0123456789", False)
    assert read_file_head(tmp_path / "none.txt", 4, "n") is None
    with pytest.raises(CaffeqError, match=r"^n: 10 bytes, past the 4 caffeq reads$"):
        read_file_head(path, 4, "n", whole=True)


def test_special_files_are_refused_before_any_read(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)                                   # a blocking open would hang here
    for where in (fifo, tmp_path, "/dev/zero"):
        with pytest.raises(CaffeqError, match=r"^w: not a regular file"):
            read_text_numbers(where, "%d", 100, "w")
        with pytest.raises(CaffeqError, match=r"^w: not a regular file"):
            read_text_numbers(where, "%lf", 100, "w", count=1)


def test_read_text_numbers(tmp_path):
    path = tmp_path / "n.txt"
    path.write_text("3 1-2 4.5 x 7")
    assert read_text_numbers(path, "%lf", 100, "n") == [3.0, 1.0, -2.0, 4.5]
    assert read_text_numbers(path, "%d", 100, "n") == [3, 1, -2, 4]
    assert read_text_numbers(tmp_path / "none", "%d", 100, "n") is None
    with pytest.raises(ValueError):
        read_text_numbers(path, "%i", 100, "n")
    with pytest.raises(CaffeqError, match=r"^n: 13 bytes, past the 8 caffeq reads$"):
        read_text_numbers(path, "%d", 8, "n")                 # every number wanted: the whole file must fit
    assert read_text_numbers(path, "%d", 8, "n", count=2) == [3, 1]
    with pytest.raises(CaffeqError, match=r"^n: its numbers are not within its first 4 bytes"):
        read_text_numbers(path, "%d", 4, "n", count=3)

    class Bad(Exception):
        pass
    with pytest.raises(Bad, match="^n: "):
        read_text_numbers(path, "%d", 8, "n", error=Bad)
