"""Template placeholders in a prototxt (DeepLab's `num_output: ${NUM_LABELS}`, PWC-Net's
`crop_width: $TARGET_WIDTH`): values that a run script substitutes before Caffe reads the file.

A placeholder is written as a field's value (outside quotes and comments), either `$NAME` / `${NAME}`
or a bare word where a number goes (MobileNet-SSD's templates: `num_output: cls3x`, which its
gen_model.sh replaces by 3 x the class count).  It gets its value from, in order:
  1. `defines` ({NAME: text}, the command line's `--define NAME=VALUE`), put in its place as text;
  2. the net definition that a caffemodel saved with its weights: the same field of the layer of the
     same name (the script filled it in before training, and Caffe wrote the filled net);
and otherwise the read stops with one line naming the placeholder, its layer and field, and the options.

Placeholders inside quoted strings (`source: "${DATA_ROOT}/train.txt"`) are plain text to Caffe and stay.
"""
import re
from dataclasses import dataclass

from ..errors import ParseError

# `field: $NAME` or `field: ${NAME}` where a value goes (after a colon, or after `{`/`<` of a
# message value would be a syntax error anyway)
_VALUE_PLACEHOLDER = re.compile(r"(?P<lead>:[ \t]*)(?P<ph>\$\{(?P<braced>\w+)\}|\$(?P<bare>[A-Za-z_]\w*))")
# unfilled placeholders parse as these numbers, exact in int32, int64 and float32 fields alike
_SENTINEL_BASE = 1 << 30
_SENTINEL_STEP = 1 << 10


class BarePlaceholder(ParseError):
    """A bare word where the parser wanted a number: the text's row and column (1-based) and the word."""

    def __init__(self, message, line, column, word):
        super().__init__(message)
        self.line, self.column, self.word = line, column, word


@dataclass
class Placeholder:
    name: str     # NUM_LABELS
    text: str     # ${NUM_LABELS} as written
    line: int     # 1-based
    sentinel: int
    where: tuple = ()   # (layer name, the message holding the field, field path) once located


def code_spans(line):
    """([(start, end)] ranges of the line outside quoted strings and the comment, the index of the
    '#' that opens the comment or None), as protobuf's tokenizer reads a prototxt line."""
    spans, start, quote, escaped = [], 0, None, False
    for i, ch in enumerate(line):
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote, start = None, i + 1
        elif ch in "\"'":
            spans.append((start, i))
            quote = ch
        elif ch == "#":
            spans.append((start, i))
            return spans, i
    if quote is None:
        spans.append((start, len(line)))
    return spans, None


def fill_placeholders(text, defines, path, notes):
    """-> (text with every value placeholder replaced, [Placeholder] still unfilled).

    Defined names get their value; the others a sentinel number that locate_placeholders finds
    again in the parsed net."""
    defines = dict(defines or {})
    pending, used = [], {}
    lines = text.split("\n")
    for number, line in enumerate(lines):
        if "$" not in line:
            continue
        pieces, last = [], 0
        for start, end in code_spans(line)[0]:
            for m in _VALUE_PLACEHOLDER.finditer(line, start, end):
                name = m.group("braced") or m.group("bare")
                if name in defines:
                    value = str(defines[name])
                    used[name] = used.get(name, 0) + 1
                else:
                    sentinel = _SENTINEL_BASE + _SENTINEL_STEP * (len(pending) + 1)
                    pending.append(Placeholder(name, m.group("ph"), number + 1, sentinel))
                    value = str(sentinel)
                pieces.append(line[last:m.start("ph")] + value)
                last = m.end("ph")
        if pieces:
            lines[number] = "".join(pieces) + line[last:]
    for name, count in used.items():
        notes.append(f"{path}: filled the template placeholder {name} with {defines[name]} "
                     f"(--define, {count} place{'s' if count > 1 else ''})")
    return "\n".join(lines), pending


_NUMBERS = {"CPPTYPE_INT32", "CPPTYPE_INT64", "CPPTYPE_UINT32", "CPPTYPE_UINT64", "CPPTYPE_FLOAT",
            "CPPTYPE_DOUBLE"}


