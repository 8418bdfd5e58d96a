"""param_str: a safe reader for the YAML mappings Python layers take.

A Python layer's `python_param.param_str` is YAML (a flow `{'feat_stride': 16}` or block `key: value`
lines, sometimes with `!!python/tuple` tags).  Only numbers, strings, booleans, null and lists are
read; nothing is evaluated or imported.
"""
import re

from .registry import LayerError

_TOKEN = re.compile(r"""\s*(?:(?P<tag>!!python/(?:tuple|list)\b)|(?P<str>'[^'\n]*'|"[^"\n]*")|(?P<num>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)"""
                    r"""|(?P<name>[A-Za-z_][\w.]*)|(?P<punct>[{}\[\](),:]))""")
_WORDS = {"true": True, "True": True, "false": False, "False": False, "null": None, "None": None}


def _tokens(text, what):
    pos, out = 0, []
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise LayerError(f"{what}: cannot read {text[pos:pos + 20].strip()!r}")
        kind = m.lastgroup
        tok = m.group(kind)
        if kind == "tag":   # PyYAML's "!!python/tuple [4, 8]": a sequence like any other
            pass
        elif kind == "str":
            out.append(("value", tok[1:-1]))
        elif kind == "num":
            out.append(("value", float(tok) if any(c in tok for c in ".eE") else int(tok)))
        elif kind == "name":
            out.append(("value", _WORDS.get(tok, tok)))
        else:
            out.append(("punct", tok))
        pos = m.end()
    return out


def _block_to_flow(text):
    """YAML block style ("a: 1" per line) -> flow style: newlines at bracket depth 0 become commas."""
    depth, out = 0, []
    for ch in text.strip():
        depth += ch in "[({"
        depth -= ch in "])}"
        out.append("," if ch == "\n" and depth == 0 else ch)
    return "{" + "".join(out) + "}"


def parse_param_str(text, what="python_param.param_str"):
    """A Python layer's param_str ("'feat_stride': 16", "{'feat_stride': 16, 'scales': [8, 16]}", or one
    "key: value" per line) -> dict.  Values: numbers, strings, booleans and lists of them (a
    "!!python/tuple" tag is read as a list); any other YAML construct is refused."""
    text = text.strip()
    if not text:
        return {}
    toks = _tokens(text if text.startswith("{") else _block_to_flow(text), what)
    pos = 0

    def peek():
        return toks[pos] if pos < len(toks) else ("end", None)

    def take(punct=None):
        nonlocal pos
        tok = peek()
        if punct is not None and tok != ("punct", punct):
            raise LayerError(f"{what}: expected '{punct}' in {text!r}")
        if tok[0] == "end":
            raise LayerError(f"{what}: {text!r} ends too soon")
        pos += 1
        return tok

    def value():
        kind, v = take()
        if kind == "value":
            return v
        if v in "[(":
            close = "]" if v == "[" else ")"
            items = []
            while peek() != ("punct", close):
                items.append(value())
                if peek() != ("punct", close):
                    take(",")
            take(close)
            return items
        raise LayerError(f"{what}: unexpected '{v}' in {text!r}")

    take("{")
    result = {}
    while peek() != ("punct", "}"):
        if peek() == ("punct", ","):   # empty line in block style
            take(",")
            continue
        kind, key = take()
        if kind != "value" or not isinstance(key, str):
            raise LayerError(f"{what}: expected a key in {text!r}")
        take(":")
        result[key] = value()
        if peek() != ("punct", "}"):
            take(",")
    take("}")
    if pos != len(toks):
        raise LayerError(f"{what}: unexpected text after the mapping in {text!r}")
    return result


def param_str_positive_int(params, key, reader=""):
    """params[key] (a parse_param_str mapping) as a positive int, else a LayerError naming the key and,
    when given, the Python layer that reads it in setup."""
    value = params.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        setup = f" ({reader} reads it in setup)" if reader else ""
        raise LayerError(f"python_param.param_str: '{key}' must be a positive integer{setup}, got {value!r}")
    return value
