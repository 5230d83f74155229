"""Main training job: a byte-level GPT on the Python stdlib corpus, with Gefen or AdamW.

    python launch/train.py --optimizer both          # AdamW vs Gefen, same seed/init/data
    python launch/train.py --optimizer gefen --model small --steps 1000

Distributed (each rank takes its slice of the same global batch; see docs/training.md):

    torchrun --standalone --nproc_per_node 2 launch/train.py --strategy ddp --optimizer both
    torchrun --standalone --nproc_per_node 2 launch/train.py --strategy zero1   # ZeroGefen
    torchrun --standalone --nproc_per_node 2 launch/train.py --strategy fsdp    # FSDP2
    deepspeed --num_gpus 2 launch/train.py --deepspeed_config integrations/deepspeed/gefen_zero2.json

Fault tolerance (docs/reliability.md): checkpoints are written atomically (temporary + fsync +
rename, with a checksum), and ``--resume auto`` resumes from this run's checkpoint when there is
one, so an elastic restart picks up where the last checkpoint left off:

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node 2 --max-restarts 3 \
        launch/train.py --strategy ddp --checkpoint-every 100 --resume auto --out runs/job

A ``Strategy`` owns the process group and device, model wrapping and the optimizer, the step,
metric reductions and the checkpoint format (rank-0 ``torch.save`` for single/ddp/zero1,
sharded DCP for fsdp, DeepSpeed's own for deepspeed).
"""
from __future__ import annotations

import argparse
import datetime
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
from launch.peers import PEERS, build_peer, step_quietly
from launch.peers import state_bytes as _peer_state_bytes

log = logging.getLogger("launch.train")

OPTIMIZERS = ("gefen", "adamw", "both", *PEERS)
PEER_STRATEGIES = ("single", "ddp")  # peers run where the optimizer sees plain replicated tensors
STRATEGIES = ("single", "ddp", "zero1", "fsdp", "deepspeed")
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
                   help="'both' runs AdamW then Gefen with identical seed, init and data; the other "
                        f"names are peer optimizers (launch/peers.py; strategies {', '.join(PEER_STRATEGIES)})")
    p.add_argument("--gefen-embeddings", default=None, choices=("factored", "shared", "elementwise"),
                   help="Gefen's second_moment for the embeddings' param group (wte, tied to the LM head, and "
                        "wpe); default: the same as every other tensor (factored). 'elementwise' (~5 B/param for "
                        "those tensors) helped on the small preset and hurt the base one (docs/quality.md)")
    p.add_argument("--gefen-second-moment", default=None, choices=("factored", "shared", "elementwise", "nibbles"),
                   help="Gefen's second_moment for every param group (default: Gefen's, factored); 'nibbles' keeps "
                        "both moments in one byte per element (docs/algorithm.md, D20; every strategy but deepspeed)")
    p.add_argument("--strategy", default=None, choices=STRATEGIES,
                   help="parallelism: 'single' (one process), or under torchrun 'ddp' (DDP), "
                        "'zero1' (DDP + ZeroGefen / ZeroRedundancyOptimizer), 'fsdp' (FSDP2), "
                        "'deepspeed' (ZeRO from --deepspeed_config; also under the deepspeed "
                        "launcher). Default: 'deepspeed' with --deepspeed_config, else 'single'")
    p.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config",
                   default=None, help="DeepSpeed JSON for --strategy deepspeed (default: "
                                      "integrations/deepspeed/gefen_zero2.json)")
    p.add_argument("--deepspeed", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None,
                   help="set by the deepspeed launcher (LOCAL_RANK is used)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: CUDA when available (NCCL for distributed strategies), else CPU (gloo)")
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
    p.add_argument("--resume", default=None,
                   help="checkpoint to resume from ('auto': this strategy's checkpoint in --out, "
                        "if there is one): "
                        "a .pt file (single, ddp, zero1), a DCP directory (fsdp), a DeepSpeed "
                        "save directory (deepspeed)")
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop (checkpointing) after this many steps of the --steps schedule, "
                        "e.g. to simulate preemption")
    p.add_argument("--dist-timeout", type=float, default=600.0,
                   help="seconds a collective may wait for the other ranks before it fails (the process "
                        "group's timeout; torch's default is 30 min)")
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
    if args.strategy is None:
        args.strategy = "deepspeed" if args.deepspeed_config else "single"
    if args.optimizer in PEERS and args.strategy not in PEER_STRATEGIES:
        raise SystemExit(f"--optimizer {args.optimizer} (a peer) runs with --strategy "
                         f"{' or '.join(PEER_STRATEGIES)}, not {args.strategy}; ZeRO, FSDP2 and DeepSpeed "
                         "runs compare gefen and adamw")
    if args.deepspeed_config and args.strategy != "deepspeed":
        raise SystemExit(f"--deepspeed_config is for --strategy deepspeed, not {args.strategy}")
    if args.strategy == "deepspeed" and not args.deepspeed_config:
        args.deepspeed_config = str(DEFAULT_DS_CONFIG)
    if args.name is None:
        args.name = time.strftime("%Y%m%d-%H%M%S")
    if args.out is None:
        args.out = os.path.join("runs", args.name)
    return args


