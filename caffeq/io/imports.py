"""jackculpepper/caffe's IMPORT layers (2d8e0c9 "merge import layer", net.cpp LoadImports and
ResolveImportName; branches closs, cfw, siamesehinge...): a layer that inlines another net file.

    layers { type: IMPORT name: "a"
             import_param { net: "examples/cfw_diffnet/shared.prototxt"
                            var { name: "bottom" value: "/data_a" } } }

The fork expands them before anything else (phase filtering included, so an IMPORT's own include
rules are ignored):
  - the file's text has each `${name}` replaced by its value, var by var, as plain text; the text is
    parsed as a net, whose layers alone are used (its name and inputs are not);
  - every imported layer's name, tops and bottoms are resolved against the IMPORT layer's name: "x"
    in import "a" is "a/x", "../x" climbs one import level, "/x" is the top-level "x"; nested imports
    compose ("a/b/x").  Nothing else is renamed: `param` names stay, so two imports of one file that
    name their params share those weights, and a caffemodel's layers are the resolved names;
  - at the top level names are kept, but a leading "/" is dropped.
The fork opens `net` relative to the directory caffe runs in (its examples run from the Caffe root);
caffeq looks there, then beside the importing file and in each folder above it.  A model file is
untrusted: only net files (.prototxt, .pt) are opened, and the expansion is bounded (nesting depth, text
size after the replacements, number of layers).
"""
import os

from ..errors import ParseError
from .prototxt import read_prototxt_text

_MAX_DEPTH = 32
_MAX_BYTES = 64 << 20
_MAX_LAYERS = 100_000
_NET_FILE_EXTS = (".prototxt", ".pt")


def _is_import(layer, v1):
    return layer.fork_type == "IMPORT" if v1 else layer.type == "Import"


def has_imports(net):
    return any(_is_import(lp, True) for lp in net.layers) or any(_is_import(lp, False) for lp in net.layer)


def resolve_import_name(name, pwd):
    """ResolveImportName: a name inside the import `pwd` ("" at the top level) as the net sees it."""
    if name.startswith("/"):
        return name[1:]
    while name.startswith("../"):
        name = name[3:]
        pwd = pwd.rsplit("/", 1)[0] if "/" in pwd else ""
    if not pwd:
        return name
    if name in ("", "."):
        return pwd
    return f"{pwd}/{name}"


def _find(net_path, importer):
    """The file an import names: as given (from the working directory, as the fork opens it), then
    beside the importing file and in each folder above it (a Caffe root the examples are run from)."""
    if os.path.isabs(net_path):
        return os.path.abspath(net_path) if os.path.isfile(net_path) else None
    folder = os.path.dirname(os.path.abspath(importer))
    candidates = [os.path.abspath(net_path)]
    while True:
        candidates.append(os.path.join(folder, net_path))
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    return next((os.path.abspath(c) for c in candidates if os.path.isfile(c)), None)


def _read_import(layer, importer, parse, warnings):
    """The imported net: its file read, the variables replaced, parsed as a NetParameter."""
    where = f"{importer}: layer '{layer.name}' (Import)"
    p = layer.import_param
    if not layer.name:
        raise ParseError(f"{importer}: an Import layer must have a name (its layers' names start with it)")
    if not p.net:
        raise ParseError(f"{where}: import_param.net is required (the net file to import)")
    if not p.net.lower().endswith(_NET_FILE_EXTS):
        raise ParseError(f"{where}: import_param.net '{p.net}' is not a net file ({' or '.join(_NET_FILE_EXTS)}); "
                         f"caffeq imports only those")
    found = _find(p.net, importer)
    if found is None:
        raise ParseError(f"{where}: import_param.net '{p.net}' not found (looked in the working directory, "
                         f"beside {os.path.basename(importer)} and in the folders above it)")
    size = os.path.getsize(found)
    if size > _MAX_BYTES:
        raise ParseError(f"{where}: import_param.net '{found}' is {size} bytes, more than a net file holds")
    text = read_prototxt_text(found, warnings)
    for i, var in enumerate(p.var):
        if not var.HasField("name") or not var.HasField("value"):
            raise ParseError(f"{where}: import_param.var[{i}] needs both name and value")
        text = text.replace("${" + var.name + "}", var.value)
        if len(text) > _MAX_BYTES:
            raise ParseError(f"{where}: import_param.var '{var.name}' makes the text of '{found}' longer than "
                             f"{_MAX_BYTES >> 20} MiB")
    return found, parse(text, found)


def _inline(net, pwd, importer, parse, chain, warnings, budget):
    """net's layers with every Import replaced by its file's layers (recursively), names resolved in pwd."""
    for field, v1 in (("layers", True), ("layer", False)):
        layers = getattr(net, field)
        expanded = []
        resolve = bool(pwd) or has_imports(net)   # the fork resolves every name once a net imports
        for lp in layers:
            if not _is_import(lp, v1):
                if resolve:
                    lp.name = resolve_import_name(lp.name, pwd)
                    for blobs in (lp.top, lp.bottom):
                        blobs[:] = [resolve_import_name(b, pwd) for b in blobs]
                expanded.append(lp)
                continue
            found, sub = _read_import(lp, importer, parse, warnings)
            if found in chain:
                raise ParseError(f"{importer}: layer '{lp.name}' (Import): import_param.net '{lp.import_param.net}' "
                                 f"imports itself (through {' -> '.join(os.path.basename(c) for c in chain)})")
            if len(chain) >= _MAX_DEPTH:
                raise ParseError(f"{importer}: layer '{lp.name}' (Import): imports nest more than {_MAX_DEPTH} "
                                 f"files deep")
            other = "layer" if v1 else "layers"
            if len(getattr(sub, other)):
                raise ParseError(f"{found}: imported by layer '{lp.name}' of {importer}: its layers must be in the "
                                 f"importing file's format ('{field}' blocks), got '{other}' blocks")
            _inline(sub, resolve_import_name(lp.name, pwd), found, parse, chain + [found], warnings, budget)
            budget[0] -= len(getattr(sub, field))
            if budget[0] < 0:
                raise ParseError(f"{chain[0]}: its imports expand to more than {_MAX_LAYERS} layers")
            expanded.extend(getattr(sub, field))
        if any(_is_import(lp, v1) for lp in layers):
            kept = [type(lp)() for lp in expanded]
            for copy, lp in zip(kept, expanded):
                copy.CopyFrom(lp)
            del layers[:]
            layers.extend(kept)


def expand_imports(net, path, parse, warnings=None):
    """Inline the IMPORT layers of `net` (read from `path`) in place.  parse(text, path) -> NetParameter
    reads an imported file's text as the main file is read.  Returns how many files were inlined."""
    if not has_imports(net):
        return 0
    count = [0]

    def counting(text, where):
        count[0] += 1
        return parse(text, where)

    _inline(net, "", os.fspath(path), counting, [os.path.abspath(path)], warnings, [_MAX_LAYERS])
    if warnings is not None:
        warnings.append(f"{path}: inlined {count[0]} imported net file(s) (jackculpepper/caffe's IMPORT layers), "
                        f"their layers named after each import")
    return count[0]
