"""A true drop-in: the failures a user of Gefen in place of AdamW must see clearly.

* A DCP checkpoint (or a consolidated ``full_state_dict``) saved with other Gefen options
  (``second_moment``, ``small_threshold``, ``row_blocks``) or for another model:
  ``gefen_dist.checkpoint.load``/``prepare_for_load``/``check_compatible``/``load_full_state_dict`` raise :class:`CheckpointMismatchError` (a ``ValueError``) naming the key,
  the option and the fix, before anything changes (plain ``dcp.load`` raises DCP's
  ``CheckpointException``, a ``BaseException``).
* A non-finite gradient on one rank of plain replicas: every rank raises the same error / skips
  the same step (tests/dist/replica_faults.py, 2 ranks, gloo).
* ``gefen_dist.Gefen`` handed DeepSpeed ZeRO flat partitions refuses to train them as AdamW (a
  stand-in wrapper here; the real engine in tests/dist/ds_check.py, case ``plainclient``).
* One INFO line at the first completed step says what Gefen steps and on which backend.
"""
import logging
import os
import sys
import types
import warnings

import pytest
import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "dist"))
from _launch import run_torchrun  # noqa: E402

sys.path.pop(0)

from gefen_dist import Gefen  # noqa: E402
from gefen_dist import checkpoint as gckpt  # noqa: E402
from gefen_dist.engine.flat_layout import LayoutError  # noqa: E402


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(96, 64)   # 6144: quantized
        self.b = nn.Linear(64, 128)  # 8192, 128 = 2 x 64 rows: two row blocks (factored, "auto")

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _trained(tmp_path, **kw):
    torch.manual_seed(0)
    m = _Net()
    opt = Gefen(m.named_parameters(), lr=1e-3, **kw)
    for _ in range(2):
        m(torch.randn(4, 96)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    path = str(tmp_path / "ck")
    gckpt.save(m, opt, path)
    return path


def _fresh(**kw):
    torch.manual_seed(1)
    m = _Net()
    return m, Gefen(m.named_parameters(), lr=1e-3, **kw)


MISMATCHES = [
    (dict(second_moment="shared"), dict(second_moment="factored"), "optim.state.a.weight.v",
     ["a shared second moment", "second_moment='factored'", "second_moment='shared'"]),
    (dict(second_moment="factored"), dict(second_moment="shared"), "optim.state.a.weight.v_row",
     ["a factored second moment", "second_moment='factored', the setting"]),
    (dict(), dict(small_threshold=7000), "optim.state.a.weight.v_row",
     ["quantized Gefen state", "small_threshold=7000", "small_threshold <= 6144"]),
    (dict(small_threshold=7000), dict(), "optim.state.a.weight.exp_avg",
     ["exact AdamW state", "small_threshold=4096", "small_threshold > 6144"]),
    (dict(), dict(row_blocks=1), "optim.state.b.weight.v_col",
     ["2 column profile(s)", "row_blocks=2"]),
]
MISMATCH_IDS = ["shared->factored", "factored->shared", "threshold-up", "threshold-down", "row_blocks"]


@pytest.mark.parametrize("saved,loading,key,words", MISMATCHES, ids=MISMATCH_IDS)
def test_dcp_option_mismatch_is_a_clear_error(tmp_path, saved, loading, key, words):
    path = _trained(tmp_path, **saved)
    for how in ("load", "prepare_for_load", "check_compatible"):
        m, opt = _fresh(**loading)
        before = [p.detach().clone() for p in m.parameters()]
        with pytest.raises(gckpt.CheckpointMismatchError) as ei:
            getattr(gckpt, how)(m, opt, path)
        msg = str(ei.value)
        assert isinstance(ei.value, ValueError)
        assert repr(key) in msg and all(w in msg for w in words), (how, msg)
        assert "Nothing was loaded" in msg and path in msg
        assert not opt.state, f"{how} changed the optimizer state"
        assert all(torch.equal(p, q) for p, q in zip(m.parameters(), before)), f"{how} changed the model"
    m, opt = _fresh(**saved)
    gckpt.load(m, opt, path)  # the options it was saved with load
    assert opt.state


@pytest.mark.parametrize("saved,loading,key,words", MISMATCHES, ids=MISMATCH_IDS)
def test_full_state_dict_option_mismatch_is_a_clear_error(tmp_path, saved, loading, key, words):
    path = _trained(tmp_path, **saved)
    m, opt = _fresh(**saved)
    gckpt.load(m, opt, path)
    full = gckpt.full_state_dict(m, opt)
    m, opt = _fresh(**loading)
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(gckpt.CheckpointMismatchError) as ei:
        gckpt.load_full_state_dict(m, opt, full)
    msg = str(ei.value)
    assert repr(key) in msg and all(w in msg for w in words) and "(full state dict). Nothing was loaded." in msg, msg
    assert not opt.state and all(torch.equal(p, q) for p, q in zip(m.parameters(), before))
    m, opt = _fresh(**saved)
    gckpt.load_full_state_dict(m, opt, full)  # the options it was saved with load
    assert opt.state


def test_plain_dcp_flow_gets_the_clear_error_from_check_compatible(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = _trained(tmp_path, second_moment="shared")
    m, opt = _fresh()
    with pytest.raises(gckpt.CheckpointMismatchError, match=r"'optim\.state\.a\.weight\.v'.*second_moment='shared'"):
        gckpt.check_compatible(m, opt, path)
    # what check_compatible spares the user: DCP's BaseException, which `except Exception` misses
    msd, osd = get_state_dict(m, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointException) as ei:
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    assert not isinstance(ei.value, Exception)


def test_other_dcp_failures_in_load_are_a_gefen_error(tmp_path):
    path = _trained(tmp_path)
    m, opt = _fresh()
    m.extra = nn.Parameter(torch.zeros(3), requires_grad=False)  # a model key the checkpoint lacks
    with pytest.raises(gckpt.CheckpointMismatchError, match=r"failed on rank\(s\) \[0\].*extra"):
        gckpt.load(m, opt, path)


def test_missing_parameter_state_is_named(tmp_path):
    path = _trained(tmp_path)
    torch.manual_seed(1)
    m = _Net()
    m.c = nn.Linear(8, 8)
    opt = Gefen(m.named_parameters(), lr=1e-3)
    with pytest.raises(gckpt.CheckpointMismatchError, match=r"no optimizer state for parameter 'c\.weight'"):
        gckpt.check_compatible(m, opt, path)
    with pytest.raises(gckpt.CheckpointMismatchError, match=r"no optimizer state under 'opt'"):
        gckpt.check_compatible(_Net(), Gefen(_Net().parameters()), path, key_prefix="opt")


# ----------------------------------------------------------------------------- replicas (torchrun)
@pytest.mark.dist
def test_nonfinite_on_one_replica_is_decided_on_every_rank():
    out = run_torchrun("replica_faults.py", 2, timeout=150).stdout
    for what in ("raise at the first step (before learning)", "raise after learning", "ZeroGefen raise", "skip",
                 "checkpoint mismatch", "announce replicas", "announce ZeroGefen", "announce FSDP2"):
        assert f"OK {what}:" in out, f"missing 'OK {what}':\n{out[-4000:]}"
    assert "ALL OK replica_faults ws=2" in out


# ----------------------------------------------------------------------------- DeepSpeed flat partitions
class _FakeZeroWrapper:
    """What DeepSpeed's ZeRO-1/2 wrapper does to a client optimizer: one flat fp32 partition per
    param group, put in place of the group's parameters."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.single_partition_of_fp32_groups = []
        for g in optimizer.param_groups:
            flat = torch.cat([p.detach().reshape(-1) for p in g["params"]]).float().requires_grad_()
            flat.grad = torch.randn_like(flat)
            self.single_partition_of_fp32_groups.append(flat)
            g["params"] = [flat]


def test_plain_gefen_refuses_deepspeed_flat_partitions(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))
    m = _Net()
    opt = Gefen(m.parameters(), lr=1e-3)
    wrapper = _FakeZeroWrapper(opt)
    flat = wrapper.single_partition_of_fp32_groups[0]
    before = flat.detach().clone()
    with pytest.raises(LayoutError) as ei:
        opt.step()
    msg = str(ei.value)
    assert "_FakeZeroWrapper" in msg and "8 B/param" in msg and "gefen_dist.integrations.deepspeed.Gefen" in msg
    assert "initialize" in msg and f"{flat.numel():,} elements" in msg
    assert not opt.state and torch.equal(flat, before), "the refusal changed something"


def test_swapped_parameters_without_deepspeed_are_accepted(monkeypatch):
    """Accelerate's prepare (FSDP2) puts other tensors in the param groups: not refused."""
    monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))
    m = _Net()
    opt = Gefen(m.parameters(), lr=1e-3)
    m2 = _Net()
    opt.param_groups[0]["params"] = list(m2.parameters())
    m2(torch.randn(4, 96)).square().mean().backward()
    opt.step()
    assert len(opt.state) == 4