# --------------------------------------------------------------------------------------------
# strategies (parallelism)
# --------------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DS_CONFIG = REPO / "integrations" / "deepspeed" / "gefen_zero2.json"
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """This process's peak memory: ``torch.cuda.max_memory_allocated`` on GPU, else peak RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_memory_allocated"
    import resource
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return (peak if sys.platform == "darwin" else peak * 1024), "peak_rss"


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t  # DTensor -> this rank's shard


class Strategy:
    """One process. Also the base class of the distributed strategies, which override:

    * ``setup``/``teardown``: process group, device;
    * ``build``: model wrapping, optimizer, LR scheduler;
    * ``train_step``/``clip``: one optimizer step;
    * ``reduce_mean``/``gather``: metrics across ranks;
    * ``checkpoint_location``/``read_meta``/``save``/``load``: checkpoint format and ownership.
    """

    name = "single"
    distributed = False
    replicated_state = False  # True: every rank holds the whole optimizer state (DDP)

    def __init__(self, args=None):
        self.args = args
        self.rank = 0
        self.local_rank = 0
        self.world_size = 1
        self.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ---------------------------------------------------------------- process group
    def setup(self) -> None:
        want = getattr(self.args, "device", "cpu") if self.args is not None else "cpu"
        if want == "auto":
            want = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(want)

    def teardown(self) -> None:
        pass

    def barrier(self) -> None:
        pass

    def reduce_mean(self, value: float) -> float:
        return value

    def gather(self, value) -> list:
        return [value]

    # ---------------------------------------------------------------- model / optimizer
    def wrap_model(self, model: nn.Module) -> nn.Module:
        return model

    def inner(self, model: nn.Module) -> nn.Module:
        """The user's module (without a DDP/DeepSpeed wrapper)."""
        return model

    def make_optimizer(self, name: str, model: nn.Module, args) -> torch.optim.Optimizer:
        return build_optimizer(name, model, args)

    def build(self, opt_name: str, model: nn.Module, args):
        """``(model, optimizer, scheduler)`` ready to train on ``self.device``."""
        model = self.wrap_model(model.to(self.device))
        opt = self.make_optimizer(opt_name, model, args)
        return model, opt, build_scheduler(opt, args)

    def clip(self, model: nn.Module, max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def train_step(self, model, opt, sched, x, y, args) -> torch.Tensor:
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.grad_clip > 0:
            self.clip(model, args.grad_clip)
        step_quietly(opt)
        sched.step()
        return loss

    def state_bytes(self, opt) -> int:
        """Optimizer-state bytes held by this rank."""
        return optimizer_state_bytes(opt)

    # ---------------------------------------------------------------- checkpoints
    def checkpoint_location(self, out, opt_name: str) -> Path:
        return checkpoint_path(out, opt_name)

    def model_state_dict(self, model: nn.Module) -> dict:
        return self.inner(model).state_dict()

    def optimizer_state_dict(self, opt: torch.optim.Optimizer) -> dict | None:
        """Called on every rank; the full state dict on rank 0 (None elsewhere is allowed)."""
        return opt.state_dict()

    def read_meta(self, path: Path) -> dict:
        return load_checkpoint_file(path)

    def save(self, path: Path, model, opt, sched, meta: dict) -> None:
        """``torch.save`` of the full state by rank 0, atomically (write + rename)."""
        osd = self.optimizer_state_dict(opt)  # collective for ZeRO-1: every rank calls it
        if self.is_main:
            atomic_torch_save({**meta, "model": self.model_state_dict(model), "optimizer": osd,
                               "scheduler": sched.state_dict(), "torch_rng": torch.get_rng_state()},
                              path)
        self.barrier()

    def load(self, path: Path, model, opt, sched, meta: dict) -> None:
        """Load a checkpoint whose :meth:`read_meta` is ``meta``, on every rank."""
        self.inner(model).load_state_dict(meta["model"])
        opt.load_state_dict(meta["optimizer"])
        sched.load_state_dict(meta["scheduler"])
        torch.set_rng_state(meta["torch_rng"])


class DistributedStrategy(Strategy):
    """torchrun (or ``deepspeed`` launcher) workers: the process group comes from the env vars
    ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``; gloo on CPU, NCCL on
    GPUs (one GPU per local rank)."""

    distributed = True

    def setup(self) -> None:
        import torch.distributed as dist

        missing = [k for k in DIST_ENV if k not in os.environ]
        if missing:
            raise SystemExit(
                f"--strategy {self.name} runs under torchrun (missing env vars {', '.join(missing)}), "
                f"e.g. torchrun --standalone --nproc_per_node 2 launch/train.py --strategy {self.name} "
                "...; see docs/training.md")
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ["LOCAL_RANK"])
        want = getattr(self.args, "device", "auto")
        use_cuda = torch.cuda.is_available() if want == "auto" else want == "cuda"
        if use_cuda:
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
        self.backend = "nccl" if use_cuda else "gloo"
        self._owns_pg = False
        if not dist.is_initialized():
            kw = {"device_id": self.device} if use_cuda else {}
            dist.init_process_group(self.backend, timeout=self.timeout(), **kw)
            self._owns_pg = True

    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=float(getattr(self.args, "dist_timeout", 600.0) or 600.0))

    def teardown(self) -> None:
        import torch.distributed as dist

        if getattr(self, "_owns_pg", False) and dist.is_initialized():
            if dist.get_backend() == "gloo":
                # Destroying a gloo group while a peer still talks to it aborts that peer
                # ("terminate called without an active exception"): meet first, but never hang
                # on a peer that already failed.
                try:
                    dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
                except Exception as e:  # a peer is gone: tear down anyway
                    log.warning("teardown: peers did not reach the final barrier (%s)", e)
            dist.destroy_process_group()

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def reduce_mean(self, value: float) -> float:
        import torch.distributed as dist

        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t.item()) / self.world_size

    def gather(self, value) -> list:
        import torch.distributed as dist

        out = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out


