"""The Triton kernel of ``second_moment="nibbles"`` (gefen_dist.kernels.triton_nibbles, D20) against the
eager reference, on CPU tensors through the Triton interpreter (in a subprocess with TRITON_INTERPRET=1,
as tests/test_triton_step.py explains; on a CUDA machine the compiled kernel runs in-process too).

Agreement contract: scales and the first moment's codes bitwise (they never depend on ``v``); ``v_row``
within a float32 ulp or two (the row's mean of ``g^2`` summed in another order), so a second-moment code
may differ where its draw lies within that ulp of its fraction (none in these problems); parameters
within 2e-7 (float32) or one bf16 ulp.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

_CHILD_ENV = "_GEFEN_TRITON_NIBBLES_CHILD"
_CHILD = os.environ.get(_CHILD_ENV) == "1"
if _CHILD:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

pytest.importorskip("triton", reason="triton is not installed")
if _CHILD:
    import _fast_interpreter

    _fast_interpreter.install()

import test_nibbles as T  # noqa: E402

interp = pytest.mark.skipif(not _CHILD, reason="runs in the TRITON_INTERPRET=1 subprocess (test_interpreter_suite)")


@pytest.mark.skipif(_CHILD, reason="this is the subprocess")
def test_interpreter_suite():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", **{_CHILD_ENV: "1"})
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", os.path.abspath(__file__)]
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"interpreter suite failed (rc {r.returncode}):\n{out[-6000:]}"
    last = [ln for ln in out.splitlines() if ln.strip()][-1]
    assert " passed" in last and "failed" not in last and "error" not in last, last


def _compare(device, **kw):
    from gefen_dist.kernels import triton_nibbles as tn

    steps, p, cb = T._problem(rows=30, slab=96)
    steps[2][10, 5] = float("nan")
    steps[1][7:9] = 0.0
    steps = [s.to(device) for s in steps]
    want, ws = T._run([s.cpu() for s in steps], p, cb, **kw)
    got, gs = T._run(steps, p.to(device), cb.to(device), fn=tn.nibble_step_factored_, **kw)
    got, gs = got.cpu(), {k: v.cpu() for k, v in gs.items()}
    assert torch.equal(gs["code"], ws["code"])
    for k in ("scale", "v_col"):  # bit for bit, but for a NaN's payload
        torch.testing.assert_close(gs[k], ws[k], rtol=0, atol=0, equal_nan=True)
    assert torch.allclose(gs["v_row"], ws["v_row"], rtol=3e-7, atol=0, equal_nan=True)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan) and bool(nan.any())
    tol = 8e-3 if got.dtype == torch.bfloat16 else 2e-7
    assert torch.allclose(got[~nan].float(), want[~nan].float(), rtol=tol, atol=tol * float(want[~nan].abs().max()))


@interp
@pytest.mark.parametrize("kw", [dict(G=1, B=32), dict(G=3, B=32, update="decoded", bound=2.0),
                                dict(G=1, B=96, dtype=torch.bfloat16, bound=2.0), dict(G=3, B=96, rows=(4, 26))])
def test_kernel_matches_the_reference(kw):
    """Row blocks cut by a shard (rows 4..26 of 30, global row 4 first), both update rules, the bound,
    bf16 parameters, a NaN gradient (its row's scales NaN), zero rows."""
    _compare("cpu", **kw)


@interp
def test_gefen_nibbles_steps_through_the_triton_kernel(monkeypatch):
    """With the CPU taken for a Triton device (as tests/test_triton_step.py does), Gefen(second_moment=
    "nibbles") steps every quantized tensor through the kernel, to within the contract of the eager path."""
    from gefen_dist import Gefen
    from gefen_dist.kernels import dispatch

    monkeypatch.setattr(dispatch, "native_cpu_usable", lambda t: False)
    monkeypatch.setattr(dispatch, "triton_usable", lambda t: t.dtype in (torch.float32, torch.bfloat16))
    a, b = T._mlp(), T._mlp()
    oa = Gefen(a.parameters(), lr=3e-3, second_moment="nibbles")
    ob = Gefen(b.parameters(), lr=3e-3, second_moment="nibbles", fused=False)
    assert dispatch.select_nibbles(a[0].weight, None).name == "triton"
    T._train(a, oa, 3)
    T._train(b, ob, 3)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6)
    assert (oa.state[a[0].weight]["idx"] == ob.state[b[0].weight]["idx"]).float().mean() > 0.999


@pytest.mark.skipif(_CHILD or not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_the_reference():
    for kw in (dict(G=1, B=32), dict(G=3, B=96, dtype=torch.bfloat16, update="decoded")):
        _compare("cuda", **kw)
