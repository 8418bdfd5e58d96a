"""Template placeholders in a prototxt (DeepLab's `num_output: ${NUM_LABELS}`, PWC-Net's
`crop_width: $TARGET_WIDTH`): values that a run script substitutes before Caffe reads the file.

A placeholder is written as a field's value (outside quotes and comments): `$NAME`, `${NAME}`, FlowNet 2.0's
`$NAME$` (`dim: $TARGET_HEIGHT$`), Collective
Knowledge's `$#NAME#$` (dividiti/ck-caffe's packages), `##NAME##` (cvjena/part_constellation_models),
`###@1###` (kumasento/caffe's hsi templates: its configure script's first argument, named ARG1), Python's
format field `{NAME}` (`input_dim:{height}`), printf fields (bare `%d`, named ARG1, ARG2, ... in the order
fprintf or Python's `%` fills them; Python's `%(NAME)d`), Jinja's `{{ NAME }}`, `<NAME>` (`num_output: <num_classes>`), CMake's `@NAME@`, or a bare word where a number goes (MobileNet-SSD's
templates: `num_output: cls3x`, which its gen_model.sh replaces by 3 x the class count).  A number's
placeholder gets its value from, in order:
  1. `defines` ({NAME: text}, the command line's `--define NAME=VALUE`), put in its place as text;
  2. the net definition that a caffemodel saved with its weights: the same field of the layer of the
     same name (the script filled it in before training, and Caffe wrote the filled net);
and otherwise the read stops with one line naming the placeholder, its layer and field, and the options.

A placeholder where text goes (LiteFlowNet's `folder: $OUTFOLDER`, `mean_file: IMAGE_MEAN` in capitals)
takes its --define value, else keeps its own text, with a warning: such fields name files, which only
reading a dataset or writing results opens.  Input dimensions may also come from --input-shape.

Placeholders inside quoted strings (`source: "${DATA_ROOT}/train.txt"`, a Python layer's param_str)
take the value --define gives them, as the script would put it there; the others are plain text
to Caffe and stay.
"""
import re
from dataclasses import dataclass

from ..errors import ParseError

# `field: $NAME`, `field: ${NAME}` or `field: {NAME}` where a value goes (after a colon; elsewhere it
# would be a syntax error anyway, and a message value `{ name: ...}` never closes right after one word)
# ${NAME}, $NAME, FlowNet 2.0's $NAME$ (its deploy templates), Jinja's {{ NAME }}: placeholders wherever
# they stand, quoted strings included
# <NAME> (zhengshou/AutoLoc's .tpl files; in text format `field: <` opens a message, which one bare
# word never completes) and CMake's configure_file @NAME@ (aleneum/temporal-segment-networks' .in files)
_NAMED = (r"\$\{(?P<braced>\w+)\}|\$(?P<dollars>[A-Za-z_]\w*)\$|\$(?P<bare>[A-Za-z_]\w*)|\{\{[ \t]*(?P<jinja>[A-Za-z_]\w*)[ \t]*\}\}"
          r"|<(?P<angle>[A-Za-z_]\w*)>|@(?P<at>[A-Za-z_]\w*)@")
# dividiti/ck-caffe's Collective Knowledge packages write $#NAME#$, cvjena/part_constellation_models'
# templates `num_output: ##NUM_CLASSES##` (a value only: elsewhere '#' opens a comment); read as ${NAME}
_CK_PLACEHOLDER = re.compile(r"\$#(\w+)#\$")
_HASH_PLACEHOLDER = re.compile(r"(?<=:)([ \t]*)##(\w+)##")
# kumasento/caffe's hsi templates: `num_output: ###@1###`, which its configure script's sed replaces by
# the script's first argument: read as ${ARG1}
_SED_ARGUMENT = re.compile(r"(?<=:)([ \t]*)###@(\d+)###")
# printf templates (siavashBigdeli/DMSP's `dim: %d`, which its MATLAB fprintf fills; Python's `%` operator alike):
# a bare `%d` takes the next value of the call's arguments, so it is named by its place in the file, ARG1,
# ARG2, ... (a `*` width or precision takes one more before it); Python's `%(NAME)d` is named
_PRINTF_SPEC = r"[-+ #0]*(?:\*|\d+)?(?:\.(?:\*|\d+))?[hlL]?[diouxXeEfFgGcrsa]"
_PRINTF = rf"%\((?P<printf>[A-Za-z_]\w*)\){_PRINTF_SPEC}|(?P<positional>%{_PRINTF_SPEC})"
_ANY_PRINTF = re.compile(rf"%%|%\([A-Za-z_]\w*\){_PRINTF_SPEC}|%{_PRINTF_SPEC}")
_VALUE_PLACEHOLDER = re.compile(rf"(?P<lead>:[ \t]*)(?P<ph>{_NAMED}|\{{(?P<format>[A-Za-z_]\w*)\}}|{_PRINTF})")
_QUOTED_PLACEHOLDER = re.compile(_NAMED)
_FORMAT_FIELD = re.compile(r":[ \t]*\{[A-Za-z_]\w*\}")   # a quick look before the full scan
# a bare word where text goes is a placeholder only when written like one: in capitals
_TEXT_PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*$")
# an unquoted name or path where a string goes, up to the next blank, quote, brace or comment
_UNQUOTED_TEXT = re.compile(r"[A-Za-z0-9_./\\-][^\s\"'{}<>#]*")
# unfilled placeholders parse as these numbers, exact in int32, int64 and float32 fields alike
_SENTINEL_BASE = 1 << 30
_SENTINEL_STEP = 1 << 10


