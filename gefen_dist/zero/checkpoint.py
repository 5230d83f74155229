"""ZeroGefen's checkpoints (a mixin of :class:`gefen_dist.zero.optimizer.ZeroGefen`).

:meth:`~ZeroCheckpointMixin.consolidate_state_dict` gathers the compressed state (never a
dequantized fp32 copy of m or v) onto one rank, whose :meth:`~ZeroCheckpointMixin.state_dict` then
has exactly single-process Gefen's layout, independent of the world size;
:meth:`~ZeroCheckpointMixin.load_state_dict` at any world size keeps this rank's slice. The mixin
uses ZeroGefen's partition and collectives (``_partition``, ``_gather_state``, ``_make_partition``,
``_set_from_full``, ``_world``, ``_rank``).
"""
from __future__ import annotations

from typing import Any, Dict

import torch
from torch.optim import Optimizer

from ..core.step import col_blocks_of
from ..engine.layout import Geometry, global_shape
from ..engine.state import MODE_EXACT, SPAN_MODES, new_step
from ..optim.gefen import saved_param_map
from ..optim.adamw_import import import_adamw, is_adamw_entry, is_adamw_state
from ..optim.state_dict_io import continue_few_rows

_GEFEN_GROUP_KEYS = ("second_moment", "row_blocks", "narrow_rows")  # an AdamW dict's groups take this optimizer's

_Q_KEYS = ("idx", "scale", "v")
_F_KEYS = ("idx", "scale", "v_row")  # sliced by rows; v_col is replicated (the same on every rank)
_E_KEYS = ("exp_avg", "exp_avg_sq")


