"""Gefen against torch.optim's contract: torch's own optimizer test machinery, in tree.

The first class is driven by :data:`GEFEN_OPTIM_INFO` (``tests/_gefen_optim_info.py``) through
the machinery that ships in the torch wheel (``optims``, ``instantiate_device_type_tests``,
``_get_optim_inputs_including_global_cliquey_kwargs``), re-stating the checks of PyTorch's
``test/test_optim.py::TestOptimRenewed`` that apply to Gefen on CPU, so CI guards the same
contract without the upstream file (``scripts/run_upstream_optim_suite.py`` runs the upstream file
itself). The functions after it pin each hole the suite and the issue found: every bad input is
answered by a clear error that names the value and the fix, and every torch API round-trips.
"""
from __future__ import annotations

import copy
import functools
import logging
import pickle

import pytest
import torch
from torch import nn
from torch.nn import Parameter

from _gefen_optim_info import GEFEN_OPTIM_INFO  # noqa: E402  (installs an expecttest stub if needed)
from torch.testing._internal.common_device_type import instantiate_device_type_tests  # noqa: E402
from torch.testing._internal.common_optimizers import (  # noqa: E402
    OptimizerErrorEnum,
    _get_optim_inputs_including_global_cliquey_kwargs,
    optims,
)
from torch.testing._internal.common_utils import TestCase, parametrize  # noqa: E402

from gefen_dist import Gefen  # noqa: E402

DB = [GEFEN_OPTIM_INFO]


def _all_inputs(device, dtype, optim_info):
    return _get_optim_inputs_including_global_cliquey_kwargs(device, dtype, optim_info, skip=("differentiable",))


