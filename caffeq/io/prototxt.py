"""Text-format (.prototxt) reader with file/line/column errors and unknown-field reporting.

An unknown field is an error (naming file, line, column, field and layer) unless it can
only matter for training, where it is skipped with a warning:
  - anywhere inside a layer that is not part of the net being read (by default the TEST
    net: `include { phase: TRAIN }` or `exclude { phase: TEST }`);
  - reading the TEST net, anywhere inside `transform_param` (data augmentation) or a loss
    parameter (`loss_param`, `*_loss_param`), or an unknown `*_loss_param` itself.
`ignore_unknown=True` (--ignore-unknown) turns every unknown field into a warning.
"""
import os
import re
from dataclasses import dataclass

from google.protobuf import text_format

from ..errors import ParseError
from .schema import caffe_pb2

_UNKNOWN_FIELD = re.compile(r'has no field named "([^"]+)"')
_LINE_COL = re.compile(r"^(\d+):(\d+)\s*:\s*(.*)$", re.DOTALL)
_PLACEHOLDER = re.compile(r"\$\{\w+\}|\$\w+")
_PHASES = {"TRAIN": caffe_pb2.TRAIN, "TEST": caffe_pb2.TEST}


@dataclass(frozen=True)
class _Unknown:
    name: str            # the unknown field's name
    message_type: str    # full name of the message it appeared in
    line: int            # 1-based, or None
    column: int
    path: tuple          # field names from the top-level message down to the unknown field
    layer: tuple         # ("layer" | "layers", index) of the enclosing top-level layer, or None
    empty: bool = False  # written as an empty message (`name { }`): it sets nothing


class _RecordingParser(text_format._Parser):
    """Lenient text parser that records every unknown field it skips and where it was."""

    def __init__(self, lines=()):
        super().__init__(allow_unknown_field=True)
        self.lines = list(lines)
        self.unknown = []
        self._path = []
        self._layer = None
        self._skipping = 0

    def _MergeMessageField(self, tokenizer, message, field):
        top_layer = not self._path and field.name in ("layer", "layers")
        if top_layer:
            self._layer = (field.name, len(getattr(message, field.name)))
        self._path.append(field.name)
        try:
            super()._MergeMessageField(tokenizer, message, field)
        finally:
            self._path.pop()
            if top_layer:
                self._layer = None

    def _SkipFieldContents(self, tokenizer, field_name, immediate_message_type):
        line = getattr(tokenizer, "_previous_line", None)
        column = getattr(tokenizer, "_previous_column", None)
        self._skipping += 1
        try:
            super()._SkipFieldContents(tokenizer, field_name, immediate_message_type)
        finally:
            self._skipping -= 1
        if not self._skipping:  # fields nested inside an unknown one are not reported again
            self.unknown.append(_Unknown(
                field_name, immediate_message_type,
                None if line is None else line + 1, None if column is None else column + 1,
                tuple(self._path) + (field_name,), self._layer,
                self._skipped_text(field_name, line, column, tokenizer) in ("{}", ":{}", "<>", ":<>")))

    def _skipped_text(self, field_name, line, column, tokenizer):
        """What followed the field name up to the last token skipped, without blanks or comments."""
        end_line = getattr(tokenizer, "_previous_line", None)
        end_column = getattr(tokenizer, "_previous_column", None)
        if None in (line, column, end_line, end_column) or end_line >= len(self.lines):
            return None
        if line == end_line:
            span = [self.lines[line][column:end_column + 1]]
        else:
            span = [self.lines[line][column:]] + self.lines[line + 1:end_line] + [self.lines[end_line][:end_column + 1]]
        text = "".join("".join(part.split("#", 1)[0].split()) for part in span)
        return text.removeprefix(field_name)


def _describe(path, err, text=""):
    """file:line:column and message of a text_format error (unknown fields are reported by _report)."""
    msg = str(err)
    m = _LINE_COL.match(msg)
    if not m:
        return path, msg.strip()
    lines = text.split("\n")
    row = int(m.group(1)) - 1
    placeholder = _PLACEHOLDER.search(lines[row]) if 0 <= row < len(lines) else None
    msg = m.group(3).strip()
    if placeholder:   # DeepLab's config files: a script substitutes ${NUM_LABELS} before Caffe reads them
        msg += (f" ({placeholder.group(0)} is a template placeholder that a script fills in before Caffe "
                f"reads the file; put the value in its place)")
    return f"{path}:{m.group(1)}:{m.group(2)}", msg


