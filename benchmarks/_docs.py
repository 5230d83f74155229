"""Splicing generated markdown into the docs (shared by the benchmark scripts)."""
from __future__ import annotations

import platform
import time
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


def publish(out: dict, out_path, md: str, md_path, default_md: Path, marker: str, doc: Path = None) -> None:
    """Write a benchmark's JSON results and markdown table, print the table, and splice it into
    ``doc`` (default: ``docs/benchmarks.md``) between its ``marker`` markers when ``md_path`` is the
    default one."""
    import json

    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(json.dumps(out, indent=1) + "\n")
    Path(md_path).write_text(md)
    print("\n" + md)
    if Path(md_path).resolve() == Path(default_md).resolve():
        splice(Path(doc) if doc is not None else Path(default_md).resolve().parents[1] / "benchmarks.md", marker, md)
    print(f"wrote {out_path} and {md_path}")


def output_args(ap, doc: str) -> None:
    """The output options of a benchmark whose table lives in ``doc``: ``--out``, ``--from-json``,
    ``--write``."""
    ap.add_argument("--out", default="", help="write the results JSON there")
    ap.add_argument("--from-json", default="", help="render stored results instead of measuring")
    ap.add_argument("--write", action="store_true", help=f"splice the table into {doc}")


def run_or_load(args, measure, table, doc: Path, marker: str) -> dict:
    """The stored results (``--from-json``) or ``measure()``'s, whose JSON goes to ``--out``; the
    markdown ``table(res)`` printed and, with ``--write``, spliced into ``doc`` between its ``marker``
    markers (a clear exit when they are missing). Stored results are never rewritten."""
    import json

    if args.from_json:
        res = json.loads(Path(args.from_json).read_text())
    else:
        res = measure()
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    md = table(res)
    print(md)
    if args.write and not splice(doc, marker, md):
        raise SystemExit(f"{doc} has no {marker} markers")
    return res


def run_meta() -> dict:
    """Where and when a benchmark ran, for its stored JSON (the README's results table reads these):
    ``torch`` (version), ``date`` (UTC, YYYY-MM-DD) and ``cpu`` (the processor's model name from
    /proc/cpuinfo, else ``platform.processor()`` or the machine type)."""
    import torch

    cpu = ""
    try:
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), "")
    except OSError:
        pass
    return {"torch": torch.__version__, "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "cpu": cpu or platform.processor() or platform.machine()}
