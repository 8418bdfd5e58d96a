"""Repairs of prototxt text that Caffe's parser refuses but whose meaning is plain, each leaving a
note, and the decoding of a file's bytes: typographic quotes, comments that are not UTF-8, a V1
enum name as a `layer`'s type, `layers` blocks that hold current-format layers; and the reading of
a capitals word alone where fields go as a template placeholder (for the refusal's wording)."""
import re

from google.protobuf import text_format

from ..errors import ParseError
from .templates import code_spans
from .upgrade import V1_TYPE_STRINGS

_ALONE_PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*")


def v1_name_as_type(text, bare, path, notes):
    """The text with a V1 enum name written as a layer's type (`type: DROPOUT` in a `layer {}`
    block) replaced by the type string Caffe's upgrade gives it, with a note; None for other words."""
    lines = text.split("\n")
    row, col = bare.line - 1, bare.column - 1
    line = lines[row]
    v2 = V1_TYPE_STRINGS.get(bare.word)
    if not bare.wants_text or v2 is None or not re.search(r"(^|[\s{])type\s*:\s*$", line[:col]) \
            or line[col:col + len(bare.word)] != bare.word:
        return None
    lines[row] = f'{line[:col]}"{v2}"{line[col + len(bare.word):]}'
    notes.append(f"{path}:{bare.line}: the V1 layer type {bare.word} in a 'layer' block read as \"{v2}\" "
                 f"(Caffe's parser refuses it)")
    return "\n".join(lines)


def block_placeholder(text, row):
    """(row, word) when the code line before the error's row is one word in capitals on its own
    (developmentseed/skynet-train's templates: `INPUT` where a script writes the input layers)."""
    lines = text.split("\n")
    for before in range(min(row, len(lines)) - 1, -1, -1):
        _, comment = code_spans(lines[before])
        code = (lines[before] if comment is None else lines[before][:comment]).strip()
        if code:
            return (before, code) if _ALONE_PLACEHOLDER.fullmatch(code) else None
    return None


V1_QUOTED_TYPE = re.compile(r'Enum type "caffe\.V1LayerParameter\.LayerType" has no value named "')


# fields only a V1 `layers` block has: a block that sets them is V1 whatever its type is written as
_V1_ONLY_FIELDS = frozenset({"blobs_lr", "weight_decay", "blob_share_mode"})
_V1_ENUM_OF_TYPE = {string: name for name, string in V1_TYPE_STRINGS.items() if string}


def v2_blocks_named_layers(text):
    """(text, renamed, retyped): each top-level `layers { ... }` block whose `type` is a quoted string made
    readable, keeping every other character in place: renamed `layer` (ginobilinie/infantSeg's
    `layers { type: "BatchNorm" param { lr_mult: 0 } }`, a current-format layer under the legacy
    name), or, where the block sets V1's own fields (qxcv/joint-regressor's `type: "Convolution"`
    beside `blobs_lr: 0`), its type written as V1's enum value, so that the V1 upgrade reads it."""
    lines = text.split("\n")
    tokenizer = text_format.Tokenizer(lines)
    depth, block, quoted, v1_blocks = 0, None, {}, set()
    previous = previous_name = None
    while not tokenizer.AtEnd():
        token, line, column = tokenizer.token, tokenizer._line, tokenizer._column
        if token in ("{", "<"):
            if depth == 0 and previous is not None and previous[0] == "layers":
                block = previous[1:]
            depth += 1
        elif token in ("}", ">"):
            depth -= 1
            if depth == 0:
                block = None
        elif block is not None and depth == 1:
            if previous is not None and previous[0] == ":" and previous_name == "type" and token[:1] in "\"'":
                quoted[block] = (line, column, token)
            elif token in _V1_ONLY_FIELDS:
                v1_blocks.add(block)
        if token != ":":
            previous_name = token
        previous = (token, line, column)
        tokenizer.NextToken()
    edits = []    # (line, column, length, replacement), made from the end so columns stay true
    for (line, column), (type_line, type_column, token) in quoted.items():
        enum = _V1_ENUM_OF_TYPE.get(token[1:-1])
        if (line, column) in v1_blocks and enum is not None:
            edits.append((type_line, type_column, len(token), enum))
        else:
            edits.append((line, column, len("layers"), "layer"))
    for line, column, length, replacement in sorted(edits, reverse=True):
        row = lines[line]
        lines[line] = row[:column] + replacement + row[column + length:]
    retyped = sum(1 for _, _, _, replacement in edits if replacement != "layer")
    return "\n".join(lines), len(edits) - retyped, retyped


