"""Quality of Gefen against AdamW: what costs validation loss, and at how many bytes per parameter.

Every optimizer trains the same model from the same init on the same batches with the same
schedule; only the optimizer differs. Workloads:

* ``lm``: byte-level GPT (``launch.gpt``) on the Python stdlib sources (``launch.corpus``), batch 32,
  linear warm-up then cosine to 10% of the peak lr at the last step, lr 2e-3, betas (0.9, 0.95),
  eps 1e-8, weight decay 0.1 on >=2-D parameters (0 on 1-D), no gradient clipping; validation loss =
  mean over fixed validation batches (``launch.corpus.val_batches``).
* ``digits``: scikit-learn's digits, MLP 64-256-256-10 (GELU), batch 64, constant lr 2e-3, betas
  (0.9, 0.999), weight decay 0.01 on >=2-D parameters; 360 held-out images (loss and accuracy).

Each run appends one JSON line to ``docs/results/quality_runs.jsonl`` (so several processes can run
disjoint ``--only`` subsets at once); ``--report`` (run after the runs, or implied when a run
finishes) aggregates the newest record of every (workload, config, variant, seed) into
``docs/results/quality[_T].json``, ``docs/results/quality_table[_T].md`` and ``docs/img/quality_*[_T].png``.

    python benchmarks/quality.py --quick                         # smoke: tiny model, few steps
    python benchmarks/quality.py --seeds 0,1 --only headline     # AdamW, Gefen shared/factored, reference
    python benchmarks/quality.py --seeds 0 --only options        # the memory-for-quality options
    python benchmarks/quality.py --seeds 0 --only peers          # torchao, bitsandbytes, Adam-mini, Adafactor, gefen-x
    python benchmarks/quality.py --report --tag small            # tables and plots only (the issue's LM)
    python benchmarks/quality.py --report --lm-preset tiny --lm-context 64 --tag tiny

``--tag T`` sends the report to ``quality_T.json``, ``quality_table_T.md``, ``quality_peers_T.md`` and
``docs/img/quality_*_T.png``; a non-quick report's table is spliced into ``docs/quality.md`` where
that file has a ``quality_table_T.md`` marker (``--tag tiny``, ``--tag small``), and the peer table,
when there are peer runs, into ``docs/benchmarks.md``. ``--runs-file`` points
at another runs JSONL.

This harness holds the product configurations only: AdamW, Gefen's shipped settings (``headline``,
``options``), the reference and the peers. The ablation variants (research code that overrides
Gefen's private methods) live in ``research/``: ``python research/quality_variants.py`` registers
them with :func:`register` and runs this same command line (``--only ablations`` and every variant
name there).

Peers (group ``peers``; ``benchmarks/_peers.py``): same lr, betas, eps and weight decay as AdamW.
``gefen_x`` runs in a child process with ``PYTHONPATH=$GEFENX_PATH`` (or ``--gefenx-path``), because
gefen-x's package is also called ``gefen`` and must not meet the reference in one process; the child
appends its own record.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))

import torch
from torch import nn
from _docs import splice  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

RESULTS = ROOT / "docs" / "results"
IMG = ROOT / "docs" / "img"
RUNS = RESULTS / "quality_runs.jsonl"

# --------------------------------------------------------------------------------------------
# optimizers
# --------------------------------------------------------------------------------------------

HEADLINE = ["adamw", "gefen_shared", "gefen_factored", "gefen_default", "reference"]

# name -> (description, factory(groups, lr, betas, seed)); lr multipliers are in LR_SCALE.
def _gefen(**kw):
    def make(groups, lr, betas, seed):
        from gefen_dist import Gefen
        kw.setdefault("fused", False)
        kw.setdefault("row_blocks", 1)  # the rows recorded before D12; gefen_default passes "auto"
        return Gefen(groups, lr=lr, betas=betas, eps=1e-8, **kw)
    return make


def _gefen_group(select, mode: str, **kw):
    """gefen_dist Gefen with the parameters ``select(model)`` returns (a set of ids) in a param group of
    their own with ``second_moment=mode``, every other tensor as ``kw`` says (native step by default)."""
    def make(groups, lr, betas, seed, *, model, **_):
        from gefen_dist import Gefen
        chosen = select(model)
        out = []
        for g in groups:
            rest = [p for p in g["params"] if id(p) not in chosen]
            mine = [p for p in g["params"] if id(p) in chosen]
            if rest:
                out.append({**g, "params": rest})
            if mine:
                out.append({**g, "params": mine, "second_moment": mode})
        return Gefen(out, lr=lr, betas=betas, eps=1e-8, **dict(dict(fused=None), **kw))
    make.needs_model = True
    return make


def _gefen_emb(mode: str, **kw):
    """gefen_dist Gefen with the nn.Embedding weights (wte, tied to the LM head, and wpe) in a param
    group of their own with ``second_moment=mode``, every other tensor as ``kw`` says."""
    kw.setdefault("row_blocks", 1)  # as recorded before D12
    return _gefen_group(lambda model: {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)},
                        mode, **kw)


def _adamw(groups, lr, betas, seed):
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8)


def _reference(groups, lr, betas, seed):
    import contextlib
    import io

    from _peers import require_gefen
    require_gefen("reference")  # never gefen-x (same package name) by accident
    from gefen.gefen import Gefen as RefGefen
    with contextlib.redirect_stdout(io.StringIO()):
        return RefGefen(groups, lr=lr, betas=betas, eps=1e-8, fused=False)


# ---- peers (group "peers"; benchmarks/_peers.py; versions pinned in pyproject's `peers` extra) ----

def _ao(bits):
    def make(groups, lr, betas, seed):
        from _peers import import_torchao_optim
        tao = import_torchao_optim()
        return (tao.AdamW8bit if bits == 8 else tao.AdamW4bit)(groups, lr=lr, betas=betas, eps=1e-8)
    return make


def _bnb8(groups, lr, betas, seed):
    from _peers import import_bnb
    return import_bnb().optim.AdamW8bit(groups, lr=lr, betas=betas, eps=1e-8)


def _adafactor(groups, lr, betas, seed):
    # torch's Adafactor: no first moment, factored v with its own decay schedule (beta2_decay -0.8);
    # the betas are not used. Its step is lr * max(eps2=1e-3, RMS(param)) * normalised grad.
    return torch.optim.Adafactor(groups, lr=lr)


def _adam_mini(groups, lr, betas, seed, *, model, dim, n_heads, name_prefix=""):
    from _peers import adam_mini
    wd = max(g["weight_decay"] for g in groups)  # Adam-mini decays all but norm/ln/bias by name
    named = [(name_prefix + n, p) for n, p in model.named_parameters()]
    return adam_mini(named, lr=lr, betas=betas, eps=1e-8, weight_decay=wd, dim=dim, n_heads=n_heads)


_adam_mini.needs_model = True


def _gefen_x(groups, lr, betas, seed):
    from _peers import make_gefenx
    return make_gefenx(groups, lr=lr, betas=betas, eps=1e-8)


# The product configurations: AdamW, Gefen's shipped settings, the reference and the peers.
# research/quality_variants.py registers the ablation variants (research code) with register().
VARIANTS = {
    "adamw": ("torch AdamW (fp32 m and v)", _adamw),
    "gefen_shared": ("gefen_dist Gefen, second_moment='shared' (paper + D1-D5)", _gefen(second_moment="shared")),
    "gefen_factored": ("gefen_dist Gefen, second_moment='factored', one column profile per tensor (row_blocks=1: the "
                       "default before D12)", _gefen(second_moment="factored")),
    "gefen_default": ("gefen_dist Gefen, defaults: second_moment='factored', row_blocks='auto' (D12: k column "
                      "profiles for a tensor of k x C rows), the update clamped at the library's default bound (D13; "
                      "from 2026-12-03 c (1 + beta1^(t-1)) K_t with c = 2)",
                      _gefen(second_moment="factored", row_blocks="auto")),
    "reference": ("reference gefen 1.2.3, fused=False", _reference),
    "i_emb_elementwise": ("gefen_dist Gefen, default (factored) with second_moment='elementwise' for the "
                          "embeddings' param group (wte = LM head, wpe): the option that trades memory for quality",
                          _gefen_emb("elementwise")),
    "gefen_elementwise": ("gefen_dist Gefen, second_moment='elementwise' for every tensor (8-bit m, fp32 v per "
                          "element: the setting that buys AdamW's second moment back with ~4 B/param)",
                          _gefen(second_moment="elementwise")),
    # peers: other memory-saving optimizers, same lr, betas, eps and weight decay as AdamW
    "ao_adamw8bit": ("torchao 0.18.0 AdamW8bit (block-wise 8-bit m and v, blocks of 256; tensors < 4096 elements fp32)", _ao(8)),
    "ao_adamw4bit": ("torchao 0.18.0 AdamW4bit (block-wise 4-bit m and v, blocks of 128; tensors < 4096 elements fp32)", _ao(4)),
    "bnb_adamw8bit": ("bitsandbytes 0.50.2 AdamW8bit (dynamic 8-bit m and v; tensors < 4096 elements fp32), CPU path", _bnb8),
    "adam_mini": ("adam-mini 1.1.1 Adam_mini (fp32 m; one v per head / neuron / token by parameter name)", _adam_mini),
    "adafactor": ("torch.optim.Adafactor, defaults (no m; step scaled by max(1e-3, RMS(param))), same lr", _adafactor),
    "adafactor_lr5x": ("torch.optim.Adafactor, lr x5 (= torch's default 1e-2 at the 2e-3 base)", _adafactor),
    "gefen_x": ("gefen-x 0.5.0 Gefen, defaults (factored_v_2d=True; CPU: fused=False); run in a subprocess", _gefen_x),
}
LR_SCALE = {"adafactor_lr5x": 5.0}
PEERS = ["ao_adamw8bit", "ao_adamw4bit", "bnb_adamw8bit", "adam_mini", "adafactor", "adafactor_lr5x", "gefen_x"]
# variants whose package may not share this process: run in a child with PYTHONPATH=<target dir>
SUBPROCESS = {"gefen_x"}
OPTIONS = ["gefen_elementwise", "i_emb_elementwise"]  # the library's memory-for-quality options


def register(name: str, description: str, factory, lr_scale: Optional[float] = None) -> None:
    """Add a configuration (``factory(groups, lr, betas, seed)``, or with ``factory.needs_model``
    also ``model=`` and the model's ``dim``/``n_heads``) under ``name``: how research code adds its
    ablation variants to this harness (it lands in the ``ablations`` group)."""
    if name in VARIANTS and VARIANTS[name][1] is not factory:
        raise ValueError(f"configuration {name!r} is already registered")
    VARIANTS[name] = (description, factory)
    if lr_scale is not None:
        LR_SCALE[name] = lr_scale


def groups() -> dict:
    """``--only`` groups over the registered configurations."""
    ablations = [k for k in VARIANTS if k not in HEADLINE and k not in PEERS and k not in OPTIONS]
    return {"headline": HEADLINE, "options": OPTIONS, "ablations": ablations, "peers": PEERS,
            "all": HEADLINE + OPTIONS + ablations}


def make_optimizer(variant: str, model: nn.Module, weight_decay: float, lr: float, betas, seed: int, **model_info):
    fac = VARIANTS[variant][1]
    groups = param_groups(model, weight_decay)
    if getattr(fac, "needs_model", False):
        return fac(groups, lr, betas, seed, model=model, **model_info)
    return fac(groups, lr, betas, seed)


def _step(opt):
    if type(opt).__name__ == "Adam_mini":
        from _peers import adam_mini_step_quiet
        return adam_mini_step_quiet(opt)
    return opt.step()


def state_bytes(opt) -> int:
    """Optimizer state bytes (quantized tensor subclasses by their storage): launch.peers.state_bytes."""
    from launch.peers import state_bytes as _sb
    return _sb(opt)


def param_groups(model: nn.Module, wd: float):
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def set_lr(opt, lr: float) -> None:
    for g in opt.param_groups:
        if isinstance(g["lr"], torch.Tensor):  # torchao keeps lr as a tensor (its compiled step reads it)
            g["lr"].fill_(lr)
        else:
            g["lr"] = lr


# --------------------------------------------------------------------------------------------
# workloads
# --------------------------------------------------------------------------------------------

def lm_config(args) -> dict:
    if args.quick:
        c = dict(preset="tiny", batch=16, context=64, steps=200, warmup=20, val_batches=5, eval_every=50)
    else:
        c = dict(preset="small", batch=32, context=128, steps=800, warmup=50, val_batches=20, eval_every=100)
    for k in ("preset", "batch", "context", "steps"):
        v = getattr(args, f"lm_{k}")
        if v is not None:
            c[k] = v
    c.update(lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1, min_lr_frac=0.1, grad_clip=None)
    return c


def lr_mult(t: int, steps: int, warmup: int, min_frac: float) -> float:
    if t < warmup:
        return (t + 1) / warmup
    frac = (t - warmup) / max(1, steps - 1 - warmup)
    return min_frac + (1.0 - min_frac) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac)))


def run_lm(variant: str, seed: int, cfg: dict, stop_at: int | None = None) -> dict:
    """Train ``cfg``'s LM; ``stop_at`` ends it after that many steps of the same schedule (the
    learning rate of every step is the full run's; ``val_loss`` is then NaN)."""
    from launch.corpus import Batches, load_corpus, val_batches
    from launch.gpt import GPT, get_config

    train, val, info = load_corpus()
    mcfg = get_config(cfg["preset"], context=cfg["context"])
    torch.manual_seed(seed)
    model = GPT(mcfg)
    nparams = sum(p.numel() for p in model.parameters())
    batches = Batches(train, cfg["batch"], cfg["context"], seed=seed)
    vb = val_batches(cfg["val_batches"], cfg["batch"], cfg["context"], data=val)
    lr0 = cfg["lr"] * LR_SCALE.get(variant, 1.0)
    opt = make_optimizer(variant, model, cfg["weight_decay"], lr0, cfg["betas"], seed,
                         dim=mcfg.d_model, n_heads=mcfg.n_head)

    def evaluate():
        model.eval()
        with torch.no_grad():
            out = sum(model(x, y)[1].item() for x, y in vb) / len(vb)
        model.train()
        return out

    train_loss, val_curve = [], []
    t0 = time.perf_counter()
    for t in range(cfg["steps"] if stop_at is None else min(stop_at, cfg["steps"])):
        set_lr(opt, lr0 * lr_mult(t, cfg["steps"], cfg["warmup"], cfg["min_lr_frac"]))
        x, y = batches(t)
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)[1]
        loss.backward()
        _step(opt)
        lv = loss.item()
        train_loss.append(round(lv, 5))
        if not math.isfinite(lv):
            break
        if (t + 1) % cfg["eval_every"] == 0 or t + 1 == cfg["steps"]:
            val_curve.append((t + 1, round(evaluate(), 6)))
    secs = time.perf_counter() - t0
    final = val_curve[-1][1] if val_curve and val_curve[-1][0] == cfg["steps"] else float("nan")
    sb = state_bytes(opt)
    return dict(val_loss=final, val_curve=val_curve, train_loss=train_loss, state_bytes=sb,
                params=nparams, bytes_per_param=sb / nparams, seconds=secs,
                corpus_sha256=info["sha256"][:16], extra=_extra(opt))


