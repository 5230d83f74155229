"""Main training job: a byte-level GPT on the Python stdlib corpus, with Gefen or AdamW.

    python launch/train.py --optimizer both          # AdamW vs Gefen, same seed/init/data
    python launch/train.py --optimizer gefen --model small --steps 1000

Only the ``single`` (one process) strategy is implemented; the ``Strategy`` class is the seam
where DDP / FSDP / DeepSpeed wrappers plug in (model wrapping, rank/world size, reductions,
checkpoint ownership).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # executed as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn as nn

from launch.corpus import Batches, load_corpus, val_batches
from launch.gpt import GPT, PRESETS, get_config

log = logging.getLogger("launch.train")

OPTIMIZERS = ("gefen", "adamw", "both")
STRATEGIES = ("single", "ddp", "fsdp", "deepspeed")
CHECKPOINT_VERSION = 1


# --------------------------------------------------------------------------------------------
# arguments
# --------------------------------------------------------------------------------------------

def _betas(s: str) -> tuple[float, float]:
    parts = s.replace("(", "").replace(")", "").split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError("--betas takes two comma-separated floats, e.g. 0.9,0.95")
    return float(parts[0]), float(parts[1])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Train a byte-level GPT on the Python stdlib with Gefen and/or AdamW.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="small", choices=sorted(PRESETS), help="model preset")
    p.add_argument("--optimizer", default="gefen", choices=OPTIMIZERS,
                   help="'both' runs AdamW then Gefen with identical seed, init and data")
    p.add_argument("--strategy", default="single", choices=STRATEGIES,
                   help="parallelism strategy (only 'single' is implemented)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16, help="global batch size (sequences)")
    p.add_argument("--context", type=int, default=None,
                   help="sequence length (default: the preset's context)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--betas", type=_betas, default=(0.9, 0.95), help="beta1,beta2")
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--weight-decay", type=float, default=0.1,
                   help="decoupled weight decay for >=2-D parameters (1-D params get none)")
    p.add_argument("--warmup", type=int, default=30, help="linear warmup steps")
    p.add_argument("--min-lr-frac", type=float, default=0.1,
                   help="cosine decays to this fraction of --lr at the last step")
    p.add_argument("--grad-clip", type=float, default=1.0, help="global grad-norm clip (0: off)")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default=None, help="run name (default: timestamp)")
    p.add_argument("--out", default=None, help="output directory (default: runs/<name>)")
    p.add_argument("--checkpoint-every", type=int, default=0,
                   help="save a checkpoint every N steps and at the end (0: never)")
    p.add_argument("--resume", default=None, help="checkpoint to resume from")
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop (checkpointing) after this many steps of the --steps schedule, "
                        "e.g. to simulate preemption")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--no-progress", action="store_true", help="disable the progress bar")
    p.add_argument("--no-plot", action="store_true", help="do not write loss.png")
    p.add_argument("--log-level", default="INFO")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.steps < 1:
        raise SystemExit("--steps must be >= 1")
    if args.optimizer == "both" and args.resume:
        raise SystemExit("--resume works with a single optimizer, not --optimizer both")
    if args.name is None:
        args.name = time.strftime("%Y%m%d-%H%M%S")
    if args.out is None:
        args.out = os.path.join("runs", args.name)
    return args


# --------------------------------------------------------------------------------------------
# strategy (parallelism) seam
# --------------------------------------------------------------------------------------------

class Strategy:
    """Single-process strategy; also the interface future DDP/FSDP/DeepSpeed strategies fill."""

    name = "single"
    rank = 0
    world_size = 1
    device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def setup(self) -> None:
        pass

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return model

    def reduce_mean(self, value: float) -> float:
        return value

    def model_state_dict(self, model: nn.Module) -> dict:
        return model.state_dict()

    def optimizer_state_dict(self, opt: torch.optim.Optimizer) -> dict:
        return opt.state_dict()

    def barrier(self) -> None:
        pass

    def teardown(self) -> None:
        pass


def make_strategy(name: str) -> Strategy:
    if name == "single":
        return Strategy()
    raise NotImplementedError(
        f"--strategy {name} is not yet implemented; only 'single' (one process) is available")


# --------------------------------------------------------------------------------------------
# optimizer
# --------------------------------------------------------------------------------------------

def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """GPT recipe: decay >=2-D tensors (matmuls, embeddings), not 1-D (biases, LayerNorm)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():  # named_parameters() de-duplicates the tied weight
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