def is_sentinel(text):
    """Whether text is the number an unfilled placeholder was read as (a skipped field's value)."""
    if not text or not text.isdigit():
        return False
    value = int(text)
    return value > _SENTINEL_BASE and (value - _SENTINEL_BASE) % _SENTINEL_STEP == 0


class BarePlaceholder(ParseError):
    """A bare word where the parser wanted a number or (wants_text) a quoted string: the text's row
    and column (1-based) and the word."""

    def __init__(self, message, line, column, word, wants_text=False):
        super().__init__(message)
        self.line, self.column, self.word, self.wants_text = line, column, word, wants_text


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
    if "{{" in text and _FORMAT_FIELD.search(text):
        lines = _unescape_format_braces(lines, path, notes)
    written_as = {}    # ${NAME} -> $#NAME#$ or ##NAME## as the file writes it
    positional, printf_args = {}, [0]    # {(row, column): ARGk} of bare printf fields, the arguments taken so far
    for number, line in enumerate(lines):
        if "$#" in line:   # Collective Knowledge's $#NAME#$: its '#' would open a comment
            for m in _CK_PLACEHOLDER.finditer(line):
                written_as["${" + m.group(1) + "}"] = m.group(0)
            line = lines[number] = _CK_PLACEHOLDER.sub(r"${\1}", line)
        if "###@" in line and _SED_ARGUMENT.search(line.split('"', 1)[0]):   # ###@N### as a value
            for m in _SED_ARGUMENT.finditer(line):
                written_as["${ARG" + m.group(2) + "}"] = m.group(0).strip()
            line = lines[number] = _SED_ARGUMENT.sub(r"\1${ARG\2}", line)
        if "##" in line and _HASH_PLACEHOLDER.search(line.split('"', 1)[0]):   # ##NAME## as a value
            for m in _HASH_PLACEHOLDER.finditer(line):
                written_as["${" + m.group(2) + "}"] = "##" + m.group(2) + "##"
            line = lines[number] = _HASH_PLACEHOLDER.sub(r"\1${\2}", line)
        if "%" in line:
            _number_printf_fields(line, number, positional, printf_args)
        alone = line.split("#", 1)[0].strip()
        if alone in defines and _TEXT_PLACEHOLDER.match(alone) and "\"" not in line:
            # a word alone on its line that a script replaces with text (skynet-train's `INPUT`)
            used[alone] = used.get(alone, 0) + 1
            lines[number] = str(defines[alone])
            continue
        if "$" not in line and "{{" not in line and "<" not in line and "@" not in line and "%" not in line \
                and not _FORMAT_FIELD.search(line):
            continue
        spans, comment = code_spans(line)
        pieces, last = [], 0
        for start, end in _with_strings(spans, comment, len(line)):
            if line[start] in "\"'":   # a quoted string: only what --define names (the script fills it)
                for m in _QUOTED_PLACEHOLDER.finditer(line, start, end):
                    name = _name(m)
                    if name in defines:
                        used[name] = used.get(name, 0) + 1
                        pieces.append(line[last:m.start()] + _escaped(defines[name], line[start]))
                        last = m.end()
                continue
            for m in _VALUE_PLACEHOLDER.finditer(line, start, end):
                name = positional[number, m.start("ph")] if m.group("positional") else _name(m)
                if name in defines:
                    value = str(defines[name])
                    used[name] = used.get(name, 0) + 1
                else:
                    sentinel = _SENTINEL_BASE + _SENTINEL_STEP * (len(pending) + 1)
                    written = written_as.get(m.group("ph"), m.group("ph"))
                    if m.group("positional"):
                        written = f"{written} ({name})"
                    pending.append(Placeholder(name, written, number + 1, sentinel))
                    value = str(sentinel)
                pieces.append(line[last:m.start("ph")] + value)
                last = m.end("ph")
        if pieces:
            lines[number] = "".join(pieces) + line[last:]
    for name, count in used.items():
        notes.append(f"{path}: filled the template placeholder {name} with {defines[name]} "
                     f"(--define, {count} place{'s' if count > 1 else ''})")
    return "\n".join(lines), pending