def _digits_data():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return (x[360:], y[360:]), (x[:360], y[:360])


def digits_config(args) -> dict:
    steps = args.digits_steps or (100 if args.quick else 300)
    return dict(steps=steps, batch=64, lr=2e-3, betas=(0.9, 0.999), weight_decay=0.01, eval_every=50,
                model="MLP 64-256-256-10 GELU", schedule="constant")


def run_digits(variant: str, seed: int, cfg: dict) -> dict:
    (xt, yt), (xv, yv) = _digits_data()
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))
    nparams = sum(p.numel() for p in model.parameters())
    lr0 = cfg["lr"] * LR_SCALE.get(variant, 1.0)
    # Adam-mini partitions by name: "mlp." makes it keep one v per output neuron of each Linear
    opt = make_optimizer(variant, model, cfg["weight_decay"], lr0, cfg["betas"], seed,
                         dim=64, n_heads=1, name_prefix="mlp.")
    gen = torch.Generator().manual_seed(1000 + seed)

    def evaluate():
        with torch.no_grad():
            logits = model(xv)
            return (nn.functional.cross_entropy(logits, yv).item(), (logits.argmax(1) == yv).float().mean().item())

    curve, train_loss = [], []
    t0 = time.perf_counter()
    for t in range(cfg["steps"]):
        i = torch.randint(0, len(yt), (cfg["batch"],), generator=gen)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(xt[i]), yt[i])
        loss.backward()
        _step(opt)
        train_loss.append(round(loss.item(), 5))
        if (t + 1) % cfg["eval_every"] == 0 or t + 1 == cfg["steps"]:
            vl, acc = evaluate()
            curve.append((t + 1, round(vl, 6), round(acc, 5)))
    vl, acc = evaluate()
    sb = state_bytes(opt)
    return dict(val_loss=vl, val_acc=acc, val_curve=[(s, l) for s, l, _ in curve], acc_curve=[(s, a) for s, _, a in curve],
                train_loss=train_loss, state_bytes=sb, params=nparams, bytes_per_param=sb / nparams,
                seconds=time.perf_counter() - t0, extra=_extra(opt))