class GefenUnavailable(RuntimeError):
    """``gefen_dist.Gefen`` cannot be imported."""


def gefen_class():
    try:
        from gefen_dist import Gefen
    except ImportError as e:
        raise GefenUnavailable(
            "--optimizer gefen needs gefen_dist.Gefen, which is not importable in this checkout "
            f"({e}); use --optimizer adamw") from e
    return Gefen


def build_optimizer(name: str, model: nn.Module, args) -> torch.optim.Optimizer:
    groups = param_groups(model, args.weight_decay)
    kw = dict(lr=args.lr, betas=tuple(args.betas), eps=args.eps, weight_decay=args.weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(groups, **kw)
    if name == "gefen":
        return gefen_class()(groups, **kw)
    raise ValueError(f"unknown optimizer {name!r}")


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state: ``opt.state_bytes()`` when provided, else the tensors' sizes."""
    if callable(getattr(opt, "state_bytes", None)):
        return int(opt.state_bytes())
    total = 0
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                total += v.numel() * v.element_size()
    return total


def lr_lambda_factory(steps: int, warmup: int, min_frac: float):
    def fn(step: int) -> float:  # multiplier applied to the lr of optimizer step `step`
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        span = max(1, steps - warmup - 1)
        progress = min(1.0, (step - warmup) / span)
        return min_frac + (1.0 - min_frac) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return fn


def build_scheduler(opt, args):
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lr_lambda_factory(args.steps, args.warmup, args.min_lr_frac))


# --------------------------------------------------------------------------------------------
# checkpoints, metrics
# --------------------------------------------------------------------------------------------

def atomic_torch_save(obj, path: str | os.PathLike) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def checkpoint_path(out: str, opt_name: str) -> Path:
    return Path(out) / f"checkpoint_{opt_name}.pt"


@dataclass
class RunResult:
    optimizer: str
    train_losses: list = field(default_factory=list)  # per step
    evals: list = field(default_factory=list)  # {step, val_loss, train_loss, lr, ...}
    summary: dict = field(default_factory=dict)


@torch.no_grad()
def evaluate(model: nn.Module, batches) -> float:
    was_training = model.training
    model.eval()
    total = 0.0
    for x, y in batches:
        _, loss = model(x, y)
        total += loss.item()
    model.train(was_training)
    return total / len(batches)


# --------------------------------------------------------------------------------------------
# training loop
# --------------------------------------------------------------------------------------------

