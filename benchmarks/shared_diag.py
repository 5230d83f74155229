"""Why is gefen_dist's second_moment="shared" worse than the paper's code on the small preset?

    python benchmarks/shared_diag.py ref_exact1d shared_refcb gefen_shared reference

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

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]
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


def main() -> None:
    Q.VARIANTS["shared_refcb"] = ("gefen_dist shared with the reference's codebook",
                                  lambda groups, lr, betas, seed: SharedRefCB(groups, lr, betas))
    Q.VARIANTS["ref_exact1d"] = ("reference on >=2-D, AdamW on 1-D",
                                 lambda groups, lr, betas, seed: Combo(groups, lr, betas))
    args = type("A", (), {"quick": False, "lm_preset": None, "lm_batch": None, "lm_context": None, "lm_steps": 100})()
    cfg = Q.lm_config(args)
    for v in sys.argv[1:] or ["ref_exact1d", "shared_refcb", "gefen_shared", "reference"]:
        r = Q.run_lm(v, 0, cfg)
        print(v, r["val_curve"], round(r["bytes_per_param"], 3), flush=True)


if __name__ == "__main__":
    main()