# modules whose optimizers are this project's (no third-party package to record); research adds its own
OWN_MODULES = {"gefen_dist", "quality"}


def _extra(opt) -> dict:
    out = {}
    mod = type(opt).__module__.split(".")[0]
    if mod not in OWN_MODULES:
        out["optimizer_class"] = f"{type(opt).__module__}.{type(opt).__qualname__}"
        try:
            from importlib.metadata import version
            dist = {"torchao": "torchao", "bitsandbytes": "bitsandbytes", "adam_mini": "adam-mini",
                    "torch": "torch", "gefen": None}.get(mod, mod)
            if mod == "gefen":
                from _peers import imported_gefen_flavour
                out["package"] = imported_gefen_flavour()
            else:
                out["package"] = f"{dist} {version(dist)}"
        except Exception:
            pass
    if hasattr(opt, "report"):
        per = {}
        for r in opt.report():
            key = f"{r['kind']}:P={r['period']}" if r["kind"] == "quantized" else r["kind"]
            per[key] = per.get(key, 0) + r["local_numel"]
        out["params_by_kind_period"] = per
    if getattr(opt, "refreshes", 0):
        out["codebook_refreshes"] = opt.refreshes
    if hasattr(opt, "_gefen_codebook"):  # reference: periods
        per = {}
        for g in opt.param_groups:
            p = g["params"][0]
            st = opt.state.get(p, {})
            if "automatic_period" in st:
                k = f"P={st['automatic_period']}"
                per[k] = per.get(k, 0) + p.numel()
        out["params_by_period"] = per
    return out