class DDPStrategy(DistributedStrategy):
    """``DistributedDataParallel`` + a replicated Gefen/AdamW; rank 0 saves with ``torch.save``."""

    name = "ddp"
    replicated_state = True

    def wrap_model(self, model: nn.Module) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [self.local_rank] if self.device.type == "cuda" else None
        return DDP(model, device_ids=ids)

    def inner(self, model: nn.Module) -> nn.Module:
        return model.module


class Zero1Strategy(DDPStrategy):
    """DDP + ZeRO-1: ``gefen_dist.ZeroGefen`` or ``ZeroRedundancyOptimizer(AdamW)``. Checkpoints
    are consolidated onto rank 0 (``consolidate_state_dict``) and saved with ``torch.save``; they
    load at any world size (and, for Gefen, into single-process Gefen)."""

    name = "zero1"
    replicated_state = False

    def make_optimizer(self, name: str, model: nn.Module, args) -> torch.optim.Optimizer:
        groups = param_groups(model, args.weight_decay)
        kw = dict(lr=args.lr, betas=tuple(args.betas), eps=args.eps, weight_decay=args.weight_decay)
        if name == "gefen":
            gefen_class()
            from gefen_dist import ZeroGefen
            return ZeroGefen(_gefen_groups(model, args), **kw)
        if name == "adamw":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            return ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, **kw)
        raise ValueError(f"unknown optimizer {name!r}")

    def state_bytes(self, opt) -> int:
        inner = getattr(opt, "optim", None)  # ZeroRedundancyOptimizer: this rank's local AdamW
        return optimizer_state_bytes(inner if inner is not None else opt)

    def optimizer_state_dict(self, opt):
        opt.consolidate_state_dict(to=0)
        return opt.state_dict() if self.is_main else None