class ZeroCheckpointMixin:
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole state (compressed: idx, scale, v; exact tensors' fp32 moments) onto
        group rank ``to``, whose :meth:`state_dict` then returns it. Every rank must call it."""
        if not 0 <= to < self._world:
            raise ValueError(f"consolidate_state_dict: to={to} is not a rank of the group (size {self._world})")
        self._consolidated = None
        if self._partition is None:  # no state on any rank yet (state is created collectively)
            if self._rank == to:
                self._consolidated = {}
            return
        params = [p for p in self._partition.params if self.state.get(p)]
        full = self._gather_state(params, self._partition, to)
        if self._rank != to:
            return
        index = {}
        i = 0
        for g in self.param_groups:
            for p in g["params"]:
                index[id(p)] = i
                i += 1
        cb = self.codebook.detach().clone() if self.codebook is not None else None
        out: Dict[int, dict] = {}
        for p in params:
            st = self.state[p]
            f = full[id(p)]
            shape = global_shape(p)
            mode = self._mode(p)
            if mode in SPAN_MODES:  # D16: idx gathered; the block state (D19: row codes) replicated (this rank's copy)
                out[index[id(p)]] = {
                    "step": st["step"], "period": st["period"], "scale_block": st["scale_block"],
                    "learned": st["learned"], "idx": f["idx"].view(shape),
                    **{k: st[k].detach().clone() for k in ("scale", "v_blk", "v_col")},
                    **{k: f[k].view(shape[0]) for k in ("scale_code", "v_code") if k in f},  # D19: gathered by rows
                    "codebook": cb if cb is not None else torch.zeros(256, dtype=torch.float32),
                }
                continue
            if mode == MODE_EXACT:
                out[index[id(p)]] = {"step": st["step"], "exp_avg": f["exp_avg"].view(shape),
                                     "exp_avg_sq": f["exp_avg_sq"].view(shape)}
                continue
            geo = Geometry.quantized(shape, st["period"])
            shp = geo.state_shapes(shape[0])
            if self._is_factored(p):
                out[index[id(p)]] = {
                    "step": st["step"], "period": st["period"], "scale_block": st["scale_block"],
                    "learned": st["learned"], "idx": f["idx"].view(shp["idx"]), "scale": f["scale"].view(shp["scale"]),
                    "v_row": f["v_row"].view(shape[0], col_blocks_of(st["v_row"])), "v_col": st["v_col"].detach().clone(),
                    "codebook": cb if cb is not None else torch.zeros(256, dtype=torch.float32),
                }
                continue
            out[index[id(p)]] = {
                "step": st["step"], "period": st["period"], "scale_block": st["scale_block"],
                "learned": st["learned"], "idx": f["idx"].view(shp["idx"]), "scale": f["scale"].view(shp["scale"]),
                "v": f["v"].view(shp["v"]),
                "codebook": cb if cb is not None else torch.zeros(256, dtype=torch.float32),
            }
        self._consolidated = out

    def state_dict(self) -> Dict[str, Any]:
        """The consolidated, world-size-independent state dict (single-process Gefen's layout).

        Needs :meth:`consolidate_state_dict` on all ranks first (automatic for one process); only
        the rank it consolidated to can return it. A step discards the consolidated copy.
        """
        if self._consolidated is None and self._world == 1:
            self.consolidate_state_dict(0)
        if self._consolidated is None:
            raise RuntimeError(
                "ZeroGefen.state_dict(): the optimizer state has not been consolidated on this rank. "
                "Call consolidate_state_dict(to=<rank>) on every rank (after the last step), then "
                "state_dict() on that rank."
            )
        sd = Optimizer.state_dict(self)
        sd["state"] = dict(self._consolidated)
        return sd

    def _import_adamw(self, saved_state: Dict[Any, Any], id_map) -> Dict[Any, Any]:
        """The saved AdamW entries of quantized tensors as full Gefen entries (:mod:`gefen_dist.optim.adamw_import`,
        with this optimizer's groups), the other entries as saved."""
        names = self._names()
        imports = [(id_map[k], e, self._group_of(id_map[k]), names[id(id_map[k])]) for k, e in saved_state.items()
                   if k in id_map and is_adamw_entry(e) and self._mode(id_map[k]) != MODE_EXACT]
        conv, _ = import_adamw(self, imports, lambda p, g, per: self._spec(p, per))
        return {k: conv.get(id_map.get(k), e) if k in id_map else e for k, e in saved_state.items()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a consolidated (or single-process Gefen) state dict at any world size: restore
        hyperparameters, periods and the codebook, decide the partition from the saved periods,
        and keep this rank's slices. No collectives."""
        id_map = saved_param_map(self, state_dict)
        saved_state = state_dict["state"]
        groups = state_dict["param_groups"]
        if is_adamw_state(saved_state):  # a torch.optim.AdamW state dict: a warm start (Gefen.load_state_dict's)
            unsupported = sorted({k for sg in groups for k in ("maximize", "amsgrad") if sg.get(k)})
            if unsupported:
                raise ValueError(f"the loaded AdamW state dict sets {unsupported}, which Gefen does not implement "
                                 "(amsgrad's max_exp_avg_sq would be dropped); load an AdamW checkpoint without them, "
                                 "or start the optimizer fresh")
            saved_state = self._import_adamw(saved_state, id_map)
            groups = [{**{k: g[k] for k in _GEFEN_GROUP_KEYS if k in g}, **sg}
                      for sg, g in zip(groups, self.param_groups)]
        Optimizer.load_state_dict(self, {**state_dict, "param_groups": groups, "state": {}})
        self._modes = None  # from the loaded groups' second_moment (each entry is validated against it below)
        names = self._names()
        full = {}
        cb = None
        for k, saved in saved_state.items():
            p = id_map[k]
            # a shared entry of a few-row tensor saved by D15's versions (withdrawn) continues as factored state
            st = dict(continue_few_rows(self, p, saved, self._group_of(p), names[id(p)]))
            self._validate_loaded(p, st, names[id(p)])
            full[p] = st
            if "codebook" in st and float(st["codebook"][0]) == -1.0 and cb is None:
                cb = st["codebook"]
        self.codebook = cb.detach().to(dtype=torch.float32).clone() if cb is not None else None
        self._consolidated = None
        self.state.clear()
        for p, st in full.items():
            # the ints as saved, and step as the tensor AdamW keeps (saved as an int or a tensor)
            self.state[p] = {k: new_step(v) if k == "step" else v for k, v in st.items()
                             if k == "step" or not isinstance(v, torch.Tensor)}
            if self._mode(p) != MODE_EXACT:
                self.state[p]["learned"] = int(st["learned"])
        self._partition = None
        self._partition = self._make_partition()
        for p, st in full.items():
            loc = self.state[p]
            mode = self._mode(p)  # the entry was validated against p's spec (_validate_loaded)
            if mode in SPAN_MODES:  # D16: this rank's idx; the block state (D19: row codes) whole on every rank
                for k in ("scale", "v_blk", "v_col"):
                    loc[k] = st[k].detach().to(device=p.device, dtype=torch.float32).reshape(-1).clone()
                self._set_from_full(p, {k: st[k] for k in ("idx", "scale_code", "v_code") if k in st})  # D19: codes
                loc["codebook"] = self._codebook_for(p.device)
                continue
            keys = _E_KEYS if mode == MODE_EXACT else _F_KEYS if self._is_factored(p) else _Q_KEYS
            for k in keys:
                loc[k] = st[k]
            if self._is_factored(p):  # replicated: every rank keeps the whole column factor
                vc = st["v_col"].detach().to(device=p.device, dtype=torch.float32)
                # [slab], or [G, slab] with row blocks (D12): the saved shape is kept
                loc["v_col"] = (vc if vc.dim() == 2 else vc.reshape(-1)).clone()
            self._set_from_full(p, {k: st[k] for k in keys})
            if mode != MODE_EXACT:
                loc["codebook"] = self._codebook_for(p.device)