class TestGefenConformance(TestCase):
    @optims(DB)
    def test_optim_infos_do_not_specify_global_cliquey_kwargs(self, device, dtype, optim_info):
        for optim_input in optim_info.optim_inputs_func(device=device):
            self.assertFalse(any(f in optim_input.kwargs for f in ("foreach", "fused", "differentiable")))

    @optims(DB)
    def test_errors(self, device, dtype, optim_info):
        for error_input in optim_info.optim_error_inputs_func(device=device, dtype=dtype):
            oi = error_input.optimizer_error_input
            assert error_input.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR
            ctx = (self.assertWarnsRegex if issubclass(error_input.error_type, Warning) else self.assertRaisesRegex)
            with ctx(error_input.error_type, error_input.error_regex):
                optim_info.optim_cls(oi.params, **oi.kwargs)

    @parametrize("contiguous", [True, False])
    @optims(DB, dtypes=[torch.float32])
    def test_forloop_goes_right_direction(self, device, dtype, optim_info, contiguous):
        for optim_input in _all_inputs(device, dtype, optim_info):
            if contiguous:
                weight = Parameter(torch.randn((10, 5), device=device, dtype=dtype))
                bias = Parameter(torch.randn((10), device=device, dtype=dtype))
            else:
                weight = Parameter(torch.randn((10, 5, 2), device=device, dtype=dtype)[..., 0])
                bias = Parameter(torch.randn((10, 2), device=device, dtype=dtype)[..., 0])
            inp = torch.randn(5, device=device, dtype=dtype)
            optimizer = optim_info.optim_cls([weight, bias], **optim_input.kwargs)

            def closure():
                optimizer.zero_grad()
                loss = (weight.mv(inp) + bias).pow(2).sum()
                loss.backward()
                return loss

            initial = closure().item()
            for _ in range(20):
                optimizer.step(closure)
            self.assertLess(closure().item(), initial, msg=optim_input.desc)
            if optim_input.kwargs.get("small_threshold") == 0:
                self.assertEqual(optimizer.state[weight]["idx"].dtype, torch.uint8)  # the quantized path ran

    @optims(DB, dtypes=[torch.float32])
    def test_param_groups_lr_and_weight_decay(self, device, dtype, optim_info):
        # upstream's test_param_groups_lr / _weight_decay: every option of the configuration in the
        # param groups (fused and small_threshold are per-group options, as AdamW's fused is)
        for optim_input in _all_inputs(device, dtype, optim_info):
            kw = dict(optim_input.kwargs)
            outer = {k: kw.pop(k) for k in ("nonfinite",) if k in kw}
            weight = Parameter(torch.randn((10, 5), device=device, dtype=dtype))
            bias = Parameter(torch.randn((10), device=device, dtype=dtype))
            irrelevant = Parameter(torch.randn(2, device=device, dtype=dtype))
            irrelevant_clone = irrelevant.clone()
            inp = torch.randn(5, device=device, dtype=dtype)
            optimizer = optim_info.optim_cls(
                [dict(params=[weight], **kw), dict(params=[bias], **{**kw, "weight_decay": 0.0}),
                 dict(params=[irrelevant], lr=1e-28)], **outer)
            loss = (weight.mv(inp) + bias).pow(2).sum()
            initial = loss.item()
            for _ in range(20):
                optimizer.zero_grad()
                loss = (weight.mv(inp) + bias).pow(2).sum()
                loss.backward()
                irrelevant.grad = torch.rand_like(irrelevant)
                optimizer.step()
            self.assertLess(loss.item(), initial, msg=optim_input.desc)
            self.assertEqual(irrelevant, irrelevant_clone)
            if kw.get("small_threshold") == 0:  # the group's threshold took the quantized path
                self.assertEqual(optimizer.state[weight]["idx"].dtype, torch.uint8)
            want = "eager" if kw.get("fused") is False else None
            if want:
                self.assertEqual(optimizer._impl(weight, weight).name, want)

    @optims(DB, dtypes=[torch.complex64])
    def test_complex(self, device, dtype, optim_info):
        # upstream's test_complex: a complex parameter steps exactly as its torch.view_as_real
        # would, mixed with a real one, for every configuration (fused True/False included)
        for optim_input in _all_inputs(device, dtype, optim_info):
            cplx = [torch.randn(10, 5, dtype=dtype, requires_grad=True),
                    torch.randn(10, dtype=dtype, requires_grad=True),
                    torch.randn(10, 5, dtype=torch.float32, requires_grad=True)]
            real = [(torch.view_as_real(p) if p.is_complex() else p).detach().clone().requires_grad_() for p in cplx]
            co = optim_info.optim_cls(cplx, **optim_input.kwargs)
            ro = optim_info.optim_cls(real, **optim_input.kwargs)
            for _ in range(3):
                for c, r in zip(cplx, real):
                    r.grad = torch.randn_like(r)
                    c.grad = torch.view_as_complex(r.grad.clone()) if c.is_complex() else r.grad.clone()
                ro.step()
                co.step()
                for c, r in zip(cplx, real):
                    self.assertEqual(torch.view_as_real(c) if c.is_complex() else c, r, atol=0, rtol=0,
                                     msg=optim_input.desc)
            if optim_input.kwargs.get("small_threshold") == 0:
                self.assertEqual(co.state[cplx[0]]["idx"].shape, (10, 5, 2))
            sd = co.state_dict()  # the real-view state round-trips into a fresh optimizer
            co2 = optim_info.optim_cls(cplx, **optim_input.kwargs)
            co2.load_state_dict(sd)

    @optims(DB, dtypes=[torch.float32])
    def test_step_is_noop_when_params_have_no_grad(self, device, dtype, optim_info):
        params = [torch.randn(2, 3, requires_grad=False, device=device, dtype=dtype) for _ in range(2)]
        old = [p.clone() for p in params]
        for optim_input in _all_inputs(device, dtype, optim_info):
            optim_info.optim_cls(params, **optim_input.kwargs).step(lambda: torch.tensor([1.0]))
            self.assertEqual(old, params)

    @optims(DB, dtypes=[torch.float32])
    def test_step_is_noop_for_zero_grads(self, device, dtype, optim_info):
        # upstream lowers AdamW's lr (by class name) because its default weight decay moves the
        # parameters; here the decay is switched off, and the check is exact
        for optim_input in _all_inputs(device, dtype, optim_info):
            kwargs = {**optim_input.kwargs, "weight_decay": 0.0}
            for shape in ((5, 1), (64, 80)):
                param = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
                old = param.clone().detach()
                optimizer = optim_info.optim_cls([param], **kwargs)
                param.grad = torch.zeros_like(param)
                optimizer.step(lambda: torch.tensor([1.0]))
                self.assertEqual(old, param, msg=optim_input.desc)

    @optims(DB, dtypes=[torch.float32])
    def test_optimizer_can_be_printed(self, device, dtype, optim_info):
        params = [Parameter(torch.randn(2, 3, device=device, dtype=dtype)) for _ in range(2)]
        for optim_input in _all_inputs(device, dtype, optim_info):
            self.assertIn("Gefen", repr(optim_info.optim_cls(params, **optim_input.kwargs)))

    @optims(DB, dtypes=[torch.float32])
    def test_state_dict_deterministic(self, device, dtype, optim_info):
        weight = Parameter(torch.randn(16, 24, device=device, dtype=dtype))
        bias = Parameter(torch.randn(16, device=device, dtype=dtype))
        inp = torch.randn(24, device=device, dtype=dtype)

        def fwd_bwd(optim, w, b, i):
            optim.zero_grad()
            loss = (w.mv(i) + b).pow(2).sum()
            loss.backward()
            return loss

        for optim_input in _all_inputs(device, dtype, optim_info):
            optimizer = optim_info.optim_cls([weight, bias], **optim_input.kwargs)
            closure = functools.partial(fwd_bwd, optimizer, weight, bias, inp)
            for _ in range(5):
                optimizer.step(closure)
            with torch.no_grad():
                weight_c, bias_c = Parameter(weight.clone()), Parameter(bias.clone())
            optimizer_c = optim_info.optim_cls([weight_c, bias_c], **optim_input.kwargs)
            closure_c = functools.partial(fwd_bwd, optimizer_c, weight_c, bias_c, inp)
            optimizer_c.load_state_dict(copy.deepcopy(optimizer.state_dict()))
            for _ in range(5):
                optimizer.step(closure)
                optimizer_c.step(closure_c)
                self.assertEqual(weight, weight_c)
                self.assertEqual(bias, bias_c)
            self.assertEqual(optimizer.state_dict(), optimizer_c.state_dict())

    @optims(DB, dtypes=[torch.float32])
    def test_can_load_older_state_dict(self, device, dtype, optim_info):
        # torch's new flags, and Gefen's own newer group keys, deleted from the saved groups
        for optim_input in _all_inputs(device, dtype, optim_info):
            torch.manual_seed(1)
            model = nn.Sequential(nn.Conv2d(4, 2, 1, stride=2), nn.BatchNorm2d(2)).to(device=device, dtype=dtype)
            inp = torch.rand(1, 4, 16, 16, device=device, dtype=dtype)
            optimizer = optim_info.optim_cls(model.parameters(), **optim_input.kwargs)
            for _ in range(3):
                optimizer.zero_grad()
                model(inp).sum().backward()
                optimizer.step()
            old = copy.deepcopy(optimizer.state_dict())
            for group in old["param_groups"]:
                for flag in ("maximize", "foreach", "fused", "differentiable", "capturable", "row_blocks"):
                    group.pop(flag, None)
            optimizer.load_state_dict(old)
            self.assertEqual(optimizer.param_groups[0]["row_blocks"], optim_input.kwargs.get("row_blocks", "auto"))
            optimizer.zero_grad()
            model(inp).sum().backward()
            optimizer.step()

    @optims(DB, dtypes=[torch.float32])
    def test_load_tensor_and_nontensor_step(self, device, dtype, optim_info):
        params = [Parameter(torch.randn(64, 80, device=device, dtype=dtype)), Parameter(torch.randn(3, device=device))]
        for p in params:
            p.grad = torch.rand_like(p)
        for optim_input in _all_inputs(device, dtype, optim_info):
            optimizer = optim_info.optim_cls(params, **optim_input.kwargs)
            for _ in range(3):
                optimizer.step()
            for as_tensor in (False, True):
                sd = copy.deepcopy(optimizer.state_dict())
                for st in sd["state"].values():
                    st["step"] = torch.tensor(float(st["step"])) if as_tensor else int(st["step"])
                optimizer.load_state_dict(sd)
                # as AdamW keeps it (not capturable): a 0-dim float32 tensor on the CPU, whatever was saved
                self.assertTrue(all(torch.is_tensor(st["step"]) and st["step"].dtype == torch.float32
                                    and st["step"].dim() == 0 and st["step"].device.type == "cpu"
                                    and st["step"].item() == 3 + as_tensor for st in optimizer.state.values()))
                optimizer.step()

    @optims(DB, dtypes=[torch.float32])
    def test_tensor_lr(self, device, dtype, optim_info):
        # (later upstream versions' test_tensor_lr) a tensor lr steps exactly like the same float
        for optim_input in _all_inputs(device, dtype, optim_info):
            weight = Parameter(torch.randn((64, 80), device=device, dtype=dtype))
            bias = Parameter(torch.randn((64), device=device, dtype=dtype))
            weight_c, bias_c = (Parameter(t.detach().clone()) for t in (weight, bias))
            inp = torch.randn(80, device=device, dtype=dtype)
            kwargs = {k: v for k, v in optim_input.kwargs.items() if k != "lr"}
            o_r = optim_info.optim_cls([weight, bias], lr=1e-3, **kwargs)
            o_t = optim_info.optim_cls([weight_c, bias_c], lr=torch.tensor(1e-3), **kwargs)
            for _ in range(5):
                for o, w, b in ((o_r, weight, bias), (o_t, weight_c, bias_c)):
                    o.zero_grad()
                    (w.mv(inp) + b).pow(2).sum().backward()
                    o.step()
                self.assertEqual(weight, weight_c)
                self.assertEqual(bias, bias_c)

    @parametrize("named0", [False, True])
    @parametrize("named1", [False, True])
    @optims(DB, dtypes=[torch.float32])
    def test_can_load_from_to_named_state_dict(self, device, dtype, optim_info, named0, named1):
        # (later upstream versions' test) state dicts of named and unnamed param groups interchange
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(80, 64), nn.GELU(), nn.Linear(64, 8)).to(device=device, dtype=dtype)
        inp = torch.rand(4, 80, device=device, dtype=dtype)
        for optim_input in _all_inputs(device, dtype, optim_info)[:4]:
            def make(m, named):
                return optim_info.optim_cls(m.named_parameters() if named else m.parameters(), **optim_input.kwargs)

            o0 = make(model, named0)
            for _ in range(3):
                o0.zero_grad()
                model(inp).sum().backward()
                o0.step()
            model1 = copy.deepcopy(model)
            o1 = make(model1, named1)
            o1.load_state_dict(copy.deepcopy(o0.state_dict()))
            self.assertEqual("param_names" in o1.param_groups[0], named0 or named1)
            for o, m in ((o0, model), (o1, model1)):
                o.zero_grad()
                m(inp).sum().backward()
                o.step()
            for p, q in zip(model.parameters(), model1.parameters()):
                self.assertEqual(p, q)

    @optims(DB, dtypes=[torch.float32])
    def test_step_hooks_fire_around_step(self, device, dtype, optim_info):
        params = [Parameter(torch.randn(64, 80, device=device, dtype=dtype))]
        params[0].grad = torch.rand_like(params[0])
        calls = []
        opt = optim_info.optim_cls(params, small_threshold=0)
        opt.register_step_pre_hook(lambda o, a, k: calls.append(("pre", o.codebook is None)))
        opt.register_step_post_hook(lambda o, a, k: calls.append(("post", o.codebook is None)))
        opt.step()
        self.assertEqual(calls, [("pre", True), ("post", False)])

    @optims(DB, dtypes=[torch.float32])
    def test_deepcopy_copies_all_public_attrs(self, device, dtype, optim_info):
        params = [Parameter(torch.randn(64, 80, device=device, dtype=dtype)), Parameter(torch.randn(3, device=device))]
        for p in params:
            p.grad = torch.rand_like(p)

        def public(obj):
            return {k for k in obj.__dict__ if not k.startswith("_")}

        for optim_input in _all_inputs(device, dtype, optim_info):
            optimizer = optim_info.optim_cls(params, **optim_input.kwargs)
            for _ in range(3):
                optimizer.step()
            self.assertEqual(public(optimizer), public(copy.deepcopy(optimizer)))


