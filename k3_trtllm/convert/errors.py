"""The error ``k3-trt convert`` raises for options that do not fit the checkpoint (sharding
rules themselves raise ``CheckpointError`` from ``checkpoint.rank_layout``)."""
from __future__ import annotations


class ConvertError(ValueError):
    """Conversion options that do not fit the checkpoint; names the option and the value."""
