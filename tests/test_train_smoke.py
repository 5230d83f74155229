"""Smoke tests for the training job (launch/train.py) on the 'tiny' preset.

Runs in-process (one subprocess run checks the script entry point). Gefen cases are skipped
while ``gefen_dist.Gefen`` is not importable.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launch.corpus import Batches, load_corpus, val_batches
from launch.gpt import GPT, get_config
from launch import train

REPO = Path(__file__).resolve().parent.parent


def _gefen_import_error() -> str | None:
    try:
        from gefen_dist import Gefen  # noqa: F401
    except ImportError as e:
        return str(e)
    return None


_GEFEN_ERR = _gefen_import_error()
OPTIMIZERS = [
    "adamw",
    pytest.param("gefen", marks=pytest.mark.skipif(
        _GEFEN_ERR is not None, reason=f"gefen_dist.Gefen not importable: {_GEFEN_ERR}")),
]

TINY = ["--model", "tiny", "--batch-size", "8", "--lr", "3e-3", "--warmup", "4",
        "--eval-every", "10", "--eval-batches", "2", "--seed", "3", "--no-progress"]


def _run(tmp: Path, opt: str, *extra: str) -> dict:
    return train.main(TINY + ["--optimizer", opt, "--out", str(tmp)] + list(extra))


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_train_smoke(tmp_path, opt):
    m = _run(tmp_path, opt, "--steps", "20")
    assert (tmp_path / "metrics.json").is_file()
    assert (tmp_path / "loss.png").stat().st_size > 1000
    on_disk = json.loads((tmp_path / "metrics.json").read_text())
    run = on_disk["runs"][opt]
    assert [e["step"] for e in run["evals"]] == [0, 10, 20]
    assert len(run["train_losses"]) == 20
    assert all(math.isfinite(v) for v in run["train_losses"])
    assert run["evals"][-1]["val_loss"] < run["evals"][0]["val_loss"] - 0.3
    assert sum(run["train_losses"][-5:]) < sum(run["train_losses"][:5])
    s = m["summary"][opt]
    assert s["state_bytes"] > 0 and s["params"] == GPT(get_config("tiny")).num_params()
    if opt == "adamw":  # exp_avg + exp_avg_sq in fp32 (+ scalar step tensors)
        assert 8.0 <= s["state_bytes_per_param"] < 8.01


@pytest.mark.skipif(_GEFEN_ERR is not None, reason="gefen_dist.Gefen not importable")
def test_gefen_embeddings_elementwise(tmp_path):
    """--gefen-embeddings elementwise: the embeddings (wte = LM head, wpe) get their own param group with a
    per-element second moment: about 4 more bytes per embedding element, training still converges."""
    base = _run(tmp_path / "a", "gefen", "--steps", "10", "--no-plot")["summary"]["gefen"]
    elem = _run(tmp_path / "b", "gefen", "--steps", "10", "--no-plot", "--gefen-embeddings", "elementwise")
    s = elem["summary"]["gefen"]
    cfg = get_config("tiny")
    n_emb = (cfg.vocab_size + cfg.context) * cfg.d_model
    assert 3.5 * n_emb < s["state_bytes"] - base["state_bytes"] < 4.1 * n_emb
    run = json.loads((tmp_path / "b" / "metrics.json").read_text())["runs"]["gefen"]
    assert run["evals"][-1]["val_loss"] < run["evals"][0]["val_loss"]


@pytest.mark.skipif(_GEFEN_ERR is not None, reason="gefen_dist.Gefen not importable")
def test_gefen_second_moment_nibbles(tmp_path):
    """--gefen-second-moment nibbles (D20): every group's second_moment; the state within 10% of the default's
    (finer scale blocks, no blocks of narrow rows), it trains, and ZeroGefen takes the same groups."""
    base = _run(tmp_path / "a", "gefen", "--steps", "10", "--no-plot")["summary"]["gefen"]
    nib = _run(tmp_path / "b", "gefen", "--steps", "10", "--no-plot", "--gefen-second-moment", "nibbles")
    s = nib["summary"]["gefen"]
    assert 0.9 * base["state_bytes"] < s["state_bytes"] < 1.1 * base["state_bytes"]
    run = json.loads((tmp_path / "b" / "metrics.json").read_text())["runs"]["gefen"]
    assert run["evals"][-1]["val_loss"] < run["evals"][0]["val_loss"] - 0.3
    from gefen_dist import ZeroGefen

    groups = train._gefen_groups(GPT(get_config("tiny")), train.build_parser().parse_args(
        ["--gefen-second-moment", "nibbles"]))
    assert {g["second_moment"] for g in groups} == {"nibbles"}
    assert ZeroGefen(groups).param_groups[0]["second_moment"] == "nibbles"


@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_checkpoint_resume_bit_identical(tmp_path, opt):
    straight, split = tmp_path / "straight", tmp_path / "split"
    a = _run(straight, opt, "--steps", "20", "--checkpoint-every", "10", "--no-plot")
    _run(split, opt, "--steps", "20", "--checkpoint-every", "10", "--stop-after", "10",
         "--no-plot")
    ck_path = train.checkpoint_path(str(split), opt)
    assert torch.load(ck_path, weights_only=False)["step"] == 10
    b = _run(split, opt, "--steps", "20", "--checkpoint-every", "10", "--no-plot",
             "--resume", str(ck_path))

    ra, rb = a["runs"][opt], b["runs"][opt]
    assert ra["train_losses"] == rb["train_losses"]
    assert [e["val_loss"] for e in ra["evals"]] == [e["val_loss"] for e in rb["evals"]]

    ca = torch.load(train.checkpoint_path(str(straight), opt), weights_only=False)
    cb = torch.load(ck_path, weights_only=False)
    assert ca["step"] == cb["step"] == 20
    assert ca["model"].keys() == cb["model"].keys()
    for k in ca["model"]:
        assert torch.equal(ca["model"][k], cb["model"][k]), k
    sa, sb = ca["optimizer"]["state"], cb["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for k, v in sa[i].items():
            if torch.is_tensor(v):
                assert torch.equal(v, sb[i][k]), (i, k)
    assert ca["scheduler"]["last_epoch"] == cb["scheduler"]["last_epoch"] == 20


def test_batches_deterministic_and_rank_split():
    data = load_corpus()[0]
    g = Batches(data, 8, 16, seed=5)
    x, y = g.batch(7)
    assert x.dtype == y.dtype == torch.int64 and x.shape == (8, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(Batches(data, 8, 16, seed=5).batch(7)[0], x)
    assert not torch.equal(g.batch(8)[0], x)
    ranks = [Batches(data, 2, 16, seed=5, rank=r, world_size=4).batch(7)[0] for r in range(4)]
    assert torch.equal(torch.cat(ranks), x)
    v1, v2 = val_batches(3, 4, 16), val_batches(3, 4, 16)
    assert all(torch.equal(p[0], q[0]) for p, q in zip(v1, v2))


def test_script_entry_point_and_errors(tmp_path):
    r = subprocess.run([sys.executable, "launch/train.py"] + TINY +
                       ["--optimizer", "adamw", "--steps", "3", "--no-plot", "--out", str(tmp_path)],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "adamw: steps 3" in r.stdout and "B/param" in r.stdout
    assert (tmp_path / "metrics.json").is_file()
    with pytest.raises(SystemExit, match="torchrun"):  # distributed strategies need a launcher
        train.main(TINY + ["--strategy", "fsdp", "--optimizer", "adamw", "--steps", "1",
                           "--out", str(tmp_path / "x")])
    if _GEFEN_ERR is not None:
        with pytest.raises(train.GefenUnavailable, match="gefen_dist.Gefen"):
            train.main(TINY + ["--optimizer", "both", "--steps", "1", "--out", str(tmp_path / "y")])


def test_both_comparison_with_stub_gefen(tmp_path, monkeypatch, capsys):
    """Exercise the --optimizer both path (table, shared plot) with AdamW standing in for Gefen."""

    class StubGefen(torch.optim.AdamW):
        def state_bytes(self) -> int:
            return sum(p.numel() for g in self.param_groups for p in g["params"])  # 1 B/param

    monkeypatch.setattr(train, "gefen_class", lambda: StubGefen)
    m = train.main(TINY + ["--optimizer", "both", "--steps", "10", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "AdamW" in out and "Gefen" in out and "state bytes" in out
    c = m["comparison"]
    assert c["val_loss_rel_diff_pct"] == 0.0  # same seed, init, data and update rule
    assert c["gefen_bytes_per_param"] == 1.0 and 7.9 < c["state_bytes_ratio"] < 8.1
    assert set(json.loads((tmp_path / "metrics.json").read_text())["runs"]) == {"adamw", "gefen"}
    assert (tmp_path / "loss.png").is_file()


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


@pytest.mark.parametrize("opt,module,bpp", [
    ("adafactor", "torch", (0.0, 0.5)),                  # factored v only
    ("torchao_adamw8bit", "torchao", (1.5, 8.01)),       # tiny model: most tensors < 4096 stay fp32
    ("bnb_adamw8bit", "bitsandbytes", (1.5, 8.01)),
    ("adam_mini", "adam_mini", (4.0, 4.2)),             # fp32 m + one v per block
    ("gefen_reference", "gefen", (0.9, 1.5)),
])
def test_train_with_peer_optimizer(tmp_path, opt, module, bpp):
    """Every peer of launch/peers.py trains under launch/train.py (those installed; the `peers` extra
    pins them), and its state bytes count quantized tensor subclasses by their real storage."""
    if not _has(module):
        pytest.skip(f"{module} is not installed (pip install -e .[peers])")
    m = _run(tmp_path, opt, "--steps", "10", "--no-plot")
    run = m["runs"][opt]
    assert len(run["train_losses"]) == 10 and all(math.isfinite(v) for v in run["train_losses"])
    assert run["evals"][-1]["val_loss"] < run["evals"][0]["val_loss"]
    s = m["summary"][opt]
    assert bpp[0] < s["state_bytes_per_param"] < bpp[1], s["state_bytes_per_param"]
    json.loads((tmp_path / "metrics.json").read_text())  # serialisable (torchao keeps lr as a tensor)


def test_peer_needs_single_or_ddp(tmp_path):
    with pytest.raises(SystemExit, match="runs with --strategy single or ddp"):
        train.main(TINY + ["--strategy", "fsdp", "--optimizer", "adafactor", "--steps", "1",
                           "--out", str(tmp_path)])


@pytest.mark.parametrize("second_moment", ["factored", "nibbles"])
def test_gpu_quality_script_smoke(tmp_path, second_moment):
    """benchmarks/gpu_quality.py (the prepared GPU quality run of issue 26) on CPU with a tiny model:
    both optimizers per seed from the same init and batches, the gaps and curves in its JSON; Gefen with
    the layout asked for."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_quality

    out = tmp_path / "gq.json"
    assert gpu_quality.main(["--smoke", "--seeds", "0", "--out", str(out), "--gefen-second-moment", second_moment]) == 0
    d = json.loads(out.read_text())
    assert d["smoke"] and set(d["gaps_pct"]) == {"0"} and math.isfinite(d["gaps_pct"]["0"])
    runs = {r["optimizer"]: r for r in d["runs"]}
    assert runs["adamw"]["bytes_per_param"] == 8.0 and runs["gefen"]["bytes_per_param"] < 2.0
    assert [s for s, _ in runs["gefen"]["val_curve"]] == [6, 12] and runs["gefen"]["truncated"] is None
    assert d["config"]["gefen_second_moment"] == second_moment