def train_one(opt_name: str, args, strategy: Strategy, cfg, corpus, out: Path,
              on_eval=None) -> RunResult:
    """Train one model with optimizer ``opt_name``; ``on_eval(result)`` is called after evals."""
    train_data, val_data, info = corpus
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    n_params = model.num_params()
    model = strategy.wrap_model(model)
    opt = build_optimizer(opt_name, model, args)
    sched = build_scheduler(opt, args)
    per_rank_batch = args.batch_size // strategy.world_size
    sampler = Batches(train_data, per_rank_batch, cfg.context, args.seed,
                      rank=strategy.rank, world_size=strategy.world_size)
    vbatches = val_batches(args.eval_batches, per_rank_batch, cfg.context, data=val_data)
    res = RunResult(opt_name)
    tokens_per_step = args.batch_size * cfg.context  # global
    start_step = 0
    train_time = 0.0

    if args.resume:
        # our own checkpoint format (plain containers + tensors); only load trusted files
        ck = torch.load(args.resume, map_location="cpu", weights_only=False)
        if ck.get("optimizer_name") != opt_name:
            raise SystemExit(f"checkpoint {args.resume} was written by optimizer "
                             f"{ck.get('optimizer_name')!r}, not {opt_name!r}")
        if ck.get("model_config") != cfg.to_dict():
            raise SystemExit(f"checkpoint model config {ck.get('model_config')} differs from "
                             f"{cfg.to_dict()}")
        old = ck.get("args", {})
        for k in ("steps", "batch_size", "lr", "betas", "eps", "weight_decay", "warmup",
                  "min_lr_frac", "seed", "grad_clip"):
            was, now = old.get(k), getattr(args, k)
            if k == "betas" and was is not None:
                was, now = tuple(was), tuple(now)
            if k in old and was != now:
                log.warning("[%s] resuming with --%s %s, checkpoint was written with %s: the "
                            "run will not match an uninterrupted one", opt_name,
                            k.replace("_", "-"), now, was)
        if ck.get("corpus_sha256") != info["sha256"]:
            log.warning("checkpoint was trained on a different corpus (sha256 %s vs %s)",
                        ck.get("corpus_sha256"), info["sha256"])
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        torch.set_rng_state(ck["torch_rng"])
        start_step = int(ck["step"])
        res.train_losses = list(ck["train_losses"])
        res.evals = list(ck["evals"])
        train_time = float(ck.get("train_time", 0.0))
        log.info("[%s] resumed from %s at step %d", opt_name, args.resume, start_step)

    def save_checkpoint(step: int) -> None:
        if not strategy.is_main:
            return
        path = checkpoint_path(out, opt_name)
        atomic_torch_save({
            "version": CHECKPOINT_VERSION,
            "step": step,
            "optimizer_name": opt_name,
            "model_config": cfg.to_dict(),
            "args": {k: v for k, v in vars(args).items()},
            "corpus_sha256": info["sha256"],
            "model": strategy.model_state_dict(model),
            "optimizer": strategy.optimizer_state_dict(opt),
            "scheduler": sched.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "train_losses": res.train_losses,
            "evals": res.evals,
            "train_time": train_time,
        }, path)
        log.debug("[%s] checkpoint step %d -> %s", opt_name, step, path)

    def do_eval(step: int) -> None:
        vl = strategy.reduce_mean(evaluate(model, vbatches))
        recent = res.train_losses[-max(1, args.eval_every):]
        rec = {
            "step": step,
            "val_loss": vl,
            "train_loss": sum(recent) / len(recent) if recent else None,
            "lr": sched.get_last_lr()[0],
            "tokens_per_s": (step * tokens_per_step / train_time) if train_time > 0 else None,
            "train_time_s": train_time,
        }
        res.evals.append(rec)
        log.info("[%s] step %d/%d  val %.4f  train %s  lr %.2e", opt_name, step, args.steps, vl,
                 "-" if rec["train_loss"] is None else f"{rec['train_loss']:.4f}", rec["lr"])
        if on_eval is not None:
            on_eval(res)

    end_step = args.steps if args.stop_after is None else min(args.steps, args.stop_after)
    if start_step == 0 and args.eval_every > 0:
        do_eval(0)

    from tqdm import tqdm
    bar = tqdm(total=end_step, initial=start_step, desc=opt_name, file=sys.stderr,
               disable=args.no_progress or not strategy.is_main, dynamic_ncols=True,
               mininterval=0.5)
    model.train()
    for step in range(start_step, end_step):
        t0 = time.perf_counter()
        x, y = sampler.batch(step)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        sched.step()
        lv = strategy.reduce_mean(loss.item())
        train_time += time.perf_counter() - t0
        if not math.isfinite(lv):
            bar.close()
            raise FloatingPointError(f"[{opt_name}] non-finite loss {lv} at step {step}")
        res.train_losses.append(lv)
        done = step + 1
        bar.update(1)
        if done % 5 == 0 or done == end_step:
            bar.set_postfix(loss=f"{lv:.3f}",
                            tok_s=f"{done * tokens_per_step / train_time:,.0f}", refresh=False)
        if args.eval_every > 0 and done % args.eval_every == 0:
            do_eval(done)
        if args.checkpoint_every > 0 and done % args.checkpoint_every == 0:
            save_checkpoint(done)
    bar.close()

    finished = end_step == args.steps
    if finished and (not res.evals or res.evals[-1]["step"] != end_step):
        do_eval(end_step)
    if args.checkpoint_every > 0 or args.stop_after is not None:
        save_checkpoint(end_step)  # final state (includes the final eval record)

    sb = optimizer_state_bytes(opt)
    last = res.train_losses[-10:]
    res.summary = {
        "optimizer": opt_name,
        "optimizer_class": type(opt).__module__ + "." + type(opt).__qualname__,
        "steps": end_step,
        "finished": finished,
        "final_train_loss": res.train_losses[-1] if res.train_losses else None,
        "train_loss_last10": sum(last) / len(last) if last else None,
        "val_loss": res.evals[-1]["val_loss"] if res.evals else None,
        "val_loss_step": res.evals[-1]["step"] if res.evals else None,
        "tokens_per_s": (end_step * tokens_per_step / train_time) if train_time > 0 else None,
        "train_time_s": train_time,
        "params": n_params,
        "state_bytes": sb,
        "state_bytes_per_param": sb / n_params,
    }
    return res


