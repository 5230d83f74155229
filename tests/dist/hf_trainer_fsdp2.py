"""transformers.Trainer with FSDP2 and ``optimizer_cls_and_kwargs=(gefen_dist.Gefen, {...})``: saved
at 2 CPU ranks, resumed at 1 (another world size) with ``resume_from_checkpoint``.

    torchrun --standalone --nproc_per_node 2 tests/dist/hf_trainer_fsdp2.py save SDT OUT
    torchrun --standalone --nproc_per_node 1 tests/dist/hf_trainer_fsdp2.py load SDT OUT

``SDT`` is the ``fsdp_config["state_dict_type"]``: ``SHARDED_STATE_DICT`` (the optimizer goes to a
DCP directory, loaded by Accelerate's ``load_fsdp_optimizer`` through ``dcp.load`` into the fresh
optimizer's state: the plain flow) or ``FULL_STATE_DICT`` (one full ``optimizer.bin``).

The model is the tiny GPT-2 of hf_common with ``n_inner=2560``: the c_fc rows of 2560 elements
have factored period 1280, shorter than the row (docs/algorithm.md D14). No gefen_dist checkpoint
helper is called: the Trainer's own save and resume.

``save`` (2 ranks): the Trainer trains ``SAVE`` steps with ``save_steps=SAVE``; a callback writes
the full (``full_tensor``) parameters and Gefen state at that save (rank 0, ``ref.pt``).
``load`` (1 rank, FSDP2 on a 1-rank mesh): a fresh Trainer (model of another seed) resumes from
``checkpoint-SAVE`` and trains one more step; a callback checks at ``on_train_begin`` (after the
Trainer loaded the checkpoint) that every parameter and Gefen state tensor equals the saved full one
bitwise (dtype kept: uint8 ``idx``), then that the step ran (step counts ``SAVE + 1``).

On CPU the Trainer refuses FSDP ("Using fsdp only works in distributed training": Accelerate finds
no accelerator backend and reports DistributedType.NO); marking the already initialised gloo state
multi-device, as tests/dist/accel_train.py does for Accelerate, makes it use its FSDP2 plugin. On
GPUs none of that is needed. Prints ``OK ...`` lines and ``ALL OK``.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _teardown import leave  # noqa: E402
from accel_resume import N_INNER, check_loaded, full_state  # noqa: E402
from hf_common import Tokens, check, rank0_print, tiny_gpt2  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
from accelerate.state import PartialState  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402

import gefen_dist  # noqa: E402

SAVE = 3
GEFEN_KW = {"lr": 3e-3, "betas": (0.9, 0.95)}


def make_trainer(out, sdt, seed, max_steps, batch):
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    PartialState(backend="gloo")
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=max_steps, per_device_train_batch_size=batch, learning_rate=3e-3,
        weight_decay=0.1, save_steps=SAVE, save_strategy="steps", report_to=[], seed=0, data_seed=0,
        dataloader_num_workers=0, disable_tqdm=True, ddp_backend="gloo",
        fsdp="full_shard", fsdp_config={"fsdp_version": 2, "state_dict_type": sdt, "reshard_after_forward": True})
    _ = args.device  # sets up Accelerate's state for the arguments
    if not torch.cuda.is_available():
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    return transformers.Trainer(model=tiny_gpt2(seed, n_inner=N_INNER), args=args, train_dataset=Tokens(),
                                optimizer_cls_and_kwargs=(gefen_dist.Gefen, dict(GEFEN_KW)))


def gefen_of(trainer):
    opt = trainer.optimizer
    opt = getattr(opt, "optimizer", opt)
    check(type(opt) is gefen_dist.Gefen, f"the Trainer's optimizer is {type(opt)}")
    return opt


class SaveRef(transformers.TrainerCallback):
    def __init__(self, trainer, out):
        self.trainer, self.out = trainer, out

    def on_save(self, args, state, control, **kw):
        ref = full_state(self.trainer.model, gefen_of(self.trainer))  # collective (full_tensor)
        if dist.get_rank() == 0:
            torch.save(ref, os.path.join(self.out, "ref.pt"))


class CheckLoaded(transformers.TrainerCallback):
    def __init__(self, trainer, ref, sdt):
        self.trainer, self.ref, self.sdt = trainer, ref, sdt
        self.checked = False

    def on_train_begin(self, args, state, control, **kw):
        gopt = gefen_of(self.trainer)
        nq = check_loaded(self.trainer.model, gopt, self.ref, "after resume")
        check(state.global_step == SAVE, state.global_step)
        rank0_print(f"OK trainer+fsdp2 {self.sdt}: ws=2 -> resume ws=1: parameters and Gefen state bitwise equal to the "
                    f"saved full tensors ({nq} uint8 idx, c_fc row {N_INNER} period 1280)")
        self.checked = True


def main():
    mode, sdt, out = sys.argv[1], sys.argv[2], sys.argv[3]
    torch.set_num_threads(1)
    check(sdt in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"), sdt)
    if mode == "save":
        tr = make_trainer(out, sdt, 0, SAVE, 4)
        tr.add_callback(SaveRef(tr, out))
        tr.train()
        check(dist.get_world_size() == 2, dist.get_world_size())
        gopt = gefen_of(tr)
        check(all(type(p).__name__ == "DTensor" for g in gopt.param_groups for p in g["params"]), "not FSDP2 shards")
        check({int(s["step"]) for s in gopt.state.values()} == {SAVE}, "step counts")
        ck = os.path.join(out, f"checkpoint-{SAVE}")
        check(os.path.isdir(ck), f"no {ck}")
        if sdt == "SHARDED_STATE_DICT":
            check(any(n.startswith("optimizer_0") for n in os.listdir(ck)), sorted(os.listdir(ck)))
        rank0_print(f"OK trainer+fsdp2 {sdt} save at ws=2: {type(tr.model_wrapped).__name__}, Gefen on DTensor shards, "
                    f"checkpoint-{SAVE}: {sorted(os.listdir(ck))}")
    else:
        ref = torch.load(os.path.join(out, "ref.pt"), weights_only=False)
        tr = make_trainer(out, sdt, 1, SAVE + 1, 8)
        cb = CheckLoaded(tr, ref, sdt)
        tr.add_callback(cb)
        tr.train(resume_from_checkpoint=os.path.join(out, f"checkpoint-{SAVE}"))
        check(cb.checked, "on_train_begin did not run")
        gopt = gefen_of(tr)
        check({int(s["step"]) for s in gopt.state.values()} == {SAVE + 1}, "the resumed Trainer did not step")
        rank0_print(f"OK trainer+fsdp2 {sdt}: resumed at ws=1 and stepped to {SAVE + 1}")
    dist.barrier()
    rank0_print("ALL OK")
    leave()


if __name__ == "__main__":
    main()
