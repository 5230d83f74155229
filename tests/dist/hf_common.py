"""Shared pieces of the Hugging Face multi-rank workers (tests/dist/hf_*.py, accel_*.py): a tiny
randomly initialised GPT-2 (no hub download), a repetitive token dataset the loss can fall on in a
few steps, and small helpers. Not a test itself."""
from __future__ import annotations

import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

VOCAB, CTX = 128, 32


class Tokens(torch.utils.data.Dataset):
    """``n`` rows of one 8-token pattern, rolled; ``input_ids == labels`` (causal LM)."""

    def __init__(self, n: int = 64, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        base = torch.randint(0, VOCAB, (8,), generator=g)
        self.x = torch.stack([base.roll(int(s)).repeat(CTX // 8) for s in torch.randint(0, 8, (n,), generator=g)])

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def tiny_gpt2(seed: int = 0, **overrides):
    """A 2-layer, 64-wide GPT-2 (about 110k parameters), dropout off, same weights on every rank;
    ``overrides`` are further ``GPT2Config`` fields (e.g. ``n_inner``)."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=CTX,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **overrides)
    return transformers.GPT2LMHeadModel(cfg)


def check(cond, msg):
    """``assert`` that survives ``python -O`` and names the rank."""
    if not cond:
        import torch.distributed as dist

        r = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        raise AssertionError(f"[rank {r}] {msg}")


def rank0_print(*a):
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        # one write per line: the other rank's output shares the pipe (PYTHONUNBUFFERED)
        sys.stdout.write(" ".join(map(str, a)) + "\n")
        sys.stdout.flush()


def state_dtypes_ok(state_values) -> int:
    """Number of quantized states among ``state_values``; raises unless every ``idx`` is uint8."""
    n = 0
    for st in state_values:
        if "idx" in st:
            check(st["idx"].dtype == torch.uint8, f"idx dtype {st['idx'].dtype}")
            n += 1
    return n


def check_same_on_ranks(params, opt) -> None:
    """Every rank ends with the same full parameters (``{name: tensor}``) and the same codebook."""
    import torch.distributed as dist

    for n, p in params.items():
        q = p.clone()
        dist.broadcast(q, 0)
        check(torch.equal(p, q), f"{n} differs between ranks")
    cb = opt.codebook.clone()
    dist.broadcast(cb, 0)
    check(torch.equal(cb, opt.codebook), "codebook differs between ranks")


def check_resumed_equal(pa, pb, sa, sb) -> None:
    """A resumed run ends bitwise equal to the uninterrupted one: parameters ``{name: tensor}`` and
    the optimizer's per-tensor state entries (lists of dicts), tensors with their dtypes."""
    for n in pa:
        check(torch.equal(pa[n], pb[n]), f"{n}: resumed run differs from the uninterrupted one "
                                         f"(max |diff| {(pa[n] - pb[n]).abs().max().item():.3g})")
    check(len(sa) == len(sb), (len(sa), len(sb)))
    for a, b in zip(sa, sb):
        check(a.keys() == b.keys(), (sorted(a), sorted(b)))
        for k in a:
            if torch.is_tensor(a[k]):
                check(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"state {k} differs after resume")
            else:
                check(a[k] == b[k], f"state {k}: {a[k]} vs {b[k]}")


def inspect_on_rank0(ck: str, fmt: str):
    """``gefen-dist inspect`` of checkpoint ``ck`` on rank 0 (None elsewhere), after a barrier:
    its format names ``fmt``, its codebook is learned, its state is Gefen's compact one (< 2.5
    B/param). Returns (report, B/param) on rank 0."""
    import torch.distributed as dist

    from gefen_dist.cli import inspect_checkpoint

    dist.barrier()
    if dist.get_rank() != 0:
        return None, None
    r = inspect_checkpoint(ck)
    check(fmt in r["format"], r["format"])
    check(r["codebook"]["learned"], "checkpoint codebook not learned")
    bpp = r["state_bytes"] / max(1, sum(t["numel"] for t in r["tensors"]))
    check(bpp < 2.5, f"checkpointed state is {bpp:.3f} B/param, not Gefen's compact state")
    return r, bpp


def finish_resume(ck: str, save: int, la, lb, pa, pb, sa, sb) -> None:
    """The end of a resume check: the resumed run's losses after step ``save`` equal the
    uninterrupted run's, it ends bitwise equal (:func:`check_resumed_equal`); prints the OK lines."""
    import torch.distributed as dist

    check(len(lb) == len(la) and lb[save:] == la[save:], f"resumed losses {lb} vs uninterrupted {la}")
    check_resumed_equal(pa, pb, sa, sb)
    rank0_print(f"OK resume from {os.path.basename(ck)}: parameters and Gefen state bitwise equal to the "
                f"uninterrupted run, losses {lb[save:]}")
    dist.barrier()
    rank0_print("ALL OK")

