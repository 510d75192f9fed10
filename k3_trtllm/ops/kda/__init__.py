"""KDA ops: ``k3::kda_prefill`` / ``k3::kda_decode`` (registered on import) and the naive math."""
from . import reference  # noqa: F401  (registers the ops)
from .naive import chunk_kda, kda_gate, l2_normalize, recurrent_kda, short_conv

__all__ = ["chunk_kda", "kda_gate", "l2_normalize", "recurrent_kda", "short_conv"]
