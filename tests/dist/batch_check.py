"""The multi-tensor CUDA step (gefen_dist.engine.cuda_batch) with several ranks, on CPU tensors through
the Triton interpreter (torchrun, gloo; tests/test_distributed.py launches it at 2 ranks).

Replicated (DDP) tensors, the same gradients on every rank. For each case, Gefen with the batch
against Gefen on the per-tensor path (both on the Triton kernels, the same collectives' group):

* ``plain``: the batch takes every tensor; parameters and state bitwise the per-tensor path's, and
  the same on every rank;
* ``span``: a ``narrow_rows="span"`` tensor is stepped beside the batch (a decision every rank
  makes alike): bitwise as above;
* ``noncontig``: a non-contiguous quantized parameter: with several ranks the whole step goes to
  the per-tensor path (one WARNING naming it), bitwise as above;
* ``nan``: a NaN in one batched gradient on rank 1 only: every rank raises naming the tensor and
  nothing changes on any rank;
* ``capturable``: ``capturable=True`` (the step's verdict, step counts and scalars on the device):
  quantized tensors bitwise the per-tensor path, exact ones (torch's fused AdamW) within rounding;
  a NaN on rank 1 only is skipped on every rank (one MAX all-reduce of the flag), nothing changes;
* ``zero``: ZeroGefen on the Triton path (owners' state-only updates, appliers) against a one-rank
  Gefen on the same path: bitwise, replicas identical;
* ``zeronib``: ZeroGefen with ``second_moment="nibbles"``, its batch against its per-tensor path (the
  ranks' ranges cut rows): bitwise, replicas identical;
* ``zerocb``: ZeroGefen with ``col_blocks="auto"`` (D21; the owners update their rows of the column-blocked
  weight, its update travels compressed), its batch against its per-tensor path and a one-rank Gefen: bitwise.

Prints ``OK <case>`` per case and ``ALL OK batch_check ws=N``.
"""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import copy  # noqa: E402
import hashlib  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from _teardown import leave  # noqa: E402

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/ (for _fast_interpreter)
import _fast_interpreter  # noqa: E402

_fast_interpreter.install()  # the interpreter patches triton.language once per launch
from gefen_dist import Gefen, ZeroGefen  # noqa: E402
from gefen_dist.engine import cuda_batch  # noqa: E402
from gefen_dist.kernels import dispatch  # noqa: E402

cuda_batch._DEVICE_TYPES = ("cuda", "cpu")  # judge CPU tensors as CUDA ones


def model(case):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 96), nn.GELU(), nn.Linear(96, 192), nn.GELU(), nn.Linear(192, 8))
    if case == "noncontig":
        m[2].weight = nn.Parameter(m[2].weight.detach().t().contiguous().t())
    return m


def optimizers(case, a, b):
    kw = dict(lr=1e-3, weight_decay=0.1)
    if case == "span":
        ga, gb = ([{"params": [m[0].weight], "narrow_rows": "span"},
                   {"params": [p for p in m.parameters() if p is not m[0].weight]}] for m in (a, b))
        oa, ob = Gefen(ga, small_threshold=2048, **kw), Gefen(gb, small_threshold=2048, **kw)
    else:
        oa, ob = Gefen(a.named_parameters(), **kw), Gefen(b.named_parameters(), **kw)
    for o in (oa, ob):
        o._impl = lambda t, p=None, group=None: dispatch._triton()
        o._foreach_exact = (lambda o: lambda p, group=None: "exp_avg" in o.state.get(p, {}))(o)
    oa._batched_step = lambda entries: False  # the per-tensor path
    return oa, ob


def grads(m, step):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
    m.zero_grad()
    ((m(x) - y) ** 2).mean().backward()


def train_both(a, b, oa, ob, steps=4, more=()):
    """``steps`` steps of both copies (and of the ``more`` (model, optimizer) pairs) on ``a``'s gradients."""
    for step in range(steps):
        grads(a, step)
        for m, _ in [(b, ob), *more]:
            for p, q in zip(a.parameters(), m.parameters()):
                q.grad = p.grad.clone()
        oa.step()
        ob.step()
        for _, o in more:
            o.step()


def digest(m, o):
    h = hashlib.sha256()
    for p in m.parameters():
        h.update(p.detach().float().numpy().tobytes())
        for v in o.state[p].values():
            if isinstance(v, torch.Tensor):
                h.update(v.detach().float().numpy().tobytes())
    return h.hexdigest()


def same_everywhere(value: str) -> bool:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return len(set(out)) == 1