# --------------------------------------------------------------------------------------------
# GPT-2 small state bytes (no training: state allocated for the measured periods)
# --------------------------------------------------------------------------------------------

EMBEDDINGS = ("wte.weight", "wpe.weight")  # GPT-2's embeddings (wte is tied to the LM head)


def _state_gefen(period_one_embeddings: bool = False, **kw):
    """A GPT-2-small state row built by gefen_dist Gefen with ``kw`` (the embeddings in a group of
    their own with ``second_moment="elementwise"`` when ``period_one_embeddings``)."""
    def build(params):
        from gefen_dist import Gefen

        if period_one_embeddings:
            params = [{"params": [x for x in params if x[0] not in EMBEDDINGS]},
                      {"params": [x for x in params if x[0] in EMBEDDINGS], "second_moment": "elementwise"}]
        return Gefen(params, lr=1e-3, fused=False, **kw)
    build.period_one = (lambda name: name in EMBEDDINGS) if period_one_embeddings else (lambda name: False)
    return build


# label -> build(named params) -> optimizer; build.period_one(name): that tensor gets period 1;
# build.extra_bytes: state the optimizer does not count. research/quality_variants.py adds rows.
GPT2_STATE_ROWS = {
    "shared": _state_gefen(second_moment="shared"),
    "factored": _state_gefen(second_moment="factored"),
    "factored, embeddings elementwise": _state_gefen(True, second_moment="factored"),
    "factored, one column profile per tensor (row_blocks=1, the default before D12)":
        _state_gefen(second_moment="factored", row_blocks=1),
    "elementwise (every quantized tensor: 8-bit m, fp32 v per element)": _state_gefen(second_moment="elementwise"),
}
GPT2_STATE_ROWS["elementwise (every quantized tensor: 8-bit m, fp32 v per element)"].period_one = lambda name: True


