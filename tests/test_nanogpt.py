"""A real client: karpathy/nanoGPT's ``train.py`` with its optimizer line changed to Gefen.

``tests/clients/nanogpt/`` holds nanoGPT's ``train.py``, ``model.py`` and ``configurator.py``
(MIT, commit in its README) with two recorded patches: ``gefen.patch`` (``model.py``:
``configure_optimizers`` builds ``gefen_dist.Gefen`` instead of ``torch.optim.AdamW``, and its
import) and ``cpu_ddp.patch`` (``train.py``: its DDP path hardcodes CUDA; two lines keep
``device='cpu'`` under gloo). ``test_vendored_files_are_upstream_plus_patches`` checks that the
vendored files are exactly the upstream blobs plus those patches.

The runs are nanoGPT's own commands on a tiny character-level config
(``config/train_stdlib_char_gefen.py``, data from ``data/stdlib_char/prepare.py``: the running
Python's argparse/textwrap/string sources), each in a fresh process with the repository root on
``PYTHONPATH``:

* one process, 20 iterations (checkpoints at 10 and 20), then ``--init_from=resume`` to 30;
* ``torchrun --nproc_per_node 2`` (``backend='gloo'``), 20 iterations, then resumed on 2 ranks to 30.

Checked: the loss falls; ``ckpt.pt`` holds Gefen's compact state (uint8 ``idx``, learned
codebook, step count = iterations); the checkpoint loads through nanoGPT's own
``configure_optimizers`` + ``optimizer.load_state_dict`` and re-saves bitwise; the resumed run
continues at ``iter 20`` with the optimizer's step counts continuing to 30 and the loss at the
checkpoint's level. nanoGPT does not checkpoint the RNG state (a resumed run draws other batches
than an uninterrupted one), so a bitwise continuation against an uninterrupted run is not
possible with its ``train.py``; that the library's own resume is bitwise is checked elsewhere
(``tests/test_train_smoke.py``, ``tests/test_hf.py``).
"""
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "dist"))
from _launch import TAIL, _env, torchrun_cmd, wait_torchrun  # noqa: E402

NANO = os.path.join(HERE, "clients", "nanogpt")
CONFIG = os.path.join(NANO, "config", "train_stdlib_char_gefen.py")
TRAIN = os.path.join(NANO, "train.py")
TIMEOUT = 240  # a run takes 10-15 s on 2 busy cores
# karpathy/nanoGPT at 3adf61e154c3fe3fca428ad6bc3818b27a3b8291: git blob ids of the vendored files
UPSTREAM = {"train.py": "de5785051050d64bbda37a4964c2c079f0739b2b",
            "model.py": "c698f8b60129d793494de058b0dd4e318c0dcb5e",
            "configurator.py": "a8bba9599537cbb34b378399a077b525a87d497f",
            "LICENSE": "329db5e33310fd5d98343e2bca690bfb07317526"}
ITER = re.compile(r"^iter (\d+): loss ([0-9.]+),", re.M)
EVAL = re.compile(r"^step (\d+): train loss ([0-9.]+), val loss ([0-9.]+)", re.M)


