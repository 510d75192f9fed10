"""``k3-trt convert``: HF K3 checkpoint → TensorRT-LLM checkpoint, TP/EP-sharded, streaming."""
from .errors import ConvertError
from .reassemble import reassemble
from .run import ConvertResult, convert_checkpoint

__all__ = ["ConvertError", "ConvertResult", "convert_checkpoint", "reassemble"]
