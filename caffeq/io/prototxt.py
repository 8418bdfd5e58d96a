"""Text-format (.prototxt) reader with file/line/column errors and unknown-field reporting.

Which unknown fields are errors and which are skipped with a warning (they can only matter for
training, or are a fork's knobs that Caffe computes the same numbers without): unknown_fields.py.
`ignore_unknown=True` (--ignore-unknown) turns every unknown field into a warning.

A solver file (caffe.SolverParameter, BVLC fields 1-40) asked for as a net gives the net it holds
inline in `net_param` (field 25), with a note; one that names its net by path (`net`, `train_net`,
`test_net`) is an error naming that file.
"""
import os
import re
from dataclasses import dataclass

from google.protobuf import text_format

from ..errors import ParseError
from .schema import caffe_pb2
from .styletransfer_dialect import styletransfer_inputs
from .templates import (
    BarePlaceholder,
    code_spans,
    fill_bare_placeholder,
    fill_placeholders,
    is_sentinel,
    resolve_placeholders,
)
from .text_repairs import (
    V1_QUOTED_TYPE,
    block_placeholder,
    decode,
    mycaffe_bare_string,
    mycaffe_text,
    plain_quotes,
    v1_name_as_type,
    v2_blocks_named_layers,
)
from .unknown_fields import QUOTED_ENUM_FORKS, report_unknown_fields
from .upgrade import fork_v1_type, upgrade_mixed_layers

_UNKNOWN_FIELD = re.compile(r'has no field named "([^"]+)"|has no value named|has no value with number')
_LINE_COL = re.compile(r"^(\d+):(\d+)\s*:\s*(.*)$", re.DOTALL)
_PLACEHOLDER = re.compile(r"\$#\w+#\$|\$\{[^}\n]*\}|\$\w+")   # ${ $ SIZE . }: an unknown template language
_BARE_NUMBER = re.compile(r"Couldn't parse (?:integer|float): ([A-Za-z_]\w*)$")
_BARE_TEXT = re.compile(r"Expected string but found: '(.+)'$")
_PHASES = {"TRAIN": caffe_pb2.TRAIN, "TEST": caffe_pb2.TEST}
_MAX_BARE_PLACEHOLDERS = 1000   # each is one more parse of the file
_SCALAR_FIELD = re.compile(r"\w+[ \t]*:[ \t]*(\d+)")   # `name: 123`


@dataclass(frozen=True)
class _Unknown:
    name: str            # the unknown field's name
    message_type: str    # full name of the message it appeared in
    line: int            # 1-based, or None
    column: int
    path: tuple          # field names from the top-level message down to the unknown field
    layer: tuple         # ("layer" | "layers", index) of the enclosing top-level layer, or None
    empty: bool = False  # written as an empty message (`name { }`): it sets nothing
    solver: bool = False  # a solver's own setting (outside its net_param): only for training
    enum_value: str = None  # set when the field is known but this value of its enum is not (a fork's)
    placeholder: bool = False  # its value is a template placeholder (`root_folder: ${OUTPUT_DIR}`)


# Fields that several forks write under one name with different messages: {(message, name):
# candidate fields of caffe.proto, the first being the one that name parses to by default}.
# SSD's webcam VideoData (207), C3D-v1.1's clips (6660), TSN's segments (yjxiong/caffe 140) and the
# LRCN video-hashing fork's frame clips (apir8181/caffe_lrcn 150).
# pmgysel's Ristretto (148) and XmBrain/Quantizer (147) name different QuantizationParameters alike.
_SHARED_NAMES = {
    ("caffe.LayerParameter", "video_data_param"): ("video_data_param", "c3d_video_data_param",
                                                   "tsn_video_data_param", "lrcn_video_data_param"),
    ("caffe.LayerParameter", "quantization_param"): ("quantization_param", "xmbrain_quantization_param"),
    # dedoogong/caffe-keypoint-rcnn's GenerateProposal names its GenerateProposalsParameter proposal_param
    ("caffe.LayerParameter", "proposal_param"): ("proposal_param", "generate_proposals_param"),
}
_FORK_OF_FIELD = {"video_data_param": "SSD", "c3d_video_data_param": "C3D v1.1",
                  "tsn_video_data_param": "TSN (yjxiong/caffe)", "lrcn_video_data_param": "apir8181/caffe_lrcn",
                  "quantization_param": "pmgysel's Ristretto", "xmbrain_quantization_param": "XmBrain/Quantizer"}
