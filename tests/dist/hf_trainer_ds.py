"""transformers.Trainer + a DeepSpeed JSON that names Gefen (ZeRO-2), 2 ranks on CPU/gloo.

Run: DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 2 tests/dist/hf_trainer_ds.py OUTDIR

The Trainer (through Accelerate) builds the DeepSpeed engine from the JSON, so DeepSpeed constructs
``gefen_dist.integrations.deepspeed.Gefen`` itself and nobody calls ``gds.initialize``: the ZeRO
layout is found lazily at the first ``step()``. Checks, on every rank:

* the engine's basic optimizer is the DeepSpeed-aware Gefen, its layout was discovered
  (``_ds_flats``), the codebook and periods are learned, every ``idx`` is uint8, the training loss
  goes down, the parameters are identical on both ranks;
* ``"col_blocks": "shape"`` in the JSON (D21, ``col_blocks="auto"``'s rule: GPT-2's ``Conv1D`` weights ``c_attn`` ``(64, 192)`` and ``c_fc``
  ``(64, 256)`` in three and four blocks of columns) reaches the flat buffers' state;
* the Trainer's checkpoint (``checkpoint-2/global_step2``) holds Gefen's compact state
  (``gefen-dist inspect`` reads it);
* a second Trainer resumed from ``checkpoint-2`` ends with bitwise the same parameters and the same
  optimizer state as the uninterrupted run, and logs the same losses for steps 3-4.

Prints ``OK ...`` lines on rank 0 and ``ALL OK`` at the end.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _teardown import leave  # noqa: E402
from hf_common import Tokens, check, check_same_on_ranks, finish_resume, inspect_on_rank0, rank0_print, state_dtypes_ok, tiny_gpt2  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
from accelerate.state import AcceleratorState, PartialState  # noqa: E402

import gefen_dist.integrations.deepspeed as gds  # noqa: E402  (registers "Gefen" with DeepSpeed)
from gefen_dist.integrations.hf import trainer_deepspeed_config  # noqa: E402

STEPS, SAVE = 4, 2

# What a user writes (trainer_deepspeed_config() returns exactly this dict): Gefen named in the JSON;
# "auto" takes lr/betas/eps/weight_decay, batch sizes and clipping from the TrainingArguments (the
# Trainer fills them in); no scheduler section, so the Trainer's own (linear) schedule drives
# DeepSpeed's optimizer. "col_blocks": "shape" (D21, the rule "auto" is: the Trainer takes every "auto" for its own
# placeholder) for GPT-2's Conv1D weights.
DS_CONFIG = {
    "zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": False},
    "optimizer": {"type": "Gefen",
                  "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto", "col_blocks": "shape"}},
    "zero_allow_untested_optimizer": True,
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 1000000,
}


def make_trainer(out, ds_json):
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=STEPS, per_device_train_batch_size=4, learning_rate=3e-3, weight_decay=0.1,
        adam_beta2=0.95, max_grad_norm=1.0, lr_scheduler_type="linear", warmup_steps=1, save_steps=SAVE,
        save_strategy="steps", logging_steps=1, report_to=[], seed=0, data_seed=0, dataloader_num_workers=0,
        disable_tqdm=True, deepspeed=ds_json, save_only_model=False,
        accelerator_config={"use_configured_state": True})
    return transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens())


def _column_blocks(opt):
    """Segment name -> its column blocks (D21) as this rank's flat-buffer states lay them out (K > 1 only)."""
    from gefen_dist.engine.flat_layout import _slots

    out = {}
    for flat_id, fs in opt._ds_flats.items():
        st = opt.state[opt._ds_tensors[flat_id]]
        check(st.get("col_blocks") == "shape", st.get("col_blocks"))
        plan, *_ = _slots(fs.segments, st["periods"], fs.small_threshold, True, st.get("row_blocks", 1),
                          span=fs._span_fn(True), col_blocks=st["col_blocks"])
        out.update((sp.seg.name, sp.colb) for sp in plan if sp.colb > 1)
    return out


def snapshot(trainer):
    eng = trainer.model_wrapped
    opt = eng.optimizer.optimizer if hasattr(eng.optimizer, "optimizer") else eng.optimizer
    params = {n: p.detach().clone() for n, p in eng.module.named_parameters()}
    state = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()} for st in opt.state.values()]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return eng, opt, params, state, losses


