"""Names made unique: Python identifiers for Caffe layer and blob names (torch backend, model.py export),
and fresh ONNX tensor and node names."""
import keyword
import re


def identifier(name, taken, reserved=()):
    """A Python identifier for a Caffe name: non-word characters become _, collisions get _2, _3..."""
    ident = re.sub(r"\W", "_", str(name), flags=re.ASCII)
    if not ident or ident[0].isdigit():
        ident = "l_" + ident
    if keyword.iskeyword(ident) or ident in reserved or ident.startswith("__"):
        ident += "_"
    return unique_name(ident, taken)


def unique_name(base, taken):
    """`base`, or base_2, base_3... when taken; the name returned is added to `taken`."""
    name, k = base, 1
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    taken.add(name)
    return name