def _blob(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_vendored_files_are_upstream_plus_patches(tmp_path):
    """Reverse-applying gefen.patch and cpu_ddp.patch gives back nanoGPT's files byte for byte."""
    if shutil.which("patch") is None:
        pytest.skip("the `patch` tool is not installed")
    for name in UPSTREAM:
        shutil.copy(os.path.join(NANO, name), tmp_path / name)
    for p in ("gefen.patch", "cpu_ddp.patch"):
        subprocess.run(["patch", "-R", "-p4", "-s", "-i", os.path.join(NANO, p)], cwd=tmp_path, check=True)
    for name, blob in UPSTREAM.items():
        assert _blob((tmp_path / name).read_bytes()) == blob, name
    model_diff = open(os.path.join(NANO, "gefen.patch")).read()
    changed = [ln for ln in model_diff.splitlines() if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    assert changed == ["+from gefen_dist import Gefen",
                       "-        optimizer = torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, **extra_args)",
                       "+        optimizer = Gefen(optim_groups, lr=learning_rate, betas=betas, **extra_args)"], changed


def _workdir(tmp_path):
    """nanoGPT runs from a directory holding configurator.py and data/<dataset>/ (as in its repo)."""
    shutil.copy(os.path.join(NANO, "configurator.py"), tmp_path / "configurator.py")
    subprocess.run([sys.executable, os.path.join(NANO, "data", "stdlib_char", "prepare.py"),
                    str(tmp_path / "data" / "stdlib_char")], check=True, capture_output=True)
    return tmp_path


def _teardown_abort(res, overrides) -> bool:
    """A 2-rank launch that finished its last iteration and then lost a rank to SIGABRT.

    gloo can abort a rank at exit when its peer closes the TCP pair first (``gloo::IoException``
    thrown on gloo's own thread: pytorch/pytorch#130345, horovod#2907); nanoGPT's ``train.py``
    (vendored, not ours to change) calls ``destroy_process_group()`` and exits. Seen in CI (2026-12-04,
    rank 1 exit -6 after the run's last checkpoint, "terminate called without an active exception";
    once, then twice in a row in a later run); locally 1 in 16 launches on an idle host (the code of
    that day's start: 0 in 6), 18 loaded repeats and 3 with the native kernels built under
    AddressSanitizer ran clean. The launch is relaunched once; a second such abort is accepted (the
    run's output and checkpoint are still checked); any other failure fails.
    """
    last = next((int(o.split("=")[1]) for o in overrides if o.startswith("--max_iters=")), 20)
    return (res.returncode != 0 and re.search(rf"^iter {last}: loss", res.stdout, re.M) is not None
            and "exitcode  : -6" in res.stdout and "terminate called without an active exception" in res.stdout)


def test_teardown_abort_rule():
    """The relaunch (and the tolerated second abort) is for gloo's teardown abort after the last
    iteration only, never for a failure during training or another abort (a heap error's, say)."""
    done = ("iter 19: loss 2.98,\niter 20: loss 2.95, time 1ms\nterminate called without an active exception\n"
            "  exitcode  : -6 (pid: 1)  (SIGABRT)\n")
    assert _teardown_abort(subprocess.CompletedProcess([], 1, done, ""), ["--out_dir=out"])
    heap = done.replace("terminate called without an active exception", "free(): invalid pointer")
    assert not _teardown_abort(subprocess.CompletedProcess([], 1, heap, ""), ["--out_dir=out"])
    assert not _teardown_abort(subprocess.CompletedProcess([], 1, done, ""), ["--max_iters=30"])
    assert not _teardown_abort(subprocess.CompletedProcess([], 1, done.replace("-6", "1"), ""), [])
    assert not _teardown_abort(subprocess.CompletedProcess([], 0, done, ""), [])


def _train(cwd, *overrides, nproc=1):
    args = [TRAIN, CONFIG, *overrides]
    cmd = [sys.executable, *args] if nproc == 1 else torchrun_cmd(args[0], nproc, *args[1:])
    what = f"nanoGPT train.py x{nproc} {' '.join(overrides)}"
    backup = cwd / "out.before"
    if nproc > 1:
        shutil.rmtree(backup, ignore_errors=True)
        if (cwd / "out").exists():
            shutil.copytree(cwd / "out", backup)
    for attempt in (1, 2):
        proc = subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        res = wait_torchrun(proc, TIMEOUT, what, check=False)
        if attempt == 1 and nproc > 1 and _teardown_abort(res, overrides):
            # once, from the same starting files: a second abort, or any other failure, fails the test
            print(f"{what}: a rank aborted after the last iteration (gloo teardown); relaunching once")
            shutil.rmtree(cwd / "out", ignore_errors=True)
            if backup.exists():
                shutil.copytree(backup, cwd / "out")
            continue
        break
    if nproc > 1 and _teardown_abort(res, overrides):
        # twice in a row (CI, 2026-12-04: a launch and its relaunch; locally 1 in 16 launches):
        # every iteration, eval and checkpoint is done, which the callers check; only the exit code of
        # the vendored script's teardown is not
        print(f"{what}: a rank aborted after the last iteration again (gloo teardown); the run's output and "
              "checkpoint are checked as they are")
    else:
        assert res.returncode == 0, f"{what} failed (rc {res.returncode}); output tail:\n{res.stdout[-TAIL:]}"
    out = res.stdout
    iters = [(int(i), float(v)) for i, v in ITER.findall(out)]
    evals = [(int(i), float(t), float(v)) for i, t, v in EVAL.findall(out)]
    return out, iters, evals


def _model_module():
    spec = importlib.util.spec_from_file_location("nanogpt_model", os.path.join(NANO, "model.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _check_ckpt(path, iters):
    """ckpt.pt as nanoGPT wrote it: Gefen's compact state, stepped ``iters`` times; returns B/param."""
    from gefen_dist import Gefen

    ck = torch.load(path, map_location="cpu", weights_only=True)  # nanoGPT's own torch.load, as in torch >= 2.6
    assert ck["iter_num"] == iters
    st = ck["optimizer"]["state"]
    q = [s for s in st.values() if "idx" in s]
    assert len(q) == 10 and len(st) == 15, (len(q), len(st))  # the 10 matrices quantized, 5 norm weights exact
    assert all(s["idx"].dtype == torch.uint8 and s["learned"] == 1 for s in q)
    assert {int(s["step"]) for s in st.values()} == {iters}
    nbytes = sum(v.numel() * v.element_size() for s in st.values() for v in s.values() if torch.is_tensor(v))
    mod = _model_module()
    model = mod.GPT(mod.GPTConfig(**ck["model_args"]))
    nparam = sum(p.numel() for p in model.parameters())
    # nanoGPT's resume path: configure_optimizers (now Gefen) + optimizer.load_state_dict(checkpoint['optimizer'])
    model.load_state_dict(ck["model"])
    cfg = ck["config"]
    opt = model.configure_optimizers(cfg["weight_decay"], cfg["learning_rate"], (cfg["beta1"], cfg["beta2"]), "cpu")
    assert type(opt) is Gefen
    opt.load_state_dict(ck["optimizer"])
    again = opt.state_dict()
    assert again["state"].keys() == st.keys()
    for k in st:
        assert again["state"][k].keys() == st[k].keys(), k
        for name, v in st[k].items():
            w = again["state"][k][name]
            assert (torch.equal(v, w) and v.dtype == w.dtype) if torch.is_tensor(v) else v == w, (k, name)
    return nbytes / nparam


def _check_resume(first, resumed, ck_eval, out):
    _, iters, evals = resumed
    assert iters[0][0] == 20 and iters[-1][0] == 30, iters[:2] + iters[-1:]
    assert "Resuming training from" in out
    # the resumed eval at 20 draws other batches (nanoGPT reseeds): same level, not the same number
    assert evals[0][0] == 20 and abs(evals[0][2] - ck_eval) < 0.2, (evals[0], ck_eval)
    assert max(v for _, v in iters) < first[1][0][1] - 0.8, (first[1][0], iters)


def test_nanogpt_single_process_and_resume(tmp_path):
    cwd = _workdir(tmp_path)
    first = _train(cwd, "--out_dir=out")
    out, iters, evals = first
    assert "using fused AdamW: False" in out  # the untouched print; the optimizer is Gefen (checked below)
    assert [i for i, _ in iters] == list(range(21)) and [e[0] for e in evals] == [0, 10, 20]
    assert iters[-1][1] < iters[0][1] - 1.0 and evals[-1][2] < evals[0][2] - 1.0, (iters, evals)
    shutil.copy(cwd / "out" / "ckpt.pt", cwd / "ckpt20.pt")
    bpp = _check_ckpt(cwd / "ckpt20.pt", 20)
    assert bpp < 2.0, bpp  # AdamW: 8 B/param
    from gefen_dist.cli import inspect_checkpoint

    r = inspect_checkpoint(str(cwd / "ckpt20.pt"))  # `gefen-dist inspect out/ckpt.pt` finds nanoGPT's optimizer
    assert r["codebook"]["learned"] and len(r["tensors"]) == 15, r["format"]
    resumed = _train(cwd, "--out_dir=out", "--init_from=resume", "--max_iters=30")
    _check_resume(first, resumed, evals[-1][2], resumed[0])
    _check_ckpt(cwd / "out" / "ckpt.pt", 30)
    print(f"single: loss {iters[0][1]:.4f} -> {iters[-1][1]:.4f}, val {evals[0][2]:.4f} -> {evals[-1][2]:.4f}, "
          f"ckpt optimizer state {bpp:.3f} B/param; resumed iter {resumed[1][0][0]}..{resumed[1][-1][0]}, "
          f"val {resumed[2][-1][2]:.4f}")


@pytest.mark.dist
def test_nanogpt_ddp_2ranks_and_resume(tmp_path):
    cwd = _workdir(tmp_path)
    first = _train(cwd, "--out_dir=out", nproc=2)
    out, iters, evals = first
    assert "tokens per iteration will be: 1,024" in out  # 2 ranks x 1 micro step x 8 x 64
    assert [i for i, _ in iters] == list(range(21)) and [e[0] for e in evals] == [0, 10, 20]
    assert iters[-1][1] < iters[0][1] - 1.0 and evals[-1][2] < evals[0][2] - 1.0, (iters, evals)
    _check_ckpt(cwd / "out" / "ckpt.pt", 20)
    resumed = _train(cwd, "--out_dir=out", "--init_from=resume", "--max_iters=30", nproc=2)
    _check_resume(first, resumed, evals[-1][2], resumed[0])
    _check_ckpt(cwd / "out" / "ckpt.pt", 30)
    print(f"ddp x2: loss {iters[0][1]:.4f} -> {iters[-1][1]:.4f}, val {evals[0][2]:.4f} -> {evals[-1][2]:.4f}; "
          f"resumed iter {resumed[1][0][0]}..{resumed[1][-1][0]}, val {resumed[2][-1][2]:.4f}")