# layer types only XmBrain/Quantizer has: their quantization_param is its message whatever fields it sets
_XMBRAIN_TYPES = {"InnerProductRistretto", "PoolingRistretto", "ReLURistretto", "DataRistretto"}
_V1_TYPE = caffe_pb2.V1LayerParameter.DESCRIPTOR.fields_by_name["type"]
_POOL_METHOD = caffe_pb2.PoolingParameter.DESCRIPTOR.fields_by_name["pool"]
_DETECTNET_CLASSES = caffe_pb2.DetectNetGroundTruthParameter.DESCRIPTOR.fields_by_name["object_class"]
_DETECTNET_CLASS_COUNT = caffe_pb2.DetectNetGroundTruthParameter.DESCRIPTOR.fields_by_name["object_class_count"]
_STYLETRANSFER_POOLS = {'"max"', '"ave"', "'max'", "'ave'"}   # its string `pool` (io/prototxt.py)
# and N-D Convolution / Pooling with three kernel sizes (chuckcho/video-caffe's C3D nets)
_3D_LAYERS = re.compile(r"\b(convolution3d_param|pooling3d_param|Convolution3D|Pooling3D|NdConvolution|NdPooling)\b"
                        r"|\bkernel_size\s*:\s*\d+\s+kernel_size\s*:\s*\d+\s+kernel_size\s*:\s*\d+")


def _block_field_names(lines, line, column):
    """Names of the fields set directly inside the message block that starts at lines[line][column]."""
    tokenizer = text_format.Tokenizer([lines[line][column:]] + lines[line + 1:])
    tokens, depth = [], 0
    while not tokenizer.AtEnd():
        token = tokenizer.token
        if token in ("{", "<"):
            depth += 1
        elif token in ("}", ">"):
            depth -= 1
            if not depth:
                break
        tokens.append((token, depth))
        tokenizer.NextToken()
    return {t for (t, d), (after, _) in zip(tokens, tokens[1:] + [("", 0)])
            if d == 1 and after in (":", "{", "<") and t[:1].isalpha()}


