"""Python identifiers for Caffe layer and blob names (shared by the torch backend and model.py export)."""
import keyword
import re


def identifier(name, taken, reserved=()):
    """A Python identifier for a Caffe name: non-word characters become _, collisions get _2, _3..."""
    ident = re.sub(r"\W", "_", str(name), flags=re.ASCII)
    if not ident or ident[0].isdigit():
        ident = "l_" + ident
    if keyword.iskeyword(ident) or ident in reserved or ident.startswith("__"):
        ident += "_"
    base, k = ident, 1
    while ident in taken:
        k += 1
        ident = f"{base}_{k}"
    taken.add(ident)
    return ident
