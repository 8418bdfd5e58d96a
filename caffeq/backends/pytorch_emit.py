"""The emission context a layer spec writes its model.py source through (`Emitter`), and the
names and literals of that source.  caffeq.backends.pytorch_source drives it over the graph."""
import ast
import inspect
import keyword
import math
import re
import textwrap

import numpy as np

from ..errors import ExportError
from .names import identifier

# ---- names and literals --------------------------------------------------------------

def module_reserved():
    from torch import nn
    return set(dir(nn.Module)) | {"forward", "training"}


def class_name(name, taken=()):
    parts = [p for p in re.split(r"[^0-9A-Za-z]+", str(name or "")) if p]
    cls = "".join(p[:1].upper() + p[1:] for p in parts) or "CaffeNet"
    if cls[0].isdigit():
        cls = "Net" + cls
    while cls in taken or keyword.iskeyword(cls):
        cls += "Net"
    return cls


class Code(str):
    """Source text that lit() writes as it is (an expression already rendered)."""


def lit(value, exact=False):
    """Python source for a constant: float32 values in their shortest exact form.

    torch casts a Python float to float32 before combining it with a float32 tensor, so the
    shortest decimal naming the same float32 gives the same bits; `exact` keeps the double's
    own repr, for values that take part in Python arithmetic first."""
    if isinstance(value, Code):
        return str(value)
    if isinstance(value, (bool, np.bool_)):
        return "True" if value else "False"
    if value is None:
        return "None"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        v = float(value)
        if math.isnan(v):
            return 'float("nan")'
        if v in (float("inf"), float("-inf")):
            return 'float("inf")' if v > 0 else '-float("inf")'
        if float(np.float32(v)) == v and not exact:
            # shortest decimal that names this float32 (torch casts float scalars to float32)
            short = str(np.float32(v))  # numpy's shortest round-trip form, e.g. 1e-05, 0.1
            if float(np.float32(float(short))) == v:
                return short if ("." in short or "e" in short) else short + ".0"
        return repr(v)
    if isinstance(value, str):
        r = repr(value)
        # double quotes, as most Python code is written (repr picks single ones)
        return '"' + r[1:-1].replace("\\'", "'").replace('"', '\\"') + '"' if r[0] == "'" else r
    if isinstance(value, tuple):
        inner = ", ".join(lit(v, exact) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, list):
        return "[" + ", ".join(lit(v, exact) for v in value) + "]"
    raise TypeError(f"no literal for {type(value).__name__}")


def one_line(text):
    """Text safe inside a # comment: control characters (newlines) written as escapes."""
    return re.sub(r"[\x00-\x1f\x7f]", lambda m: repr(m.group())[1:-1], str(text))


def doc_safe(text):
    """Text safe inside a triple-quoted docstring."""
    text = str(text).replace("\\", "\\\\").replace('"""', '\\"\\"\\"')
    return re.sub(r"[\x00-\x09\x0b-\x1f\x7f]", lambda m: repr(m.group())[1:-1], text)


def size_arg(values):
    """A kernel/stride/pad argument: one int when all axes agree, else a tuple."""
    values = tuple(int(v) for v in values)
    return lit(values[0]) if len(set(values)) == 1 else lit(values)


# ---- the emission context given to specs ----------------------------------------------

