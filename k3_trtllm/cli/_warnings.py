"""Third-party warnings that ``k3-trt build`` triggers on every run and that say nothing
about the user's model: filtered by category, module and message, so any other warning
(a new deprecation, a real export problem) still shows."""
from __future__ import annotations

import logging
import warnings

# torch.onnx's exporter logs, for each torchvision op it could translate, that torchvision
# is not installed; K3 graphs have no torchvision ops.
_TORCHVISION_LOGGER = "torch.onnx._internal.exporter._registration"


class _NoTorchvisionNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("torchvision is not installed")


_torchvision_filter = _NoTorchvisionNotice()


def quiet_known_build_warnings() -> None:
    """Install the filters (idempotent). Only the build CLI calls this: library users keep
    every warning."""
    # torch.export's own pytree code calls the LeafSpec check it deprecates (torch 2.9+);
    # the warning is raised from the pickling helper (copyreg) while exporting.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning)
    # Dynamic dims that share one symbol (num_tokens in two inputs) keep the first name; the
    # exporter reports every other one.
    warnings.filterwarnings("ignore", message=r"# The axis name: \w+ will not be used, since it shares the same "
                            r"shape constraints with another axis", category=UserWarning,
                            module=r"torch\.onnx\._internal\.exporter\._onnx_program")
    logger = logging.getLogger(_TORCHVISION_LOGGER)
    if _torchvision_filter not in logger.filters:
        logger.addFilter(_torchvision_filter)
