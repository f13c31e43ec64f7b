"""The README's Python example runs as written (extracted between its markers, the way `.ci/run`
extracts the test command), and every relative link in its table of contents names a heading."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _block(marker: str) -> str:
    text = README.read_text()
    m = re.search(rf"<!-- {marker} -->\n```\w*\n(.*?)```\n<!-- /{marker} -->", text, re.S)
    assert m, f"no block between <!-- {marker} --> markers in README.md"
    return m.group(1)


def test_the_python_example_runs_as_written():
    code = _block("python-example")
    scope: dict = {"__name__": "readme_example"}
    exec(compile(code, str(README) + ":python-example", "exec"), scope)
    model, new, st = scope["model"], scope["new"], scope["st"]
    assert [len(o) for o in new] == [8, 8]
    assert scope["logits"].shape == (4, model.config.vocab_size)
    assert scope["child"].length == 5 and st.length == 2    # 4 prompt + 1 decode; truncated to 2
    assert not model.cache.live                              # both released


def test_the_contents_links_name_headings():
    text = README.read_text()
    anchors = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
               for h in re.findall(r"^#+ (.*)$", text, re.M)}
    links = re.findall(r"\]\(#([^)]+)\)", text)
    assert links and not [a for a in links if a not in anchors]
