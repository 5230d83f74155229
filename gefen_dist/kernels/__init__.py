"""Fused kernels: a native CPU kernel (C + OpenMP, built on first use) and a Triton GPU kernel.

Pure math like :mod:`gefen_dist.core`; no ``torch.distributed``.
"""