def _rule_is_only_phase(rule, phase):
    """True when the NetStateRule names this phase and nothing else (no level / stage)."""
    return (rule.HasField("phase") and rule.phase == phase and not rule.HasField("min_level")
            and not rule.HasField("max_level") and not rule.stage and not rule.not_stage)


def _left_out(layer, phase):
    """True when Caffe never puts this layer in the net of the given phase."""
    include = list(getattr(layer, "include", ()))
    if include and all(r.HasField("phase") and r.phase != phase for r in include):
        return True
    return any(_rule_is_only_phase(r, phase) for r in getattr(layer, "exclude", ()))


def _is_loss_param(name):
    return name == "loss_param" or name.endswith("_loss_param")


def _training_only(unknown, message, phase):
    """Why an unknown field cannot matter for reading the `phase` net, or None."""
    if unknown.empty:
        return "an empty message, it sets nothing"
    if unknown.layer is not None and isinstance(message, caffe_pb2.NetParameter):
        kind, index = unknown.layer
        layers = getattr(message, kind)
        if index < len(layers) and _left_out(layers[index], phase):
            return f"the layer is not in the {caffe_pb2.Phase.Name(phase)} net"
    if phase != caffe_pb2.TEST or unknown.layer is None:
        return None
    inner = unknown.path[1:]  # below the layer
    if "transform_param" in inner[:-1]:
        return "data augmentation (transform_param) only matters for training"
    if any(_is_loss_param(p) for p in inner):
        return "loss parameters only matter for training"
    return None


def _layer_name(unknown, message):
    if unknown.layer is None or not isinstance(message, caffe_pb2.NetParameter):
        return None
    kind, index = unknown.layer
    layers = getattr(message, kind)
    if index >= len(layers):
        return None
    layer = layers[index]
    if kind == "layers" and not layer.name and layer.HasField("layer"):
        return layer.layer.name or None  # V0: the name sits one level down
    return layer.name or None


def _report(unknowns, message, path, phase, ignore_unknown, warnings):
    """Raise for the first unknown field that may matter; warn (once per field name) for the rest."""
    groups = {}
    for u in unknowns:
        reason = _training_only(u, message, phase)
        if reason is None and not ignore_unknown:
            layer = _layer_name(u, message)
            where = f"{path}:{u.line}:{u.column}" if u.line else path
            ctx = f" in layer '{layer}'" if layer else ""
            raise ParseError(
                f"{where}: unknown field '{u.name}'{ctx} (message {u.message_type} has no field "
                f"'{u.name}'); pass --ignore-unknown to skip unknown fields with a warning")
        groups.setdefault((u.name, reason), []).append(u)
    if warnings is None:
        return
    for (name, reason), members in groups.items():
        first = members[0]
        layer = _layer_name(first, message)
        where = f"{path}:{first.line}" if first.line else path
        more = f" (and {len(members) - 1} more)" if len(members) > 1 else ""
        warnings.append(f"{where}: ignored unknown field '{name}'"
                        + (f" in layer '{layer}'" if layer else "") + more
                        + (f": {reason}" if reason else ""))


def parse_prototxt_text(text, message=None, path="<text>", ignore_unknown=False, warnings=None,
                        phase="TEST"):
    """Parse text into a NetParameter (or the given message).

    phase: the net the caller will build ("TEST" or "TRAIN"); decides which unknown
    fields are training-only (see the module docstring).
    """
    message = message if message is not None else caffe_pb2.NetParameter()
    if phase not in _PHASES:
        raise ParseError(f"{path}: phase must be TRAIN or TEST, got {phase!r}")
    try:
        text_format.Parse(text, message, allow_unknown_field=False)
        return message
    except text_format.ParseError as e:
        if not _UNKNOWN_FIELD.search(str(e)):
            where, msg = _describe(path, e, text)
            raise ParseError(f"{where}: {msg}") from None
    # Unknown fields present: parse leniently, recording each one, then decide.
    message.Clear()
    parser = _RecordingParser(text.split("\n"))
    try:
        parser.ParseLines(text.split("\n"), message)
    except text_format.ParseError as e:
        where, msg = _describe(path, e, text)
        raise ParseError(f"{where}: {msg}") from None
    _report(parser.unknown, message, path, _PHASES[phase], ignore_unknown, warnings)
    return message


def read_prototxt(path, ignore_unknown=False, warnings=None, message=None, phase="TEST"):
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
    return parse_prototxt_text(text, message, path, ignore_unknown, warnings, phase)
