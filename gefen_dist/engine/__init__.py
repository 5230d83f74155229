"""The engine: what every backend shares once it has said which pieces of which global tensors
this rank holds.

* :mod:`.layout`: pieces (this rank's rows of a global tensor) and their block geometry.
* :mod:`.state`: one spec of a tensor's state (mode, keys, shapes, dtypes).
* :mod:`.learning`: periods and the codebook from the first nonzero gradient, over pieces.
* :mod:`.column_stats`: the factored second moment's column statistics over pieces.
* :mod:`.tensor_step`, :mod:`.cuda_batch`: stepping per tensor, and all CUDA tensors at once.
* :mod:`.flat`, :mod:`.flat_layout`, :mod:`.flat_step`: the same over a flat buffer of segments
  (DeepSpeed's partitions).
* :mod:`.comm`: the few collectives (learning, column sums), behind one interface.
* :mod:`.nonfinite`, :mod:`.report`: gradient checks and what the state costs.

The math itself lives in :mod:`gefen_dist.core` (reference) and :mod:`gefen_dist.kernels` (C,
Triton), picked by :mod:`gefen_dist.kernels.dispatch`; nothing here imports the optimizer classes
(:mod:`gefen_dist.optim`, :mod:`gefen_dist.zero`) or the integrations.
"""
