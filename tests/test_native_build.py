"""Building the native CPU libraries (gefen_dist/kernels/native.py, ``gefen-dist build-kernels``).

The ranks of a job on a new machine all need the libraries at the same moment; one compiles while the
others wait on the lock file and load its result (the step kernel takes ~20 s to compile, so eight
ranks compiling it side by side would spend minutes of CPU before the first step).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NATIVE = ROOT / "gefen_dist" / "kernels" / "native.py"

# One process: load native.py alone (stdlib only: no torch import), wait until every process of the
# test is ready, then load the small first-step library from the empty cache at the same moment.
_CHILD = textwrap.dedent("""
    import importlib.util, logging, os, sys, time
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    spec = importlib.util.spec_from_file_location("gefen_native_alone", sys.argv[1])
    native = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(native)
    gate, me, n = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    open(os.path.join(gate, f"ready{me}"), "w").close()
    t0 = time.monotonic()
    while sum(os.path.exists(os.path.join(gate, f"ready{i}")) for i in range(n)) < n:
        if time.monotonic() - t0 > 60:
            sys.exit("the other processes never started")
        time.sleep(0.001)
    lib = native.load_library("gefen_first_step", ["first_step.c"])
    print("LOADED", lib is not None and lib.gefen_first_step_abi() > 0)