def fill_bare_placeholder(text, bare, defines, pending, notes, path):
    """The text with the bare word at bare.line:bare.column replaced by its --define value, or by a
    sentinel recorded in `pending` (see fill_placeholders)."""
    lines = text.split("\n")
    row, col = bare.line - 1, bare.column - 1
    line = lines[row]
    if line[col:col + len(bare.word)] != bare.word:   # not where the parser said: leave its error
        raise ParseError(str(bare))
    defines = defines or {}
    given = [name for name, value in defines.items() if str(value) == bare.word and name != bare.word]
    if given:   # the user's own value is the word: a typo in --define, not a placeholder of the file
        raise ParseError(f"{path}:{bare.line}: --define {given[0]}={bare.word}: the field there takes a number, "
                         f"not {bare.word!r}")
    if bare.word in defines:
        value = str(defines[bare.word])
        note = f"{path}: filled the template placeholder {bare.word} with {value} (--define)"
        if note not in notes:
            notes.append(note)
    else:
        sentinel = _SENTINEL_BASE + _SENTINEL_STEP * (len(pending) + 1)
        pending.append(Placeholder(bare.word, bare.word, bare.line, sentinel))
        value = str(sentinel)
    lines[row] = line[:col] + value + line[col + len(bare.word):]
    return "\n".join(lines)


def _scan(message, path, found, skip=()):
    """Append (field path, value) for every number set in message, recursively; a path step is
    `name` or `name[i]` for a repeated field.  Top-level fields named in `skip` are not visited."""
    for field, value in message.ListFields():
        if field.name in skip:
            continue
        repeated = field.is_repeated
        items = list(enumerate(value)) if repeated else [(None, value)]
        is_number = any(field.cpp_type == getattr(field, kind) for kind in _NUMBERS)
        for i, item in items:
            step = field.name if i is None else f"{field.name}[{i}]"
            if field.message_type is not None:
                _scan(item, path + (step,), found)
            elif is_number:
                found.append((path + (step,), item))


def _layers(net):
    return list(net.layer) + list(net.layers)


def locate_placeholders(net, pending):
    """Record for each pending placeholder the layer (its name and message) and field path where it landed."""
    by_sentinel = {p.sentinel: p for p in pending}
    spots = []
    for layer in _layers(net):
        found = []
        _scan(layer, (), found)
        spots += [(layer.name, layer, field_path, value) for field_path, value in found]
    found = []
    _scan(net, (), found, skip=("layer", "layers"))   # the layers were scanned above, each as its owner
    spots += [("", net, field_path, value) for field_path, value in found]
    for layer_name, owner, field_path, value in spots:
        p = by_sentinel.get(int(value)) if float(value).is_integer() else None
        if p is not None:
            p.where = (layer_name, owner, field_path)


def _steps(field_path):
    for step in field_path:
        name, _, index = step.partition("[")
        yield name, int(index[:-1]) if index else None


def _value_at(message, field_path):
    for name, index in _steps(field_path):
        field = message.DESCRIPTOR.fields_by_name.get(name)
        if field is None:
            return None
        if index is None and field.message_type is not None and not message.HasField(name):
            return None
        value = getattr(message, name)
        if index is not None:
            if index >= len(value):
                return None
            value = value[index]
        message = value
    return message


def _set_at(message, field_path, value):
    *parents, (name, index) = list(_steps(field_path))
    for parent, i in parents:
        message = getattr(message, parent) if i is None else getattr(message, parent)[i]
    if index is None:
        setattr(message, name, value)
    else:
        getattr(message, name)[index] = value


def resolve_placeholders(net, pending, path, notes, weights_net=None, weights_path=None):
    """Put in each pending placeholder's value from the weights' own net; refuse the rest clearly."""
    if not pending:
        return
    locate_placeholders(net, pending)
    saved = {}
    for layer in _layers(weights_net) if weights_net is not None else ():
        saved.setdefault(layer.name, layer)
    values = {}
    for p in pending:
        layer_name, owner, field_path = p.where or ("", None, ())
        source = (saved.get(layer_name) if layer_name else weights_net) if weights_net is not None else None
        value = _value_at(source, field_path) if source is not None and field_path else None
        if value is None or value >= _SENTINEL_BASE:
            field = ".".join(field_path) or "a field"
            where = f" (layer '{layer_name}', {field})" if layer_name else f" ({field})"
            hint = f" (the net saved in {weights_path} does not give it)" if weights_net is not None else \
                ", or --weights whose saved net gives it"
            raise ParseError(f"{path}:{p.line}: {p.text}{where} is a template placeholder that a script fills "
                             f"in before Caffe reads the file: pass --define {p.name}=VALUE{hint}")
        if values.setdefault(p.name, value) != value:
            raise ParseError(f"{path}:{p.line}: the template placeholder {p.text} has two values in the net "
                             f"saved in {weights_path}: {values[p.name]} and {value}; pass --define {p.name}=VALUE")
        _set_at(owner, field_path, value)
    for name, value in values.items():
        notes.append(f"{path}: filled the template placeholder {name} with {value}, from the net saved "
                     f"in {weights_path}")
