"""Distributed checkpoints and DDP: real torchrun launches on CPU/gloo (tests/dist/*.py), plus the
single-process parts of gefen_dist.checkpoint and gefen_dist.integrations.fsdp in-process.

Launches (about 8, each a few seconds): dcp_reshard.py save at 2 ranks, then load at 1, 3 and 4
ranks (its model has row blocks, span and rows8 tensors and a tensor with column blocks, D21); ddp_check.py at 2 ranks (with the mismatch checks) and as 2 nodes x 1 rank; batch_check.py
(the multi-tensor CUDA step through the Triton interpreter) at 2 ranks.
"""
import os
import re
import sys

import pytest
import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "dist"))
from _launch import free_port, run_torchrun, start_torchrun, wait_torchrun  # noqa: E402

sys.path.pop(0)

from gefen_dist import checkpoint as gckpt  # noqa: E402
from gefen_dist.integrations.fsdp import build_optimizer, clip_grad_norm_  # noqa: E402

TIMEOUT = 150


def _ok_lines(out):
    return [ln for ln in out.splitlines() if ln.startswith("OK ")]


# ----------------------------------------------------------------------------- DCP (torchrun)
@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("gefen_dcp")
    out = run_torchrun("dcp_reshard.py", 2, "save", d, timeout=TIMEOUT).stdout
    assert "ALL OK save ws=2" in out, out[-4000:]
    return d, out


@pytest.mark.dist
def test_dcp_save_ws2(dcp_dir):
    d, out = dcp_dir
    oks = _ok_lines(out)
    assert any(ln.startswith("OK save fsdp ws=2") for ln in oks), out[-3000:]
    assert any(ln.startswith("OK save ddp ws=2") for ln in oks), out[-3000:]
    assert any(ln.startswith("OK save pre-step") for ln in oks), out[-3000:]
    for name in ("fsdp", "ddp", "prestep"):
        assert os.path.exists(os.path.join(d, name, ".metadata")), name
    for name in ("fsdp_full.pt", "ddp_full.pt", "fsdp_grads.pt", "ddp_grads.pt"):
        assert os.path.exists(os.path.join(d, name)), name


PLAIN = "plain get_state_dict/dcp.load/set_state_dict ws=2 -> fsdp2 ws={}"
EXPECT = {
    1: ["fsdp2 ws=2 -> fsdp2 ws=1", "fsdp2 ws=2 -> ddp ws=1"],
    3: ["fsdp2 ws=2 -> fsdp2 ws=3", "ddp ws=2 -> fsdp2 ws=3", "full state dict (rank 0, broadcast) -> fsdp2 ws=3",
        "pre-step checkpoint -> fsdp2 ws=3", "shard_model mp_policy=bf16 ws=3"],
    4: ["fsdp2 ws=2 -> fsdp2 ws=4", "fsdp2 ws=2 -> hsdp 2x2", "clip_grad_norm_ hsdp 2x2"],
}


@pytest.mark.dist
@pytest.mark.parametrize("ws", [1, 3, 4])
def test_dcp_load_resharded(dcp_dir, ws):
    d, _ = dcp_dir
    out = run_torchrun("dcp_reshard.py", ws, "load", d, timeout=TIMEOUT).stdout
    oks = _ok_lines(out)
    for what in EXPECT[ws] + [PLAIN.format(ws)]:
        assert any(ln.startswith(f"OK {what}") for ln in oks), f"missing 'OK {what}':\n{out[-4000:]}"
    for ln in oks:
        m = re.search(r"max rel ([0-9.e+-]+)", ln)
        if m:
            assert float(m.group(1)) <= 1e-6, ln
    assert f"ALL OK load ws={ws}" in out


# ----------------------------------------------------------------------------- CUDA batch, 2 ranks
@pytest.mark.dist
def test_cuda_batch_with_two_ranks_through_the_interpreter():
    """tests/dist/batch_check.py: the multi-tensor CUDA step on replicated tensors at 2 ranks (CPU
    tensors through the Triton interpreter) is bitwise the per-tensor path on every rank, with a span
    tensor beside it; a non-contiguous quantized parameter sends the whole step to the per-tensor
    path (one WARNING), since the ranks' collectives must match; a NaN on rank 1 only makes every
    rank raise with nothing changed; with capturable=True a NaN on rank 1 only is skipped on every rank
    on the device; ZeroGefen on the Triton path (cut ranges, its owners' state-only
    updates and appliers) is bitwise a one-rank Gefen on that path, and with second_moment="nibbles" or
    col_blocks="auto" its batch is bitwise its per-tensor path."""
    pytest.importorskip("triton", reason="triton is not installed")
    out = run_torchrun("batch_check.py", 2, timeout=TIMEOUT).stdout
    ok = _ok_lines(out)
    for case in ("plain", "nan", "span", "noncontig", "capturable", "zero", "zeronib", "zerocb"):
        for rank in (0, 1):
            assert any(ln.startswith(f"OK {case} rank {rank}:") for ln in ok), f"{case} rank {rank}:\n{out[-4000:]}"
    assert "ALL OK batch_check ws=2" in out