def gpt2_small_bytes() -> dict:
    """B/param of each of ``GPT2_STATE_ROWS`` on the GPT-2 small tensor set, with the periods that
    ``benchmarks/memory.py`` measured (``docs/results/memory.json``), allocated via ``init_state``."""
    mem = RESULTS / "memory.json"
    if not mem.exists():
        return {}
    per_tensor = json.loads(mem.read_text())["per_tensor"]
    out = {"source": "docs/results/memory.json shapes and periods"}
    for label, build in GPT2_STATE_ROWS.items():
        params = [(r["name"], nn.Parameter(torch.empty(r["shape"]))) for r in per_tensor]
        opt = build(params)
        opt.init_state({r["name"]: 1 if build.period_one(r["name"]) else r["period"]
                        for r in per_tensor if r["kind"] == "quantized"})
        n = sum(p.numel() for _, p in params)
        sb = opt.state_bytes() + getattr(build, "extra_bytes", 0)
        out[label] = dict(params=n, state_bytes=sb, bytes_per_param=sb / n)
        del opt, params
    return out


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------

def _cfg_key(cfg: dict) -> str:
    return json.dumps({k: v for k, v in sorted(cfg.items())}, default=list)


def host_signature() -> str:
    """The CPU model and the SIMD level torch dispatches to, recorded with every run. AdamW's runs
    reproduce bitwise on another host, Gefen's do not (the same code and seed differ by 0.4% of
    validation loss on the `small` preset; research/quality-log.md, round 14), so runs compared seed by
    seed should come from one host."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    return f"{model}; torch {torch.backends.cpu.get_cpu_capability()}"


def load_runs(lm_cfg: dict, dg_cfg: dict) -> dict:
    runs = {}
    if not RUNS.exists():
        return runs
    want = {"lm": _cfg_key(lm_cfg), "digits": _cfg_key(dg_cfg)}
    for line in RUNS.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        if _cfg_key(r["config"]) != want.get(r["workload"]):
            continue
        runs[(r["workload"], r["variant"], r["seed"])] = r  # newest wins
    return runs


def _fmt_pct(x):
    return f"{x:+.2f}%"


def summarise(runs: dict, workload: str) -> list:
    rows = []
    base = {s: r for (w, v, s), r in runs.items() if w == workload and v == "adamw"}
    ref = {s: r for (w, v, s), r in runs.items() if w == workload and v == "reference"}
    for v in VARIANTS:
        rs = {s: r for (w, vv, s), r in runs.items() if w == workload and vv == v}
        if not rs:
            continue
        seeds = sorted(rs)
        losses = [rs[s]["result"]["val_loss"] for s in seeds]
        row = dict(variant=v, description=VARIANTS[v][0], seeds=seeds, val_loss=losses,
                   mean=statistics.fmean(losses), bytes_per_param=[rs[s]["result"]["bytes_per_param"] for s in seeds],
                   seconds=statistics.fmean(rs[s]["result"]["seconds"] for s in seeds))
        if workload == "digits":
            accs = [rs[s]["result"]["val_acc"] for s in seeds]
            row["val_acc"] = accs
            row["acc_mean"] = statistics.fmean(accs)
        paired = [100.0 * (rs[s]["result"]["val_loss"] / base[s]["result"]["val_loss"] - 1.0) for s in seeds if s in base]
        if paired:
            row["vs_adamw_pct"] = paired
            row["vs_adamw_mean_pct"] = statistics.fmean(paired)
            row["vs_adamw_median_pct"] = statistics.median(paired)
        pr = [100.0 * (rs[s]["result"]["val_loss"] / ref[s]["result"]["val_loss"] - 1.0) for s in seeds if s in ref]
        if pr:
            row["vs_reference_pct"] = pr
            row["vs_reference_mean_pct"] = statistics.fmean(pr)
        rows.append(row)
    return rows


def _seed_spread(rows):
    a = next((r for r in rows if r["variant"] == "adamw"), None)
    if not a or len(a["val_loss"]) < 2:
        return None
    return 100.0 * (max(a["val_loss"]) - min(a["val_loss"])) / statistics.fmean(a["val_loss"])


def _paired_cell(paired: list) -> str:
    """One seed: its difference; two: mean [min, max]; three or more: the median too (one seed on which
    AdamW itself trains badly moves the mean far more than the median)."""
    if len(paired) == 1:
        return _fmt_pct(paired[0])
    med = f", median {_fmt_pct(statistics.median(paired))}" if len(paired) >= 3 else ""
    return f"{_fmt_pct(statistics.fmean(paired))}{med} [{_fmt_pct(min(paired))}, {_fmt_pct(max(paired))}]"


def table_md(rows: list, workload: str) -> str:
    acc = workload == "digits"
    head = "| variant | seeds | val loss per seed | mean | vs AdamW (paired by seed: mean, median [min, max]) | vs reference (paired) |"
    head += " val acc (mean) |" if acc else ""
    head += " state B/param | s/run |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        vs = "—" if r["variant"] == "adamw" else (_paired_cell(r["vs_adamw_pct"]) if "vs_adamw_pct" in r else "n/a")
        vr = "—" if r["variant"] == "reference" else (
            f"{_fmt_pct(r['vs_reference_mean_pct'])}" if "vs_reference_pct" in r else "n/a")
        cells = [f"`{r['variant']}`", ",".join(map(str, r["seeds"])),
                 ", ".join(f"{x:.4f}" for x in r["val_loss"]), f"{r['mean']:.4f}", vs, vr]
        if acc:
            cells.append(f"{100 * r['acc_mean']:.2f}%")
        bp = r["bytes_per_param"]
        cells += [f"{min(bp):.3f}" if max(bp) - min(bp) < 5e-4 else f"{min(bp):.3f}–{max(bp):.3f}", f"{r['seconds']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: dict, workload: str, variants: list, path: Path, title: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    any_ = False
    for ci, v in enumerate(variants):
        style = dict(color=plt.cm.tab20(ci % 20), linestyle="-" if v in HEADLINE else "--")
        rs = [r for (w, vv, s), r in sorted(runs.items()) if w == workload and vv == v]
        if not rs:
            continue
        any_ = True
        steps = [s for s, _ in rs[0]["result"]["val_curve"]]
        vals = [statistics.fmean(r["result"]["val_curve"][i][1] for r in rs if len(r["result"]["val_curve"]) > i)
                for i in range(len(steps))]
        axes[0].plot(steps, vals, marker=".", label=f"{v} (n={len(rs)})", **style)
        tl = [statistics.fmean(x) for x in zip(*[r["result"]["train_loss"] for r in rs])]
        k = max(1, len(tl) // 40)
        sm = [statistics.fmean(tl[i:i + k]) for i in range(0, len(tl) - k + 1, k)]
        axes[1].plot([i + k for i in range(0, len(tl) - k + 1, k)], sm, label=v, **style)
    if not any_:
        plt.close(fig)
        return False
    axes[0].set_title(f"{title}: validation loss (mean over seeds), second half")
    axes[1].set_title(f"{title}: training loss (window mean), second half")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    # zoom on the late phase; a diverged variant (late values far above the typical line's) is drawn
    # off the scale rather than flattening every other curve, and its label says so
    def late(line):
        return [float(y) for y in line.get_ydata()[len(line.get_ydata()) // 2:]]

    for ai, ax in enumerate(axes):
        lines = [l for l in ax.get_lines() if late(l)]
        if not lines:
            continue
        typical = statistics.median(max(late(l)) for l in lines)
        lo = min(min(late(l)) for l in lines)
        hi = min(max(max(late(l)) for l in lines), typical + 3.0 * (typical - lo) + 1e-3)
        ax.set_ylim(*((lo - 0.05 * (hi - lo + 1e-3), hi + 0.3 * (hi - lo + 1e-3)) if ai == 0 else (lo * 0.98, hi * 1.05)))
        for l in lines:
            if max(late(l)) > hi:
                l.set_label(f"{l.get_label()} (off scale)")
    for ax in axes:
        ax.legend(fontsize=7)
    for ax in axes:  # the same late phase on the step axis (the early curves are off the scale)
        xs = [l.get_xdata() for l in ax.get_lines() if len(l.get_xdata())]
        if xs:
            ax.set_xlim(left=0.45 * max(x[-1] for x in xs))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _command(args, script: str = "benchmarks/quality.py") -> str:
    c = f"python {script} --report"
    for flag in ("quick",):
        if getattr(args, flag):
            c += f" --{flag}"
    for k in ("lm_preset", "lm_batch", "lm_context", "lm_steps", "digits_steps", "tag"):
        v = getattr(args, k)
        if v is not None:
            c += f" --{k.replace('_', '-')} {v}"
    return c


def report_suffix(args) -> str:
    return ("_quick" if args.quick else "") + (f"_{args.tag}" if args.tag else "")


def peers_md(runs: dict, lm_cfg: dict, dg_cfg: dict, args, script: str = "benchmarks/quality.py") -> str:
    """The peer table (docs/benchmarks.md): every peer against AdamW and Gefen, paired by seed."""
    suffix = report_suffix(args)
    md = [f"<!-- generated by `{_command(args, script)}`; do not edit -->"]
    show = ["adamw", "gefen_default", "gefen_factored", "gefen_shared", "reference"] + PEERS
    shown = [x.strip() for x in args.workloads.split(",")]
    for w, cfg, title in (("lm", lm_cfg, "Byte-level GPT"), ("digits", dg_cfg, "Digits MLP")):
        if w not in shown:
            continue
        rows = [r for r in summarise(runs, w) if r["variant"] in show]
        if not any(r["variant"] in PEERS for r in rows):
            continue
        rows.sort(key=lambda r: show.index(r["variant"]))
        desc = (f"{cfg['preset']} preset (context {cfg['context']}), batch {cfg['batch']}, {cfg['steps']} steps"
                if w == "lm" else f"{cfg['model']}, batch {cfg['batch']}, {cfg['steps']} steps")
        md.append(f"\n#### {title}: {desc}\n")
        md.append("Each row's mean is over its own seeds; compare rows through the paired column "
                  "(per seed against AdamW with the same seed).\n")
        md.append(table_md(rows, w))
        md.append("\n" + "\n".join(f"* `{r['variant']}`: {r['description']}" for r in rows if r["variant"] in PEERS))
        img = IMG / f"quality_{w}_peers{suffix}.png"
        if plot(runs, w, [r["variant"] for r in rows], img, title + " peers"):
            md.append(f"\n![{title} peers](img/{img.name})")
    return "\n".join(md) + "\n"




def report(args, lm_cfg, dg_cfg, doc: Optional[Path] = None, script: str = "benchmarks/quality.py") -> None:
    """Tables, plots and the aggregate JSON of the stored runs; a non-quick report's table is spliced
    into ``doc`` (default ``docs/quality.md``) where it has the report's marker."""
    runs = load_runs(lm_cfg, dg_cfg)
    suffix = report_suffix(args)
    out = {"lm_config": lm_cfg, "digits_config": dg_cfg, "variants": {k: v[0] for k, v in VARIANTS.items()},
           "lr_scale": LR_SCALE, "torch": torch.__version__, "command": _command(args, script)}
    md = [f"<!-- generated by {script}{' --quick' if args.quick else ''}"
          f"{' --tag ' + args.tag if args.tag else ''}; do not edit -->"]
    shown = [x.strip() for x in args.workloads.split(",")]
    for w, cfg, title in (("lm", lm_cfg, "Byte-level GPT"), ("digits", dg_cfg, "Digits MLP")):
        if w not in shown:
            continue
        rows = summarise(runs, w)
        out[w] = rows
        if not rows:
            continue
        desc = (f"{cfg['preset']} preset (context {cfg['context']}), batch {cfg['batch']}, {cfg['steps']} steps, "
                f"warm-up {cfg['warmup']} then cosine to {cfg['min_lr_frac']:g}x, lr {cfg['lr']:g}, betas {tuple(cfg['betas'])}, "
                f"wd {cfg['weight_decay']:g} on >=2-D, val = mean of {cfg['val_batches']} fixed batches"
                if w == "lm" else
                f"{cfg['model']}, batch {cfg['batch']}, {cfg['steps']} steps, {cfg['schedule']} lr {cfg['lr']:g}, "
                f"betas {tuple(cfg['betas'])}, wd {cfg['weight_decay']:g} on >=2-D, 360 held-out images")
        md.append(f"\n### {title}: {desc}\n")
        if rows:
            md.append(f"Parameters: {runs[next(k for k in runs if k[0] == w)]['result']['params']:,}.")
        sp = _seed_spread(rows)
        if sp is not None:
            md.append(f"AdamW seed-to-seed spread (max - min over mean): {sp:.2f}%.")
        md.append("")
        md.append(table_md([r for r in rows if r["variant"] in HEADLINE], w))
        abl = [r for r in rows if r["variant"] not in HEADLINE and r["variant"] not in PEERS]
        if abl:
            md.append("\nAblations (rows compared by seed with AdamW and the reference):\n")
            md.append(table_md(abl, w))
        md.append("\n" + "\n".join(f"* `{r['variant']}`: {r['description']}" for r in rows
                                    if r["variant"] not in PEERS))
        if any(r["variant"] in PEERS for r in rows):
            md.append(f"\nPeer optimizers: see `docs/results/quality_peers{suffix}.md` (docs/benchmarks.md).")
        img = IMG / f"quality_{w}{suffix}.png"
        if plot(runs, w, [v for v in HEADLINE], img, title):
            md.append(f"\n![{title} headline](../img/{img.name})")
        img2 = IMG / f"quality_{w}_ablations{suffix}.png"
        if abl and plot(runs, w, ["adamw", "gefen_shared", "gefen_factored"] + [r["variant"] for r in abl], img2,
                        title + " ablations"):
            md.append(f"\n![{title} ablations](../img/{img2.name})")
    if not args.no_gpt2_bytes:
        g2 = gpt2_small_bytes()
        out["gpt2_small_state"] = g2
        if g2:
            md.append("\n### State on GPT-2 small (124M; periods as measured in docs/results/memory.json)\n")
            md.append("| second_moment | params | state bytes | B/param |\n|---|---|---|---|")
            for sm in GPT2_STATE_ROWS:
                md.append(f"| {sm} | {g2[sm]['params']:,} | {g2[sm]['state_bytes']:,} | {g2[sm]['bytes_per_param']:.4f} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"quality{suffix}.json").write_text(json.dumps(out, indent=1, default=list) + "\n")
    (RESULTS / f"quality_table{suffix}.md").write_text("\n".join(md) + "\n")
    pm = peers_md(runs, lm_cfg, dg_cfg, args, script)
    if pm.count("\n") > 1:
        (RESULTS / f"quality_peers{suffix}.md").write_text(pm)
        splice(ROOT / "docs" / "benchmarks.md", f"quality_peers{suffix}.md", pm)
        print(pm)
    # docs/quality.md embeds each non-quick report that has a marker there (quality_table_<tag>.md)
    if not args.quick:
        page = Path(doc) if doc is not None else ROOT / "docs" / "quality.md"
        rel = os.path.relpath(IMG, page.parent)
        splice(page, f"quality_table{suffix}.md", "\n".join(md).replace("](../img/", f"]({rel}/"))
    print("\n".join(md))


# --------------------------------------------------------------------------------------------

def _run_child(args, variant: str, workload: str, seed: int) -> None:
    """One run of ``variant`` in a child process whose PYTHONPATH puts gefen-x first (its package is
    also called ``gefen``); the child appends its own record to the runs file."""
    import subprocess

    from _peers import gefenx_available, gefenx_env, gefenx_install_hint, gefenx_path

    path = Path(args.gefenx_path) if args.gefenx_path else gefenx_path()
    if not gefenx_available(path):
        print(f"[{workload}] {variant}: gefen-x not found at {path}; skipped. Install: {gefenx_install_hint(path)}",
              flush=True)
        return
    cmd = [sys.executable, str(Path(__file__).resolve()), "--only", variant, "--workloads", workload,
           "--seeds", str(seed), "--threads", str(args.threads), "--no-report", "--no-gpt2-bytes",
           "--runs-file", str(RUNS)]
    if args.quick:
        cmd.append("--quick")
    for k in ("lm_preset", "lm_batch", "lm_context", "lm_steps", "digits_steps"):
        v = getattr(args, k)
        if v is not None:
            cmd += [f"--{k.replace('_', '-')}", str(v)]
    r = subprocess.run(cmd, env=gefenx_env(path))
    if r.returncode != 0:
        print(f"[{workload}] {variant} seed {seed}: child exited with {r.returncode}", flush=True)


def main(argv=None, doc: Optional[Path] = None, script: str = "benchmarks/quality.py"):
    """The command line; research/quality_variants.py calls it after registering its variants, with
    its own page (``doc``) for the report's tables."""
    global RUNS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny GPT, 200 steps; digits 300 steps")
    ap.add_argument("--only", default="headline",
                    help="comma-separated variant names, globs or groups (headline, options, peers, ablations, all)")
    ap.add_argument("--workloads", default="lm,digits")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--report", action="store_true", help="only aggregate existing runs into tables and plots")
    ap.add_argument("--no-report", action="store_true", help="do not aggregate after the runs")
    ap.add_argument("--no-gpt2-bytes", action="store_true")
    ap.add_argument("--lm-preset", default=None)
    ap.add_argument("--lm-batch", type=int, default=None)
    ap.add_argument("--lm-context", type=int, default=None)
    ap.add_argument("--lm-steps", type=int, default=None)
    ap.add_argument("--digits-steps", type=int, default=None)
    ap.add_argument("--tag", default=None,
                    help="report outputs go to quality_<tag>.json, quality_table_<tag>.md, quality_peers_<tag>.md "
                         "and docs/img/quality_*_<tag>.png, and splice docs/quality.md's quality_table_<tag>.md block")
    ap.add_argument("--runs-file", default=None, help=f"runs JSONL to append to / report from (default {RUNS})")
    ap.add_argument("--gefenx-path", default=None,
                    help="gefen-x target dir for the `gefen_x` variant's subprocess (default $GEFENX_PATH or "
                         "~/.cache/gefen_dist/peers/gefenx)")
    args = ap.parse_args(argv)
    if args.runs_file:
        RUNS = Path(args.runs_file)
    torch.set_num_threads(args.threads)
    lm_cfg, dg_cfg = lm_config(args), digits_config(args)
    if not args.report:
        names, grp = [], groups()
        for tok in args.only.split(","):
            tok = tok.strip()
            for n in grp.get(tok, [v for v in VARIANTS if fnmatch.fnmatch(v, tok)]):
                if n not in names:
                    names.append(n)
        if not names:
            ap.error(f"--only {args.only!r} matches no variant; choose from {list(VARIANTS)} or {list(grp)}")
        seeds = [int(s) for s in args.seeds.split(",")]
        workloads = [w.strip() for w in args.workloads.split(",")]
        RESULTS.mkdir(parents=True, exist_ok=True)
        child = os.environ.get("GEFEN_BENCH_GEFENX_CHILD") == "1"
        for w in workloads:
            for seed in seeds:
                for v in names:
                    cfg = lm_cfg if w == "lm" else dg_cfg
                    if v in SUBPROCESS and not child:
                        _run_child(args, v, w, seed)
                        continue
                    t0 = time.time()
                    res = (run_lm if w == "lm" else run_digits)(v, seed, cfg)
                    rec = dict(workload=w, variant=v, seed=seed, config=cfg, result=res, time=time.time(),
                               host=host_signature(), torch=torch.__version__)
                    with open(RUNS, "a") as f:
                        f.write(json.dumps(rec, default=list) + "\n")
                    acc = f" acc {res['val_acc']:.4f}" if "val_acc" in res else ""
                    print(f"[{w}] {v:<24} seed {seed}: val {res['val_loss']:.4f}{acc} "
                          f"{res['bytes_per_param']:.3f} B/param  {time.time() - t0:.0f}s", flush=True)
    if not args.no_report:
        report(args, lm_cfg, dg_cfg, doc, script)


if __name__ == "__main__":
    main()