class _FieldPicker(text_format._Parser):
    """Text parser that reads a name several forks share (_SHARED_NAMES) into the candidate field
    whose message declares every field the block sets; notes record each choice that needed a guess.

    A singular field set twice in one message (caffe-segnet's deploy file names the net twice) is
    read as protobuf's merge reads it, the later value kept, with a note: Caffe's text parser refuses
    it, but what the file means is plain.  Callers parse with MergeLines for that reason.
    """

    def __init__(self, lines=(), allow_unknown_field=False):
        super().__init__(allow_unknown_field=allow_unknown_field)
        self.lines = list(lines)
        self.notes = []
        self._has_3d_layers = bool(_3D_LAYERS.search("\n".join(self.lines)))
        self._fork_types = set()   # fork V1 enum names already noted
        self._styletransfer_pool_noted = False
        self.block_order = []      # "layer" / "layers", in the order the net's blocks come
        self._depth = 0

    def _MergeMessageField(self, tokenizer, message, field):
        if field is _DETECTNET_CLASSES and tokenizer.token not in ("{", "<"):
            # SidHard/digits-multi-detect declares object_class a class count, NVCaffe a ClassMapping
            self._MergeScalarField(tokenizer, message, _DETECTNET_CLASS_COUNT)
            return
        options = _SHARED_NAMES.get((message.DESCRIPTOR.full_name, field.name))
        if options and self.lines and tokenizer._line < len(self.lines):
            field = message.DESCRIPTOR.fields_by_name[self._pick(options, tokenizer, message)]
        if not field.is_repeated and message.HasField(field.name):
            self.notes.append(f"{tokenizer._line + 1}: {message.DESCRIPTOR.name} sets '{field.name}' a second "
                              f"time; the two blocks are merged, later fields winning (Caffe's parser "
                              f"refuses a field given twice)")
        if not self._depth and field.name in ("layer", "layers") and isinstance(message, caffe_pb2.NetParameter):
            self.block_order.append(field.name)
        self._depth += 1
        try:
            super()._MergeMessageField(tokenizer, message, field)
        finally:
            self._depth -= 1

    def _note_second_value(self, tokenizer, message, field):
        """The note for a singular scalar set again (called before the new value is read)."""
        if field.is_repeated or not message.HasField(field.name):
            return
        old = getattr(message, field.name)
        if field.enum_type is not None:
            old = field.enum_type.values_by_number[old].name if old in field.enum_type.values_by_number else old
        new = tokenizer.token
        same = str(old) == new.strip("\"'")
        old = f'"{old}"' if isinstance(old, str) and field.enum_type is None else old   # as written
        self.notes.append(f"{tokenizer._line + 1}: {message.DESCRIPTOR.name} sets '{field.name}' a second time"
                          + (" to the same value" if same else f" ({old}, then {new}); the later value is kept")
                          + " (Caffe's parser refuses a field given twice)")

    def _MergeScalarField(self, tokenizer, message, field):
        # a fork's V1 layer type (NUSWIDE_DATA) that the enum lacks: kept as written, for the upgrade
        if field is _V1_TYPE and tokenizer.token.isidentifier() and \
                tokenizer.token not in field.enum_type.values_by_name:
            message.fork_type = tokenizer.token
            # jackculpepper/caffe's IMPORT layers are inlined (io/imports.py), never read as a type
            if message.fork_type not in self._fork_types and message.fork_type != "IMPORT":
                self._fork_types.add(message.fork_type)
                self.notes.append(f"{tokenizer._line + 1}: V1 layer type {message.fork_type} is not one of "
                                  f"Caffe's; read as the type \"{fork_v1_type(message.fork_type)}\"")
            tokenizer.NextToken()
            return
        if field is _POOL_METHOD and tokenizer.token in _STYLETRANSFER_POOLS:
            self._styletransfer_pool(tokenizer, message)
            return
        self._note_second_value(tokenizer, message, field)
        super()._MergeScalarField(tokenizer, message, field)

    def _styletransfer_pool(self, tokenizer, message):
        """shenfalong/styletransfer's `pool: "max"` / `pool: "ave"`: its caffe.proto declares `pool` a string
        (default "ave") and its Pooling sizes the output with floor rounding, as a convolution does.  A
        quoted lower-case name is no value of BVLC's enum, so no other fork's file reads differently."""
        name = tokenizer.token[1:-1]
        self._note_second_value(tokenizer, message, message.DESCRIPTOR.fields_by_name["pool"])
        message.pool = caffe_pb2.PoolingParameter.MAX if name == "max" else caffe_pb2.PoolingParameter.AVE
        message.round_mode = caffe_pb2.PoolingParameter.FLOOR
        if not self._styletransfer_pool_noted:
            self._styletransfer_pool_noted = True
            self.notes.append(f"{tokenizer._line + 1}: pool: \"{name}\" is shenfalong/styletransfer's string pooling "
                              f"method (no value of Caffe's enum); read as {name.upper()} with floor rounding, as "
                              f"that fork's Pooling sizes its output")
        tokenizer.NextToken()

    def _pick(self, options, tokenizer, layer):
        if "generate_proposals_param" in options:
            # the layer's type alone says whose, whatever fields the block sets: the keypoint-rcnn fork's
            # GenerateProposal, else proposal_param as before; a type written after the block is read ahead
            kind = layer.type or _type_after_block(self.lines, tokenizer._line, tokenizer._column)
            return "generate_proposals_param" if kind == "GenerateProposal" else options[0]
        names = _block_field_names(self.lines, tokenizer._line, tokenizer._column)
        known = {option: names & set(_message_of(option).fields_by_name) for option in options}
        fits = [option for option in options if known[option] == names]
        if not names or len(fits) == 1:
            return options[0] if not names else fits[0]
        if not fits:   # an unknown field either way: the message that knows most of them reports it
            return max(options, key=lambda option: len(known[option]))
        if "xmbrain_quantization_param" in options:   # only bw_params / fl_params, which both declare
            return "xmbrain_quantization_param" if layer.type in _XMBRAIN_TYPES else options[0]
        lrcn = "lrcn_video_data_param"
        if lrcn in fits and "new_length" not in names and len(layer.top) == 3 and not self._has_3d_layers:
            # caffe_lrcn's clip_size has a default: its three tops (data, label, marker) and no 3-D layer say it
            self.notes.append(f"{tokenizer._line + 1}: video_data_param sets only fields that several forks share "
                              f"({', '.join(sorted(names))}); read as {_FORK_OF_FIELD[lrcn]}'s (three tops, no "
                              f"3-D layers, no new_length)")
            return lrcn
        # only fields C3D v1.1 and TSN share (source, batch_size, new_length, ...): C3D's clips feed
        # its 3-D layers, TSN's segments feed 2-D ones
        choice = "c3d_video_data_param" if self._has_3d_layers else "tsn_video_data_param"
        choice = choice if choice in fits else fits[0]
        why = "the net has 3-D layers" if self._has_3d_layers else "the net has no 3-D layers"
        self.notes.append(
            f"{tokenizer._line + 1}: video_data_param sets only fields that "
            f"{' and '.join(_FORK_OF_FIELD[f] for f in fits)} share ({', '.join(sorted(names))}); "
            f"read as {_FORK_OF_FIELD[choice]}'s ({why})")
        return choice


