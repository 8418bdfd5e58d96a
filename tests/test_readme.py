"""The README's supported-layer table lists every registered Caffe type."""
from pathlib import Path

import caffeq

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_every_registered_type_is_in_the_readme_table():
    table = README[README.index("## Supported layers"):]
    table = table[:table.index("\n## ", 5)]
    missing = [t for t in caffeq.supported_types() if t not in table]
    assert not missing, f"add to README's supported-layer table: {missing}"