# ----------------------------------------------------------------------------- DDP (torchrun)
def _digest(out):
    m = re.search(r"^DIGEST ([0-9a-f]{64})$", out, re.M)
    assert m, f"no DIGEST line:\n{out[-4000:]}"
    return m.group(1)


@pytest.fixture(scope="module")
def ddp_single():
    return run_torchrun("ddp_check.py", 2, "--mismatch", "--adamw-import", "--nibbles", "--col-blocks",
                        timeout=TIMEOUT).stdout


@pytest.mark.dist
def test_ddp_replicas_identical_and_mismatch_errors(ddp_single):
    out = ddp_single
    assert any(ln.startswith("OK ddp ws=2: 5 steps, replicas bitwise identical") for ln in _ok_lines(out)), out[-4000:]
    for case in ("extra parameter", "different shape"):
        for rank in (0, 1):
            assert f"OK mismatch ({case}) rank {rank}: RuntimeError" in out, f"{case} rank {rank}:\n{out[-4000:]}"
    assert any(ln.startswith("OK adamw import ws=2:") for ln in _ok_lines(out)), out[-4000:]
    assert any(ln.startswith("OK nibbles ddp ws=2:") for ln in _ok_lines(out)), out[-4000:]
    assert any(ln.startswith("OK col_blocks ddp ws=2:") for ln in _ok_lines(out)), out[-4000:]
    assert "ALL OK ddp_check ws=2" in out
    _digest(out)


@pytest.mark.dist
def test_ddp_two_nodes_match_one_node(ddp_single):
    port = free_port()
    procs = [start_torchrun("ddp_check.py", 1, nnodes=2, node_rank=k, master_port=port) for k in (0, 1)]
    res = [wait_torchrun(p, TIMEOUT, f"ddp_check.py node {k}") for k, p in enumerate(procs)]
    out0 = res[0].stdout
    assert "ALL OK ddp_check ws=2" in out0, out0[-4000:]
    assert _digest(out0) == _digest(ddp_single), "2 nodes x 1 rank differs from 1 node x 2 ranks"


# ----------------------------------------------------------------------------- in-process
class _Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.state = nn.Linear(96, 64)  # a module literally named "state": FQN lookup must not be fooled
        self.w = nn.Linear(64, 80, bias=False)

    def forward(self, x):
        return self.w(torch.relu(self.state(x)))


def _train(m, opt, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 96, generator=g)
        opt.zero_grad()
        m(x).pow(2).mean().backward()
        clip_grad_norm_(m, 1.0)
        opt.step()


def test_single_process_save_load_roundtrip(tmp_path):
    torch.manual_seed(0)
    m = _Small()
    opt = build_optimizer(m, lr=1e-3, weight_decay=0.1)
    assert [len(g["params"]) for g in opt.param_groups] == [2, 1]  # decay on >=2-D only
    assert opt.param_groups[1]["weight_decay"] == 0.0
    _train(m, opt, 3)
    gckpt.save(m, opt, str(tmp_path / "ck"), extra={"step": 3})
    periods = gckpt.saved_periods(m, opt, str(tmp_path / "ck"))
    assert periods == {"state.weight": opt.state[m.state.weight]["period"], "w.weight": opt.state[m.w.weight]["period"]}

    torch.manual_seed(1)
    m2 = _Small()
    opt2 = build_optimizer(m2, lr=1e-3, weight_decay=0.1)
    extra = gckpt.load(m2, opt2, str(tmp_path / "ck"))
    assert extra == {"step": 3}
    for p, q in zip(m.parameters(), m2.parameters()):
        assert torch.equal(p, q)
        for k, v in opt.state[p].items():
            w = opt2.state[q][k]
            if isinstance(v, torch.Tensor):
                assert w.dtype == v.dtype and torch.equal(w, v), k
            else:
                assert w == v, k
    cb = opt2.codebook
    assert all(st["codebook"] is cb for st in opt2.state.values() if "codebook" in st)
    _train(m, opt, 1, seed=5)
    _train(m2, opt2, 1, seed=5)
    for p, q in zip(m.parameters(), m2.parameters()):
        assert torch.equal(p, q)


