"""torchrun worker: FSDP2 (and HSDP) Gefen against single-process Gefen on the same global batch.

Run: torchrun --nproc_per_node N tests/dist/fsdp_vs_single.py [--hsdp] [--then OPTIONS ...]
Every rank also runs the single-process reference on the full global batch locally. ``--then``
separates configurations checked one after the other in the same launch (a launch costs seconds of
process start-up per rank); rank 0 prints ``CONFIG i: OPTIONS`` before each.
"""
import argparse
import copy
import os
import sys

if "--cuda-batch" in sys.argv:  # before anything imports triton (its interpreter is chosen at import)
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/ (for _fast_interpreter)
    import _fast_interpreter

    _fast_interpreter.install()  # the interpreter patches triton.language once per launch

import torch
import torch.distributed as dist
from _teardown import leave
from torch import nn

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))]
from gefen_dist import Gefen  # noqa: E402


class Net(nn.Module):
    def __init__(self, span=False):
        super().__init__()
        # 33 rows: uneven shards; `tiny` (3x2048 = 6144 >= 4096): an empty shard on rank 3 of 4;
        # b: 132 = 4 x 33 rows, four row blocks of the factored column profile (D12), whose edges
        # fall inside the shards at 3 ranks (44 rows each)
        self.a = nn.Linear(96, 33)
        self.b = nn.Linear(33, 132)
        self.tiny = nn.Parameter(torch.randn(3, 2048) * 0.02)
        self.c = nn.Linear(132, 8, bias=False)
        self.span = span
        if span:  # narrow rows (D16): blocks of 1024 and 342 rows, cut by the shards at 2-4 ranks
            self.e1 = nn.Parameter(torch.randn(4999, 1) * 0.1)
            self.e3 = nn.Parameter(torch.randn(1501, 3) * 0.1)
            gen = torch.Generator().manual_seed(7)
            self.register_buffer("p1", torch.randn(96, 4999, generator=gen) / 70)
            self.register_buffer("p3", torch.randn(96, 4503, generator=gen) / 70)

    def forward(self, x):
        h = torch.relu(self.a(x))
        h = torch.relu(self.b(h))
        h = h + (self.tiny.sum(0)[:132] * 0.1)
        out = self.c(h)
        if self.span:
            out = out + (torch.tanh(x @ self.p1) * self.e1.view(1, -1)).sum(1, keepdim=True) \
                + (torch.tanh(x @ self.p3) * self.e3.reshape(1, -1)).sum(1, keepdim=True)
        return out


def model(span, seed=0):
    torch.manual_seed(seed)
    return Net(span)


def forward(m, x):
    return m(x)


def main():
    configs, cur = [], []
    for a in sys.argv[1:] + ["--then"]:
        if a == "--then":
            configs.append(cur)
            cur = []
        else:
            cur.append(a)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    groups = []
    for i, argv in enumerate(configs):
        if dist.get_rank() == 0:
            print(f"CONFIG {i}: {' '.join(argv)}", flush=True)
        groups += check(parse(argv))
    leave(*groups)


def parse(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--hsdp", action="store_true")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--second-moment", default="shared")
    ap.add_argument("--narrow-span", action="store_true",
                    help="add (4999, 1) and (1501, 3) parameters and step with narrow_rows='span' (D16)")
    ap.add_argument("--narrow-rows8", action="store_true",
                    help="the --narrow-span model stepped with narrow_rows='rows8' (D19): b.weight's rows of 33 "
                         "elements in one-byte codes against blocks of 32 rows, e1 and e3 per block of rows")
    ap.add_argument("--refusals", action="store_true", help="also check the clear refusals (Shard(1), FSDP1)")
    ap.add_argument("--nonfinite", action="store_true",
                    help="also check that a NaN/inf in one rank's shard makes every rank skip or raise")
    ap.add_argument("--cuda-batch", action="store_true",
                    help="step both optimizers with the multi-tensor CUDA batch (gefen_dist.engine.cuda_batch) on CPU "
                         "tensors through the Triton interpreter: the sharded batch's collectives and pieces")
    ap.add_argument("--capturable", action="store_true",
                    help="with --cuda-batch: both optimizers capturable=True, nonfinite='skip' (the verdict, step "
                         "counts and scalars on the device); then a NaN in one rank's shard skips on every rank")
    ap.add_argument("--adamw-import", action="store_true",
                    help="also load AdamW state (DTensor entries of an AdamW over the sharded model, and a full one) "
                         "into a sharded Gefen and compare with the single-process warm start")
    ap.add_argument("--col-blocks", action="store_true",
                    help="tiny (3 rows of 2048 elements: a row per shard at 3 ranks, an empty shard at 4) in a param "
                         "group of its own with col_blocks=4 (D21: a row statistic per block of 512 columns, v_row "
                         "[3, 4])")
    ap.add_argument("--per-tensor", action="store_true",
                    help="both optimizers on the per-tensor path (the native multi-tensor CPU batch off)")
    ap.add_argument("--same-grads", action="store_true",
                    help="feed the FSDP optimizer the single-process gradient (sharded): isolates the "
                         "optimizer's rank invariance, which must then be bitwise")
    return ap.parse_args(argv)