def _name(match):
    """The placeholder's NAME, whichever way it is written."""
    groups = match.groupdict()
    return next(groups[k] for k in ("braced", "dollars", "bare", "jinja", "angle", "at", "format", "printf")
                if groups.get(k))


def _number_printf_fields(line, row, names, taken):
    """Name the line's bare printf fields ARGk in the order the format fills them: through the whole text,
    comments and strings included, a `*` width or precision taking an argument of its own before the value."""
    for m in _ANY_PRINTF.finditer(line):
        spec = m.group(0)
        if spec == "%%" or spec.startswith("%("):
            continue
        taken[0] += 1 + spec.count("*")
        names[row, m.start()] = f"ARG{taken[0]}"


def _with_strings(spans, comment, length):
    """The line's code spans and, between them, its quoted strings (quotes included), in order."""
    out, previous_end = [], None
    for start, end in spans:
        if previous_end is not None and start > previous_end:
            out.append((previous_end, start))   # the string between two code spans
        if end > start:
            out.append((start, end))
        previous_end = end
    if comment is None and previous_end is not None and previous_end < length:
        out.append((previous_end, length))   # an unterminated string runs to the end
    return out


def _escaped(value, quote):
    return str(value).replace("\\", "\\\\").replace(quote, "\\" + quote)


def _unescape_format_braces(lines, path, notes):
    """A whole file written for Python's str.format (`input_dim:{height}`, `layer {{`): its doubled
    braces outside strings and comments are single ones once formatted."""
    doubled = False
    for number, line in enumerate(lines):
        if "{{" not in line and "}}" not in line:
            continue
        spans, comment = code_spans(line)
        pieces, last = [], 0
        for start, end in spans:
            pieces.append(line[last:start] + line[start:end].replace("{{", "{").replace("}}", "}"))
            last = end
        new = "".join(pieces) + line[last:]
        doubled |= new != line
        lines[number] = new
    if doubled:
        notes.append(f"{path}: read as a Python format template: its doubled braces are single ones")
    return lines


_NUMBERS = {"CPPTYPE_INT32", "CPPTYPE_INT64", "CPPTYPE_UINT32", "CPPTYPE_UINT64", "CPPTYPE_FLOAT",
            "CPPTYPE_DOUBLE"}


def _quoted(value):
    return '"' + _escaped(value, '"') + '"'


def fill_bare_placeholder(text, bare, defines, pending, notes, path):
    """The text with the bare word at bare.line:bare.column replaced by its --define value, or by a
    sentinel recorded in `pending` (see fill_placeholders); where text goes, by the quoted value."""
    lines = text.split("\n")
    row, col = bare.line - 1, bare.column - 1
    line = lines[row]
    if line[col:col + len(bare.word)] != bare.word:   # not where the parser said: leave its error
        raise ParseError(str(bare))
    if _next_char(lines, row, col + len(bare.word)) in ("{", "<", ":"):
        # the next field's name (gtlim/Ahra's `num_output:` then `weight_filler {`): a value is missing
        raise ParseError(f"{path}:{bare.line}:{bare.column}: a value is missing before '{bare.word}' (the field "
                         f"before it has none)")
    if bare.wants_text:
        word, value = _text_placeholder(line[col:], bare, defines, pending, notes, path)
        lines[row] = line[:col] + _quoted(value) + line[col + len(word):]
        return "\n".join(lines)
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


def _next_char(lines, row, col):
    """The first character after lines[row][col:] that is not blank or in a comment ('' at the end)."""
    for text in [lines[row][col:]] + lines[row + 1:]:
        _, comment = code_spans(text)
        rest = (text if comment is None else text[:comment]).strip()
        if rest:
            return rest[0]
    return ""


