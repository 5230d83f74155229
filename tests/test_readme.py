"""Run the code blocks of README.md and docs/*.md.

Convention (docs/index.md): every ```python block runs, in a fresh namespace, unless the last
non-blank line before its fence is ``<!-- skip-test -->`` (blocks that need several processes,
a GPU, DeepSpeed or the reader's own model). ```bash blocks whose every command is
``gefen-dist plan ...`` run too (through ``gefen_dist.cli.main``, in-process).
"""
import glob
import os
import re
import shlex

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP = "<!-- skip-test -->"
FENCE = re.compile(r"^```(\w*)\s*$")

# Blocks in pages owned by others that need a `<!-- skip-test -->` line but do not have it yet,
# keyed by (page, first code line). Remove entries once the marker is in the page.
PENDING_MARKERS: set = set()


def _blocks(pages=None):
    """The fenced code blocks of ``pages`` (default: README.md and docs/*.md)."""
    if pages is None:
        pages = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    out = []
    for page in pages:
        rel = os.path.relpath(page, ROOT)
        with open(page) as f:
            lines = f.read().splitlines()
        i = 0
        while i < len(lines):
            m = FENCE.match(lines[i])
            if not m or not m.group(1):
                i += 1
                continue
            lang, start = m.group(1), i
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            code = "\n".join(lines[i + 1:j])
            prev = next((lines[k].strip() for k in range(start - 1, -1, -1) if lines[k].strip()), "")
            out.append(dict(page=rel, line=start + 1, lang=lang, code=code, skip=prev == SKIP))
            i = j + 1
    return out


BLOCKS = _blocks()
PY = [b for b in BLOCKS if b["lang"] == "python"]
SH = [b for b in BLOCKS if b["lang"] == "bash"]


def _first_line(code):
    return next((ln for ln in code.splitlines() if ln.strip()), "")


@pytest.mark.parametrize("block", PY, ids=[f"{b['page']}:{b['line']}" for b in PY])
def test_python_block(block, capsys):
    if block["skip"]:
        pytest.skip("marked <!-- skip-test -->")
    if (block["page"], _first_line(block["code"])) in PENDING_MARKERS:
        pytest.skip("needs a <!-- skip-test --> marker in its page (listed in PENDING_MARKERS)")
    torch.manual_seed(0)
    ns = {"__name__": "__readme__"}
    exec(compile(block["code"], f"{block['page']}:{block['line']}", "exec"), ns)  # noqa: S102


def _plan_commands(code):
    cmds = []
    for ln in code.splitlines():
        ln = ln.split("#", 1)[0].strip()
        if not ln:
            continue
        if not ln.startswith("gefen-dist plan "):
            return None
        cmds.append(shlex.split(ln)[1:])
    return cmds or None


RUNNABLE_SH = [b for b in SH if _plan_commands(b["code"]) and not b["skip"]]


@pytest.mark.parametrize("block", RUNNABLE_SH, ids=[f"{b['page']}:{b['line']}" for b in RUNNABLE_SH])
def test_gefen_dist_plan_block(block, capsys):
    from gefen_dist.cli import main

    for argv in _plan_commands(block["code"]):
        assert main(argv) == 0, argv
        assert "optimizer state" in capsys.readouterr().out


def test_pending_markers_are_still_needed():
    """Fails once a page got its marker (or changed), so the list does not go stale."""
    present = {(b["page"], _first_line(b["code"])) for b in PY if not b["skip"]}
    stale = PENDING_MARKERS - present
    assert not stale, f"remove from PENDING_MARKERS: {sorted(stale)}"


def test_readme_quick_start_is_collected():
    assert any(b["page"] == "README.md" and "Gefen(" in b["code"] and not b["skip"] for b in PY)
    assert RUNNABLE_SH, "docs have at least one gefen-dist plan example"


def test_readme_results_table_is_the_scripts():
    """README.md's results table is exactly what benchmarks/results_table.py prints from the stored
    results (rerun it with --write after a benchmark changes a file in docs/results/)."""
    import sys

    bench = os.path.join(ROOT, "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import results_table

    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    a, b = f"<!-- BEGIN generated: {results_table.MARKER} -->\n", f"<!-- END generated: {results_table.MARKER} -->"
    assert a in text and b in text
    assert text[text.index(a) + len(a):text.index(b)] == results_table.table_md()


def test_quality_peers_table_is_the_scripts():
    """docs/quality.md's table of the default and the peers is exactly what
    benchmarks/peers_table.py prints from the stored runs (rerun it with --write after new runs)."""
    import sys

    bench = os.path.join(ROOT, "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import peers_table

    with open(os.path.join(ROOT, "docs", "quality.md")) as f:
        text = f.read()
    a, b = f"<!-- BEGIN generated: {peers_table.MARKER} -->\n", f"<!-- END generated: {peers_table.MARKER} -->"
    assert a in text and b in text
    assert text[text.index(a) + len(a):text.index(b)] == peers_table.table()
