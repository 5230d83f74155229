"""Why is gefen_dist's second_moment="shared" worse than the paper's code on the small preset?

    python research/shared_diag.py ref_exact1d shared_refcb gefen_shared reference
    python research/shared_diag.py step1      # one step against the reference, same codebook

Runs benchmarks/quality.py's LM recipe (small preset, seed 0) shortened to 100 steps (the cosine
schedule then spans those 100 steps) for variants that each undo one gefen_dist decision, and
prints each one's validation loss at step 100; nothing is written to the results files.

* ``ref_exact1d``: the reference on the >=2-D tensors and torch AdamW on the 1-D ones (gefen_dist
  keeps 1-D tensors exact);
* ``shared_refcb``: gefen_dist shared, with the codebook the reference learns from the same first
  gradient (gefen_dist learns it from the quantized tensors only).
"""
import contextlib
import io
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "research"), str(ROOT / "benchmarks"), str(ROOT)]
import quality as Q  # noqa: E402
from gefen_dist import Gefen  # noqa: E402
class Combo(torch.optim.Optimizer):
    """The reference Gefen over the >=2-D groups, torch AdamW over the 1-D ones."""

    def __init__(self, groups, lr, betas):
        from gefen.gefen import Gefen as Ref
        big = [g for g in groups if any(p.dim() >= 2 for p in g["params"])]
        small = [g for g in groups if not any(p.dim() >= 2 for p in g["params"])]
        with contextlib.redirect_stdout(io.StringIO()):
            self.ref = Ref(big, lr=lr, betas=betas, eps=1e-8, fused=False)
        self.adam = torch.optim.AdamW(small, lr=lr, betas=betas, eps=1e-8)
        super().__init__([p for g in groups for p in g["params"]], dict(lr=lr))
        self.param_groups = self.ref.param_groups + self.adam.param_groups

    def step(self, closure=None):
        with contextlib.redirect_stdout(io.StringIO()):
            self.ref.step()
        self.adam.step()

    @property
    def state(self):
        st = dict(self.ref.state)
        st.update(self.adam.state)
        return st

    @state.setter
    def state(self, v):  # torch.optim.Optimizer.__init__ assigns it; the two inner optimizers own it
        pass


class SharedRefCB(Gefen):
    """gefen_dist shared, but with the codebook the reference learns from the same first gradient."""
    def __init__(self, groups, lr, betas):
        self._all = [p for g in groups for p in g["params"]]
        super().__init__(groups, lr=lr, betas=betas, eps=1e-8, second_moment="shared", fused=False)
    def _learn_codebook(self, live, t_periods):
        super()._learn_codebook(live, t_periods)
        from gefen.gefen import Gefen as Ref
        copies = [torch.nn.Parameter(p.detach().clone()) for p in self._all]
        for c, p in zip(copies, self._all):
            c.grad = p.grad.detach().clone()
        with contextlib.redirect_stdout(io.StringIO()):
            ref = Ref(copies, lr=0.0, betas=(0.9, 0.95), eps=1e-8, fused=False)
            ref.step()
        cb = ref._gefen_codebook.detach().to(torch.float32).clone()
        print("codebook max |diff| vs ours:", float((cb - self.codebook).abs().max()), flush=True)
        self.codebook = cb
        for st in self.state.values():
            if "codebook" in st:
                st["codebook"] = self._codebook_for(st["idx"].device)


def step1_check() -> None:
    """gefen_dist shared (with the reference's codebook) against the reference after one step on the
    small GPT: every >=2-D parameter, index, scale and v, bitwise."""
    import copy

    from gefen.gefen import Gefen as Ref
    from launch.gpt import GPT, get_config

    torch.manual_seed(0)
    m1 = GPT(get_config("small"))
    m2 = copy.deepcopy(m1)

    def groups(m):
        return [{"params": [p for p in m.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                {"params": [p for p in m.parameters() if p.dim() < 2], "weight_decay": 0.0}]

    o1 = SharedRefCB(groups(m1), lr=2e-3, betas=(0.9, 0.95))
    with contextlib.redirect_stdout(io.StringIO()):
        o2 = Ref(groups(m2), lr=2e-3, betas=(0.9, 0.95), eps=1e-8, fused=False)
    x = torch.randint(0, 256, (8, 129), generator=torch.Generator().manual_seed(1))
    for m, o in ((m1, o1), (m2, o2)):
        o.zero_grad()
        m(x[:, :-1].contiguous(), x[:, 1:].contiguous())[1].backward()
        with contextlib.redirect_stdout(io.StringIO()):
            o.step()
    same = True
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        if a.dim() < 2:
            continue
        s1, s2 = o1.state[a], o2.state[b]
        eq = (torch.equal(a, b) and torch.equal(s1["idx"].reshape(-1).long(), s2["m_codebook"].reshape(-1).long())
              and torch.equal(s1["scale"].reshape(-1), s2["m_magnitude"].reshape(-1))
              and torch.equal(s1["v"].reshape(-1), s2["vmean"].reshape(-1)))
        same &= eq
        if not eq:
            print("differs:", n)
    print("step 1, >=2-D tensors, same codebook: " + ("bitwise equal" if same else "NOT equal"))


def main() -> None:
    if sys.argv[1:] == ["step1"]:
        step1_check()
        return
    Q.register("shared_refcb", "gefen_dist shared with the reference's codebook",
               lambda groups, lr, betas, seed: SharedRefCB(groups, lr, betas))
    Q.register("ref_exact1d", "reference on >=2-D, AdamW on 1-D",
               lambda groups, lr, betas, seed: Combo(groups, lr, betas))
    args = type("A", (), {"quick": False, "lm_preset": None, "lm_batch": None, "lm_context": None, "lm_steps": 100})()
    cfg = Q.lm_config(args)
    for v in sys.argv[1:] or ["ref_exact1d", "shared_refcb", "gefen_shared", "reference"]:
        r = Q.run_lm(v, 0, cfg)
        print(v, r["val_curve"], round(r["bytes_per_param"], 3), flush=True)


if __name__ == "__main__":
    main()
