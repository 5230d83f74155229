"""The generic resume flow (torchtitan, Accelerate, Lightning): a fresh optimizer's
``get_state_dict`` -> ``dcp.load`` -> ``set_state_dict``, with nothing from gefen_dist.checkpoint
(D14: the factored default's state shapes depend on the global shape only). Single process here;
the same flow across world sizes is in tests/dist/dcp_reshard.py (``load_plain``)."""
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from gefen_dist import Gefen
from gefen_dist import checkpoint as gckpt
from gefen_dist.core.periods import shape_period


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 64, bias=False), torch.nn.Linear(64, 301, bias=False),
                               torch.nn.Linear(2100, 8, bias=False))  # row 2100 > 1024: period 1050


def _train(m, opt, n, seed):
    """Gradients with a strong period-32 structure along the rows of the first weight (the paper's
    detector finds 16 or 32 there, and periods shorter than the row on the Gaussian others)."""
    g = torch.Generator().manual_seed(seed)
    scale = (10.0 ** (torch.arange(256) % 32 // 8)).repeat(64, 1)
    for _ in range(n):
        opt.zero_grad()
        for p in m.parameters():
            p.grad = torch.randn(p.shape, generator=g) * (scale if p.shape == (64, 256) else 1.0)
        opt.step()


def _plain_resume(mode, path, prepare=False):
    m = _model()
    opt = Gefen(m.parameters(), lr=1e-2, second_moment=mode)
    if prepare:
        gckpt.prepare_for_load(m, opt, path, key_prefix="optim")
    msd, osd = get_state_dict(m, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(m, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return m, opt


def _save(mode, path):
    m = _model()
    opt = Gefen(m.parameters(), lr=1e-2, second_moment=mode)
    _train(m, opt, 3, 1)
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    return m, opt


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def _same_state_then_same_steps(m, opt, m2, opt2):
    """Every state entry of the resumed optimizer equals the saved one's (values and dtypes), and two more
    steps on the same gradients keep the parameters equal."""
    for p, q in zip(m.parameters(), m2.parameters()):
        for k, v in opt.state[p].items():
            w = opt2.state[q][k]
            assert (torch.equal(v, w) and v.dtype == w.dtype) if torch.is_tensor(v) else v == w, k
    _train(m, opt, 2, 7)
    _train(m2, opt2, 2, 7)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))


def test_factored_default_resumes_through_the_plain_flow_bitwise(tmp_path):
    m, opt = _save("factored", str(tmp_path))
    for p in m.parameters():  # the period comes from the shape: the row, capped as the paper caps
        assert opt.state[p]["period"] == shape_period(p.shape), (tuple(p.shape), opt.state[p]["period"])
    assert opt.state[m[2].weight]["period"] == 1050
    m2, opt2 = _plain_resume("factored", str(tmp_path))
    _same_state_then_same_steps(m, opt, m2, opt2)


def test_nibbles_resume_through_the_plain_flow_bitwise(tmp_path):
    """second_moment="nibbles" (D20): its periods are fixed by the shape too (core.periods.nibble_period), so
    a fresh optimizer's placeholder state (a 16-entry codebook) has the saved shapes and the plain flow
    resumes it bitwise, including the 16-codeword codebook."""
    from gefen_dist.core.periods import nibble_period

    m, opt = _save("nibbles", str(tmp_path))
    assert [opt.state[p]["period"] for p in m.parameters()] == [nibble_period(p.shape) for p in m.parameters()]
    assert opt.codebook.shape == (16,)
    m2, opt2 = _plain_resume("nibbles", str(tmp_path))
    assert torch.equal(opt2.codebook, opt.codebook)
    _same_state_then_same_steps(m, opt, m2, opt2)


def test_shared_needs_prepare_for_load(tmp_path, caplog):
    """The paper's scheme keeps ``v`` per detected period: the plain flow cannot size it, and DCP says
    so (a CheckpointException naming the size mismatch), after Gefen's warning naming the fix;
    prepare_for_load sizes it from the metadata."""
    m, opt = _save("shared", str(tmp_path))
    periods = [opt.state[p]["period"] for p in m.parameters()]
    assert any(per != shape_period(p.shape) for per, p in zip(periods, m.parameters())), periods
    with caplog.at_level("WARNING", logger="gefen_dist.optim.gefen"):
        with pytest.raises(BaseException, match="Size mismatch|CheckpointException"):
            _plain_resume("shared", str(tmp_path))
    warned = [r.getMessage() for r in caplog.records if "have not learned their periods" in r.getMessage()]
    assert len(warned) == 1 and "gefen_dist.checkpoint.prepare_for_load(model, optimizer" in warned[0], warned
    caplog.clear()
    with caplog.at_level("WARNING", logger="gefen_dist.optim.gefen"):
        m2, opt2 = _plain_resume("shared", str(tmp_path), prepare=True)
    assert not [r for r in caplog.records if "have not learned their periods" in r.getMessage()]
    _train(m, opt, 2, 7)
    _train(m2, opt2, 2, 7)
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))
