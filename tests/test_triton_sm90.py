"""The multi-tensor Triton update kernel compiled for sm_90 (H100/H200) on this CPU-only machine
(benchmarks/triton_sm90.py: triton's own ptxas, cuobjdump and nvdisasm): the machine code of every
shipped full-tile configuration with the ``ALIGNED`` promise (what the GPT-2 tensor set gets: 16-byte
aligned allocations, rows and scale blocks multiples of 16) has 128-bit global loads, no register
spills and at most 168 registers in the default factored mode.

Before the promise (the kernel read its pointers from a metadata table, so alignment could not be
proven) the same configurations compiled to 255 registers with up to 69 spill stores and no 128-bit
load at all; the unaligned fallback still does, and is compiled here once to check that it builds.
Timing needs the device (benchmarks/gpu_step.py).
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import triton_sm90 as sm90  # noqa: E402

_WHY = sm90.available()
pytestmark = pytest.mark.skipif(bool(_WHY), reason=f"offline sm_90 compile unavailable: {_WHY}")



@pytest.mark.parametrize("mode", sorted(sm90.MODES))
def test_aligned_configurations_vectorise_without_spills(mode):
    rows = [sm90.compile_multi(mode, bf16, r, b, aligned=True) for bf16 in (False, True) for r, b in sm90.TILES]
    for r in rows:
        assert r["loads_128"] >= 8, r  # p, g and idx (and the column factors) in 16-byte loads
        assert r["registers"] <= 255, r
        assert r["spill_stores"] == 0, r
        if r["mode"] == "factored":
            assert r["registers"] <= 168, r
            # the column factors come precomputed (ColumnFactors) and a per-element step size costs one
            # division (the C kernel's form): 88 MUFU and 3152-3360 SASS instructions before, 40 and
            # 2296-2512 after
            assert r["mufu"] <= 40 and r["instructions"] <= 2600, r
        if r["mode"] == "elementwise":
            assert r["mufu"] <= 53, r  # one division per element instead of two
        assert r["maxnreg"] == 255, r  # the launch option MultiStep passes (no prologue spills)


def test_capturable_configurations_match_the_host_ones():
    """capturable=True launches the same kernel reading lr, the bias corrections, the bound and the skip
    flag from the device (DEVICE_HP): its aligned float32 and bfloat16 factored configurations compile
    with the host-scalar ones' 128-bit loads and no spill. The loaded scalars live in registers where
    kernel arguments are read from the constant bank: 138-186 registers against 128-168 (measured
    2026-12-05, triton 3.9; at 16x128 float32 one CTA of 4 warps fewer fits an SM)."""
    for bf16 in (False, True):
        for r, b in sm90.TILES:
            host = sm90.compile_multi(2, bf16, r, b, aligned=True)
            dev = sm90.compile_multi(2, bf16, r, b, aligned=True, device_hp=True)
            assert dev["spill_stores"] == 0 and dev["loads_128"] == host["loads_128"] >= 8, (host, dev)
            assert dev["registers"] <= 192 and dev["mufu"] == host["mufu"], (host, dev)


def test_column_block_configurations_vectorise_without_spills():
    """The multi kernel's column-block variant (COLB, D21: a launch group of its own in the batch) compiles for
    sm_90 in every aligned float32 and bfloat16 tile with 128-bit loads and no spill: 142-184 registers against
    the factored default's 128-168, one more MUFU (the K per-block row means; measured 2026-12-07, triton 3.9)."""
    for bf16 in (False, True):
        for r, b in sm90.TILES:
            x = sm90.compile_multi(2, bf16, r, b, aligned=True, colb=True)
            assert x["spill_stores"] == 0 and x["loads_128"] >= 8 and x["registers"] <= 192 and x["mufu"] <= 41, x


def test_unaligned_fallback_builds():
    r = sm90.compile_multi(2, False, 16, 128, aligned=False)
    assert r["registers"] is not None and r["loads"] > 0, r


def test_span_kernels_compile_without_spills():
    """The span kernels (D16, kernels/triton_span.py: statistics, update, update from given indices)
    compile for sm_90 for float32 and bfloat16 rows of 1 to 79 elements, with no register spills and
    at most 64 registers (8 warps, 4 elements per thread; pieces that cut rows included); so do their
    variants for blocks of one row (D19, rows of 22-79). Spills read from the stack frame, without
    disassembling the 48 kernels (test_a_spilling_kernel_has_a_stack_frame)."""
    rows = sm90.shipped_span(disasm=False)
    assert len(rows) == 3 * 2 * (len(sm90.SPAN_SLABS) + len(sm90.ROWS_SLABS))
    for r in rows:
        assert r["stack"] == 0 and r["registers"] <= 64, r


def test_a_spilling_kernel_has_a_stack_frame():
    """What lets test_span_kernels_compile_without_spills read spills from ``cuobjdump -res-usage``
    alone: the multi kernel held to 96 registers spills (STL in its SASS) and has a stack frame for
    the spill slots; the shipped configurations (test_aligned_...) have neither."""
    r = sm90.compile_multi(2, False, 16, 128, aligned=True, maxnreg=96)
    assert r["registers"] <= 96 and r["spill_stores"] > 0 and r["stack"] > 0, r
    for x in [sm90.compile_multi(2, bf16, 16, 128, aligned=True) for bf16 in (False, True)]:
        assert x["spill_stores"] == 0 and x["stack"] == 0, x


def test_apply_many_compiles_without_spills():
    """ZeroGefen's multi-range applier (ApplyMany, 8 warps on the step kernel's 2048-element tiles)
    compiles for sm_90 for the factored and compressed modes, float32 and bfloat16, with no register
    spill and at most 192 registers (its launch options: 8 warps and the multi kernel's register
    ceiling; 4 warps take 244-255 and spill at 16x128, ptxas's own ceiling spills at 4x512
    bfloat16). Its pointers come
    from a table and the exchanged buffer's parts are 8-byte aligned, so its loads are not 128-bit."""
    # the tiles that need the most registers, and the one ptxas's own ceiling spilled (all 20: --apply)
    for mode, bf16, r, b in [(m, bf, r, b) for m in (0, 2) for bf in (False, True) for r, b in sm90.TILES[:2]] + [
            (0, True, 4, 512)]:
        x = sm90.compile_apply(mode, bf16, r, b)
        assert x["spill_stores"] == 0 and x["registers"] <= 192 and x["loads"] > 0, x


def test_nibbles_kernel_compiles_without_spills():
    """second_moment="nibbles" (D20, kernels/triton_nibbles.py): every tile its launchers pick (chunks of 32 to
    256 columns, 128 or 256 elements a program) compiles for sm_90 in float32 and bfloat16 without spills, the
    per-tensor kernel and the multi-tensor one."""
    from gefen_dist.kernels.triton_nibbles import nibble_config

    for bs in (32, 64, 128, 256):
        rows, block, warps = nibble_config(bs)
        for bf16 in (False, True):
            r = sm90.compile_nibbles(bf16, rows, block, warps, disasm=False)
            assert r["stack"] == 0 and r["registers"] <= 128, r
            # the multi-tensor kernel (NibbleStep) under its launch's register ceiling, host or device scalars
            for device_hp in (False, True):
                r = sm90.compile_nibbles_multi(bf16, rows, block, warps, disasm=False, device_hp=device_hp)
                assert r["stack"] == 0 and r["registers"] <= 128, r