""")


def _have_cc() -> bool:
    spec = importlib.util.spec_from_file_location("gefen_native_probe", NATIVE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod._compiler() is not None


def _race(tmp_path, env_extra, n=3):
    """``n`` processes of ``_CHILD`` released at the same instant with ``env_extra``; (rc, stdout,
    stderr) of each."""
    gate = tmp_path / "gate"
    gate.mkdir()
    env = {**os.environ, **env_extra}
    env.pop("GEFEN_DIST_NO_NATIVE", None)
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, str(NATIVE), str(gate), str(i), str(n)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(n)]
    outs = [p.communicate(timeout=240) for p in procs]
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def test_concurrent_first_loads_compile_once(tmp_path):
    """Three processes load the same library from an empty cache at the same instant: exactly one
    compiles it (one "compiling" log line in all), all three load it, and the cache holds the one
    library (no temporary files left behind)."""
    if not _have_cc():
        pytest.skip("no C compiler")
    cache = tmp_path / "cache"
    outs = _race(tmp_path, {"GEFEN_DIST_CACHE": str(cache)})
    for rc, out, err in outs:
        assert rc == 0 and "LOADED True" in out, (out, err)
    logs = "".join(err for _, _, err in outs)
    assert logs.count("gefen_dist: compiling gefen_first_step") == 1, logs
    assert logs.count("gefen_dist: built gefen_first_step") == 1, logs
    libs = sorted(f.name for f in cache.iterdir() if f.suffix == ".so")
    assert len(libs) == 1 and libs[0].startswith("gefen_first_step-"), sorted(os.listdir(cache))
    assert not [f for f in os.listdir(cache) if f.startswith(".gefen_first_step") and f.endswith(".so")]


def test_a_failing_compile_is_not_repeated_by_the_waiting_processes(tmp_path):
    """Three processes at once with a compiler that fails every build (slowly): each of the flag
    variants is compiled once in all, not once per process (the processes that waited read the
    recorded failure), every process falls back (None) and logs why."""
    cc = tmp_path / "failing-cc"
    calls = tmp_path / "calls"
    cc.write_text(f"#!/bin/sh\necho x >> {calls}\nsleep 0.5\necho 'no such compiler feature' >&2\nexit 1\n")
    cc.chmod(0o755)
    for rc, out, err in _race(tmp_path, {"GEFEN_DIST_CACHE": str(tmp_path / "cache"), "CC": str(cc)}):
        assert rc == 0 and "LOADED False" in out, (out, err)
        assert "could not build native library gefen_first_step" in err and "no such compiler feature" in err, err
    spec = importlib.util.spec_from_file_location("gefen_native_variants", NATIVE)
    native = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(native)
    assert len(calls.read_text().split()) == len(native.flag_variants()), calls.read_text()


def test_an_unusable_cache_falls_back_with_the_fix(tmp_path):
    """A cache directory that cannot be created (here: under a file) is not a crash at the first
    step: the loader returns None (the eager path runs) and the warning names the directory and
    GEFEN_DIST_CACHE."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    code = ("import importlib.util, logging, sys\n"
            "logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
            "spec = importlib.util.spec_from_file_location('gefen_native_alone', sys.argv[1])\n"
            "native = importlib.util.module_from_spec(spec); spec.loader.exec_module(native)\n"
            "print('LIB', native.load_library('gefen_first_step', ['first_step.c']))\n")
    env = {**os.environ, "GEFEN_DIST_CACHE": str(blocker / "cache")}
    env.pop("GEFEN_DIST_NO_NATIVE", None)
    r = subprocess.run([sys.executable, "-c", code, str(NATIVE)], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "LIB None" in r.stdout, (r.stdout, r.stderr)
    if _have_cc():
        assert str(blocker / "cache") in r.stderr and "GEFEN_DIST_CACHE" in r.stderr, r.stderr


def test_user_flags_are_appended_and_keyed(tmp_path):
    """``GEFEN_DIST_CFLAGS`` is appended to every flag set and is part of the cache key: a build with it sits
    beside the default one (two libraries in the cache), and a flag the compiler refuses falls back to the
    eager path (None) with the compiler's message naming it; a value with an open quote is refused."""
    if not _have_cc():
        pytest.skip("no C compiler")
    code = ("import importlib.util, logging, sys\n"
            "logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
            "spec = importlib.util.spec_from_file_location('gefen_native_alone', sys.argv[1])\n"
            "native = importlib.util.module_from_spec(spec); spec.loader.exec_module(native)\n"
            "print('LIB', native.load_library('gefen_dp', ['dp.c']) is not None)\n")
    cache = tmp_path / "cache"

    def load(flags):
        env = {**os.environ, "GEFEN_DIST_CACHE": str(cache)}
        env.pop("GEFEN_DIST_NO_NATIVE", None)
        env.pop("GEFEN_DIST_CFLAGS", None)
        if flags is not None:
            env["GEFEN_DIST_CFLAGS"] = flags
        return subprocess.run([sys.executable, "-c", code, str(NATIVE)], env=env, capture_output=True, text=True,
                              timeout=240)

    r0, r1 = load(None), load("-DGEFEN_DIST_PROBE=1 -g")
    assert "LIB True" in r0.stdout and "LIB True" in r1.stdout, (r0.stderr, r1.stderr)
    assert len([f for f in cache.iterdir() if f.suffix == ".so"]) == 2, sorted(os.listdir(cache))
    bad = load("-fno-such-gefen-flag")
    assert "LIB False" in bad.stdout and "-fno-such-gefen-flag" in bad.stderr, bad.stderr
    r = load("-DX='open")
    assert r.returncode != 0 and "GEFEN_DIST_CFLAGS" in r.stderr and "quote it" in r.stderr, r.stderr


def test_build_kernels_command(capsys, monkeypatch):
    """``gefen-dist build-kernels`` builds (or finds) the three libraries in the cache this run uses and
    names them; with the native path switched off it says what runs instead and exits 1."""
    from gefen_dist import cli

    monkeypatch.delenv("GEFEN_DIST_NO_NATIVE", raising=False)
    if not _have_cc():
        pytest.skip("no C compiler")
    assert cli.main(["build-kernels", "--json"]) == 0
    built = json.loads(capsys.readouterr().out)
    assert set(built) == {"gefen_step", "gefen_dp", "gefen_first_step"}
    assert all(p and Path(p).is_file() for p in built.values()), built
    from gefen_dist.kernels import native
    if native.flag_variants()[0][-1] in native._X86_STORE_FLAGS and "clang" not in native._compiler():
        # GCC on x86-64 takes the first set (its unsplit stores; research/speed-log.md)
        assert all(p.endswith("-v0.so") for p in built.values()), built
    monkeypatch.setenv("GEFEN_DIST_NO_NATIVE", "1")
    assert cli.main(["build-kernels"]) == 1
    out = capsys.readouterr().out
    assert out.count("not built (the eager torch path runs instead") == 3, out


def test_a_hung_compiler_times_out_and_falls_back(tmp_path, monkeypatch, caplog):
    """A compiler that never returns does not hang the first step (nor the ranks waiting on its lock):
    the compile times out, every flag variant is tried, the loader falls back (None) and says why."""
    import logging

    spec = importlib.util.spec_from_file_location("gefen_native_timeout", NATIVE)
    native = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(native)
    cc = tmp_path / "hung-cc"
    cc.write_text("#!/bin/sh\nsleep 30\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("GEFEN_DIST_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("GEFEN_DIST_NO_NATIVE", raising=False)
    monkeypatch.setattr(native, "_COMPILE_TIMEOUT", 0.3)
    with caplog.at_level(logging.WARNING, logger="gefen_native_timeout"):
        assert native.load_library("gefen_first_step", ["first_step.c"]) is None
    assert caplog.text.count("timed out after 0.3 s") == len(native.flag_variants()), caplog.text
