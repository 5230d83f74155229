"""The ```python blocks of the research logs (research/*.md) run from the repository root, as
tests/test_readme.py runs those of README.md and docs/ (same convention: a block preceded by
``<!-- skip-test -->`` is skipped). CI does not collect this file."""
import glob
import os

import pytest
import torch

from test_readme import ROOT, _blocks

PY = [b for b in _blocks(sorted(glob.glob(os.path.join(ROOT, "research", "*.md")))) if b["lang"] == "python"]


@pytest.mark.parametrize("block", PY, ids=[f"{b['page']}:{b['line']}" for b in PY])
def test_research_log_block(block, monkeypatch):
    if block["skip"]:
        pytest.skip("marked <!-- skip-test -->")
    monkeypatch.chdir(ROOT)
    torch.manual_seed(0)
    exec(compile(block["code"], f"{block['page']}:{block['line']}", "exec"), {"__name__": "__research_log__"})  # noqa: S102


def test_the_logs_have_blocks():
    assert any(b["page"] == os.path.join("research", "quality-log.md") for b in PY)