class FSDPStrategy(DistributedStrategy):
    """FSDP2 (``gefen_dist.integrations.fsdp.shard_model``) + Gefen/AdamW over the sharded
    (DTensor) parameters, global-norm clipping across shards, sharded DCP checkpoints
    (``gefen_dist.checkpoint``) that reload at any world size."""

    name = "fsdp"

    def wrap_model(self, model: nn.Module) -> nn.Module:
        from gefen_dist.integrations.fsdp import shard_model

        return shard_model(model)

    def clip(self, model: nn.Module, max_norm: float) -> None:
        from gefen_dist.integrations.fsdp import clip_grad_norm_

        clip_grad_norm_(model, max_norm)

    def checkpoint_location(self, out, opt_name: str) -> Path:
        return Path(out) / f"checkpoint_{opt_name}_dcp"

    def read_meta(self, path: Path) -> dict:
        return load_checkpoint_file(Path(path) / "meta.pt")

    def save(self, path: Path, model, opt, sched, meta: dict) -> None:
        """Every rank writes its shards into a temporary directory; rank 0 adds ``meta.pt`` and a
        manifest and swaps the complete directory in (``gefen_dist.checkpoint.save``)."""
        from gefen_dist import checkpoint as gckpt

        gckpt.save(model, opt, str(path), files={
            "meta.pt": {**meta, "scheduler": sched.state_dict(), "torch_rng": torch.get_rng_state()}})

    def load(self, path: Path, model, opt, sched, meta: dict) -> None:
        from gefen_dist import checkpoint as gckpt

        gckpt.load(model, opt, str(path))
        sched.load_state_dict(meta["scheduler"])
        torch.set_rng_state(meta["torch_rng"])


