"""transformers.Trainer with ``optimizer_cls_and_kwargs=(gefen_dist.Gefen, {...})`` under DDP, 2 CPU ranks,
launched by ``accelerate launch`` with the shipped ``integrations/accelerate/ddp.yaml``.

Run (the two flags override the GPU-sized values of the shipped file; nothing else changes)::

    accelerate launch --config_file integrations/accelerate/ddp.yaml --num_processes 2 --mixed_precision no \
        tests/dist/hf_trainer_ddp.py OUTDIR

No ``gefen_dist.integrations.hf`` helper: the optimizer is the plain class with its kwargs, as
for any ``torch.optim`` optimizer, and the Trainer builds its own two param groups (weight decay
on all but biases and LayerNorm weights). Checks, on every rank:

* the model is wrapped in ``DistributedDataParallel`` over 2 ranks, the Trainer's optimizer is
  ``gefen_dist.Gefen`` with the Trainer's param groups and the kwargs given, it stepped 4 times
  (uint8 ``idx``, learned codebook), the loss goes down, parameters and codebook agree on both ranks;
* ``checkpoint-2/optimizer.pt`` (written by rank 0) is Gefen's compact state (``gefen-dist inspect``);
* a second Trainer resumed from ``checkpoint-2`` ends with bitwise the same parameters, Gefen state
  and step-3/4 losses as the uninterrupted run.

Prints ``OK ...`` lines on rank 0 and ``ALL OK`` at the end.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _teardown import leave  # noqa: E402
from hf_common import Tokens, check, check_same_on_ranks, finish_resume, inspect_on_rank0, rank0_print, state_dtypes_ok, tiny_gpt2  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402

import gefen_dist  # noqa: E402

STEPS, SAVE = 4, 2
GEFEN_KW = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8}  # what the user writes; weight decay: the Trainer's groups


# CPU only (on GPUs leave both out): without them Accelerate's state on a CPU-only machine is
# DistributedType.NO under this launch (it looks for an accelerator backend), and each rank trains
# alone, without DDP and without an error. use_cpu gives MULTI_CPU over gloo.
CPU_ARGS = {} if torch.cuda.is_available() else {"use_cpu": True, "ddp_backend": "gloo"}


def make_trainer(out):
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=STEPS, per_device_train_batch_size=4, learning_rate=3e-3, weight_decay=0.1,
        max_grad_norm=1.0, lr_scheduler_type="linear", warmup_steps=1, save_steps=SAVE, save_strategy="steps",
        logging_steps=1, report_to=[], seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
        **CPU_ARGS)
    return transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(),
                                optimizer_cls_and_kwargs=(gefen_dist.Gefen, dict(GEFEN_KW)))


def inner(opt):
    return getattr(opt, "optimizer", opt)  # Accelerate's AcceleratedOptimizer wraps it


def snapshot(trainer):
    opt = inner(trainer.optimizer)
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    state = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
             for g in opt.param_groups for p in g["params"]]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return opt, params, state, losses


def main():
    out = sys.argv[1]
    torch.set_num_threads(1)
    full = make_trainer(os.path.join(out, "a"))
    res = full.train()
    check(dist.is_initialized() and dist.get_world_size() == 2, "not 2 ranks")
    rank0_print(f"OK launch: {full.accelerator.distributed_type}, backend {dist.get_backend()}, "
                f"world size {dist.get_world_size()}, mixed precision {full.accelerator.mixed_precision}")
    check(isinstance(full.model_wrapped, torch.nn.parallel.DistributedDataParallel), type(full.model_wrapped))
    opt, pa, sa, la = snapshot(full)
    check(type(opt) is gefen_dist.Gefen, f"the Trainer's optimizer is {type(opt)}")
    wds = [g["weight_decay"] for g in opt.param_groups]
    check(wds == [0.1, 0.0], f"param groups' weight decay {wds}")
    check(all(p.ndim >= 2 for p in opt.param_groups[0]["params"]), "decayed group holds 1-D tensors")
    g = opt.param_groups[0]
    check((tuple(g["betas"]), g["eps"]) == (GEFEN_KW["betas"], GEFEN_KW["eps"]), (g["betas"], g["eps"]))
    check(g["lr"] == full.lr_scheduler.get_last_lr()[0], (g["lr"], full.lr_scheduler.get_last_lr()))
    nq = state_dtypes_ok(opt.state.values())
    check(nq >= 1, "no quantized state")
    check(all(st["step"] == STEPS for st in opt.state.values()), [st["step"] for st in opt.state.values()])
    check(opt.codebook is not None and opt.codebook.numel() == 256, "codebook not learned")
    check(res.global_step == STEPS and len(la) == STEPS and la[-1] < la[0], (res.global_step, la))
    check_same_on_ranks(pa, opt)
    rank0_print(f"OK trainer+ddp: {type(opt).__module__}.{type(opt).__name__} from optimizer_cls_and_kwargs, "
                f"groups wd {wds}, stepped {STEPS}x, {nq} quantized states, loss {la[0]:.3f} -> {la[-1]:.3f}")

    ck = os.path.join(out, "a", f"checkpoint-{SAVE}")  # written by rank 0; every rank resumes from it
    r, bpp = inspect_on_rank0(ck, "Hugging Face Trainer")
    if r is not None:
        rank0_print(f"OK checkpoint {os.path.basename(ck)}: {r['format']}, {bpp:.3f} B/param")
    dist.barrier()

    resumed = make_trainer(os.path.join(out, "b"))
    resumed.train(resume_from_checkpoint=ck)
    opt_b, pb, sb, lb = snapshot(resumed)
    check(type(opt_b) is gefen_dist.Gefen, type(opt_b))
    check(torch.equal(opt_b.codebook, opt.codebook), "resumed codebook differs")
    check(len(lb) == STEPS, (len(lb), STEPS))
    finish_resume(ck, SAVE, la, lb, pa, pb, sa, sb)
    leave()


if __name__ == "__main__":
    main()