def _type_after_block(lines, line, column):
    """The `type: "..."` set after the message block that starts at lines[line][column], in the message
    that holds the block (its layer), or ""."""
    tokenizer = text_format.Tokenizer([lines[line][column:]] + lines[line + 1:])
    depth, last = 0, []
    while not tokenizer.AtEnd():
        token = tokenizer.token
        if token in ("{", "<"):
            depth += 1
        elif token in ("}", ">"):
            depth -= 1
            if depth < 0:
                break
        elif not depth and last == ["type", ":"]:
            return token.strip("\"'")
        last = (last + [token])[-2:]
        tokenizer.NextToken()
    return ""


def _message_of(layer_field):
    return caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name[layer_field].message_type


class _RecordingParser(_FieldPicker):
    """Lenient text parser that records every unknown field it skips and where it was."""

    def __init__(self, lines=(), net_path=()):
        super().__init__(lines, allow_unknown_field=True)
        self.net_path = list(net_path)   # where the NetParameter sits: () or ["net_param"] in a solver
        self.unknown = []
        self._path = []
        self._layer = None
        self._skipping = 0

    def _MergeMessageField(self, tokenizer, message, field):
        top_layer = self._path == self.net_path and field.name in ("layer", "layers")
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
            inside_net = self._path[:len(self.net_path)] == self.net_path
            self.unknown.append(_Unknown(
                field_name, immediate_message_type,
                None if line is None else line + 1, None if column is None else column + 1,
                # from the net down; a solver's own fields keep the solver's path
                tuple(self._path[len(self.net_path):] if inside_net else self._path) + (field_name,),
                self._layer,
                self._skipped_text(field_name, line, column, tokenizer) in ("{}", ":{}", "<>", ":<>"),
                solver=not inside_net, placeholder=self._placeholder_value(line, column)))

    def _MergeScalarField(self, tokenizer, message, field):
        # a fork's value of a known enum (SSD forks' `conf_loss_type: FocalLoss`): recorded like an
        # unknown field, so that where it cannot matter (a loss parameter) it is only a warning
        token = tokenizer.token
        # a fork that declares the field a string writes its value quoted (Intel Caffe's engine: "MKL2017")
        quoted = len(token) > 2 and token[0] == token[-1] and token[0] in "\"'" and token[1:-1].isidentifier()
        forked = quoted and field.enum_type is not None and field.enum_type.full_name in QUOTED_ENUM_FORKS
        if forked:   # its string field, whatever the value: Intel's "CAFFE" is no more this enum's CAFFE
            token = token[1:-1]
            if self._skipping:
                tokenizer.NextToken()
                return
        # a fork's enum value written as its number (caffe-roc's Eltwise `operation: 3`) is as unknown as a name
        numbered = field.enum_type is not None and re.fullmatch(r"-?(0[xX][0-9a-fA-F]+|\d+)", token) is not None \
            and int(token, 0 if "x" in token.lower() else 10) not in field.enum_type.values_by_number
        if field.enum_type is not None and field is not _V1_TYPE \
                and (numbered or token.isidentifier() and (forked or token not in field.enum_type.values_by_name)) \
                and not self._skipping:
            inside_net = self._path[:len(self.net_path)] == self.net_path
            self.unknown.append(_Unknown(
                field.name, field.enum_type.full_name, tokenizer._line + 1, tokenizer._column + 1,
                tuple(self._path[len(self.net_path):] if inside_net else self._path) + (field.name,),
                self._layer, solver=not inside_net, enum_value=token))
            tokenizer.NextToken()
            return
        super()._MergeScalarField(tokenizer, message, field)

    def _placeholder_value(self, line, column):
        """Whether the field at (line, column) has a template placeholder's number as its value."""
        m = _SCALAR_FIELD.match(self.lines[line], column) if line is not None and line < len(self.lines) else None
        return m is not None and is_sentinel(m.group(1))

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