def _text_placeholder(rest, bare, defines, pending, notes, path):
    """(the unquoted text at the start of `rest` to replace, the text to put there) for a placeholder
    where the parser wanted a quoted string; the parser's own error for anything else."""
    defines = defines or {}
    for p in pending:   # `folder: $OUTFOLDER` holds the sentinel fill_placeholders put there
        if bare.word == str(p.sentinel):
            pending.remove(p)
            notes.append(f"{path}:{bare.line}: kept the template placeholder {p.text} as text (a script fills "
                         f"it in before Caffe reads the file; --define {p.name}=VALUE sets it)")
            return bare.word, p.text
    # a --define value put where text goes (`--define OUTFOLDER=/tmp/out`): the longest one found there
    for value in sorted((str(v) for v in defines.values()), key=len, reverse=True):
        if value and rest.startswith(value):
            return value, value
    if bare.word in defines:
        return bare.word, defines[bare.word]
    if _TEXT_PLACEHOLDER.match(bare.word):
        notes.append(f"{path}:{bare.line}: kept the template placeholder {bare.word} as text (a script fills it "
                     f"in before Caffe reads the file; --define {bare.word}=VALUE sets it)")
        return bare.word, bare.word
    # a name or path left unquoted (`top: pool1`, `source: /PATH/TO/TRAIN_LMDB`): its meaning is plain
    unquoted = _UNQUOTED_TEXT.match(rest)
    if unquoted and rest[unquoted.end():unquoted.end() + 1] not in ("\"", "'"):   # not a lost opening quote
        notes.append(f"{path}:{bare.line}: read the unquoted {unquoted.group(0)} as a string (Caffe's parser "
                     f"wants it in quotes)")
        return unquoted.group(0), unquoted.group(0)
    raise ParseError(str(bare))


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


def as_written(text, pending):
    """text (a note about the net) with the sentinels of pending placeholders shown as written."""
    for p in pending:
        text = text.replace(str(p.sentinel), p.text)
    return text


def _input_dimension(owner, field_path, input_shapes):
    """The --input-shape value for a placeholder in an Input layer's shape (where the input header
    was upgraded to), else None."""
    if not input_shapes or getattr(owner, "type", None) != "Input" or len(field_path) != 3:
        return None
    _, (_, shape), (_, dim) = _steps(field_path)
    if shape is None or dim is None or shape >= len(owner.top):
        return None
    given = input_shapes.get(owner.top[shape])
    return int(given[dim]) if given is not None and dim < len(given) else None


def _refuse_param_str_placeholders(net, path, unfilled):
    """A Python layer's param_str that still holds a placeholder (atakigawa's `'feat_stride':
    {{shrink_scale}}`; the defined ones were filled with the text) is refused, naming --define,
    before the layer tries to read it; a listing leaves the layer unsized instead."""
    for layer in net.layer:   # V1 files have no Python layer
        text = layer.python_param.param_str if layer.HasField("python_param") else ""
        found = _QUOTED_PLACEHOLDER.search(text)
        if found is None:
            continue
        fix = f"pass --define {_name(found)}=VALUE"
        refusal = (f"{path}: layer '{layer.name}': python_param.param_str holds the template placeholder "
                   f"{found.group(0)}, which a script fills in before Caffe reads the file: {fix}")
        if unfilled is None:
            raise ParseError(refusal)
        unfilled.setdefault(layer.name, (refusal, f"python_param.param_str holds the template placeholder "
                                                  f"{found.group(0)}: {fix}"))


