#!/usr/bin/env python
"""Compile gefen_dist's multi-tensor Triton update kernel for sm_90 (H100/H200) without a GPU, and
report what the machine code looks like: registers per thread, local-memory spills, and how many
of its global loads are 128-bit.

    python benchmarks/triton_sm90.py            # every shipped configuration, a table
    python benchmarks/triton_sm90.py --json out.json
    python benchmarks/triton_sm90.py --span     # the span kernels (D16, kernels/triton_span.py)
    python benchmarks/triton_sm90.py --apply    # ZeroGefen's multi-range applier (kernels/triton_state.py)

Triton ships ``ptxas``, ``cuobjdump`` and ``nvdisasm``, so ``triton.compile`` with a
``GPUTarget("cuda", 90, 32)`` produces the real cubin on a CPU-only machine. Registers come from
``cuobjdump -res-usage`` (``REG``), spills are the ``STL`` (store-to-local) instructions of the
SASS, 128-bit loads are ``LDG.E.128``; the static instruction and ``MUFU`` (special-function unit)
counts of the listing are a proxy for the issue cost per element. The configurations are the ones
:class:`MultiStep` launches:
mode 0 (``v`` per scale block), 1 (``elementwise``), 2 (factored); float32 and bfloat16
parameters; the full 2048-element tiles of ``_config`` (ROWS x BLOCK_SIZE = 16x128 ... 1x2048, 4
warps), the constexprs a CUDA device gets for betas (0.9, 0.999) with weight decay; each with and
without the ``ALIGNED`` promise (taken when every member's pointers are 16-byte aligned and its row
and scale block are multiples of 16).

This says nothing about time: that needs the device (``benchmarks/gpu_step.py``). It is the
static half of the issue's check, and ``tests/test_triton_sm90.py`` asserts it in CI.
"""
from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TILES = ((16, 128), (8, 256), (4, 512), (2, 1024), (1, 2048))
MODES = {0: "shared", 1: "elementwise", 2: "factored"}


def tools_dir() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def available() -> str:
    """'' when the offline compile can run here, else why not."""
    try:
        import triton  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except Exception as e:  # pragma: no cover - triton is in the test extra on Linux x86_64
        return f"triton is not importable ({e})"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1 is set (the interpreter has no compiler backend)"
    for tool in ("cuobjdump", "nvdisasm"):
        if not os.access(os.path.join(tools_dir(), tool), os.X_OK):
            return f"triton's {tool} is missing from {tools_dir()}"
    return ""