class DeepSpeedStrategy(DistributedStrategy):
    """DeepSpeed ZeRO from ``--deepspeed_config`` (default ``integrations/deepspeed/gefen_zero2.json``).

    The JSON is used as is except for what the job owns: batch sizes (``--batch-size`` global,
    one micro-batch per step), ``gradient_clipping`` (``--grad-clip``), the optimizer's
    hyperparameters (``--lr``, ``--betas``, ``--eps``, ``--weight-decay``; ``--optimizer adamw``
    replaces the JSON optimizer by torch's AdamW) and the LR schedule (the job's warmup + cosine
    replaces the JSON ``scheduler``), so that every strategy trains the same recipe.
    """

    name = "deepspeed"

    def setup(self) -> None:
        if not torch.cuda.is_available() or getattr(self.args, "device", "auto") == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        super().setup()
        try:
            import deepspeed
        except ImportError as e:
            raise SystemExit(f"--strategy deepspeed needs deepspeed ({e}); pip install deepspeed") from e
        import gefen_dist.integrations.deepspeed  # noqa: F401  registers "type": "Gefen"

        deepspeed.init_distributed(dist_backend=self.backend, timeout=self.timeout())

    def config(self, opt_name: str, args) -> dict:
        with open(args.deepspeed_config) as f:
            cfg = json.load(f)
        cfg["train_batch_size"] = args.batch_size
        cfg["train_micro_batch_size_per_gpu"] = args.batch_size // self.world_size
        cfg["gradient_accumulation_steps"] = 1
        cfg["gradient_clipping"] = float(args.grad_clip)
        cfg.pop("scheduler", None)
        hp = dict(lr=args.lr, betas=list(args.betas), eps=args.eps, weight_decay=args.weight_decay)
        if opt_name == "adamw":
            cfg["optimizer"] = {"type": "AdamW", "params": {**hp, "torch_adam": True}}
        else:
            opt = cfg.setdefault("optimizer", {"type": "Gefen"})
            if opt.get("type") != "Gefen":
                raise SystemExit(f"--optimizer gefen: {args.deepspeed_config} configures optimizer "
                                 f"{opt.get('type')!r}, expected \"Gefen\"")
            opt["params"] = {**opt.get("params", {}), **hp}
            cfg["zero_allow_untested_optimizer"] = True
        cfg.setdefault("steps_per_print", 10**9)
        return cfg

    def build(self, opt_name: str, model: nn.Module, args):
        import deepspeed

        from gefen_dist.integrations import deepspeed as gds

        cfg = self.config(opt_name, args)
        init = gds.initialize if opt_name == "gefen" else deepspeed.initialize
        groups = _gefen_groups(model, args) if opt_name == "gefen" else param_groups(model, args.weight_decay)
        engine, _, _, sched = init(model=model, model_parameters=groups,
                                   config=cfg, lr_scheduler=lambda o: build_scheduler(o, args))
        self.device = engine.device if isinstance(engine.device, torch.device) else torch.device(engine.device)
        self.stage = int(cfg.get("zero_optimization", {}).get("stage", 0))
        return engine, engine.optimizer, sched

    def inner(self, model):
        return model.module

    def train_step(self, model, opt, sched, x, y, args) -> torch.Tensor:
        _, loss = model(x, y)
        model.backward(loss)
        model.step()  # clipping, optimizer step, zero_grad, LR scheduler step
        return loss

    def state_bytes(self, opt) -> int:
        basic = getattr(opt, "optimizer", opt)  # the ZeRO wrapper's client optimizer
        return optimizer_state_bytes(basic)

    def checkpoint_location(self, out, opt_name: str) -> Path:
        return Path(out) / f"checkpoint_{opt_name}_ds"

    def read_meta(self, path: Path) -> dict:
        return load_checkpoint_file(Path(path) / "meta.pt")

    def save(self, path: Path, model, opt, sched, meta: dict) -> None:
        import shutil

        path = Path(path)
        tag = f"step{meta['step']}"
        model.save_checkpoint(str(path), tag=tag, client_state={"train_meta": meta})  # all ranks
        self.barrier()
        if self.is_main:
            atomic_torch_save(meta, path / "meta.pt")
            for d in path.iterdir():  # keep only the newest tag (the one 'latest' names)
                if d.is_dir() and d.name.startswith("step") and d.name != tag:
                    shutil.rmtree(d, ignore_errors=True)
        self.barrier()

    def load(self, path: Path, model, opt, sched, meta: dict) -> None:
        tag = f"step{meta['step']}"
        loaded, _ = model.load_checkpoint(str(path), tag=tag)  # also restores the LR scheduler
        if loaded is None:
            raise SystemExit(f"DeepSpeed could not load {path} (tag {tag})")


STRATEGY_CLASSES = {"single": Strategy, "ddp": DDPStrategy, "zero1": Zero1Strategy,
                    "fsdp": FSDPStrategy, "deepspeed": DeepSpeedStrategy}


def make_strategy(name: str, args=None) -> Strategy:
    try:
        cls = STRATEGY_CLASSES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; choose from {sorted(STRATEGY_CLASSES)}") from None
    return cls(args)


# --------------------------------------------------------------------------------------------
# optimizer
# --------------------------------------------------------------------------------------------