instantiate_device_type_tests(TestGefenConformance, globals(), only_for="cpu")


# ============================================================================================
# The holes, one test each
# ============================================================================================

def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 16))


def _train(model, opt, steps=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 64, generator=g)).pow(2).mean().backward()
        opt.step()


def _state_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert v.dtype == b[k].dtype and torch.equal(v, b[k]), k
        else:
            assert v == b[k], k


def test_weight_decay_default_is_adamws():
    import inspect

    want = inspect.signature(torch.optim.AdamW).parameters["weight_decay"].default
    assert Gefen([Parameter(torch.zeros(3))]).defaults["weight_decay"] == want == 0.01


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(lr=torch.tensor([1e-3, 1e-3])), ValueError, r"Tensor lr must be 1-element, got shape \(2,\)"),
    (dict(lr="1e-3"), TypeError, r"learning rate: '1e-3' \(a str; expected a float such as 1e-3"),
    (dict(eps="1e-8"), TypeError, r"epsilon value: '1e-8' \(a str; expected a float such as 1e-8"),
    (dict(weight_decay="0.1"), TypeError, r"weight_decay value: '0.1' \(a str; expected a float such as 0.01"),
    (dict(betas=("0.9", "0.999")), TypeError, r"betas: \('0.9', '0.999'\) \(expected a pair of floats"),
    (dict(betas="0.9"), TypeError, r"betas: '0.9'"),
    (dict(lr=None), TypeError, r"learning rate: None"),
])
def test_bad_hyperparameters_rejected_at_construction_and_add_param_group(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        Gefen([Parameter(torch.zeros(4, 4))], **kwargs)
    opt = Gefen([Parameter(torch.zeros(4, 4))])
    with pytest.raises(exc, match=match.replace(": ", " in param group 1: ", 1)):
        opt.add_param_group({"params": [Parameter(torch.zeros(3))], **kwargs})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("key,value", [("nonfinite", "skip"), ("bound_updates", False)])
def test_optimizer_wide_options_refused_in_param_groups(key, value):
    w = Parameter(torch.zeros(64, 80))
    with pytest.raises(ValueError, match=rf"Invalid option '{key}' in param group 0: .*Gefen\(params, {key}=\.\.\.\)"):
        Gefen([{"params": [w], key: value}])
    opt = Gefen([w])
    with pytest.raises(ValueError, match=rf"'{key}' in param group 1"):
        opt.add_param_group({"params": [Parameter(torch.zeros(3))], key: value})
    assert len(opt.param_groups) == 1


def test_fused_and_small_threshold_per_param_group():
    # as AdamW honours a per-group `fused`: each group's own value, else the constructor's
    torch.manual_seed(0)
    a, b, c = (Parameter(torch.randn(64, 80)) for _ in range(3))
    opt = Gefen([{"params": [a], "fused": False}, {"params": [b], "small_threshold": 10**6}, {"params": [c]}])
    for p in (a, b, c):
        p.grad = torch.randn_like(p)
    opt.step()
    assert opt._impl(a, a).name == "eager" and opt._impl(c, c).name != "eager"
    assert "idx" in opt.state[a] and "exp_avg" in opt.state[b] and "idx" in opt.state[c]
    # a fresh optimizer with the same groups loads the state; the group values of the running code stay
    opt2 = Gefen([{"params": [a], "fused": False}, {"params": [b], "small_threshold": 10**6}, {"params": [c]}])
    opt2.load_state_dict(opt.state_dict())
    assert opt2.param_groups[0]["fused"] is False and opt2.param_groups[1]["small_threshold"] == 10**6
    # a group whose threshold would change that tensor's layout is refused, naming it, and nothing changes
    opt3 = Gefen([{"params": [a], "fused": False}, {"params": [b]}, {"params": [c]}])
    with pytest.raises(ValueError, match="lacks"):
        opt3.load_state_dict(opt.state_dict())
    assert not opt3.state
    for bad, match in (({"fused": "yes"}, "Invalid fused in param group 0: 'yes'"),
                       ({"small_threshold": -1}, "Invalid small_threshold in param group 0: -1")):
        with pytest.raises(ValueError, match=match):
            Gefen([{"params": [a], **bad}])


def test_sharded_optimizers_refuse_per_group_fused_and_threshold_and_complex():
    from gefen_dist import ZeroGefen

    w = Parameter(torch.zeros(64, 80))
    for key, value in (("fused", False), ("small_threshold", 0)):
        with pytest.raises(ValueError, match=rf"Invalid option '{key}' in param group 0"):
            ZeroGefen([{"params": [w], key: value}])
    with pytest.raises(TypeError, match="ZeroGefen does not support complex parameters"):
        ZeroGefen([Parameter(torch.zeros(64, 80, dtype=torch.complex64))])


# ------------------------------------------------------------------------ deepcopy / pickle
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_deepcopy_and_pickle_round_trip_the_whole_optimizer(how):
    m = _mlp()
    opt = Gefen(m.parameters(), lr=1e-2, fused=False, small_threshold=1000, nonfinite="skip")
    _train(m, opt)
    opt.skipped_steps = 2
    if how == "deepcopy":
        m2, opt2 = copy.deepcopy((m, opt))
        assert opt2._comm is opt._comm  # the process group is shared, not copied
    else:
        m2, opt2 = pickle.loads(pickle.dumps((m, opt)))
    for k in ("fused", "small_threshold", "nonfinite", "skipped_steps", "codebook_info"):
        assert getattr(opt2, k) == getattr(opt, k), k
    assert torch.equal(opt2.codebook, opt.codebook) and opt2.codebook is not opt.codebook
    for p, q in zip(m.parameters(), m2.parameters()):
        assert q in opt2.state and p not in opt2.state
        _state_equal(opt.state[p], opt2.state[q])
    # the copy's tensors share one codebook again, and it steps exactly like the original
    cbs = {id(st["codebook"]) for st in opt2.state.values() if "codebook" in st}
    assert cbs == {id(opt2.codebook)}
    _train(m, opt, seed=7)
    _train(m2, opt2, seed=7)
    for p, q in zip(m.parameters(), m2.parameters()):
        assert torch.equal(p, q)


# ------------------------------------------------------------------------ load_state_dict
def _trained(seed=0, **kw):
    m = _mlp(seed)
    opt = Gefen(m.parameters(), lr=1e-2, **kw)
    _train(m, opt)
    return m, opt


def test_load_state_dict_hooks_run_in_torchs_order():
    m, opt = _trained()
    sd = opt.state_dict()
    m2 = _mlp(5)
    opt2 = Gefen(m2.parameters(), lr=1e-2)
    seen = {}

    def pre(optimizer, state_dict):
        state_dict["state"] = {**state_dict["state"], 0: dict(state_dict["state"][0], step=123)}  # per-parameter
        state_dict["param_groups"] = [dict(g, lr=0.5) for g in state_dict["param_groups"]]

    def post(optimizer):
        st = optimizer.state[m2[0].weight]
        seen["idx_dtype"] = st["idx"].dtype
        seen["codebook_shared"] = st["codebook"] is optimizer.codebook
        optimizer.state["flag"] = True  # a non-dict entry
        optimizer.param_groups[0]["lr"] = 0.25  # kept: Gefen's own load is done

    opt2.register_load_state_dict_pre_hook(pre)
    opt2.register_load_state_dict_post_hook(post)
    opt2.load_state_dict(sd)
    assert opt2.state[m2[0].weight]["step"] == 123
    assert seen == {"idx_dtype": torch.uint8, "codebook_shared": True}
    assert opt2.state["flag"] is True and opt2.param_groups[0]["lr"] == 0.25
    assert sd["state"][0]["step"] == 3 and sd["param_groups"][0]["lr"] == 1e-2  # the caller's dict untouched


def test_load_adamw_state_dict_is_atomic_and_says_why():
    """An AdamW state dict warm-starts Gefen (tests/test_adamw_import.py); a corrupt one is refused
    before anything changes, naming the parameter."""
    m = _mlp()
    adamw = torch.optim.AdamW(m.parameters())
    m(torch.randn(4, 64)).sum().backward()
    adamw.step()
    m2, opt = _trained(3)
    before = copy.deepcopy(opt.state_dict())
    bad = copy.deepcopy(adamw.state_dict())
    bad["state"][0]["exp_avg"].fill_(float("inf"))
    with pytest.raises(ValueError, match=r"AdamW state of parameter 'group0.param0' holds NaN or inf"):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for k in before["state"]:
        _state_equal(before["state"][k], after["state"][k])
    opt.load_state_dict(adamw.state_dict())  # the warm start
    assert opt.state[m2[0].weight]["learned"] == 1 and int(opt.state[m2[0].weight]["step"]) == 1
    # an all-exact Gefen takes AdamW's moments (same keys; the tensor step becomes an int)
    m3 = _mlp()
    exact = Gefen(m3.parameters(), small_threshold=10**12)
    exact.load_state_dict(adamw.state_dict())
    for p, q in zip(m.parameters(), m3.parameters()):
        assert torch.equal(exact.state[q]["exp_avg"], adamw.state[p]["exp_avg"]) and exact.state[q]["step"] == 1


def test_load_atomic_on_a_bad_entry_in_the_middle():
    m, opt = _trained()
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["lr"] = 0.123
    sd["state"][2]["exp_avg"] = sd["state"][2]["exp_avg"][:3]  # group0.param2 (exact), after a valid param0
    m2, opt2 = _trained(4)
    before = copy.deepcopy(opt2.state_dict())
    with pytest.raises(ValueError, match=r"parameter 'group0.param2' has shape \(3, 128\) but the parameter has shape \(16, 128\)"):
        opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == 1e-2
    for k in before["state"]:
        _state_equal(before["state"][k], opt2.state_dict()["state"][k])


def test_load_older_groups_fill_newer_keys_with_a_warning(caplog):
    m, opt = _trained()
    sd = copy.deepcopy(opt.state_dict())
    for g in sd["param_groups"]:
        del g["second_moment"], g["row_blocks"]
    m2 = _mlp()
    opt2 = Gefen(m2.parameters(), lr=1e-2)
    with caplog.at_level(logging.WARNING, logger="gefen_dist.optim.state_dict_io"):
        opt2.load_state_dict(sd)
    msgs = " ".join(r.getMessage() for r in caplog.records)
    assert "lack 'second_moment'" in msgs and "lack 'row_blocks'" in msgs
    assert opt2.param_groups[0]["second_moment"] == "factored" and opt2.param_groups[0]["row_blocks"] == "auto"
    _train(m2, opt2)


def test_load_with_another_second_moment_refused_naming_both():
    m, opt = _trained(second_moment="shared")
    m2 = _mlp()
    opt2 = Gefen(m2.parameters(), lr=1e-2)  # factored
    with pytest.raises(ValueError, match=r"saved with second_moment='shared'.*uses second_moment='factored'"):
        opt2.load_state_dict(opt.state_dict())
    assert not opt2.state


def test_load_allocates_no_float_copy_of_the_indices():
    """torch's base class casts every floating state tensor to the parameter dtype: the uint8
    indices became an fp32 copy (4 B/param) first. Every tensor an aten op creates during the
    load is counted here: nothing on the same device."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes = 0
            self.float_like_idx = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and func not in (torch.ops.aten.select.int, torch.ops.aten.view.default,
                                                                torch.ops.aten.detach.default):
                    self.bytes += t.numel() * t.element_size()
                    self.float_like_idx += int(t.is_floating_point() and tuple(t.shape) == (128, 64))
            return out

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128))
    opt = Gefen(m.parameters(), lr=1e-2)
    _train(m, opt)
    sd = opt.state_dict()
    m2 = copy.deepcopy(m)
    opt2 = Gefen(m2.parameters(), lr=1e-2)
    with Count() as c:
        opt2.load_state_dict(sd)
    assert opt2.state[m2[0].weight]["idx"].dtype == torch.uint8
    assert c.float_like_idx == 0
    assert c.bytes <= opt.state_bytes() // 10, c.bytes


# ------------------------------------------------------------------------ step pre-checks
def test_changed_parameter_shape_is_refused():
    w = Parameter(torch.randn(64, 128))
    opt = Gefen([w], fused=False)
    w.grad = torch.randn(64, 128)
    opt.step()
    w.data = torch.randn(32, 128)
    w.grad = torch.randn(32, 128)
    with pytest.raises(RuntimeError, match=r"'group0.param0' has shape \(32, 128\).*created for shape "
                                           r"\(64, 128\).*Re-create the optimizer"):
        opt.step()


@pytest.mark.parametrize("shape", [(5000, 0), (0,), (0, 64, 3)])
def test_zero_size_parameters_just_work(shape):
    z = Parameter(torch.zeros(shape))
    w = Parameter(torch.randn(64, 80))
    opt = Gefen([z, w], small_threshold=0)
    for _ in range(2):
        z.grad, w.grad = torch.zeros(shape), torch.randn(64, 80)
        opt.step()
    assert "exp_avg" in opt.state[z] and opt.state[z]["step"] == 2
    assert opt.state[w]["idx"].dtype == torch.uint8
    opt2 = Gefen([Parameter(torch.zeros(shape)), Parameter(w.detach().clone())], small_threshold=0)
    opt2.load_state_dict(opt.state_dict())


def test_meta_parameters_to_empty_then_train(caplog):
    def meta_model():
        with torch.device("meta"):
            return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 16))

    def materialise(m):
        m.to_empty(device="cpu")
        for layer in (m[0], m[2]):
            layer.reset_parameters()

    # stepping while the parameters are still on meta: a clear error, no state created
    m = meta_model()
    with caplog.at_level(logging.WARNING, logger="gefen_dist.optim.validation"):
        opt = Gefen(m.parameters(), small_threshold=0)
    assert any("meta-device parameter" in r.getMessage() for r in caplog.records)
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    with pytest.raises(RuntimeError, match=r"'group0.param0' .*meta device.*model.to_empty\(device=\.\.\.\).*initialise"):
        opt.step()
    assert not opt.state
    # an optimizer built before to_empty() holds the old meta parameters: said so, not a silent no-op
    opt.zero_grad()
    materialise(m)
    m(torch.randn(2, 64)).sum().backward()
    with pytest.raises(RuntimeError, match=r"meta device.*build Gefen after to_empty\(\)"):
        opt.step()
    # the pattern: to_empty, initialise, then the optimizer; state is created at the first step, on CPU
    m = meta_model()
    materialise(m)
    opt = Gefen(m.parameters(), small_threshold=0)
    _train(m, opt)
    assert opt.state[m[0].weight]["idx"].device.type == "cpu" and opt.codebook is not None


def test_torch_compile_of_step_is_refused_clearly():
    m = _mlp()
    opt = Gefen(m.parameters())
    m(torch.randn(4, 64)).sum().backward()
    with pytest.raises(Exception, match=r"cannot be compiled with torch.compile.*torch.compiler.disable"):
        torch.compile(opt.step)()
    assert opt.codebook is None and not any("idx" in st for st in opt.state.values())
    torch.compiler.disable(opt.step)()  # the documented way out
    assert opt.codebook is not None


def test_nonfinite_ignore_inf_in_first_gradient_learns_from_finite_values():
    torch.manual_seed(0)
    w = Parameter(torch.randn(64, 128))
    opt = Gefen([w], nonfinite="ignore")
    w.grad = torch.randn(64, 128)
    w.grad[3, 4] = float("inf")
    w.grad[9, 9] = float("nan")
    opt.step()
    assert opt.codebook is not None and bool(torch.isfinite(opt.codebook).all())
    assert torch.isinf(w.grad[3, 4])  # the caller's gradient is given back untouched
    with torch.no_grad():
        w.copy_(torch.randn(64, 128))
    opt2 = Gefen([Parameter(w.detach().clone())])
    opt2.load_state_dict(opt.state_dict())  # the state is a valid checkpoint
    for _ in range(3):
        w.grad = torch.randn(64, 128)
        opt.step()
    assert bool(torch.isfinite(w[32:]).all())  # rows whose state the inf never touched train on