def decode(raw, path, warnings):
    """The file's text. Bytes that are not UTF-8 are accepted in comments, which Caffe's tokenizer
    skips unread (files with GBK or Latin-1 comments load in Caffe); anywhere else they are an error."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        first_bad = e.start
    text = raw.decode("utf-8", errors="replace")
    for number, line in enumerate(text.splitlines(), 1):
        bad = line.find("\ufffd")
        if bad >= 0:
            comment = code_spans(line)[1]
            if comment is None or bad < comment:
                raise ParseError(f"{path}:{number}: not UTF-8 text (byte {first_bad}), outside a comment")
    if warnings is not None:
        warnings.append(f"{path}: comments that are not UTF-8 text (from byte {first_bad}) were skipped, "
                        f"as Caffe skips them")
    return text


_CURLY = "\u201c\u201d"
_TYPOGRAPHIC_CLOSE = re.compile(r"\u201d(?=\s*($|#|}|\w+\s*[:{<]))")


def plain_quotes(text, path, warnings):
    """Typographic double quotes (“name”, or "name” from a word processor) read as plain ones where
    they open or close a string, with a note: Caffe's tokenizer refuses them, but what they quote is
    plain.  Inside a string or a comment they stay."""
    if _CURLY[0] not in text and _CURLY[1] not in text:
        return text
    lines, changed = text.split("\n"), []
    for number, line in enumerate(lines):
        fixed = _plain_quotes_of_line(line)
        if fixed != line:
            lines[number] = fixed
            changed.append(number + 1)
    if changed and warnings is not None:
        rows = ", ".join(map(str, changed[:5])) + (", ..." if len(changed) > 5 else "")
        warnings.append(f"{path}:{changed[0]}: typographic quotes (\u201c \u201d) read as plain ones "
                        f"(line{'s' if len(changed) > 1 else ''} {rows}); Caffe's parser refuses them")
    return "\n".join(lines)


def _closing(line, start, quotes):
    """Index of the first of `quotes` after start not escaped by a backslash, or -1."""
    i = start
    while i < len(line):
        if line[i] == "\\":
            i += 2
            continue
        if line[i] in quotes:
            return i
        i += 1
    return -1


def _plain_quotes_of_line(line):
    out, i = list(line), 0
    while i < len(line) and line[i] != "#":
        if line[i] in "\"'":
            end = _closing(line, i + 1, line[i])
            # "norm1”: a typographic quote that ends the string where the next field or the line follows
            found = _TYPOGRAPHIC_CLOSE.search(line, i + 1)   # the whole line: its lookahead reads on
            typographic = found.start() if found and (end < 0 or found.start() < end) else -1
            if typographic >= 0:
                end = typographic
                out[end] = '"'
            if end < 0:
                break
            i = end + 1
        elif line[i] in _CURLY:
            out[i] = '"'
            end = _closing(line, i + 1, _CURLY + '"')
            if end < 0:
                break
            out[end] = '"'
            i = end + 1
        else:
            i += 1
    return "".join(out)


# MyCaffe (MyCaffe/MyCaffe, a C# Caffe) writes its own dialect of the text format: what only it writes
# (its RUN phase, its IMAGEDB backend, its own field names) marks a file as MyCaffe's.  Its RawProto
# reader (MyCaffe.basecode/RawProto.cs, b8922aa) splits each line at blanks and takes the word after
# `name:` as the value, quoted or not, so its writer leaves text values unquoted (`label_map_file:
# C:\ProgramData\...`), which protobuf's tokenizer refuses.
MYCAFFE_MARK = re.compile(r"(^|[\s{])(phase\s*:\s*RUN\b|backend\s*:\s*IMAGEDB\b|(use_imagedb_mean|enable_random_selection|"
                          r"freeze_learning|enable_noise|normalization2_param|lstm_attention_param|"
                          r"data_sequence_param)\b)", re.M)
_UNQUOTED_VALUE = re.compile(r"(\b\w+[ \t]*:[ \t]*)([^\s\"'{}<>#:][^\s{}]*)")
_SCALAR_WORD = re.compile(r"[-+]?(\d+\.?\d*([eE][-+]?\d+)?[fF]?|\.\d+([eE][-+]?\d+)?|0[xX][0-9a-fA-F]+|inf|infinity|nan)"
                          r"|[A-Za-z_]\w*", re.I)


def is_mycaffe_text(text):
    """Whether the text holds what only MyCaffe writes, outside strings and comments (a comment or a name
    in another fork's file that mentions `phase: RUN` or `enable_noise` does not count)."""
    if not MYCAFFE_MARK.search(text):   # the common case, without splitting lines
        return False
    for line in text.split("\n"):
        if MYCAFFE_MARK.search(line):
            spans, _ = code_spans(line)
            if any(MYCAFFE_MARK.search(line[start:end]) for start, end in spans):
                return True
    return False


def mycaffe_text(text, path, warnings):
    """A MyCaffe file's text with each unquoted value that is neither a number nor a word (a Windows
    path) quoted, as MyCaffe reads it, with a note; other files unchanged."""
    if not is_mycaffe_text(text):
        return text
    lines, quoted = text.split("\n"), []
    for number, line in enumerate(lines):
        spans, _ = code_spans(line)
        fixed = line
        for start, end in reversed(spans):   # outside strings and the comment; each value a blank-free word
            part = _UNQUOTED_VALUE.sub(_quote_value, line[start:end])
            fixed = fixed[:start] + part + fixed[end:]
        if fixed != line:
            lines[number] = fixed
            quoted.append(number + 1)
    if warnings is not None:
        warnings.append(f"{path}: a MyCaffe (MyCaffe/MyCaffe, C#) model file: read in its dialect (its RUN phase is "
                        f"the inference net, IMAGEDB a data source, unquoted text values strings)")
        if quoted:
            rows = ", ".join(map(str, quoted[:5])) + (", ..." if len(quoted) > 5 else "")
            warnings.append(f"{path}:{quoted[0]}: unquoted text value(s) read as strings, as MyCaffe reads them "
                            f"(line{'s' if len(quoted) > 1 else ''} {rows}); Caffe's parser refuses them")
    return "\n".join(lines)


def _quote_value(m):
    value = m.group(2)
    if _SCALAR_WORD.fullmatch(value):
        return m.group(0)
    return m.group(1) + '"' + value.replace("\\", "\\\\") + '"'


def mycaffe_bare_string(text, bare, path, notes):
    """In a MyCaffe file, the text with a bare word where a string goes (`source: MNIST`) quoted, with a
    note (MyCaffe's reader takes it as the string); None otherwise."""
    if not bare.wants_text or not is_mycaffe_text(text):
        return None
    lines = text.split("\n")
    row, col = bare.line - 1, bare.column - 1
    line = lines[row]
    if line[col:col + len(bare.word)] != bare.word:
        return None
    lines[row] = f'{line[:col]}"{bare.word}"{line[col + len(bare.word):]}'
    notes.append(f"{path}:{bare.line}: the unquoted word {bare.word} read as the string \"{bare.word}\", as "
                 f"MyCaffe reads it")
    return "\n".join(lines)