def parse_prototxt_text(text, message=None, path="<text>", ignore_unknown=False, warnings=None,
                        phase="TEST", known_layer=None, defines=None, placeholders=None):
    """Parse text into a NetParameter (or the given message).

    phase: the net the caller will build ("TEST" or "TRAIN"); decides which unknown
    fields are training-only (see the module docstring).  known_layer: see unknown_fields._training_only.
    defines: {NAME: value} for template placeholders (io/templates.py).  placeholders: a list that
    receives the placeholders left unfilled, for the caller to fill from a caffemodel's net; without
    it an unfilled placeholder is an error.
    """
    message = message if message is not None else caffe_pb2.NetParameter()
    if phase not in _PHASES:
        raise ParseError(f"{path}: phase must be TRAIN or TEST, got {phase!r}")
    filled = []
    text, pending = fill_placeholders(text, defines, path, filled)
    for _ in range(_MAX_BARE_PLACEHOLDERS):
        try:
            message = _parse(text, message, path, ignore_unknown, warnings, phase, known_layer)
            break
        except BarePlaceholder as e:
            message.Clear()
            text = v1_name_as_type(text, e, path, filled) or mycaffe_bare_string(text, e, path, filled) or \
                fill_bare_placeholder(text, e, defines, pending, filled, path)
    else:
        raise ParseError(f"{path}: more than {_MAX_BARE_PLACEHOLDERS} words where values go; not a net definition")
    if warnings is not None:
        warnings.extend(filled)
    if isinstance(message, caffe_pb2.NetParameter):
        styletransfer_inputs(message, path, warnings)
    if placeholders is None:
        resolve_placeholders(message, pending, path, [])
    else:
        placeholders.extend(pending)
    return message


def _parse_error(path, err, text):
    """The ParseError for a text_format error; a bare word where a number goes (MobileNet-SSD's
    templates: `num_output: cls3x`) or a quoted string goes is a BarePlaceholder, which the caller
    fills and parses again."""
    bare = _BARE_NUMBER.search(str(err))
    bare_text = _BARE_TEXT.search(str(err))
    m = _LINE_COL.match(str(err))
    where, msg = _describe(path, err, text)
    if (bare or bare_text) and m:
        return BarePlaceholder(f"{where}: {msg}", int(m.group(1)), int(m.group(2)), (bare or bare_text).group(1),
                               wants_text=bare is None)
    unclosed = _unclosed(path, text)
    if unclosed is not None:
        return ParseError(unclosed)
    block = block_placeholder(text, int(m.group(1)) - 1) if m else None
    if block is not None:
        row, word = block
        return ParseError(f"{path}:{row + 1}: '{word}' stands alone where fields go: a template placeholder that a "
                          f"script replaces with text (layers or fields) before Caffe reads the file; put that "
                          f"text in its place, or pass --define {word}=TEXT")
    stray = _word_before(text, int(m.group(1)), int(m.group(2))) if m and msg.endswith('Expected "{".') else None
    if stray is not None:
        row, col, word = stray
        return ParseError(f"{path}:{row}:{col}: '{word}' stands where a field name goes but is followed by neither "
                          f"':' nor '{{' (a stray word?)")
    return ParseError(f"{where}: {msg}")


def _word_before(text, row, col):
    """(row, column, word) of the token before 1-based (row, col) when it is a bare word: the name protobuf took
    for an unknown field, whose value it then found missing (`}z` closing a layer)."""
    lines = text.split("\n")
    for r in range(min(row, len(lines)) - 1, -1, -1):
        line = lines[r][:col - 1] if r == row - 1 else lines[r]
        _, comment = code_spans(line)
        code = line if comment is None else line[:comment]
        if code.strip():
            tokens = [m for m in _TOKEN.finditer(code) if not m.group(0).isspace()]
            last = tokens[-1]
            return (r + 1, last.start() + 1, last.group(0)) if last.group(0)[:1].isalpha() else None
    return None


_TOKEN = re.compile(r"\s+|#[^\n]*|[A-Za-z_][\w.]*|[{}<>:]|[\"']|[^\s{}<>:\"'#A-Za-z_]+")
_CLOSER = {"{": "}", "<": ">"}
_FIELDS_INSIDE = re.compile(r"\s[A-Za-z_]\w*\s*(:|\{)")