# --------------------------------------------------------------------------------------------
# reporting
# --------------------------------------------------------------------------------------------

def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def format_summary(results: dict[str, RunResult]) -> str:
    lines = []
    for name, r in results.items():
        s = r.summary
        vl = "n/a" if s["val_loss"] is None else f"{s['val_loss']:.4f}"
        lines.append(
            f"{name:>6}: steps {s['steps']}  train loss (last10) {s['train_loss_last10']:.4f}  "
            f"val loss {vl}  {s['tokens_per_s'] or 0:,.0f} tok/s  "
            f"state {_fmt_bytes(s['state_bytes'])} ({s['state_bytes_per_param']:.3f} B/param, "
            f"{s['params']:,} params)")
    cmp = comparison(results)
    if cmp:
        lines.append("")
        lines.append(f"{'':<18}{'AdamW':>14}{'Gefen':>14}{'Gefen vs AdamW':>18}")
        lines.append(f"{'val loss':<18}{cmp['adamw_val_loss']:>14.4f}{cmp['gefen_val_loss']:>14.4f}"
                     f"{cmp['val_loss_rel_diff_pct']:>+17.2f}%")
        lines.append(f"{'train loss (10)':<18}{cmp['adamw_train_loss']:>14.4f}"
                     f"{cmp['gefen_train_loss']:>14.4f}{cmp['train_loss_rel_diff_pct']:>+17.2f}%")
        lines.append(f"{'state bytes':<18}{cmp['adamw_state_bytes']:>14,}"
                     f"{cmp['gefen_state_bytes']:>14,}{cmp['state_bytes_ratio']:>17.2f}x")
        lines.append(f"{'bytes/param':<18}{cmp['adamw_bytes_per_param']:>14.3f}"
                     f"{cmp['gefen_bytes_per_param']:>14.3f}")
        lines.append(f"{'tokens/s':<18}{cmp['adamw_tokens_per_s']:>14,.0f}"
                     f"{cmp['gefen_tokens_per_s']:>14,.0f}")
    return "\n".join(lines)


def comparison(results: dict[str, RunResult]) -> dict | None:
    if not {"adamw", "gefen"} <= results.keys():
        return None
    a, g = results["adamw"].summary, results["gefen"].summary
    if not a or not g or a["val_loss"] is None or g["val_loss"] is None:
        return None
    return {
        "adamw_val_loss": a["val_loss"],
        "gefen_val_loss": g["val_loss"],
        "val_loss_rel_diff_pct": 100.0 * (g["val_loss"] - a["val_loss"]) / a["val_loss"],
        "adamw_train_loss": a["train_loss_last10"],
        "gefen_train_loss": g["train_loss_last10"],
        "train_loss_rel_diff_pct":
            100.0 * (g["train_loss_last10"] - a["train_loss_last10"]) / a["train_loss_last10"],
        "adamw_state_bytes": a["state_bytes"],
        "gefen_state_bytes": g["state_bytes"],
        # how many times smaller Gefen's state is than AdamW's
        "state_bytes_ratio": a["state_bytes"] / g["state_bytes"] if g["state_bytes"] else math.inf,
        "adamw_bytes_per_param": a["state_bytes_per_param"],
        "gefen_bytes_per_param": g["state_bytes_per_param"],
        "adamw_tokens_per_s": a["tokens_per_s"] or 0.0,
        "gefen_tokens_per_s": g["tokens_per_s"] or 0.0,
    }


