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
    assert loose == ["__init__.py", "cli.py", "plan.py"], loose
    dirs = sorted(p.name for p in PKG.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert dirs == sorted(LAYERS + ["checkpoint", "integrations"]), dirs


def test_only_the_deepspeed_integration_imports_deepspeed():
    files = [f for f in _files() if not (f.parent.name == "integrations" and f.name.startswith(("deepspeed", "ds_")))]
    assert _offenders(files, ["deepspeed"]) == {}


@pytest.mark.parametrize("research", ["research", "benchmarks", "tests"])
def test_product_never_imports_research_or_benchmarks(research):
    assert _offenders(_files(), [research]) == {}


# ------------------------------------------------------------------ the mode is stored, not guessed
# A tensor's mode (exact / shared / factored / elementwise) is its StateSpec's: live code asks the
# optimizer (``Gefen._mode``, ``engine.state.mode_of``) or is handed the param group's
# ``second_moment``; only ``engine.state.mode_of_saved``, for files and foreign state dicts that
# carry no spec, decides a mode from which keys an entry holds.
MODE_KEYS = {"v_col", "v_row", "idx", "v"}
# exact state's key: no membership test for it in the live layers either (cli and the DeepSpeed
# universal reader use it only to recognise foreign Adam files)
LIVE_KEYS = {"exp_avg", "exp_avg_sq"}
LIVE_LAYERS = ("engine", "optim", "zero")


def _key_membership_tests(path: Path, keys):
    """``(line, source)`` of every ``"<key>" in x`` / ``"<key>" not in x`` with ``<key>`` one of
    ``keys`` (a string literal on the left of ``in``: testing whether a dict holds that key).
    Building dicts, ``for k in (...)`` loops and ``x in ("idx", ...)`` are not such tests."""
    src = path.read_text()
    out = []
    for node in ast.walk(ast.parse(src)):
        if not isinstance(node, ast.Compare):
            continue
        left = node.left
        for op, right in zip(node.ops, node.comparators):
            if (isinstance(op, (ast.In, ast.NotIn)) and isinstance(left, ast.Constant)
                    and isinstance(left.value, str) and left.value in keys):
                out.append((node.lineno, ast.get_source_segment(src, node)))
            left = right
    return out


def test_key_membership_checker_sees_what_it_should(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('a = "v_col" in st\nb = st and "idx" not in st\nc = 1 < 2 and "x" in "v"\n'
                 'd = {"v": 1, "idx": 2}\ne = [k for k in ("idx", "v") if k in st]\nf = "v_col" in st["x"]\n'
                 'g = key in ("v", "idx")\n')
    assert sorted(ln for ln, _ in _key_membership_tests(f, MODE_KEYS)) == [1, 2, 6]


def test_only_mode_of_saved_reads_the_mode_from_state_keys():
    state_py = PKG / "engine" / "state.py"
    found = {str(f.relative_to(PKG.parent)): hits for f in _files() if f != state_py
             for hits in [_key_membership_tests(f, MODE_KEYS)] if hits}
    assert found == {}, ("decide a tensor's mode with its StateSpec (Gefen._mode / engine.state.mode_of), or for a "
                         f"saved entry with engine.state.mode_of_saved, not from the keys it holds: {found}")
    # and the one that does is mode_of_saved
    tree = ast.parse(state_py.read_text())
    fns = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and any(
        isinstance(c, ast.Compare) and isinstance(c.left, ast.Constant) and c.left.value in MODE_KEYS
        for c in ast.walk(n))}
    assert fns == {"mode_of_saved"}, fns


def test_live_layers_do_not_guess_exact_state_from_keys():
    found = {str(f.relative_to(PKG.parent)): hits for layer in LIVE_LAYERS for f in _files(layer)
             if f != PKG / "engine" / "state.py" for hits in [_key_membership_tests(f, LIVE_KEYS)] if hits}
    assert found == {}, found
