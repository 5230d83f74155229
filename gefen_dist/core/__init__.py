"""Pure math of Gefen: periods, codebook, quantisation and the eager update.

Nothing in this package imports ``torch.distributed``; the layers above (layout, comm,
optimizer, integrations) depend on it, never the reverse.
"""
