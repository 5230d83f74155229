"""``gefen-dist plan`` / ``gefen-dist inspect`` (gefen_dist/plan.py, gefen_dist/cli.py)."""
import json
import math
import os
import pickle
import subprocess
import sys

import pytest
import torch
from torch import nn

from gefen_dist import Gefen, ZeroGefen
from gefen_dist import checkpoint as gckpt
from gefen_dist import plan as P
from gefen_dist.cli import CheckpointError, inspect_checkpoint, main, render_inspect

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLS = torch.linspace(0.2, 3.0, 256)


class Net(nn.Module):
    """Matrices whose learned period is their row (column-scaled inputs), a row > 1024 (capped
    estimate), 1-D and small tensors (exact)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(256, 128)       # (128, 256): P = 256
        self.wide = nn.Linear(128, 1536)     # (1536, 128): P = 128
        self.long = nn.Linear(1536, 8)       # (8, 1536): row 1536 > 1024, smallest divisor > 1024 = 1536
        self.small = nn.Linear(8, 4)         # 32 elements: exact
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.small(self.norm(self.long(torch.tanh(self.wide(torch.tanh(self.emb(x)))))))


def net():  # a factory for --model
    return Net()


def _stepped(cls=Gefen, steps=1):
    torch.manual_seed(0)
    m = Net()
    opt = cls(m.named_parameters(), lr=1e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(64, 256, generator=g) * COLS
        opt.zero_grad()
        m(x).pow(2).mean().backward()
        opt.step()
    return m, opt


# ----------------------------------------------------------------------------- plan
def test_estimate_equals_measured_state_bytes_where_periods_are_rows():
    m, opt = _stepped()
    rep = {r["name"]: r for r in opt.report()}
    est = P.estimate_from_shapes([P.TensorSpec(n, tuple(p.shape)) for n, p in m.named_parameters()])
    matched, extra = 0, 0
    for t in est.tensors:
        r = rep[t["name"]]
        assert r["kind"] == t["kind"], t["name"]
        if r["period"] == t["period"]:
            assert r["scale_block"] == t["scale_block"]
            assert r["state_bytes"] == t["gefen_bytes"], t["name"]
            matched += 1
        else:  # a learned period is a divisor of the row, so smaller: more bytes than estimated
            assert t["period"] % r["period"] == 0 and r["state_bytes"] > t["gefen_bytes"]
            extra += r["state_bytes"] - t["gefen_bytes"]
    assert matched >= len(est.tensors) - 1  # emb.weight learns 128 < its row of 256 on this data
    assert rep["long.weight"]["period"] == 1536 and rep["wide.weight"]["period"] == 128
    assert est.gefen_state_bytes + extra == opt.state_bytes()  # codebook counted once on both sides
    adamw = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 256)).sum().backward()
    adamw.step()
    measured = sum(v.numel() * v.element_size() for st in adamw.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor))
    assert est.adamw_state_bytes == measured


def test_estimated_period_cap_rule(capsys):
    assert P.estimated_period((10, 768)) == 768
    assert P.estimated_period((768, 3072)) == 1536
    assert P.estimated_period((4, 1024)) == 1024
    assert P.estimated_period((4, 1031)) == 1031  # prime row: itself
    assert P.estimated_period((4, 2304)) == 1152
    assert P.estimated_period((8, 3, 3, 64)) == 576  # conv: the row is prod(shape[1:])
    assert P.tensor_state((4096,))["kind"] == "exact"
    assert P.tensor_state((63, 65))["kind"] == "exact"  # 4095 < 4096
    st = P.tensor_state((64, 64), second_moment="shared")
    assert st["kind"] == "quantized" and st["gefen_bytes"] == 4096 + 4 * 64 + 4 * 64
    st = P.tensor_state((64, 64))  # factored (default): scale per row-period, v_row, v_col
    assert st["kind"] == "quantized" and st["gefen_bytes"] == 4096 + 4 * 64 + 4 * 64 + 4 * 64
    # column blocks (D21): K v_row entries per row, scale blocks inside the blocks; the estimate is the optimizer's
    assert P.tensor_state((256, 768))["period"] == 768
    st = P.tensor_state((256, 768), col_blocks="auto")  # k = 3 blocks of 256 columns
    assert st["period"] == 256 and st["gefen_bytes"] == 256 * 768 + 4 * 256 * 3 + 4 * 256 * 3 + 4 * 768
    ps = [torch.nn.Parameter(torch.randn(s)) for s in ((256, 768), (96, 96), (64, 512))]
    opt = Gefen(ps, col_blocks="auto")
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    est = P.estimate_from_shapes([P.TensorSpec(f"p{i}", tuple(p.shape)) for i, p in enumerate(ps)], col_blocks="auto")
    assert est.gefen_state_bytes == opt.state_bytes()
    from gefen_dist.cli import main as cli_main

    assert cli_main(["plan", "--params", "1e9", "--col-blocks", "x"]) == 2
    assert "--col-blocks 'x': give 'auto' or a positive int" in capsys.readouterr().err


def test_gpt2_small_shapes_reproduce_measured_bytes_and_paper_figure():
    sys.path.insert(0, ROOT)
    from launch.gpt import GPT, get_config

    with open(os.path.join(ROOT, "docs", "results", "memory.json")) as f:
        mem = json.load(f)
    with torch.device("meta"):
        model = GPT(get_config("gpt2", vocab_size=50257))
    est = P.estimate_from_shapes([P.TensorSpec(n, tuple(p.shape)) for n, p in model.named_parameters()])
    assert est.n_params == mem["params"]
    assert est.gefen_state_bytes == mem["gefen_state_bytes"]
    assert est.adamw_state_bytes == mem["adamw_state_bytes"]
    per = {r["name"]: r["period"] for r in mem["per_tensor"]}
    assert all(per[t["name"]] == t["period"] for t in est.tensors)
    assert P.GPT2_SMALL_GEFEN_BYTES_PER_PARAM == pytest.approx(mem["gefen_bytes_per_param"], abs=1e-15)
    assert round(est.gefen_bytes_per_param, 4) == 1.0194  # factored default with row blocks, D12 (shared: 1.0161)
    saved = (8 - est.gefen_bytes_per_param) * 1e9 / 2**30
    assert saved == pytest.approx(6.5, abs=0.01)
    p = P.plan(est, "ddp", 1)
    assert p["state"]["saved_gib_per_billion_params"] == pytest.approx(saved)


def test_per_rank_strategies():
    est = P.estimate_from_param_count(1e9)
    n, N = 10**9, 8
    g = est.gefen_state_bytes
    assert g == math.ceil(n * P.GPT2_SMALL_GEFEN_BYTES_PER_PARAM)
    r = P.per_rank(est, "ddp", N, "fp32")
    assert r["adamw"] == dict(parameters=4 * n, gradients=4 * n, master=0, state=8 * n, device=16 * n, host=0)
    assert r["gefen"]["state"] == g
    r = P.per_rank(est, "zero1", N, "bf16-mixed")
    assert r["adamw"]["parameters"] == 2 * n and r["adamw"]["gradients"] == 2 * n
    assert r["adamw"]["master"] == 4 * n // N and r["adamw"]["state"] == 8 * n // N
    r = P.per_rank(est, "zero2", N, "bf16-mixed")
    assert r["adamw"]["device"] == 2 * n + (2 + 4 + 8) * n // N  # docs/deepspeed.md: 2 + 14/N
    r = P.per_rank(est, "zero3", N, "bf16-mixed")
    assert r["adamw"]["device"] == 16 * n // N
    assert r["gefen"]["state"] == math.ceil((g - 1024) / N) + 1024  # codebook replicated
    r = P.per_rank(est, "fsdp2", N, "bf16-mixed")
    assert r["adamw"] == dict(parameters=4 * n // N, gradients=4 * n // N, master=0, state=8 * n // N,
                              device=16 * n // N, host=0)
    r = P.per_rank(est, "offload", N, "bf16-mixed")
    assert r["adamw"]["device"] == 2 * n + 2 * n // N and r["adamw"]["host"] == 12 * n // N
    with pytest.raises(ValueError, match="unknown strategy"):
        P.per_rank(est, "tp", 2)
    assert P.max_micro_batch(80 * 2**30, 16 * 2**30, 2**30) == 64
    assert P.max_micro_batch(10, 20, 1) == 0
    assert P.parse_bytes("80GiB") == 80 * 2**30 and P.parse_bytes("40 GB") == 40 * 10**9
    assert P.parse_bytes("1.5e9") == 1_500_000_000
    with pytest.raises(ValueError, match="cannot parse"):
        P.parse_bytes("80 parsecs")


def test_hf_config_shapes_match_transformers():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    cfgs = [
        transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=300, n_positions=32),
        transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=16, n_inner=48,
                                tie_word_embeddings=False),
        transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=300),
        transformers.LlamaConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                 head_dim=32, vocab_size=300, tie_word_embeddings=True, attention_bias=True),
        transformers.Qwen2Config(num_hidden_layers=1, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=300),
    ]
    for cfg in cfgs:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        want = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        got = [(s.name, s.shape) for s in P.shapes_from_hf_config(json.loads(cfg.to_json_string()))]
        assert sorted(got) == sorted(want), cfg.model_type


def _run(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_plan_cli(tmp_path, capsys):
    rc, out, _ = _run(capsys, "plan", "--params", "1.3e9", "--strategy", "zero3", "--world-size", "8",
                      "--precision", "bf16-mixed", "--device-memory", "80GiB", "--activation-bytes-per-sample", "2GiB")
    assert rc == 0
    assert "largest micro-batch" in out and "master weights" in out and "6.50 GiB saved per billion" in out
    cfg = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc, out, _ = _run(capsys, "plan", "--config", str(tmp_path / "config.json"), "--strategy", "fsdp2",
                      "--world-size", "4", "--json", "--per-tensor")
    assert rc == 0
    p = json.loads(out)
    assert p["params"] == 124439808 and p["tensors"] == 148
    assert p["period_source"] == "shapes"
    # HF Conv1D weights are (in, out): c_attn (768, 2304) gets 1152, mlp.c_proj (3072, 768) gets 768
    per = {t["name"]: t["period"] for t in p["per_tensor"]}
    assert per["transformer.h.0.attn.c_attn.weight"] == 1152 and per["transformer.h.0.mlp.c_proj.weight"] == 768
    rc, out, _ = _run(capsys, "plan", "--model", "test_cli:net", "--strategy", "ddp")
    assert rc == 0 and "ESTIMATED FROM SHAPES" in out
    rc, out, _ = _run(capsys, "plan", "--model", "torch.nn:Linear", "--model-kwargs",
                      '{"in_features": 1024, "out_features": 4096}', "--json")
    assert json.loads(out)["params"] == 1024 * 4096 + 4096
    rc, _, err = _run(capsys, "plan", "--config", str(tmp_path / "missing.json"))
    assert rc == 2 and "cannot read config.json" in err
    (tmp_path / "bert.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    rc, _, err = _run(capsys, "plan", "--config", str(tmp_path / "bert.json"))
    assert rc == 2 and "not understood" in err
    rc, _, err = _run(capsys, "plan", "--model", "no_such_module_xyz:f")
    assert rc == 2 and "cannot import" in err


# ----------------------------------------------------------------------------- inspect
def test_inspect_torch_save_gefen_zero_and_wrapped(tmp_path, capsys):
    m, opt = _stepped(steps=2)
    path = tmp_path / "opt.pt"
    torch.save(opt.state_dict(), path)
    r = inspect_checkpoint(str(path))
    rep = {x["name"]: x for x in opt.report()}
    assert r["state_bytes"] == opt.state_bytes()
    for t in r["tensors"]:
        assert (t["kind"], t["period"], t["bytes"]) == (rep[t["name"]]["kind"], rep[t["name"]]["period"],
                                                       rep[t["name"]]["state_bytes"])
        if t["kind"] == "quantized":
            assert t["idx_dtype"] == "uint8" and t["step"] == 2
    cb = r["codebook"]
    assert cb["learned"] and cb["min"] == -1.0 and cb["max"] == 1.0 and cb["distinct"] == 256 and cb["sorted"]
    assert r["world_size"] is None
    # ZeroGefen (1 process): consolidated dict, same layout and numbers
    _, zopt = _stepped(ZeroGefen, steps=2)
    torch.save({"model": m.state_dict(), "optim": zopt.state_dict()}, tmp_path / "zero.pt")
    rz = inspect_checkpoint(str(tmp_path / "zero.pt"))
    assert [(t["name"], t["period"], t["bytes"]) for t in rz["tensors"]] == \
           [(t["name"], t["period"], t["bytes"]) for t in r["tensors"]]
    rc, out, _ = _run(capsys, "inspect", str(path))
    assert rc == 0 and "codebook: 256 entries, 256 distinct" in out and "long.weight" in out
    rc, out, _ = _run(capsys, "inspect", str(path), "--json")
    assert json.loads(out)["state_bytes"] == opt.state_bytes()
    # before any step: placeholder codebook
    torch.save(Gefen(Net().parameters()).state_dict(), tmp_path / "fresh.pt")
    assert "no Gefen" not in render_inspect(inspect_checkpoint(str(tmp_path / "fresh.pt")))


def test_inspect_dcp_directory(tmp_path):
    m, opt = _stepped()
    gckpt.save(m, opt, str(tmp_path / "dcp"))
    r = inspect_checkpoint(str(tmp_path / "dcp"))
    assert r["format"].startswith("torch.distributed.checkpoint") and r["world_size"] == 1
    rep = {x["name"]: x for x in opt.report()}
    for t in r["tensors"]:
        assert (t["kind"], t["period"], t["scale_block"], t["bytes"]) == (
            rep[t["name"]]["kind"], rep[t["name"]]["period"], rep[t["name"]]["scale_block"],
            rep[t["name"]]["state_bytes"])
    assert r["state_bytes"] == opt.state_bytes()
    assert r["codebook"]["present"] and r["codebook"]["size"] == 256


def test_inspect_errors(tmp_path, capsys):
    m = Net()
    adamw = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 256)).sum().backward()
    adamw.step()
    torch.save(adamw.state_dict(), tmp_path / "adamw.pt")
    with pytest.raises(CheckpointError, match="not Gefen's .looks like torch.optim.Adam/AdamW"):
        inspect_checkpoint(str(tmp_path / "adamw.pt"))
    torch.save({"weights": torch.zeros(3)}, tmp_path / "model.pt")
    with pytest.raises(CheckpointError, match="holds no optimizer state dict"):
        inspect_checkpoint(str(tmp_path / "model.pt"))
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot read"):
        inspect_checkpoint(str(tmp_path / "junk.pt"))
    with open(tmp_path / "evil.pt", "wb") as f:  # arbitrary objects are never unpickled
        pickle.dump({"state": {}, "param_groups": [], "x": Net}, f)
    with pytest.raises(CheckpointError, match="weights_only"):
        inspect_checkpoint(str(tmp_path / "evil.pt"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="neither a torch.distributed.checkpoint"):
        inspect_checkpoint(str(tmp_path / "empty"))
    import torch.distributed.checkpoint as dcp

    dcp.save({"optim": {"state": {"w": {"exp_avg": torch.zeros(4)}}}}, checkpoint_id=str(tmp_path / "adcp"))
    with pytest.raises(CheckpointError, match="without Gefen optimizer state .Adam"):
        inspect_checkpoint(str(tmp_path / "adcp"))
    rc, _, err = _run(capsys, "inspect", str(tmp_path / "missing"))
    assert rc == 2 and "does not exist" in err


_DS_SCRIPT = r"""
import json, os, sys, torch
sys.path.insert(0, {root!r})
import deepspeed
import gefen_dist.integrations.deepspeed  # noqa: F401
from torch import nn
cfg = json.load(open(os.path.join({root!r}, "integrations", "deepspeed", "gefen_zero2.json")))
cfg["train_micro_batch_size_per_gpu"] = 4
cfg.pop("train_batch_size", None)
cfg["optimizer"]["params"]["narrow_rows"] = "span"  # 2.weight (131 rows of 67): blocks of rows (D16)
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(95, 67), nn.Tanh(), nn.Linear(67, 131), nn.Tanh(), nn.Linear(131, 8))
engine, *_ = deepspeed.initialize(model=m, model_parameters=m.parameters(), config=cfg)
for s in range(2):
    x = torch.randn(4, 95) * torch.linspace(0.2, 3, 95)
    engine.backward(engine(x).pow(2).mean()); engine.step()