def _unclosed(path, text):
    """The one-line message for a file that does not parse because a quoted string is not closed
    on its line (protobuf's tokenizer, as Caffe's, ends a string there), or because the file ends
    inside a block: where that string or the outermost open block began, with the layer's name.
    None when neither is the case."""
    open_blocks = []          # [field, line, opener, layer name] from the outermost
    words = []                # the last few tokens: `name : "conv1"` names the layer being read
    for row, line in enumerate(text.split("\n"), 1):
        col, line_strings = 0, []
        while col < len(line):
            m = _TOKEN.match(line, col)
            token = m.group(0)
            if token in ("\"", "'"):
                end = col + 1
                while end < len(line) and line[end] != token:
                    end += 2 if line[end] == "\\" else 1
                if end >= len(line):
                    # the quotes pair up wrongly after the one left open: a "string" holding fields
                    # (`"conv1 convolution_param {`) began at it
                    start = next((c for c, q in line_strings if _FIELDS_INSIDE.search(q)), col)
                    return (f"{path}:{row}:{start + 1}: unterminated string: the {line[start]} opened here is not "
                            f"closed on its line")
                value = line[col + 1:end]
                line_strings.append((col, value))
                if open_blocks and len(open_blocks) == 1 and words[-2:] == ["name", ":"] \
                        and open_blocks[0][3] is None:
                    open_blocks[0][3] = value
                words.append(token + value + token)
                col = end + 1
                continue
            col = m.end()
            if token.isspace() or token.startswith("#"):
                continue
            if token in _CLOSER:
                field = next((w for w in reversed(words[-2:]) if w[:1].isalpha() or w[:1] == "_"), None)
                open_blocks.append([field, row, token, None])
            elif token in ("}", ">") and open_blocks:
                open_blocks.pop()
            words = (words + [token])[-3:]
    if not open_blocks:
        return None
    field, row, opener, name = open_blocks[0]
    if field in ("layer", "layers"):
        what = f"layer '{name}'" if name else "a layer"
    else:
        what = f"'{field}'" if field else f"the '{opener}' block"
    return f"{path}:{row}: {what} opened here is not closed: the file ends before its '{_CLOSER[opener]}'"


def _parse(text, message, path, ignore_unknown, warnings, phase, known_layer):
    lines = text.split("\n")
    try:
        picker = _FieldPicker(lines)
        picker.MergeLines(lines, message)
        _add_notes(picker, path, warnings)
        _interleave(message, picker, path, warnings)
        return message
    except text_format.ParseError as e:
        if V1_QUOTED_TYPE.search(str(e)):
            repaired, renamed, retyped = v2_blocks_named_layers(text)
            if renamed or retyped:
                message.Clear()
                message = _parse(repaired, message, path, ignore_unknown, warnings, phase, known_layer)
                if warnings is not None and renamed:
                    warnings.append(f"{path}: {renamed} 'layers' block(s) hold a current-format layer (a quoted type "
                                    f"string); read as 'layer' blocks (Caffe's parser refuses them)")
                if warnings is not None and retyped:
                    warnings.append(f"{path}: {retyped} V1 'layers' block(s) (blobs_lr, weight_decay) give their type "
                                    f"as a quoted string, which Caffe's parser refuses; read as V1's enum value")
                return message
        if not _UNKNOWN_FIELD.search(str(e)):
            raise _parse_error(path, e, text) from None
    # Unknown fields present: parse leniently, recording each one, then decide.
    message.Clear()
    parser = _RecordingParser(text.split("\n"))
    try:
        parser.MergeLines(text.split("\n"), message)
    except text_format.ParseError as e:
        raise _parse_error(path, e, text) from None
    if isinstance(message, caffe_pb2.NetParameter) and _is_solver(parser.unknown):
        message.CopyFrom(_net_from_solver(text, path, ignore_unknown, warnings, phase, known_layer))
        return message
    report_unknown_fields(parser.unknown, message, path, _PHASES[phase], ignore_unknown, warnings, known_layer)
    _add_notes(parser, path, warnings)
    _interleave(message, parser, path, warnings)
    return message