def test_copies_rebuild_their_own_parameter_set(monkeypatch):
    """deepcopy/pickle drop the ids of the original's parameters; add_param_group and step still work."""
    import copy
    import pickle

    monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))
    m = _Net()
    opt = Gefen(m.a.parameters(), lr=1e-3)
    for o, mm in (copy.deepcopy((opt, m)), pickle.loads(pickle.dumps((opt, m)))):
        o.add_param_group({"params": list(mm.b.parameters())})
        mm(torch.randn(4, 96)).square().mean().backward()
        o.step()
        assert len(o.state) == 4


# ----------------------------------------------------------------------------- what steps
def test_first_step_logs_what_steps_once(caplog, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    torch.manual_seed(0)
    m = _Net()
    opt = Gefen(m.named_parameters(), lr=1e-3, second_moment="shared")
    with caplog.at_level(logging.INFO, logger="gefen_dist.optim.gefen"):
        for _ in range(3):
            m(torch.randn(4, 96)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    lines = [r.getMessage() for r in caplog.records if "is stepping" in r.getMessage()]
    assert len(lines) == 1, lines
    n = sum(p.numel() for p in m.parameters())
    assert lines[0].startswith(f"Gefen is stepping 4 tensors (2 quantized: shared 2; 2 exact), {n:,} parameters at ")
    assert "B/param of state; backend: single process; kernel: " in lines[0] and "\n" not in lines[0]
    assert str(opt.report()).splitlines()[-1] == "stepped by gefen_dist, backend: single process"


def test_torchrun_without_process_group_is_named(caplog, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    m = _Net()
    opt = Gefen(m.parameters(), lr=1e-3)
    with caplog.at_level(logging.INFO, logger="gefen_dist.optim.gefen"):
        m(torch.randn(4, 96)).square().mean().backward()
        opt.step()
    line = next(r.getMessage() for r in caplog.records if "is stepping" in r.getMessage())
    assert "single process, although WORLD_SIZE=2: torch.distributed is not initialised" in line
    assert "use_cpu=True" in line


def test_skipped_first_step_is_not_announced(caplog):
    m = _Net()
    opt = Gefen(m.parameters(), lr=1e-3, nonfinite="skip")
    with caplog.at_level(logging.INFO, logger="gefen_dist.optim.gefen"):
        m(torch.randn(4, 96)).square().mean().backward()
        m.a.weight.grad[0, 0] = float("inf")
        opt.step()
        assert not [r for r in caplog.records if "is stepping" in r.getMessage()]
        opt.zero_grad()
        m(torch.randn(4, 96)).square().mean().backward()
        opt.step()
    assert len([r for r in caplog.records if "is stepping" in r.getMessage()]) == 1
