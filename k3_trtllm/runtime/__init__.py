"""Inflight-batching runtime (DESIGN §4): scheduler, cache bookkeeping, sampler, engine."""
from .engine import CompletedRequest, EngineConfig, LLMEngine, RequestOutput, build_engine
from .executor import Executor, TorchExecutor
from .sequence import SamplingParams

__all__ = ["CompletedRequest", "EngineConfig", "Executor", "LLMEngine", "RequestOutput", "SamplingParams",
           "TorchExecutor", "build_engine"]