def _groups(m, args):
    """The model's parameters; with ``--col-blocks`` ``tiny`` in a group of its own with ``col_blocks=4``."""
    if not args.col_blocks:
        return m.parameters()
    return [{"params": [m.tiny], "col_blocks": 4}, {"params": [p for p in m.parameters() if p is not m.tiny]}]


def _narrow_kw(args):
    return dict(narrow_rows="rows8") if args.narrow_rows8 else dict(narrow_rows="span") if args.narrow_span else {}


def _narrow_tag(args):
    return " rows8" if args.narrow_rows8 else " span" if args.narrow_span else ""


def check(args):
    """One configuration: the sharded run against the single-process oracle, and the extra checks it
    names; returns the mesh's groups (left together at the end of the launch)."""
    narrow = args.narrow_span or args.narrow_rows8
    rank, ws = dist.get_rank(), dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if args.hsdp:
        mesh = init_device_mesh("cpu", (2, ws // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (ws,))
    ref = model(narrow)
    kw = _narrow_kw(args)
    if args.capturable:
        kw.update(capturable=True, nonfinite="skip")
    ref_opt = Gefen(_groups(ref, args), lr=3e-3, weight_decay=0.1, second_moment=args.second_moment, **kw)
    ref_opt._comm = __import__("gefen_dist.engine.comm", fromlist=["LocalComm"]).LocalComm()  # single-process oracle
    m = model(narrow)
    for mod in (m.a, m.b, m.c):
        fully_shard(mod, mesh=mesh)
    fully_shard(m, mesh=mesh)
    opt = Gefen(_groups(m, args), lr=3e-3, weight_decay=0.1, second_moment=args.second_moment, **kw)
    from gefen_dist.engine import cuda_batch as cuda_path

    cuda_path._DEVICE_TYPES = ("cuda", "cpu") if args.cuda_batch else ("cuda",)
    cuda_path._NATIVE_CPU = not args.per_tensor
    if args.cuda_batch:
        for o in (opt, ref_opt):
            o._impl = lambda t, p=None, group=None: __import__("gefen_dist.kernels.dispatch", fromlist=["_triton"])._triton()
    g = torch.Generator().manual_seed(5)
    n_shard_groups = ws if not args.hsdp else ws  # every rank gets its own slice of the global batch
    for step in range(args.steps):
        xg = torch.randn(8 * ws, 96, generator=g)
        yg = torch.randn(8 * ws, 8, generator=g)
        x, y = xg[rank * 8:(rank + 1) * 8], yg[rank * 8:(rank + 1) * 8]
        opt.zero_grad()
        ((forward(m, x) - y) ** 2).mean().backward()
        if not args.same_grads:
            opt.step()
        ref_opt.zero_grad()
        ((forward(ref, xg) - yg) ** 2).mean().backward()
        if args.same_grads:
            from torch.distributed.tensor import distribute_tensor

            for p, q in zip(m.parameters(), ref.parameters()):
                p.grad._local_tensor.copy_(distribute_tensor(q.grad, p.device_mesh, p.placements)._local_tensor)
            opt.step()
        ref_opt.step()
    if args.cuda_batch:
        assert opt._cuda_batch is not None and opt._cuda_batch.sharded, "the sharded batch did not run"
        assert ref_opt._cuda_batch is not None and not ref_opt._cuda_batch.sharded
        if args.hsdp:
            assert (opt._cuda_batch.cols.mask is not None) == (mesh.get_coordinate()[0] != 0), "replica mask"
        assert (opt._cuda_batch.dstep is not None) == args.capturable
        if rank == 0:
            print(f"OK cuda batch: sharded={opt._cuda_batch.sharded}", flush=True)
    if args.second_moment == "factored" and not narrow:  # b's four row blocks (D12), on every rank as in the oracle
        assert tuple(opt.state[m.b.weight]["v_col"].shape) == (4, 33), opt.state[m.b.weight]["v_col"].shape
    if args.col_blocks:  # tiny's four column blocks (D21): v_row [3, 4] sharded with the rows, scale blocks of 512
        st = opt.state[m.tiny]
        assert tuple(st["v_row"].shape) == (3, 4) and st["scale_block"] == 512, (st["v_row"].shape, st["scale_block"])
        if rank == 0:
            print("OK col blocks: v_row (3, 4)", flush=True)
    if args.same_grads:
        assert torch.equal(opt.codebook, ref_opt.codebook), "codebook differs from single process"
    else:
        # real FSDP gradients differ from the full-batch ones at rounding level (reduce-scatter order),
        # which can move a first-gradient value across a histogram bin edge: the codebook then differs
        # slightly (CPU-dependent: it was bitwise equal on an AMD EPYC, not on an Intel Xeon)
        cdiff = float((opt.codebook - ref_opt.codebook).abs().max())
        if rank == 0:
            print(f"codebook max abs diff {cdiff:.3e}", flush=True)
        assert cdiff <= 1e-3, f"codebook differs from single process by {cdiff}"
    worst = 0.0
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        full = p.full_tensor()
        rel = float((full - q).abs().max() / q.abs().max().clamp_min(1e-30))
        worst = max(worst, rel)
        st, rst = opt.state[p], ref_opt.state[q]
        assert st.get("period") == rst.get("period"), (name, st.get("period"), rst.get("period"))
        span = opt._mode(p) in ("span", "rows8")
        assert span == (narrow and name in ("b.weight", "e1", "e3")), (name, opt._mode(p))
        assert (opt._mode(p) == "rows8") == (args.narrow_rows8 and name == "b.weight"), (name, opt._mode(p))
        for k in ("idx", "scale", "v", "v_row", "scale_code", "v_code", "exp_avg", "exp_avg_sq"):
            if k in st and not (span and k == "scale"):
                assert type(st[k]).__name__ == "DTensor", (name, k)
                assert st[k].placements == p.placements and st[k].shape[0] == p.shape[0]
                ful = st[k].full_tensor()
                assert ful.shape == rst[k].shape, (name, k, ful.shape, rst[k].shape)
        if span:
            assert st["v_blk"].shape == rst["v_blk"].shape, (name, st["v_blk"].shape)
            for k in ("scale", "v_blk", "v_col"):  # replicated (D16): the same on every rank
                assert type(st[k]).__name__ == "Tensor", (name, k, type(st[k]))
        if args.same_grads and args.capturable and "exp_avg" in st:
            # exact tensors under capturable: torch's fused AdamW, whose CPU kernel rounds an element
            # by its position in the (vectorised or scalar) loop: shards and the whole tensor differ
            # by float32 rounding here (a CUDA thread's arithmetic does not depend on it)
            assert rel <= 1e-6, (name, rel)
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.allclose(st[k].full_tensor(), rst[k], rtol=1e-6, atol=1e-12), (name, k)
        elif args.same_grads:
            assert torch.equal(full, q), (name, rel)
            for k in ("idx", "scale", "v", "v_row", "v_blk", "v_col", "scale_code", "v_code", "exp_avg", "exp_avg_sq"):
                if k in st:
                    a = st[k].full_tensor() if hasattr(st[k], "full_tensor") else st[k]
                    assert torch.equal(a, rst[k]), (name, k)
        else:
            # real FSDP gradients differ from the full-batch ones at rounding level (reduce-scatter order)
            # (a single codeword flip moves an element by lr*sigma*gap: ~1e-4 of the max)
            assert rel <= 1e-3, (name, rel)
    if rank == 0:
        print(f"OK fsdp{'/hsdp' if args.hsdp else ''} {args.second_moment}{_narrow_tag(args)}"
              f"{' col_blocks' if args.col_blocks else ''} same_grads={args.same_grads} ws={ws}: max relative param diff {worst:.3e}"
              + ("; quantized tensors bitwise" if args.capturable else ""), flush=True)
    if args.refusals:
        check_refusals(mesh, rank)
    if args.nonfinite:
        check_nonfinite(m, opt, rank, ws)
    if args.capturable:
        check_capturable_skip(m, opt, rank, ws)
    if args.adamw_import:
        check_adamw_import(mesh, args, rank, ws)
    return [mesh.get_group(d) for d in range(mesh.ndim)]


def check_adamw_import(mesh, args, rank, ws):
    """An AdamW over the sharded model and one over the single-process model, stepped on the same
    gradients; their state dicts loaded into Gefen (gefen_dist/optim/adamw_import.py): the sharded
    Gefen's state from the DTensor entries, and from the full single-process dict, equals the
    single-process warm start bitwise (codebook, periods, every state tensor), and one more step on
    the same gradient keeps the parameters equal."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    from gefen_dist.engine.comm import LocalComm

    narrow = args.narrow_span or args.narrow_rows8
    kw = dict(lr=3e-3, weight_decay=0.1, second_moment=args.second_moment, **_narrow_kw(args))
    ref, m = model(narrow, seed=3), model(narrow, seed=3)
    for mod in (m.a, m.b, m.c):
        fully_shard(mod, mesh=mesh)
    fully_shard(m, mesh=mesh)
    a_ref = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1)
    a_sh = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(11)

    def same_grads():
        xg, yg = torch.randn(8 * ws, 96, generator=g), torch.randn(8 * ws, 8, generator=g)
        for net in (ref, m):
            for p in net.parameters():
                p.grad = None
        ((forward(ref, xg) - yg) ** 2).mean().backward()
        for p, q in zip(m.parameters(), ref.parameters()):
            p.grad = distribute_tensor(q.grad, p.device_mesh, p.placements)

    for _ in range(3):
        same_grads()
        a_ref.step()
        a_sh.step()
    g_ref = Gefen(ref.parameters(), **kw)
    g_ref._comm = LocalComm()
    # (copies: a loaded state dict's tensors become the optimizer's own, as in torch, and both step)
    g_ref.load_state_dict(copy.deepcopy(a_ref.state_dict()))
    full_sd = copy.deepcopy(a_ref.state_dict())
    for source in ("dtensor", "full"):
        g_sh = Gefen(m.parameters(), **kw)
        g_sh.load_state_dict(a_sh.state_dict() if source == "dtensor" else full_sd)
        assert torch.equal(g_sh.codebook, g_ref.codebook), source
        for (name, p), q in zip(m.named_parameters(), ref.parameters()):
            st, rst = g_sh.state[p], g_ref.state[q]
            assert st.get("period") == rst.get("period") and st.get("learned") == rst.get("learned"), (source, name)
            assert int(st["step"]) == int(rst["step"]) == 3, (source, name)
            for k, t in rst.items():
                if isinstance(t, torch.Tensor) and k != "step":
                    mine = st[k].full_tensor() if hasattr(st[k], "full_tensor") else st[k]
                    assert torch.equal(mine, t), (source, name, k)
    # an AdamW DCP checkpoint of the sharded model, loaded by gefen_dist.checkpoint.load into a new Gefen
    import tempfile

    from gefen_dist import checkpoint as gck

    box = [tempfile.mkdtemp(prefix="adamw_dcp_") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    path = os.path.join(box[0], "ck")
    gck.save(m, a_sh, path)
    g_dcp = Gefen(m.parameters(), **kw)
    gck.load(m, g_dcp, path)
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        assert torch.equal(p.full_tensor(), q), ("dcp weights", name)
        assert int(g_dcp.state[p]["step"]) == 3 and torch.equal(g_dcp.codebook, g_ref.codebook), ("dcp", name)
        for k, t in g_ref.state[q].items():
            if isinstance(t, torch.Tensor) and k != "step":
                u = g_dcp.state[p][k]
                assert torch.equal(u.full_tensor() if hasattr(u, "full_tensor") else u, t), ("dcp", name, k)
    dist.barrier()
    if rank == 0:
        __import__("shutil").rmtree(box[0], ignore_errors=True)
    same_grads()  # one more step of the last sharded Gefen (the full dict's) and the reference
    g_sh.step()
    g_ref.step()
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        assert torch.equal(p.full_tensor(), q), name
    g_full = Gefen(m.parameters(), **kw)  # a full (unsharded) Gefen state dict loads as each rank's rows
    g_full.load_state_dict(copy.deepcopy(g_ref.state_dict()))
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        for k, t in g_sh.state[p].items():
            if isinstance(t, torch.Tensor):
                u = g_full.state[p][k]
                assert type(u) is type(t) and torch.equal(u.full_tensor() if hasattr(u, "full_tensor") else u,
                                                          t.full_tensor() if hasattr(t, "full_tensor") else t), (name, k)
    if rank == 0:
        print(f"OK adamw import ws={ws}{' hsdp' if args.hsdp else ''}{_narrow_tag(args)}: DTensor and full "
              "AdamW state dicts and an AdamW DCP checkpoint give the single-process warm start bitwise; a full Gefen state dict loads as the shards", flush=True)


def check_nonfinite(m, opt, rank, ws):
    """A NaN in one rank's shard of a quantized tensor's gradient (factored: found through the
    column statistics) or an inf in a small dense one: every rank skips (nonfinite='skip', nothing
    changes) or raises (nonfinite='raise'); the decision is global, so shards never diverge."""
    def snapshot():
        out = [p.detach()._local_tensor.clone() for p in m.parameters()]
        for p in m.parameters():
            for k, v in sorted(opt.state[p].items()):
                if isinstance(v, torch.Tensor):
                    out.append((v._local_tensor if hasattr(v, "_local_tensor") else v).clone())
        return out

    cases = [(m.b.weight, 1 % ws, float("nan")), (m.a.bias, 0, float("inf"))]
    for p_bad, bad_rank, val in cases:
        for mode in ("skip", "raise"):
            for p in m.parameters():
                p.grad = torch.zeros_like(p) + 1e-3
            if rank == bad_rank and p_bad.grad._local_tensor.numel():
                p_bad.grad._local_tensor.view(-1)[0] = val
            opt.nonfinite = mode
            before, skipped = snapshot(), opt.skipped_steps
            if mode == "skip":
                opt.step()
                assert opt.skipped_steps == skipped + 1, (rank, mode, opt.skipped_steps)
            else:
                try:
                    opt.step()
                except RuntimeError as e:
                    assert "non-finite" in str(e), e
                else:
                    raise AssertionError(f"rank {rank}: a {val} gradient on rank {bad_rank} did not raise")
            after = snapshot()
            assert all(torch.equal(a, b) for a, b in zip(before, after)), (rank, mode, "state changed")
    opt.nonfinite = "raise"
    if rank == 0:
        print(f"OK nonfinite ws={ws}: NaN in one shard of a factored tensor and inf in a dense one "
              "make every rank skip (unchanged) or raise", flush=True)


def check_capturable_skip(m, opt, rank, ws):
    """capturable=True: a NaN in the last rank's shard of a factored tensor's gradient is seen on every
    rank through the all-reduced column sums and the MAX of the skip flag: every rank's step changes
    nothing and counts one device skip."""
    for p in m.parameters():
        p.grad = torch.zeros_like(p) + 1e-3
    if rank == ws - 1 and m.b.weight.grad._local_tensor.numel():
        m.b.weight.grad._local_tensor.view(-1)[0] = float("nan")
    before = [p.detach()._local_tensor.clone() for p in m.parameters()]
    state = [(v._local_tensor if hasattr(v, "_local_tensor") else v).clone()
             for p in m.parameters() for _, v in sorted(opt.state[p].items()) if isinstance(v, torch.Tensor)]
    opt.step()
    assert all(torch.equal(a, p.detach()._local_tensor) for a, p in zip(before, m.parameters())), rank
    after = [(v._local_tensor if hasattr(v, "_local_tensor") else v)
             for p in m.parameters() for _, v in sorted(opt.state[p].items()) if isinstance(v, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(state, after)), rank
    assert float(opt.device_skipped_steps) == 1.0, (rank, opt.device_skipped_steps)
    if rank == 0:
        print(f"OK capturable ws={ws}: a NaN in one rank's shard skipped on every rank on the device", flush=True)


def check_refusals(mesh, rank):
    """Layouts whose pieces are not whole rows are refused with an error that says what to do."""
    from torch.distributed.tensor import Shard, distribute_tensor

    col = nn.Parameter(distribute_tensor(torch.randn(8, 64), mesh, [Shard(1)]))
    try:
        Gefen([col])
        raise AssertionError("Shard(1) parameter was accepted")
    except TypeError as e:
        assert "Shard(0)" in str(e) and "Shard(1)" in str(e), e
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    try:
        wrapped = FSDP1(nn.Linear(16, 16), use_orig_params=False)
    except Exception as e:  # FSDP1 construction itself unsupported here: nothing to refuse
        if rank == 0:
            print(f"OK refusals: Shard(1) raises a clear error; SKIP fsdp1 (not buildable here: "
                  f"{type(e).__name__}; tests/test_optimizer.py covers its FlatParameter)", flush=True)
        return
    try:
        Gefen(wrapped.parameters())
        raise AssertionError("FSDP1 FlatParameter was accepted")
    except TypeError as e:
        assert "fully_shard" in str(e), e
    if rank == 0:
        print("OK refusals: Shard(1) and FSDP1 FlatParameter raise clear errors", flush=True)


if __name__ == "__main__":
    main()