def resolve_placeholders(net, pending, path, notes, weights_net=None, weights_path=None, input_shapes=None,
                         unfilled=None):
    """Put in each pending placeholder's value from --input-shape (an input's dimensions) or the
    weights' own net; refuse the rest clearly.  unfilled: a dict that receives {layer name: the
    refusal} for the placeholders of layers that stay unfilled instead (a listing of the net, whose
    shapes from those layers on are unknown): (the refusal, the reason without file and line)."""
    _refuse_param_str_placeholders(net, path, unfilled)
    if not pending:
        return
    locate_placeholders(net, pending)
    saved = {}
    for layer in _layers(weights_net) if weights_net is not None else ():
        saved.setdefault(layer.name, layer)
    values = {}
    for p in pending:
        if not p.where:   # in a field the reading skipped (a fork's filler field at TEST): nothing reads it
            notes.append(f"{path}:{p.line}: the template placeholder {p.text} is in a field skipped as unknown; "
                         f"it needs no value")
            continue
        layer_name, owner, field_path = p.where
        source = (saved.get(layer_name) if layer_name else weights_net) if weights_net is not None else None
        given = _input_dimension(owner, field_path, input_shapes)
        if given is not None:   # the input's shape comes from --input-shape anyway
            _set_at(owner, field_path, given)
            continue
        value = _value_at(source, field_path) if source is not None and field_path else None
        if value is None or value >= _SENTINEL_BASE:
            field = ".".join(field_path) or "a field"
            where = f" (layer '{layer_name}', {field})" if layer_name else f" ({field})"
            hint = f" (the net saved in {weights_path} does not give it)" if weights_net is not None else \
                ", or --weights whose saved net gives it"
            if getattr(owner, "type", None) == "Input" and field_path[:1] == ("input_param",):
                _, (_, shape), _ = _steps(field_path)
                hint += f", or --input-shape {owner.top[shape]}=N,C,H,W"
            refusal = (f"{path}:{p.line}: {p.text}{where} is a template placeholder that a script fills in "
                       f"before Caffe reads the file: pass --define {p.name}=VALUE{hint}")
            if unfilled is not None and layer_name:
                # one reason for every layer of the placeholder, so that the listing's note groups them
                unfilled.setdefault(layer_name, (refusal, f"{'.'.join(field_path)} is the template placeholder "
                                                          f"{p.text}: pass --define {p.name}=VALUE{hint}"))
                continue
            raise ParseError(refusal)
        if values.setdefault(p.name, value) != value:
            raise ParseError(f"{path}:{p.line}: the template placeholder {p.text} has two values in the net "
                             f"saved in {weights_path}: {values[p.name]} and {value}; pass --define {p.name}=VALUE")
        _set_at(owner, field_path, value)
    for name, value in values.items():
        notes.append(f"{path}: filled the template placeholder {name} with {value}, from the net saved "
                     f"in {weights_path}")


DIGITS_UNSET = ("inner_product_param.num_output is not set: DIGITS writes its networks' output InnerProduct "
                "without it and fills in the number of classes when it trains")
DEEPDETECT_UNSET = ("convolution_param.num_output is 0: DeepDetect's templates leave it for the service to set to "
                    "the number of classes (Caffe itself refuses 0)")


def _unset_num_output(lp, weights):
    """(why, the num_output the weights give or None) for a layer whose output count a tool fills in before
    Caffe reads the file, else None."""
    shape = weights[0].array.shape if weights and weights[0].array.ndim >= 2 else None
    if lp.type == "InnerProduct" and not lp.inner_product_param.HasField("num_output"):
        value = None if shape is None else shape[-1] if lp.inner_product_param.transpose else shape[-2]
        return DIGITS_UNSET, value
    # DeepDetect's update_protofile_classes (src/backends/caffe/caffelib.cc, before 5a825d3 removed the backend)
    # sets a Convolution's or Deconvolution's num_output of 0 to the class count (it also overwrites the last
    # such layer's count, which the file already states)
    if lp.type in ("Convolution", "Deconvolution") and lp.convolution_param.HasField("num_output") \
            and lp.convolution_param.num_output == 0:
        if shape is None:
            return DEEPDETECT_UNSET, None
        # weights (num_output, C / group, ...) for a Convolution, (C, num_output / group, ...) for a Deconvolution
        return DEEPDETECT_UNSET, shape[0] if lp.type == "Convolution" else shape[1] * max(lp.convolution_param.group, 1)
    return None


def fill_unset_num_outputs(net, blobs, path, notes, weights_path=None, unfilled=None):
    """Output counts that a tool sets before Caffe reads the file, so that the file it keeps has none: DIGITS
    (digits/model/tasks/caffe_train.py) the num_output of the InnerProduct layers that make the network's
    outputs, DeepDetect a Convolution's or Deconvolution's num_output of 0.  Take each from that layer's
    weights (blobs: {layer: [BlobData]}), else leave the layer to a listing (unfilled) or to its own refusal."""
    for lp in net.layer:
        found = _unset_num_output(lp, (blobs or {}).get(lp.name))
        if found is None:
            continue
        why, value = found
        if value is not None:
            param = lp.inner_product_param if lp.type == "InnerProduct" else lp.convolution_param
            param.num_output = int(value)
            notes.append(f"{path}: layer '{lp.name}': {why}; {int(value)}, from the weights in {weights_path}")
        elif unfilled is not None:
            why = f"{why}: pass --weights, whose blobs give it"
            unfilled.setdefault(lp.name, (f"{path}: layer '{lp.name}': {why}", why))
