"""K3 ops: each defined once (``contract.py``) and registered as ``torch.ops.k3.*`` on import."""
from . import kda, mla, moe  # noqa: F401  (registration side effects)