class Emitter:
    """What a spec's `pytorch_source(node, emit)` writes through.

    - `emit.inputs`: Python expressions (local names) of the node's bottoms;
      `emit.in_shape(i)` / `emit.out_shape(i)`: Caffe's static shapes
      (dim 0 is the batch: never bake it, use x.shape[0]);
    - `emit.module(expr)` declares `self.<attr> = expr` in __init__ (attr is
      the layer's name as an identifier, `emit.attr`; `emit.extra_attr(suffix)`
      names another) and returns "self.<attr>"; `emit.init(line)`: a raw line;
    - `emit.blob(i)`: a float32 copy of the node's blob i;
    - `emit.param(name, blob_or_array)` / `emit.buffer(...)`: the state-dict
      entry "<attr>.<name>" (a blob index of the node, or an array);
    - `emit.helper(source)`: a helper class or function, defined once in the
      file; returns its name.  `emit.uses("F")` imports torch.nn.functional;
    - `emit.tmp(hint)`, `emit.stmt(line)`: extra forward lines before the result;
    - `emit.note(text)`: a line for the class docstring;
    - `emit.consumers(tensor)`, `emit.absorb(node)`: for fusions (BatchNorm + Scale);
    - `emit.exact_batchnorm`: keep Caffe's BatchNorm op order (see the module doc).

    Return the call expression for the top, a list with one per top, [] for
    none, or None when the layer's configuration is not supported (or raise
    ExportError saying why).
    """

    def __init__(self, exporter):
        self._x = exporter
        self.exact_batchnorm = exporter.exact_batchnorm
        self.node = None
        self.attr = None
        self.inputs = []

    # -- the node -----------------------------------------------------------------------
    def in_shape(self, i=0):
        return tuple(self._x.graph.tensors[self.node.inputs[i]].shape)

    def out_shape(self, i=0):
        return tuple(self._x.graph.tensors[self.node.outputs[i]].shape)

    def blob(self, index, node=None):
        """A float32 copy of the node's blob `index`."""
        node = node or self.node
        if node.blobs is None or index >= len(node.blobs) or node.blobs[index] is None:
            raise ExportError(f"layer '{node.name}' ({node.type}): weight blob {index} is not loaded")
        return np.array(node.blobs[index], dtype=np.float32, copy=True)

    lit = staticmethod(lit)
    Code = Code
    size_arg = staticmethod(size_arg)

    # -- __init__ -------------------------------------------------------------------------
    def module(self, expr, comment=None, attr=None):
        attr = attr or self.attr
        line = f"self.{attr} = {expr}"
        if comment:
            line += f"  # {one_line(comment)}"
        self._x.init_lines.append(line)
        return f"self.{attr}"

    def blob_parameters(self, names):
        """An nn.ParameterDict holding the node's blobs in order under `names` (state-dict entries
        "<attr>.<name>") -> its attribute expression, for layers whose forward reads several named weights."""
        m = self.module("torch.nn.ParameterDict()")
        for i, name in enumerate(names):
            self.init(f"{m}['{name}'] = torch.nn.Parameter(torch.zeros{tuple(self.node.blobs[i].shape)!r})")
            self.param(name, i)
        return m

    def extra_attr(self, suffix):
        """Another attribute name for this layer ("<attr>_<suffix>", kept unique)."""
        return identifier(f"{self.attr}_{suffix}", self._x._attrs, self._x._attr_reserved)

    def init(self, line):
        """A raw __init__ line (after the module declarations of this layer)."""
        self._x.init_lines.append(line)

    def param(self, name, value, attr=None, blob=None):
        """State-dict entry "<attr>.<name>": blob `value` of the node, or an array computed from
        blob `blob` (so shared parameters can be tied)."""
        self._entry(name, value, attr, blob)

    buffer = param  # the module decides parameter or buffer; the state dict holds both

    def _entry(self, name, value, attr, blob):
        attr = attr or self.attr
        key = ".".join(k for k in (attr, name) if k)  # name "": the attribute is the nn.Parameter
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            blob = int(value)
            array = self.blob(blob)
        else:
            array = np.asarray(value)
        if blob is not None:
            self._x.blob_keys[(self.node.name, blob)] = key
        if key in self._x.state:
            raise ExportError(f"internal: state-dict key {key!r} written twice")
        self._x.state[key] = np.asarray(array, order="C")  # (ascontiguousarray makes 0-d 1-d)

    # -- module level ---------------------------------------------------------------------
    def helper(self, source):
        """Write a module-level helper once: source text, or a function or class (its source)."""
        if not isinstance(source, str):
            source = imported_source(source)
        source = textwrap.dedent(source).strip("\n")
        names = re.findall(r"^(?:class|def)\s+(\w+)", source, re.MULTILINE)
        if not names:
            raise ExportError("internal: a helper must define classes or functions")
        # bundles of several definitions (torch_sources) may share some with other bundles: each
        # definition is written once under its own name, the same text twice being one helper
        for key, text in _definitions(source, names):
            prev = self._x.helpers.get(key)
            if prev is not None and prev != text:
                raise ExportError(f"internal: two different helpers defining {key}")
            taken = {n for k in self._x.helpers if k != key for n in k.split(",")}
            if taken & set(key.split(",")):
                raise ExportError(f"internal: helper names {sorted(taken & set(key.split(',')))} defined twice")
            self._x.helpers[key] = text
        if re.search(r"\bF\.", source):
            self.uses("F")
        return names[-1]

    def instance(self, source, *values, needs=(), **named):
        """self.<attr> = <the class `source` defines last>(values..., name=value...), each value
        written by lit() (a Code value as it is), with the helpers it `needs` written first;
        returns the attribute expression."""
        for helper in needs:
            self.helper(helper)
        args = [lit(v) for v in values] + [f"{k}={lit(v)}" for k, v in named.items()]
        return self.module(f"{self.helper(source)}({', '.join(args)})")

    def uses(self, what):
        self._x.imports.add(what)

    def note(self, text):
        if text not in self._x.notes:
            self._x.notes.append(text)

    # -- forward --------------------------------------------------------------------------
    def tmp(self, hint="t"):
        return self._x.fresh_local(hint)

    def stmt(self, line, comment=None):
        self._x.pending.append(line + (f"  # {one_line(comment)}" if comment else ""))

    # -- graph ----------------------------------------------------------------------------
    def consumers(self, tensor):
        return list(self._x.uses.get(tensor, []))

    def is_output(self, tensor):
        return tensor in self._x.output_set

    def absorb(self, node):
        """This layer's result is `node`'s top as well (node is then not emitted on its own)."""
        self._x.absorbed_now.append(node)