def _interleave(message, parser, path, warnings):
    """A net that mixes 'layer' and V1 'layers' blocks (which Caffe refuses to upgrade) gets its V1
    entries upgraded in place, in the order the file gives the blocks, with a note."""
    if not isinstance(message, caffe_pb2.NetParameter) or not (len(message.layer) and len(message.layers)):
        return
    if any(v1.HasField("layer") for v1 in message.layers):
        return   # V0 entries: upgrade_net refuses the mix
    count = upgrade_mixed_layers(message, parser.block_order)
    if warnings is not None:
        warnings.append(f"{path}: mixes 'layer' blocks with {count} legacy V1 'layers' block(s), which Caffe "
                        f"refuses to upgrade; read the V1 ones upgraded where they stand")


def _add_notes(parser, path, warnings):
    if warnings is not None:
        warnings.extend(f"{path}:{note}" for note in parser.notes)


# SolverParameter fields that say where the net is; no NetParameter has them
_SOLVER_NET_FIELDS = ("net_param", "net", "train_net", "test_net", "train_net_param", "test_net_param")


def _is_solver(unknowns):
    """A solver read as a net: its net field is an unknown top-level field of the NetParameter."""
    return any(len(u.path) == 1 and u.name in _SOLVER_NET_FIELDS for u in unknowns)


def _net_from_solver(text, path, ignore_unknown, warnings, phase, known_layer=None):
    """The NetParameter a solver file holds in net_param (Caffe's Solver::InitTrainNet/InitTestNets
    use it for both phases when no train_/test_ net is given)."""
    lines = text.split("\n")
    solver = caffe_pb2.SolverParameter()
    parser = _RecordingParser(lines, net_path=("net_param",))
    try:
        parser.MergeLines(lines, solver)
    except text_format.ParseError as e:
        where, msg = _describe(path, e, text)
        raise ParseError(f"{where}: {msg} (reading the file as a Caffe solver)") from None
    named = [(f, v) for f, v in (("net", solver.net), ("train_net", solver.train_net))
             if solver.HasField(f)] + [("test_net", v) for v in solver.test_net]
    if not solver.HasField("net_param"):
        inline = (["train_net_param"] if solver.HasField("train_net_param") else []) + \
                 (["test_net_param"] if len(solver.test_net_param) else [])
        if named:
            field, net_file = named[0]
            raise ParseError(f"{path}: this is a Caffe solver; its net is in another file ({field}: "
                             f"\"{net_file}\", relative to where caffe was started): pass that file instead")
        raise ParseError(f"{path}: this is a Caffe solver with its nets in {' and '.join(inline) or 'no field'}; "
                         f"caffeq reads a solver's net from net_param only: copy the net into its own "
                         f"prototxt and pass that")
    net = solver.net_param
    report_unknown_fields(parser.unknown, net, path, _PHASES[phase], ignore_unknown, warnings, known_layer)
    if warnings is not None:
        also = f" (it also names {', '.join(f for f, _ in named)}, not read)" if named else ""
        warnings.append(f"{path}: a Caffe solver file; read the net in its net_param and ignored the "
                        f"solver settings{also}")
    return net


def read_prototxt(path, ignore_unknown=False, warnings=None, message=None, phase="TEST", known_layer=None,
                  defines=None, placeholders=None):
    path = os.fspath(path)
    return parse_prototxt_text(read_prototxt_text(path, warnings), message, path, ignore_unknown, warnings, phase,
                               known_layer, defines, placeholders)


def read_prototxt_text(path, warnings=None):
    """A prototxt file's text as Caffe's tokenizer would see it: refused if binary or an HTML page, a
    byte-order mark skipped, non-UTF-8 comments and typographic quotes read with a note."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ParseError(f"{path}: cannot read: {e.strerror or e}") from None
    if b"\x00" in raw[:4096]:
        raise ParseError(f"{path}: binary data, not a text prototxt (pass it as --weights?)")
    if raw.startswith(b"\xef\xbb\xbf"):
        # a Windows editor's UTF-8 byte-order mark: protobuf's tokenizer (Caffe's, OpenCV's) stops on
        # it, though the text after it is the net
        raw = raw[3:]
        if warnings is not None:
            warnings.append(f"{path}: skipped the UTF-8 byte-order mark at the start of the file")
    text = decode(raw, path, warnings)
    if b"<!DOCTYPE html" in raw[:2048] or b"<html" in raw[:2048]:
        raise ParseError(f"{path}: an HTML page, not a prototxt (a web page saved in place of the raw file?)")
    return mycaffe_text(plain_quotes(text, path, warnings), path, warnings)