def say(line: str) -> None:
    """One write per line, so that the ranks' lines do not interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main():
    dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    for case in ("plain", "span", "noncontig"):
        a = model(case)
        b = copy.deepcopy(a)
        oa, ob = optimizers(case, a, b)
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("gefen_dist.engine.cuda_batch").addHandler(handler)
        train_both(a, b, oa, ob)
        logging.getLogger("gefen_dist.engine.cuda_batch").removeHandler(handler)
        da, db = digest(a, oa), digest(b, ob)
        assert da == db, f"{case}: batch != per-tensor on rank {rank}"
        assert same_everywhere(db), f"{case}: replicas differ"
        batch = getattr(ob, "_cuda_batch", None)
        warned = [r.getMessage() for r in records if "is not used" in r.getMessage()]
        if case == "noncontig":
            assert batch is None and len(warned) == 1 and "'2.weight'" in warned[0], warned
        else:
            assert batch is not None and not warned, warned
            if case == "span":
                assert ob._mode(b[0].weight) == "span" and all(p is not b[0].weight for _, p in batch.entries)
        say(f"OK {case} rank {rank}: bitwise the per-tensor path, replicas identical")
        if case == "plain":
            grads(b, 9)
            if rank == 1:
                b[2].weight.grad[3, 5] = float("nan")
            before = digest(b, ob)
            try:
                ob.step()
            except RuntimeError as e:
                assert "non-finite gradient" in str(e) and "2.weight" in str(e), e
            else:
                raise AssertionError(f"rank {rank}: no error for a NaN on rank 1")
            assert digest(b, ob) == before, f"rank {rank}: a refused step changed something"
            say(f"OK nan rank {rank}: every rank raised, nothing changed")
    # capturable=True (engine/device_step.py): the verdict stays on the device, all-reduced with MAX
    a = model("plain")
    b = copy.deepcopy(a)
    oa, ob = (Gefen(m.named_parameters(), lr=1e-3, weight_decay=0.1, nonfinite="skip", capturable=c)
              for m, c in ((a, False), (b, True)))
    for o in (oa, ob):
        o._impl = lambda t, p=None, group=None: dispatch._triton()
    oa._batched_step = lambda entries: False  # the per-tensor path
    train_both(a, b, oa, ob)
    assert ob._cuda_batch is not None and ob._cuda_batch.dstep is not None
    for p, q in zip(a.parameters(), b.parameters()):
        exact = "exp_avg" in oa.state[p]
        for k, v in list(oa.state[p].items()) + [("param", p)]:
            w = q if k == "param" else ob.state[q][k]
            if isinstance(v, torch.Tensor):  # the exact tensors by torch's fused AdamW: within rounding
                assert (torch.allclose(v, w, rtol=1e-6, atol=1e-7) if exact else torch.equal(v, w)), (rank, k)
    assert same_everywhere(digest(b, ob)), "capturable: replicas differ"
    grads(b, 9)
    if rank == 1:
        b[2].weight.grad[3, 5] = float("nan")
    before = digest(b, ob)
    ob.step()  # skipped on every rank, decided on the device
    assert digest(b, ob) == before and float(ob.device_skipped_steps) == 1.0, f"capturable nan: rank {rank}"
    say(f"OK capturable rank {rank}: the batch's quantized tensors bitwise the per-tensor path, exact ones within "
        "rounding; a NaN on rank 1 only skipped on every rank on the device, nothing changed")
    # ZeroGefen on the Triton path (its owners' state-only updates and appliers,
    # kernels/triton_state.py): the ranks own cut ranges; bitwise a one-rank Gefen on the same path
    solo = [dist.new_group([r]) for r in range(ws)][rank]

    a = model("plain")
    b = copy.deepcopy(a)
    oa = Gefen(a.named_parameters(), lr=1e-3, weight_decay=0.1, process_group=solo)
    ob = ZeroGefen(b.named_parameters(), lr=1e-3, weight_decay=0.1)
    for o in (oa, ob):
        o._impl = lambda t, p=None, group=None: dispatch._triton()
    oa._foreach_exact = lambda p, group=None: "exp_avg" in oa.state.get(p, {})
    oa._batched_step = lambda entries: False
    c = copy.deepcopy(a)  # and against the one-rank Gefen's multi-tensor batch (column sums in its order)
    oc = Gefen(c.named_parameters(), lr=1e-3, weight_decay=0.1, process_group=solo)
    oc._impl = lambda t, p=None, group=None: dispatch._triton()
    train_both(a, b, oa, ob, more=[(c, oc)])
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters())), f"zero: rank {rank}"
    assert oc._cuda_batch is not None and all(torch.equal(p, q) for p, q in zip(c.parameters(), b.parameters())), \
        f"zero against the batch: rank {rank}"
    params = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in b.parameters())).hexdigest()
    assert same_everywhere(params), "zero: replicas differ"  # (each rank holds its own slices of the state)
    cut = [ob.owned_range(p) for p in b.parameters()]
    layout, many, rest = ob._apply_cache[2:]  # the appliers of every rank's ranges in one launch
    taken = [x for x in layout if x not in rest]
    assert many is not None and {x[0] for x in taken} == set(range(ws)), f"zero: apply_many {rank}"
    zb = ob._zero_batch  # the column statistics, owners' states and factors batched (zero/batch.py)
    assert zb is not None and zb.fact and sum(sm.launches for _, sm in zb._states) >= 1, f"zero: batch {rank}"
    say(f"OK zero rank {rank}: ZeroGefen on the Triton path bitwise Gefen's (per tensor and batched), replicas "
        f"identical (owned {cut}); {len(taken)} ranges of {ws} ranks applied in {many.launches} launch(es), "
        f"owners' states in {sum(sm.launches for _, sm in zb._states)}")
    # ZeroGefen with second_moment="nibbles" (D20): its batch (the ratios around every rank's v_col EMA,
    # the owners' rows in one NibbleStep) against its per-tensor path (the owners' Triton nibble kernel),
    # the ranks' ranges cutting rows of the weights: bitwise, replicas identical
    from gefen_dist.zero import batch as zbatch

    usable = dispatch.native_cpu_usable, dispatch.triton_usable
    dispatch.native_cpu_usable = lambda t: False  # the owners' per-tensor nibble kernel: the Triton one
    dispatch.triton_usable = lambda t: t.dtype in (torch.float32, torch.bfloat16)
    a = model("plain")
    b = copy.deepcopy(a)
    oa, ob = (ZeroGefen(m.named_parameters(), lr=1e-3, weight_decay=0.1, second_moment="nibbles") for m in (a, b))
    for o in (oa, ob):
        o._impl = lambda t, p=None, group=None: dispatch._triton()
    prepare = zbatch.ZeroBatch.prepare
    zbatch.ZeroBatch.prepare = lambda self, opt: None if opt is oa else prepare(self, opt)
    train_both(a, b, oa, ob, steps=3)
    zbatch.ZeroBatch.prepare = prepare
    dispatch.native_cpu_usable, dispatch.triton_usable = usable
    assert digest(a, oa) == digest(b, ob), f"zeronib: rank {rank}"
    nb = [x for x in ob._zero_batch._nibs if "step" in x]
    params = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in b.parameters())).hexdigest()
    assert len(nb) == 1 and same_everywhere(params), f"zeronib: replicas {rank}"
    cut = [ob.owned_range(p) for p in b.parameters()]
    say(f"OK zeronib rank {rank}: ZeroGefen nibbles' batch bitwise its per-tensor path, replicas identical "
        f"(owned {cut}; {len(nb[0]['params'])} owned tensors in {nb[0]['step'].launches} launch(es))")
    # ZeroGefen with col_blocks="auto" (D21): the (48, 192) weight's owners update its state (rows cut by the
    # ranges; the Triton kernel's state-only step with column blocks) beside the batch's state launches, its update
    # travels compressed and is applied range by range; bitwise the per-tensor path and a one-rank Gefen's batch
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(32, 192), nn.GELU(), nn.Linear(192, 48), nn.GELU(), nn.Linear(48, 8))
    b, c = copy.deepcopy(a), copy.deepcopy(a)
    oa, ob = (ZeroGefen(m.named_parameters(), lr=1e-3, weight_decay=0.1, col_blocks="auto") for m in (a, b))
    oc = Gefen(c.named_parameters(), lr=1e-3, weight_decay=0.1, col_blocks="auto", process_group=solo)
    for o in (oa, ob, oc):
        o._impl = lambda t, p=None, group=None: dispatch._triton()
    zbatch.ZeroBatch.prepare = lambda self, opt: None if opt is oa else prepare(self, opt)
    train_both(a, b, oa, ob, steps=3, more=[(c, oc)])
    zbatch.ZeroBatch.prepare = prepare
    assert digest(a, oa) == digest(b, ob), f"zerocb: rank {rank}"
    assert all(torch.equal(p, q) for p, q in zip(c.parameters(), b.parameters())), f"zerocb against Gefen: {rank}"
    assert tuple(ob.state[b[2].weight]["v_row"].shape)[1:] == (4,) and ob._zero_batch is not None, f"zerocb: {rank}"
    from gefen_dist.zero.partition import MODE_FACTORED

    assert ob._wire_mode(b[2].weight, ob.state[b[2].weight]) == MODE_FACTORED, f"zerocb: wire {rank}"
    params = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in b.parameters())).hexdigest()
    assert same_everywhere(params), f"zerocb: replicas {rank}"
    cut = [ob.owned_range(p) for p in b.parameters()]
    say(f"OK zerocb rank {rank}: ZeroGefen col_blocks' batch bitwise its per-tensor path and a one-rank Gefen, "
        f"replicas identical (owned {cut})")
    dist.barrier()
    if rank == 0:
        say(f"ALL OK batch_check ws={ws}")
    leave()  # gloo's teardown race (tests/dist/_teardown.py)


if __name__ == "__main__":
    main()