def test_single_process_full_state_dict(tmp_path):
    torch.manual_seed(0)
    m = _Small()
    opt = build_optimizer(m, lr=1e-3)
    _train(m, opt, 2)
    sd = gckpt.full_state_dict(m, opt)
    assert sd["optim"]["state"]["w.weight"]["idx"].dtype == torch.uint8
    torch.save(sd, tmp_path / "full.pt")
    torch.manual_seed(1)
    m2 = _Small()
    opt2 = build_optimizer(m2, lr=1e-3)
    gckpt.load_full_state_dict(m2, opt2, torch.load(tmp_path / "full.pt", weights_only=False))
    st, st2 = opt.state[m.w.weight], opt2.state[m2.w.weight]
    assert st2["idx"].dtype == torch.uint8 and torch.equal(st["idx"], st2["idx"]) and all(
        torch.equal(st[k], st2[k]) for k in ("scale", "v", "v_row", "v_col") if k in st)
    assert opt2.codebook is not None and torch.equal(opt2.codebook, opt.codebook)


def test_prepare_for_load_replaces_mismatched_state(tmp_path):
    torch.manual_seed(0)
    m = _Small()
    opt = build_optimizer(m, lr=1e-3)
    _train(m, opt, 2)
    gckpt.save(m, opt, str(tmp_path / "ck"))
    per = opt.state[m.w.weight]["period"]
    # an optimizer whose state has another period (placeholder: the row) gets it re-allocated
    m2 = _Small()
    opt2 = build_optimizer(m2, lr=1e-3)
    opt2.init_state()
    got = gckpt.prepare_for_load(m2, opt2, str(tmp_path / "ck"))
    assert got["w.weight"] == per and opt2.state[m2.w.weight]["period"] == per
    assert opt2.state[m2.w.weight]["scale"].shape == opt.state[m.w.weight]["scale"].shape


def test_save_before_first_step_keeps_placeholders(tmp_path):
    torch.manual_seed(0)
    m = _Small()
    opt = build_optimizer(m, lr=1e-3)
    gckpt.save(m, opt, str(tmp_path / "ck"))  # no DCP zero-grad step: state allocated with step 0
    assert all(st["step"] == 0 for st in opt.state.values())
    assert opt.codebook is None and opt.state[m.w.weight]["learned"] == 0
    m2 = _Small()
    opt2 = build_optimizer(m2, lr=1e-3)
    gckpt.load(m2, opt2, str(tmp_path / "ck"))
    assert opt2.codebook is None and opt2.state[m2.w.weight]["learned"] == 0
    _train(m2, opt2, 1)
    assert torch.unique(opt2.codebook).numel() == 256 and opt2.state[m2.w.weight]["learned"] == 1


def test_find_key_prefers_exact_prefix():
    keys = ["optim.state.state.w.v", "optim.state.w.v", "other.state.w.v"]
    assert gckpt._find_key(keys, "w", "v", "optim") == "optim.state.w.v"
    assert gckpt._find_key(keys, "state.w", "v", "optim") == "optim.state.state.w.v"
    assert gckpt._find_key(["state.w.v"], "w", "v", "optim") == "state.w.v"
    assert gckpt._find_key(["x.state.w.v"], "w", "v", "optim") == "x.state.w.v"
    with pytest.raises(ValueError, match="several"):
        gckpt._find_key(["x.state.w.v", "y.state.w.v"], "w", "v", "optim")


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_plain_matches_torch(norm_type):
    torch.manual_seed(0)
    a, b = _Small(), _Small()
    b.load_state_dict(a.state_dict())
    x = torch.randn(8, 96)
    a(x).pow(2).sum().backward()
    b(x).pow(2).sum().backward()
    na = clip_grad_norm_(a, 0.3, norm_type=norm_type)
    nb = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.3, norm_type=norm_type)
    assert abs(float(na) - float(nb)) <= 1e-5 * float(nb)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-8)


def test_shard_model_block_detection():
    from gefen_dist.integrations.fsdp import _blocks

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(4, 4)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Block(), Block()])
            self.head = nn.Linear(4, 2)

    m = M()
    assert _blocks(m, None) == [m.layers[1], m.layers[0]]  # ModuleList children, children first
    got = _blocks(m, [Block, nn.Linear])
    # every Linear comes before the Block that contains it (fully_shard children before parents)
    assert got.index(m.layers[0].inner) < got.index(m.layers[0]) and m.head in got and len(got) == 5
