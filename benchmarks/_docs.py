"""Splicing generated markdown into the docs (shared by the benchmark scripts)."""
from __future__ import annotations

from pathlib import Path


def splice(doc: Path, marker: str, body: str) -> bool:
    """Replace the text between ``<!-- BEGIN generated: MARKER -->`` and ``<!-- END generated:
    MARKER -->`` in ``doc`` by ``body``; False (nothing written) when the file or a marker is
    missing."""
    if not doc.exists():
        return False
    text = doc.read_text()
    a, b = f"<!-- BEGIN generated: {marker} -->", f"<!-- END generated: {marker} -->"
    if a not in text or b not in text:
        return False
    doc.write_text(text[:text.index(a) + len(a)] + "\n" + body.rstrip("\n") + "\n" + text[text.index(b):])
    return True
