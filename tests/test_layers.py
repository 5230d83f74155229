"""The package's one direction of dependency, checked on the source (ast, no imports run):

core (pure math) <- kernels (one implementation per device, and the one dispatch) <- engine
(pieces, state spec, learner, steps) <- optim (``Gefen``) <- zero (``ZeroGefen``) <- checkpoint,
plan, cli, integrations. ``core`` imports neither ``kernels`` nor ``torch.distributed``; only
the DeepSpeed integration imports ``deepspeed``; nothing in the package imports ``research`` or
``benchmarks``; ``kernels`` imports nothing above it."""
import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "gefen_dist"


def _imports(path: Path):
    """Absolute module names imported by ``path`` (relative imports resolved against the package)."""
    tree = ast.parse(path.read_text())
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    pkg = parts if path.name == "__init__.py" else parts[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[:len(pkg) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
                if node.module is None:  # from . import x
                    out.update(f"{mod}.{a.name}" for a in node.names)
                    continue
            else:
                mod = node.module or ""
            out.add(mod)
    return out


def _files(sub=""):
    return sorted(p for p in (PKG / sub).rglob("*.py") if "__pycache__" not in p.parts)


def _offenders(files, bad):
    found = {}
    for f in files:
        hits = sorted(m for m in _imports(f) if any(m == b or m.startswith(b + ".") for b in bad))
        if hits:
            found[str(f.relative_to(PKG.parent))] = hits
    return found


def test_import_resolution_sees_relative_imports():
    # the checker itself: relative imports resolve to absolute names (kernels/dispatch.py does
    # ``from ..core.quant import ...`` and ``from . import first_step``)
    got = _imports(PKG / "kernels" / "dispatch.py")
    assert {"gefen_dist.core.quant", "gefen_dist.core", "gefen_dist.kernels.first_step"} <= got, got


# The packages from the bottom up; each may import only those before it (and the top-level
# modules ``checkpoint``, ``plan`` and ``cli`` sit above all of them but the integrations).
LAYERS = ["core", "kernels", "engine", "optim", "zero"]
ABOVE_ALL = ["gefen_dist.integrations", "gefen_dist.checkpoint", "gefen_dist.plan", "gefen_dist.cli"]


@pytest.mark.parametrize("layer", LAYERS)
def test_each_package_imports_only_the_layers_below(layer):
    above = [f"gefen_dist.{x}" for x in LAYERS[LAYERS.index(layer) + 1:]] + ABOVE_ALL
    assert _files(layer), f"gefen_dist/{layer}/ has no modules"
    assert _offenders(_files(layer), above) == {}


def test_core_is_pure_math():
    assert _offenders(_files("core"), ["torch.distributed", "deepspeed", "numba", "triton"]) == {}


def test_kernels_do_not_communicate():
    assert _offenders(_files("kernels"), ["torch.distributed", "deepspeed"]) == {}


def test_the_package_is_only_its_layers():
    # a new module lands in a layer (or is one of the few top-level entry points), not loose
    loose = sorted(p.name for p in PKG.glob("*.py"))
    assert loose == ["__init__.py", "checkpoint.py", "cli.py", "plan.py"], loose
    dirs = sorted(p.name for p in PKG.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert dirs == sorted(LAYERS + ["integrations"]), dirs


def test_only_the_deepspeed_integration_imports_deepspeed():
    files = [f for f in _files() if not (f.parent.name == "integrations" and f.name.startswith(("deepspeed", "ds_")))]
    assert _offenders(files, ["deepspeed"]) == {}


@pytest.mark.parametrize("research", ["research", "benchmarks", "tests"])
def test_product_never_imports_research_or_benchmarks(research):
    assert _offenders(_files(), [research]) == {}