def _fingerprint(code):
    """What a code object compiled from the same text has whatever module compiles it (not its bytecode: that
    depends on how the module binds its names): names, locals, constants (nested code alike), the line offsets."""
    lines = sorted({line - code.co_firstlineno for _, _, line in code.co_lines() if line is not None})
    return (code.co_argcount, code.co_kwonlyargcount, code.co_names, code.co_varnames, tuple(lines),
            tuple(_fingerprint(c) if inspect.iscode(c) else repr(c) for c in code.co_consts))


def imported_source(obj):
    """inspect.getsource(obj), refused where it is not the code caffeq imported: getsource reads the file as
    it is on disk now, at the line the import recorded, so a module edited since then (a long-lived process,
    another checkout's edit) gives another definition's text, or the same name with another body."""
    source = inspect.getsource(obj)
    name = getattr(obj, "__name__", None)
    text = textwrap.dedent(source)
    try:
        tree = ast.parse(text)
        same = [getattr(n, "name", None) for n in tree.body] == [name]
    except SyntaxError:
        same = False
    fn = inspect.unwrap(obj)
    if same and inspect.isfunction(fn) and not fn.__code__.co_freevars:
        code = compile(text, "<helper>", "exec")
        mine = [c for c in code.co_consts if inspect.iscode(c) and c.co_name == fn.__code__.co_name]
        same = len(mine) == 1 and _fingerprint(mine[0]) == _fingerprint(fn.__code__)
    if not same:
        raise ExportError(f"the source of {getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', name)} "
                          f"in {inspect.getsourcefile(obj)} is no longer the code imported (the file changed "
                          f"since): import caffeq afresh and export again")
    return source


def _definitions(source, names):
    """[(name, text)] of each top-level def / class in source, or [(all names, source)] where the source
    holds other top-level statements too (they stay together with the definitions that use them)."""
    tree = ast.parse(source)
    if not all(isinstance(n, (ast.FunctionDef, ast.ClassDef)) for n in tree.body):
        return [(",".join(names), source)]
    lines = source.split("\n")
    parts = []
    for node in tree.body:
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        parts.append((node.name, "\n".join(lines[first - 1:node.end_lineno])))
    return parts