def metrics_dict(args, cfg, info, results: dict[str, RunResult]) -> dict:
    config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()}
    return {
        "config": config,
        "model_config": cfg.to_dict(),
        "corpus": info,
        "torch": torch.__version__,
        "runs": {n: {"evals": r.evals, "train_losses": r.train_losses, "summary": r.summary}
                 for n, r in results.items()},
        "summary": {n: r.summary for n, r in results.items()},
        "comparison": comparison(results),
    }


def plot_losses(results: dict[str, RunResult], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = {"adamw": "tab:blue", "gefen": "tab:red"}
    for name, r in results.items():
        c = colors.get(name)
        tl = r.train_losses
        if tl:
            w = max(1, min(20, len(tl) // 20))
            sm = [sum(tl[max(0, i - w + 1):i + 1]) / len(tl[max(0, i - w + 1):i + 1])
                  for i in range(len(tl))]
            ax.plot(range(1, len(tl) + 1), tl, color=c, alpha=0.2, lw=0.8)
            ax.plot(range(1, len(tl) + 1), sm, color=c, lw=1.5, label=f"{name} train")
        ev = [e for e in r.evals if e["val_loss"] is not None]
        if ev:
            ax.plot([e["step"] for e in ev], [e["val_loss"] for e in ev], "o--", color=c,
                    label=f"{name} val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}{path.suffix}")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------

def main(argv=None) -> dict:
    """Run the job; returns the metrics dict (also written to ``<out>/metrics.json``)."""
    args = parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    if args.threads:
        torch.set_num_threads(args.threads)
    strategy = make_strategy(args.strategy)
    strategy.setup()
    try:
        if args.batch_size % strategy.world_size:
            raise SystemExit("--batch-size must be divisible by the world size")
        names = ["adamw", "gefen"] if args.optimizer == "both" else [args.optimizer]
        if "gefen" in names:
            gefen_class()  # fail before spending time on AdamW
        overrides = {"dropout": args.dropout}
        if args.context is not None:
            overrides["context"] = args.context
        cfg = get_config(args.model, **overrides)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        corpus = load_corpus()
        info = corpus[2]
        log.info("corpus: %d files, %s bytes (train %s / val %s), sha256 %s…", info["files"],
                 f"{info['bytes']:,}", f"{info['train_bytes']:,}", f"{info['val_bytes']:,}",
                 info["sha256"][:16])
        log.info("model %s: %s; %d threads; out %s", args.model, cfg, torch.get_num_threads(),
                 out)

        results: dict[str, RunResult] = {}

        def write_metrics():
            if strategy.is_main:
                atomic_write_text(out / "metrics.json",
                                  json.dumps(metrics_dict(args, cfg, info, results), indent=1))

        def on_eval(res: RunResult):
            results[res.optimizer] = res
            write_metrics()

        for name in names:
            results[name] = train_one(name, args, strategy, cfg, corpus, out, on_eval=on_eval)
            write_metrics()

        metrics = metrics_dict(args, cfg, info, results)
        if strategy.is_main:
            write_metrics()
            if not args.no_plot:
                plot_losses(results, out / "loss.png",
                            f"byte-level GPT '{args.model}' on Python stdlib, "
                            f"{args.steps} steps, batch {args.batch_size}x{cfg.context}")
            print(format_summary(results), flush=True)
            log.info("wrote %s", out / "metrics.json")
        return metrics
    finally:
        strategy.teardown()


if __name__ == "__main__":
    try:
        main()
    except (GefenUnavailable, NotImplementedError) as e:
        sys.exit(f"error: {e}")
