"""Text-format (.prototxt) reader with file/line/column errors and unknown-field reporting."""
import os
import re

from google.protobuf import text_format

from ..errors import ParseError
from .schema import caffe_pb2

_UNKNOWN_FIELD = re.compile(r'has no field named "([^"]+)"')
_LINE_COL = re.compile(r"^(\d+):(\d+)\s*:\s*(.*)$", re.S)


def _layer_at(text, line_no):
    """Name of the layer whose block encloses line_no (1-based), best effort."""
    lines = text.splitlines()[:line_no]
    depth = 0
    for line in reversed(lines):
        depth += line.count("}") - line.count("{")
        m = re.search(r'\bname\s*:\s*"([^"]*)"', line)
        if m and depth <= 0:
            return m.group(1)
    return None


def _describe(path, text, err):
    msg = str(err)
    m = _LINE_COL.match(msg)
    line = col = None
    if m:
        line, col, msg = int(m.group(1)), int(m.group(2)), m.group(3)
    where = f"{path}:{line}:{col}" if line else path
    unknown = _UNKNOWN_FIELD.search(msg)
    if unknown and line:
        layer = _layer_at(text, line)
        ctx = f" in layer '{layer}'" if layer else ""
        return where, f"unknown field '{unknown.group(1)}'{ctx} ({msg.strip()}); " \
                      f"pass --ignore-unknown to skip unknown fields with a warning"
    return where, msg.strip()


def parse_prototxt_text(text, message=None, path="<text>", ignore_unknown=False, warnings=None):
    """Parse text into a NetParameter (or the given message)."""
    message = message if message is not None else caffe_pb2.NetParameter()
    try:
        text_format.Parse(text, message, allow_unknown_field=False)
        return message
    except text_format.ParseError as e:
        where, msg = _describe(path, text, e)
        if not (ignore_unknown and _UNKNOWN_FIELD.search(str(e))):
            raise ParseError(f"{where}: {msg}") from None
    # Unknown fields allowed: report each one as a warning, then parse leniently.
    if warnings is not None:
        probe = message.__class__()
        seen = set()
        remaining = text
        for _ in range(1000):
            try:
                text_format.Parse(remaining, probe, allow_unknown_field=False)
                break
            except text_format.ParseError as e:
                m = _UNKNOWN_FIELD.search(str(e))
                lm = _LINE_COL.match(str(e))
                if not (m and lm):
                    break
                line = int(lm.group(1))
                layer = _layer_at(remaining, line)
                key = (m.group(1), layer)
                if key not in seen:
                    seen.add(key)
                    warnings.append(f"{path}:{line}: ignored unknown field '{m.group(1)}'"
                                    + (f" in layer '{layer}'" if layer else ""))
                # blank the field name so the next parse goes past it
                lines = remaining.splitlines()
                col = int(lm.group(2))
                ln = lines[line - 1]
                lines[line - 1] = ln[:col - 1] + ln[col - 1:].replace(m.group(1), "__caffeq_skip__", 1)
                remaining = "\n".join(lines)
                probe = message.__class__()
    message.Clear()
    try:
        text_format.Parse(text, message, allow_unknown_field=True)
    except text_format.ParseError as e:
        where, msg = _describe(path, text, e)
        raise ParseError(f"{where}: {msg}") from None
    return message


def read_prototxt(path, ignore_unknown=False, warnings=None, message=None):
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ParseError(f"{path}: cannot read: {e.strerror or e}") from None
    if b"\x00" in raw[:4096]:
        raise ParseError(f"{path}: binary data, not a text prototxt (pass it as --weights?)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ParseError(f"{path}: not UTF-8 text (byte {e.start})") from None
    return parse_prototxt_text(text, message, path, ignore_unknown, warnings)
