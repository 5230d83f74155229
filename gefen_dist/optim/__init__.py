"""The optimizer class users construct: :class:`~gefen_dist.optim.gefen.Gefen`, a
``torch.optim.Optimizer`` over the engine, with its argument checks (:mod:`.validation`) and its
``state_dict``/``load_state_dict``/copy/pickle contract (:mod:`.state_dict_io`)."""
from .gefen import Gefen, Report  # noqa: F401

__all__ = ["Gefen", "Report"]