engine.save_checkpoint(sys.argv[1], tag="t2")
"""


@pytest.mark.dist
def test_inspect_deepspeed_checkpoint(tmp_path):
    pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    script = tmp_path / "mk.py"
    script.write_text(_DS_SCRIPT.format(root=ROOT))
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(29500 + os.getpid() % 1000), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, str(script), str(tmp_path / "ds")], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    for path in (tmp_path / "ds", tmp_path / "ds" / "t2"):  # save dir (via 'latest') or the tag dir
        r = inspect_checkpoint(str(path))
        assert r["format"] == "DeepSpeed ZeRO-2 checkpoint" and r["world_size"] == 1
        names = [t["name"] for t in r["tensors"]]
        assert names == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
        t = r["tensors"][0]
        assert t["kind"] == "quantized" and t["period"] > 0 and t["covered"] == t["numel"] == 67 * 95
        assert r["tensors"][4]["kind"] == "exact"  # 8 x 131 < 4096
        assert r["codebook"]["learned"] and r["codebook"]["distinct"] == 256
    # the total: every state tensor of the file (factored v_row / v_col, D16's span_* arrays), the codebook once
    one = next((tmp_path / "ds" / "t2").glob("*optim_states.pt"))
    states = torch.load(one, weights_only=False)["optimizer_state_dict"]["base_optimizer_state"]["state"]
    keys = {k for st in states.values() for k, v in st.items() if torch.is_tensor(v)}
    assert {"v_row", "v_col", "span_scale", "span_vblk", "span_vcol"} <= keys, keys
    want = sum(v.numel() * v.element_size() for st in states.values() for k, v in st.items()
               if torch.is_tensor(v) and k not in ("codebook", "step"))
    want += 256 * 4
    assert r["state_bytes"] == want, (r["state_bytes"], want)
    assert inspect_checkpoint(str(one))["format"].startswith("DeepSpeed ZeRO-2 checkpoint (one rank")


def test_cli_module_entry_point():
    res = subprocess.run([sys.executable, "-m", "gefen_dist.cli", "plan", "--params", "7e9", "--strategy", "zero2",
                          "--world-size", "8", "--precision", "bf16-mixed"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "optimizer state" in res.stdout
