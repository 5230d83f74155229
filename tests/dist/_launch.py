"""Launch torchrun workers from pytest (CPU/gloo), with a timeout that kills the whole launch.

    from _launch import run_torchrun
    out = run_torchrun("dcp_reshard.py", 2, "save", tmpdir, timeout=120).stdout

``script`` is a path, or a file name in ``tests/dist``. Workers get ``OMP_NUM_THREADS=1`` and the
repository root on ``PYTHONPATH``. A failed or timed-out launch raises ``AssertionError`` with the
tail of the output (``check=False`` returns the result instead). The result is a
``subprocess.CompletedProcess`` whose ``stdout`` holds stdout and stderr interleaved.

``relaunch_on_crash=True`` (for launches that only compute and compare, e.g. ``fsdp_vs_single.py``) runs a
launch once more when a worker of the first one was killed by SIGSEGV or SIGBUS (:func:`crashed_worker`),
with a ``UserWarning`` that carries the first launch's output (its crashed worker's Python stacks, which
``PYTHONFAULTHANDLER`` prints). A second crash, or any other failure, fails as before. Why: one 4-rank
FSDP2 launch lost a worker to SIGSEGV in one fresh-clone CI run of 2026-12-07 (rank 3, inside a gloo
all-gather of ``DTensor.full_tensor``); 40+ local repeats of that launch and the whole suite with the
native kernels under AddressSanitizer (both intrinsics builds) ran clean (docs/reliability.md).
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import warnings
from typing import List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TAIL = 8000


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _script(script: str) -> str:
    if os.path.isabs(script) or os.path.exists(script):
        return os.path.abspath(script)
    return os.path.join(HERE, script)


def _env() -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    # a worker killed by a signal (SIGSEGV, SIGABRT) prints every thread's Python stack before it dies, so a
    # crash in a launch says where it happened (CI 2026-12-07: rank 3 of the 4-rank HSDP launch, SIGSEGV)
    env.setdefault("PYTHONFAULTHANDLER", "1")
    return env


def torchrun_cmd(script: str, nproc: int, *args, nnodes: int = 1, node_rank: int = 0,
                 master_port: Optional[int] = None) -> List[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    if nnodes == 1 and master_port is None:
        cmd.append("--standalone")  # c10d rendezvous on a free port: concurrent test runs don't clash
    else:
        cmd += ["--nnodes", str(nnodes), "--node_rank", str(node_rank), "--master_addr", "127.0.0.1",
                "--master_port", str(master_port if master_port is not None else free_port())]
    return cmd + [_script(script), *map(str, args)]


def start_torchrun(script: str, nproc: int, *args, nnodes: int = 1, node_rank: int = 0,
                   master_port: Optional[int] = None) -> subprocess.Popen:
    """Start a launch in its own process group (so a timeout can end all of its workers)."""
    return subprocess.Popen(torchrun_cmd(script, nproc, *args, nnodes=nnodes, node_rank=node_rank,
                                         master_port=master_port),
                            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _children(pid: int) -> List[int]:
    """Direct children of ``pid`` (torchrun starts its workers in sessions of their own)."""
    kids = []
    for d in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return kids


def _kill(proc: subprocess.Popen) -> None:
    """End a launch: SIGTERM to the agent (it stops its workers), then SIGKILL what is left of
    the workers we saw and of the agent's own process group."""
    workers = _children(proc.pid)
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        pass
    for pid in workers:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the launch's own process group (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass


def wait_torchrun(proc: subprocess.Popen, timeout: float, what: str = "torchrun",
                  check: bool = True) -> subprocess.CompletedProcess:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        out, _ = proc.communicate()
        raise AssertionError(f"{what} timed out after {timeout}s (a collective hung?); output tail:\n"
                             f"{(out or '')[-TAIL:]}") from None
    res = subprocess.CompletedProcess(proc.args, proc.returncode, out or "", "")
    if check and proc.returncode != 0:
        raise AssertionError(f"{what} failed (rc {proc.returncode}); output tail:\n{res.stdout[-TAIL:]}")
    return res


# torchrun's report of a worker killed by a signal: "exitcode  : -11 (pid: 123)  (SIGSEGV)"
_SIGNAL_EXIT = re.compile(r"exitcode\s*:\s*-\d+\b[^\n]*\((SIG[A-Z]+)\)")
_CRASH_SIGNALS = ("SIGSEGV", "SIGBUS")


def crashed_worker(res: subprocess.CompletedProcess) -> Optional[str]:
    """The signal (``"SIGSEGV"``, ``"SIGBUS"``) that killed a worker of a failed launch, else None (a
    launch that passed, a Python exception, an abort, a timeout's kill, or the SIGTERM torchrun sends the
    other workers after one died: those are failures to report, never to relaunch)."""
    if res.returncode == 0:
        return None
    sigs = set(_SIGNAL_EXIT.findall(res.stdout or ""))
    return next((s for s in _CRASH_SIGNALS if s in sigs), None)


def run_torchrun(script: str, nproc: int, *args, timeout: float = 180, check: bool = True,
                 relaunch_on_crash: bool = False, **kw) -> subprocess.CompletedProcess:
    """Run ``torchrun --nproc_per_node nproc script *args`` and wait at most ``timeout`` seconds
    (``relaunch_on_crash``: the module's docstring)."""
    what = f"torchrun {os.path.basename(script)} x{nproc} {' '.join(map(str, args))}"
    res = wait_torchrun(start_torchrun(script, nproc, *args, **kw), timeout, what, check=check and not relaunch_on_crash)
    sig = crashed_worker(res) if relaunch_on_crash else None
    if sig is not None:
        warnings.warn(f"{what}: a worker died of {sig}; relaunching once. First launch's output tail:\n"
                      f"{res.stdout[-TAIL:]}", UserWarning, stacklevel=2)
        what += f" (relaunched after a {sig})"
        res = wait_torchrun(start_torchrun(script, nproc, *args, **kw), timeout, what, check=False)
    if check and res.returncode != 0:
        raise AssertionError(f"{what} failed (rc {res.returncode}); output tail:\n{res.stdout[-TAIL:]}")
    return res