def _compile(name: str, fn, ptr: Dict[str, str], ints, consts: Dict[str, object], options: Dict[str, object],
             disasm: bool = True, kern=None):
    """Compile kernel ``name`` (its plain function ``fn``) for sm_90: ``ptr`` the pointer arguments'
    types (16-byte aligned, as the launcher marks tensor arguments), ``ints`` the int32 scalars (the
    other scalars float32); its registers and stack frame (``cuobjdump -res-usage``), and with ``disasm``
    its spill stores, loads and SASS counts (``nvdisasm``, ~0.85 s a kernel here). A kernel that spills
    has a stack frame (the spill slots); the tests that check only registers and spills read ``stack``."""
    import triton
    from triton.backends.compiler import GPUTarget

    from gefen_dist.kernels import triton_kernels as tk

    kern = tk._kernel(name) if kern is None else kern
    names = list(inspect.signature(fn).parameters)
    sig = {n: ptr.get(n, "i32" if n in ints else "fp32") for n in names}
    sig.update({c: "constexpr" for c in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in ptr}
    src = triton.compiler.ASTSource(fn=kern, signature=sig, constexprs={(names.index(c),): v for c, v in consts.items()},
                                    attrs=attrs)
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(ck.asm["cubin"])
        res = subprocess.run([os.path.join(tools_dir(), "cuobjdump"), "-res-usage", path], capture_output=True,
                             text=True, check=True).stdout
        sass = subprocess.run([os.path.join(tools_dir(), "nvdisasm"), path], capture_output=True, text=True,
                              check=True).stdout if disasm else None
    regs, stack = re.search(r"REG:(\d+)", res), re.search(r"STACK:(\d+)", res)
    out = dict(registers=int(regs.group(1)) if regs else None, stack=int(stack.group(1)) if stack else None)
    if sass is not None:
        out.update(spill_stores=len(re.findall(r"\bSTL", sass)), loads=len(re.findall(r"\bLDG", sass)),
                   loads_128=len(re.findall(r"\bLDG\.E\.128", sass)), **sass_counts(sass))
    return out


def _memo(fn):
    """Compile each configuration once per process (the tests ask for some twice: the capturable
    check compiles the host configurations that the aligned one has already; a compile and its
    disassembly take 1-3 s); every call gets its own copy of the figures."""
    cached = functools.lru_cache(maxsize=None)(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return dict(cached(*args, **kwargs))

    return wrapper


@_memo
def compile_multi(mode: int, bf16: bool, rows: int, block: int, aligned: bool, warps: int = 4,
                  lut_fast: bool = True, maxnreg=None, device_hp: bool = False, colb: bool = False) -> Dict[str, object]:
    """Compile one configuration of the multi-tensor kernel for sm_90, with the launch options
    :class:`MultiStep` uses (``maxnreg``: default, the library's); its resource figures.
    ``device_hp``: the ``capturable=True`` variant, which reads the step's scalars from the device;
    ``colb``: the column-block variant (factored, D21)."""
    from gefen_dist.kernels import triton_kernels as tk, triton_multi as tm

    # tab_ptr: the per-bucket float32 entries in the two-candidate mode of modes 1 and 2, else the int32 table
    ptr = {"meta_ptr": "*i64", "gptr_ptr": "*i64", "prog_ptr": "*i64", "cb_ptr": "*fp32",
           "tab_ptr": "*fp32" if lut_fast and mode != 0 else "*i32",  # TritonTables.kernel_table
           "hp_ptr": "*fp32"}
    consts = dict(MODE=mode, LERP_SMALL=True, FUSED_LERP=True, FUSED_AXPY=True, HAS_WD=True, LUT_FAST=lut_fast,
                  IS_BF16=bf16, ROWS=rows, BLOCK_SIZE=block, ALIGNED=aligned, DEVICE_HP=device_hp, COLB=colb)
    opts = dict(num_warps=warps, enable_fp_fusion=False, **tm.multi_launch_options())
    if maxnreg is not None:
        opts["maxnreg"] = maxnreg
    out = _compile("multi", tk._gefen_multi_kernel, ptr, ("scan_steps",), consts, opts)
    return dict(mode=MODES[mode], dtype="bfloat16" if bf16 else "float32", rows=rows, block=block, warps=warps,
                aligned=aligned, device_hp=device_hp, colb=colb, maxnreg=opts.get("maxnreg"), lut_fast=lut_fast, **out)


@_memo
def compile_apply(mode: int, bf16: bool, rows: int, block: int, warps: int = 8,
                  ceiling: bool = True) -> Dict[str, object]:
    """Compile one configuration of ZeroGefen's multi-range applier (``_apply_multi_kernel``,
    kernels/triton_state.py's ``ApplyMany``) for sm_90, with its launch options (8 warps, the multi
    kernel's register ceiling; ``warps`` / ``ceiling=False``: the alternatives they were chosen over)."""
    from gefen_dist.kernels import triton_kernels as tk, triton_multi as tm

    ptr = {"meta_ptr": "*i64", "prog_ptr": "*i64", "hp_ptr": "*fp32", "cf_ptr": "*i64", "cb_ptr": "*fp32",
           "base": "i64"}  # (an int divisible by 16 gets the same attribute from the launcher)
    consts = dict(MODE=mode, IS_BF16=bf16, ROWS=rows, BLOCK_SIZE=block)
    out = _compile("apply", tk._apply_multi_kernel, ptr, (), consts,
                   dict(num_warps=warps, enable_fp_fusion=False, **(tm.multi_launch_options() if ceiling else {})))
    return dict(mode=MODES[mode], dtype="bfloat16" if bf16 else "float32", rows=rows, block=block, warps=warps,
                aligned=False, device_hp=False, ceiling=ceiling, **out)


@_memo
def compile_nibbles(bf16: bool, rows: int, block: int, warps: int = 4, disasm: bool = True) -> Dict[str, object]:
    """Compile one configuration of the ``second_moment="nibbles"`` kernel (D20, kernels/triton_nibbles.py)
    for sm_90 with its launch options (``triton_tables._config``'s tiles)."""
    from gefen_dist.kernels import triton_nibbles as tn

    g = "*i16" if bf16 else "*fp32"
    ptr = {"p_ptr": g, "g_ptr": g, "code_ptr": "*u8", "scale_ptr": "*fp32", "vrow_ptr": "*fp32", "ro_ptr": "*fp32",
           "rn_ptr": "*fp32", "cb_ptr": "*fp32", "lv_ptr": "*fp32"}
    ints = ("nrows", "S", "B", "NBLK", "row0", "row_block", "key")
    consts = dict(LERP_SMALL=True, FUSED_LERP=True, FUSED_AXPY=True, HAS_WD=True, IS_BF16=bf16, DECODED=False,
                  ROWS=rows, BLOCK_SIZE=block)
    out = _compile("nibbles", tn._nibble_kernel, ptr, ints, consts, dict(num_warps=warps, enable_fp_fusion=False),
                   disasm, kern=tn._kernel())
    return dict(kernel="nibbles", dtype="bfloat16" if bf16 else "float32", rows=rows, block=block, warps=warps, **out)


@_memo
def compile_nibbles_multi(bf16: bool, rows: int, block: int, warps: int = 4, disasm: bool = True,
                          device_hp: bool = False) -> Dict[str, object]:
    """Compile one configuration of the multi-tensor ``second_moment="nibbles"`` kernel
    (``_nibble_multi_kernel``, :class:`~gefen_dist.kernels.triton_nibbles.NibbleStep`) for sm_90;
    ``device_hp``: the ``capturable=True`` variant (the step's scalars and step count read on the device)."""
    from gefen_dist.kernels import triton_nibbles as tn

    ptr = {"meta_ptr": "*i64", "gptr_ptr": "*i64", "prog_ptr": "*i64", "cb_ptr": "*fp32", "lv_ptr": "*fp32",
           "hp_ptr": "*fp32", "step_ptr": "*fp32"}
    consts = dict(LERP_SMALL=True, FUSED_LERP=True, FUSED_AXPY=True, HAS_WD=True, IS_BF16=bf16, DECODED=False,
                  ROWS=rows, BLOCK_SIZE=block, DEVICE_HP=device_hp)
    out = _compile("nibbles_multi", tn._nibble_multi_kernel, {**ptr, "step_key_part": "i64"}, (), consts,
                   dict(num_warps=warps, enable_fp_fusion=False, maxnreg=tn._MULTI_MAXNREG), disasm,
                   kern=tn._kernel("multi"))
    return dict(kernel="nibbles_multi", dtype="bfloat16" if bf16 else "float32", rows=rows, block=block, warps=warps,
                device_hp=device_hp, **out)


SPAN_SLABS = (1, 4, 16, 64, 79)  # row lengths of tensors kept per block of rows (D16: below 80)
ROWS_SLABS = (22, 40, 79)  # row lengths of rows8 tensors (D19: blocks of one row, 22-79)


@_memo
def compile_span(kernel: str, bf16: bool, slab: int, apply: bool = False, disasm: bool = True) -> Dict[str, object]:
    """Compile a span kernel (``"span_stats"`` or ``"span_update"``, kernels/triton_span.py; with the
    prefix ``"span_rows"`` the variants for blocks of one row, D19) for rows of ``slab`` elements, with
    the tile and launch options that module uses."""
    from gefen_dist.kernels import triton_kernels as tk, triton_multi as tm, triton_span as ts

    SP = 1 << max(0, (slab - 1).bit_length())
    R = max(1, ts._TILE // SP)
    g = "*i16" if bf16 else "*fp32"
    if kernel == "span_rows_stats":
        fn, ints = tk._span_rows_stats_kernel, ("nrows", "S", "row0", "lead", "count")
        ptr = {"g_ptr": g, "idx_ptr": "*u8", "scale_ptr": "*fp32", "cb_ptr": "*fp32", "m_ptr": "*fp32",
               "part_ptr": "*fp64", "blk_ptr": "*fp64", "amax_ptr": "*fp32"}
        consts = dict(LERP_SMALL=True, FUSED_LERP=True, IS_BF16=bf16, R=R, SP=SP)
    elif kernel == "span_rows_update":
        fn, ints = tk._span_rows_update_kernel, ("nrows", "S", "row0", "lead", "count", "scan_steps")
        ptr = {"p_ptr": g, "m_ptr": "*fp32", "idx_ptr": "*u8", "scale_ptr": "*fp32", "rms_ptr": "*fp32",
               "cf_ptr": "*fp32", "cb_ptr": "*fp32", "tab_ptr": "*fp32"}
        consts = dict(APPLY=apply, HAS_WD=True, LUT_FAST=True, IS_BF16=bf16, R=R, SP=SP)
    elif kernel == "span_stats":
        fn, ints = tk._span_stats_kernel, ("nrows", "S", "k", "row0", "b_first", "lead", "count")
        ptr = {"g_ptr": g, "idx_ptr": "*u8", "scale_ptr": "*fp32", "cb_ptr": "*fp32", "m_ptr": "*fp32",
               "part_ptr": "*fp64", "blk_ptr": "*fp64", "amax_ptr": "*fp32"}
        consts = dict(LERP_SMALL=True, FUSED_LERP=True, IS_BF16=bf16, R=R, SP=SP)
    else:
        fn, ints = tk._span_update_kernel, ("nrows", "S", "k", "row0", "b_first", "lead", "count", "scan_steps")
        ptr = {"p_ptr": g, "m_ptr": "*fp32", "idx_ptr": "*u8", "scale_ptr": "*fp32", "rms_ptr": "*fp32",
               "cf_ptr": "*fp32", "cb_ptr": "*fp32", "tab_ptr": "*fp32"}
        consts = dict(APPLY=apply, HAS_WD=True, LUT_FAST=True, IS_BF16=bf16, R=R, SP=SP)
    out = _compile(kernel, fn, ptr, ints, consts, dict(num_warps=ts._WARPS, enable_fp_fusion=False,
                                                         **tm.multi_launch_options()), disasm)
    return dict(kernel=kernel + ("_apply" if apply else ""), dtype="bfloat16" if bf16 else "float32", slab=slab,
                tile=f"{R}x{SP}", **out)


def sass_counts(sass: str) -> Dict[str, int]:
    """Static counts in the SASS listing: every instruction, and the special-function unit's
    (``MUFU``: reciprocal and square-root approximations, the core of the correctly rounded
    ``div_rn``/``sqrt_rn`` sequences). Static, not executed: a loop body counts once."""
    ins = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    return dict(instructions=len(ins), mufu=sum(1 for i in ins if i.startswith("MUFU")))


def shipped(aligned=(False, True)) -> List[Dict[str, object]]:
    return [compile_multi(m, bf, r, b, al) for m in MODES for bf in (False, True) for r, b in TILES for al in aligned]


def shipped_span(disasm: bool = True) -> List[Dict[str, object]]:
    kernels = (("span_stats", False), ("span_update", False), ("span_update", True))
    rows = (("span_rows_stats", False), ("span_rows_update", False), ("span_rows_update", True))
    return ([compile_span(k, bf, s, ap, disasm) for k, ap in kernels for bf in (False, True) for s in SPAN_SLABS]
            + [compile_span(k, bf, s, ap, disasm) for k, ap in rows for bf in (False, True) for s in ROWS_SLABS])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows to this file")
    ap.add_argument("--span", action="store_true", help="the span kernels (D16) instead of the multi-tensor kernel")
    ap.add_argument("--apply", action="store_true", help="ZeroGefen's multi-range applier (ApplyMany)")
    ap.add_argument("--apply-warps", type=int, default=8, help="with --apply: num_warps (the library's: 8)")
    ap.add_argument("--apply-no-ceiling", action="store_true", help="with --apply: ptxas's own register ceiling")
    ap.add_argument("--device-hp", action="store_true",
                    help="the aligned factored configurations with and without DEVICE_HP (capturable=True)")
    a = ap.parse_args(argv)
    why = available()
    if why:
        print(f"cannot compile offline: {why}", file=sys.stderr)
        return 2
    if a.span:
        rows = shipped_span()
        for r in rows:
            print(f"{r['kernel']:>17} {r['dtype']:>8} S={r['slab']:<3} {r['tile']:>7} | regs {r['registers']:>3} "
                  f"spills {r['spill_stores']:>3} LDG {r['loads']:>3} SASS {r['instructions']:>5} MUFU {r['mufu']:>3}")
        return 0
    if a.apply:
        rows = [compile_apply(m, bf, r, b, a.apply_warps, not a.apply_no_ceiling) for m in (0, 2)
                for bf in (False, True) for r, b in TILES]
    elif a.device_hp:
        rows = [compile_multi(2, bf, r, b, True, device_hp=d) for bf in (False, True) for r, b in TILES
                for d in (False, True)]
    else:
        rows = shipped()
    hdr = (f"{'mode':>11} {'dtype':>8} {'tile':>8} {'aligned':>7} {'dev_hp':>6} | {'regs':>4} {'spills':>6} {'LDG':>4} {'LDG.128':>7}"
           f" {'SASS':>5} {'MUFU':>4}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['mode']:>11} {r['dtype']:>8} {str(r['rows']) + 'x' + str(r['block']):>8} {str(r['aligned']):>7} {str(r['device_hp']):>6} | "
              f"{r['registers']:>4} {r['spill_stores']:>6} {r['loads']:>4} {r['loads_128']:>7} {r['instructions']:>5} "
              f"{r['mufu']:>4}")
    if a.json:
        import triton

        with open(a.json, "w") as f:
            json.dump({"triton": triton.__version__, "target": "sm_90", "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