def main():
    out = sys.argv[1]
    torch.set_num_threads(1)
    check(trainer_deepspeed_config(2, col_blocks="auto") == DS_CONFIG, trainer_deepspeed_config(2, col_blocks="auto"))
    ds_json = os.path.join(out, "gefen_zero2_trainer.json")
    os.makedirs(out, exist_ok=True)
    tmp = f"{ds_json}.{os.environ.get('RANK', '0')}"  # every rank writes the same file atomically (no
    with open(tmp, "w") as f:                          # process group exists before TrainingArguments)
        json.dump(DS_CONFIG, f, indent=2)
    os.replace(tmp, ds_json)

    # CPU only: on GPUs the Trainer's own PartialState picks nccl. Without CUDA it finds no backend
    # and would run DeepSpeed with a world size of 1 on each rank, so the state is configured
    # beforehand with gloo and the Trainer told to use it ("use_configured_state").
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")

    # -------------------------------------------------------------- uninterrupted run
    full = make_trainer(os.path.join(out, "a"), ds_json)
    res = full.train()
    ws = dist.get_world_size()
    check(ws == 2, f"world size {ws}")
    eng, opt, pa, sa, la = snapshot(full)
    check(type(opt) is gds.Gefen, f"basic optimizer is {type(opt)}")
    check(type(eng.optimizer).__name__ == "DeepSpeedZeroOptimizer", type(eng.optimizer).__name__)
    check(bool(opt._ds_flats), "the ZeRO layout was not discovered")
    check(opt.codebook is not None and opt.codebook.numel() == 256, "codebook not learned")
    # the "auto" values came from the TrainingArguments; the Trainer's linear schedule drives the lr
    g = opt.param_groups[0]
    check((tuple(g["betas"]), g["eps"], g["weight_decay"]) == ((0.9, 0.95), 1e-8, 0.1),
          (g["betas"], g["eps"], g["weight_decay"]))
    check(g["lr"] == full.lr_scheduler.get_last_lr()[0] and 0 <= g["lr"] < 3e-3,
          (g["lr"], full.lr_scheduler.get_last_lr()))
    per = opt.periods()
    check(per and all(v >= 0 for v in per.values()), f"periods not learned: {per}")
    nq = state_dtypes_ok(opt.state.values())
    check(nq >= 1, "no quantized state")
    colb = _column_blocks(opt)
    check(colb and max(colb.values()) == 4, colb)
    check(all(st["step"] == STEPS for st in opt.state.values()), [st["step"] for st in opt.state.values()])
    check(res.global_step == STEPS and len(la) == STEPS, (res.global_step, la))
    check(la[-1] < la[0], f"loss did not go down: {la}")
    # the segments carry the model's parameter names (found through the engine), not "paramN"
    names = [None, None]
    dist.all_gather_object(names, sorted(per))
    seen = set(names[0]) | set(names[1])
    check("transformer.h.0.attn.c_attn.weight" in seen and not any(n.startswith("param") for n in seen),
          sorted(seen)[:8])
    # ZeRO-2: every rank ends with the same full parameters; state learned in the global tensor:
    # the same codebook on both ranks
    check_same_on_ranks(pa, opt)
    rank0_print(f"OK trainer+deepspeed zero2: lazy layout ({len(opt._ds_flats)} flat partitions, {len(per)} segments "
                f"on this rank; column blocks {sorted(set(colb.values()))}), loss {la[0]:.3f} -> {la[-1]:.3f}, idx uint8")

    ck = os.path.join(out, "a", f"checkpoint-{SAVE}")
    r, bpp = inspect_on_rank0(ck, "DeepSpeed")
    if r is not None:
        check(r["world_size"] == 2, r.get("world_size"))
        q = [t for t in r["tensors"] if t["kind"] == "quantized"]
        check(q and any(t["name"] == "transformer.h.0.attn.c_attn.weight" for t in r["tensors"]),
              [t["name"] for t in r["tensors"]][:10])
        rank0_print(f"OK checkpoint {os.path.basename(ck)}: {r['format']}, {len(q)} quantized tensors, "
                    f"{bpp:.3f} B/param")
    dist.barrier()

    # -------------------------------------------------------------- resume from checkpoint-2
    # a second Trainer in the same processes: Accelerate allows one DeepSpeed plugin per
    # AcceleratorState, so drop the first one (the gloo PartialState stays)
    AcceleratorState._reset_state(reset_partial_state=False)
    resumed = make_trainer(os.path.join(out, "b"), ds_json)
    resumed.train(resume_from_checkpoint=ck)
    _, opt_b, pb, sb, lb = snapshot(resumed)
    check(type(opt_b) is gds.Gefen and bool(opt_b._ds_flats), "resumed optimizer lost its layout")
    state_dtypes_ok(opt_b.state.values())
    check(torch.equal(opt_b.codebook, opt.codebook), "resumed codebook differs")
    check(opt_b.periods() == per, "resumed periods differ")
    # the log history of steps 1-2 comes from the checkpoint's trainer_state.json, 3-4 are new
    check(len(lb) == STEPS, (len(lb), STEPS))
    finish_resume(ck, SAVE, la, lb, pa, pb, sa, sb)
    leave()  # barrier, destroy, exit without static destructors (_teardown.py)


if __name__ == "__main__":
    main()
