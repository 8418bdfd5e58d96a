"""The README's supported-layer table lists every registered Caffe type."""
from pathlib import Path

import caffeq

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_every_registered_type_is_in_the_readme_table():
    table = README[README.index("## Supported layers"):]
    table = table[:table.index("\n## ", 5)]
    from caffeq.layers import get_spec
    builtin = [t for t in caffeq.supported_types() if type(get_spec(t)).__module__.startswith("caffeq.layers.")]
    missing = [t for t in builtin if t not in table]
    assert not missing, f"add to README's supported-layer table: {missing}"
