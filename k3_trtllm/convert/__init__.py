"""``k3-trt convert``: HF K3 checkpoint → TensorRT-LLM checkpoint, TP/EP-sharded, streaming."""
from .parallel import ConvertError, Parallel, parallel_for
from .reassemble import reassemble
from .run import ConvertResult, convert_checkpoint

__all__ = ["ConvertError", "ConvertResult", "Parallel", "convert_checkpoint", "parallel_for", "reassemble"]