def param_groups(model: nn.Module, weight_decay: float, embeddings: str | None = None) -> list[dict]:
    """GPT recipe: decay >=2-D tensors (matmuls, embeddings), not 1-D (biases, LayerNorm). With
    ``embeddings`` (a Gefen ``second_moment``), the nn.Embedding weights get a group of their own
    with that second moment."""
    emb = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)} if embeddings else set()
    decay, no_decay, embs = [], [], []
    for _, p in model.named_parameters():  # named_parameters() de-duplicates the tied weight
        if not p.requires_grad:
            continue
        (embs if id(p) in emb else decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if embs:
        groups.append({"params": embs, "weight_decay": weight_decay, "second_moment": embeddings})
    return groups


def _gefen_groups(model: nn.Module, args) -> list[dict]:
    groups = param_groups(model, args.weight_decay, getattr(args, "gefen_embeddings", None))
    sm = getattr(args, "gefen_second_moment", None)
    for g in groups if sm else ():
        g.setdefault("second_moment", sm)  # (the embeddings' own group keeps --gefen-embeddings')
    return groups


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
        return gefen_class()(_gefen_groups(model, args), **kw)
    if name in PEERS:
        return build_peer(name, getattr(model, "module", model), groups, **kw)
    raise ValueError(f"unknown optimizer {name!r}")


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state: ``opt.state_bytes()`` when provided, else the tensors' sizes
    (DTensor: this rank's shard; quantized tensor subclasses: their inner tensors)."""
    return _peer_state_bytes(opt, _local)


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
    """``torch.save`` to ``.<name>.tmp-<pid>``, fsync, rename over ``path``, fsync the directory; the
    file carries a SHA-256 that :func:`load_checkpoint_file` checks (``gefen_dist.checkpoint``)."""
    from gefen_dist.checkpoint import atomic_save

    atomic_save(obj, path)


def load_checkpoint_file(path: str | os.PathLike) -> dict:
    """Our own checkpoint format (plain containers + tensors, unpickled: only load trusted files);
    a truncated or corrupted file raises ``CheckpointCorruptError`` naming it and what to do."""
    from gefen_dist.checkpoint import load_file

    return load_file(path, map_location="cpu", weights_only=False)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def checkpoint_path(out: str, opt_name: str) -> Path:
    return Path(out) / f"checkpoint_{opt_name}.pt"


# Test-only fault injection (tests/test_faults.py): with GEFEN_DIST_FAULT_KILL_AT_STEP=K, rank
# GEFEN_DIST_FAULT_KILL_RANK (default 1) SIGKILLs itself before training step K, but only in the
# first incarnation of a torchrun job (TORCHELASTIC_RESTART_COUNT 0 or unset), so that the
# restarted job (--max-restarts >= 1, --resume auto) runs through.
FAULT_KILL_ENV = "GEFEN_DIST_FAULT_KILL_AT_STEP"
FAULT_RANK_ENV = "GEFEN_DIST_FAULT_KILL_RANK"


def fault_kill_step(strategy: Strategy) -> int | None:
    k = os.environ.get(FAULT_KILL_ENV)
    if not k:
        return None
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) != 0:
        return None
    if strategy.rank != int(os.environ.get(FAULT_RANK_ENV, "1")):
        return None
    return int(k)


def fault_kill(opt_name: str, step: int) -> None:
    import signal

    log.warning("[%s] %s: SIGKILL of rank %s before step %d (test-only fault injection)", opt_name,
                FAULT_KILL_ENV, os.environ.get("RANK", "0"), step)
    sys.stderr.write(f"FAULT: rank {os.environ.get('RANK', '0')} killing itself before step {step}\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


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
    dev = strategy.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    torch.manual_seed(args.seed)
    model = GPT(cfg)  # same init on every rank
    n_params = model.num_params()
    model, opt, sched = strategy.build(opt_name, model, args)
    dev = strategy.device
    per_rank_batch = args.batch_size // strategy.world_size
    sampler = Batches(train_data, per_rank_batch, cfg.context, args.seed,
                      rank=strategy.rank, world_size=strategy.world_size)
    # validation: the same global batches at every world size; each rank evaluates its rows and
    # the per-rank means are averaged (equal row counts: the global mean)
    lo, hi = strategy.rank * per_rank_batch, (strategy.rank + 1) * per_rank_batch
    vbatches = [(x[lo:hi].to(dev), y[lo:hi].to(dev)) for x, y in
                val_batches(args.eval_batches, args.batch_size, cfg.context, data=val_data)]
    res = RunResult(opt_name)
    tokens_per_step = args.batch_size * cfg.context  # global
    start_step = 0
    train_time = 0.0
    ck_path = strategy.checkpoint_location(out, opt_name)

    if strategy.is_main:
        from gefen_dist.checkpoint import recover_interrupted, stale_temporaries

        recover_interrupted(ck_path)  # a directory swap cut short: the previous checkpoint back
        for t in stale_temporaries(ck_path):  # partial writes of a killed run: never read
            log.warning("[%s] removing %s, left by an interrupted checkpoint save", opt_name, t)
            if os.path.isdir(t):
                import shutil
                shutil.rmtree(t, ignore_errors=True)
            else:
                Path(t).unlink(missing_ok=True)
    strategy.barrier()
    resume = ck_path if args.resume == "auto" else (Path(args.resume) if args.resume else None)
    if args.resume == "auto" and not resume.exists():
        log.info("[%s] --resume auto: no checkpoint at %s, starting from step 0", opt_name, resume)
        resume = None
    if resume is not None:
        path = resume
        ck = strategy.read_meta(path)
        if ck.get("optimizer_name") != opt_name:
            raise SystemExit(f"checkpoint {path} was written by optimizer "
                             f"{ck.get('optimizer_name')!r}, not {opt_name!r}")
        if ck.get("model_config") != cfg.to_dict():
            raise SystemExit(f"checkpoint model config {ck.get('model_config')} differs from "
                             f"{cfg.to_dict()}")
        saved_strategy = ck.get("strategy", "single")
        if saved_strategy != strategy.name:
            raise SystemExit(f"checkpoint {path} was written by --strategy {saved_strategy}, "
                             f"this run is --strategy {strategy.name}")
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
        strategy.load(path, model, opt, sched, ck)
        start_step = int(ck["step"])
        res.train_losses = list(ck["train_losses"])
        res.evals = list(ck["evals"])
        train_time = float(ck.get("train_time", 0.0))
        log.info("[%s] resumed from %s at step %d", opt_name, path, start_step)

    def save_checkpoint(step: int) -> None:
        meta = {
            "version": CHECKPOINT_VERSION,
            "step": step,
            "optimizer_name": opt_name,
            "strategy": strategy.name,
            "world_size": strategy.world_size,
            "model_config": cfg.to_dict(),
            "args": {k: v for k, v in vars(args).items()},
            "corpus_sha256": info["sha256"],
            "train_losses": res.train_losses,
            "evals": res.evals,
            "train_time": train_time,
        }
        strategy.save(ck_path, model, opt, sched, meta)
        log.debug("[%s] checkpoint step %d -> %s", opt_name, step, ck_path)

    def do_eval(step: int) -> None:
        vl = strategy.reduce_mean(evaluate(model, vbatches))
        recent = res.train_losses[-max(1, args.eval_every):]
        rec = {
            "step": step,
            "val_loss": vl,
            "train_loss": sum(recent) / len(recent) if recent else None,
            "lr": float(sched.get_last_lr()[0]),  # a tensor for optimizers with tensor lr (torchao)
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
    kill_at = fault_kill_step(strategy)
    for step in range(start_step, end_step):
        if step == kill_at:
            fault_kill(opt_name, step)
        t0 = time.perf_counter()
        x, y = sampler.batch(step)
        loss = strategy.train_step(model, opt, sched, x.to(dev), y.to(dev), args)
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

    sb_ranks = [int(b) for b in strategy.gather(strategy.state_bytes(opt))]
    peak, peak_kind = peak_memory_bytes(dev)
    peaks = [int(b) for b in strategy.gather(peak)]
    # optimizer state of one model copy: DDP replicates it on every rank, the others shard it
    replicas = strategy.world_size if strategy.replicated_state else 1
    sb = sum(sb_ranks) // replicas
    last = res.train_losses[-10:]
    inner_opt = getattr(opt, "optimizer", opt) if strategy.name == "deepspeed" else opt
    res.summary = {
        "optimizer": opt_name,
        "optimizer_class": type(inner_opt).__module__ + "." + type(inner_opt).__qualname__,
        "strategy": strategy.name,
        "world_size": strategy.world_size,
        "device": str(dev),
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
        "state_bytes_per_rank": sb_ranks,
        "state_bytes_sum_over_ranks": sum(sb_ranks),
        "peak_memory_kind": peak_kind,
        "peak_memory_bytes_per_rank": peaks,
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
    strategy = make_strategy(args.strategy, args)
    strategy.setup()
    try:
        if strategy.distributed:
            # one run directory for all ranks (the default name is rank 0's timestamp)
            args.name, args.out = strategy.gather((args.name, args.out))[0]
            if not strategy.is_main:  # log (and show progress) on rank 0 only
                logging.getLogger().setLevel(logging.WARNING)
                log.setLevel(logging.WARNING)
            log.info("strategy %s: %d ranks, backend %s, device %s", strategy.name,
                     strategy.world_size, strategy.backend, strategy.device)
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
