"""MLA ops (spec §4.4): importing this package registers ``k3::mla_prefill`` and
``k3::mla_decode``."""
from . import reference  # noqa: F401  (registers the ops)
from .naive import absorbed_attention, causal_mask, expanded_attention, gather_latents, insert_latents

__all__ = ["absorbed_attention", "causal_mask", "expanded_attention", "gather_latents", "insert_latents"]
