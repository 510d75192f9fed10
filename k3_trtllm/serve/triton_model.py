"""The decoupled Triton Python-backend model: one k3-trt engine serving every request.

Loaded by the ``model.py`` that ``k3-trt triton-repo`` writes; runs inside Triton's Python
backend stub, where ``triton_python_backend_utils`` exists. ``execute`` only parses and
queues; the engine loop thread streams each request's tokens through its response sender.
Engine state is published as Triton metrics on the metrics port:
``k3_engine{model="k3",quantity="blocks_in_use"}`` and the other LoopStats fields (with
``--prefix-cache``: ``prefix_cache_queries``, ``prefix_cache_hits`` and ``cached_tokens``).

Draining: when the ``drain_file`` parameter names a file and that file appears (``k3-trt
serve`` creates it on SIGINT/SIGTERM), the loop stops admitting and ends every open
request with "server shutting down" (UNAVAILABLE), then writes ``drain_file + ".done"``;
tritonserver, stopped next, then has nothing in flight to wait for.
"""
from __future__ import annotations

import json
import logging

import triton_python_backend_utils as pb_utils

from k3_trtllm.serve.engine_loop import EngineLoop, ErrorKind, LoopStats
from k3_trtllm.serve.protocol import BadRequest, ResponseBuilder, output_arrays, parse_request
from k3_trtllm.serve.repository import engine_kwargs_from_parameters

log = logging.getLogger(__name__)
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonStream:
    """One request's response sender, seen by the engine loop as a Sink."""

    def __init__(self, request, generation, tokenizer) -> None:
        self.sender = request.get_response_sender()
        self.builder = ResponseBuilder(generation, tokenizer)

    def on_tokens(self, new_ids: list[int], finish_reason: str | None,
                  new_log_probs: list[float] | None = None) -> bool:
        chunk, done = self.builder.add(new_ids, finish_reason, new_log_probs)
        if chunk is not None:
            tensors = [pb_utils.Tensor(name, array) for name, array in output_arrays(chunk).items()]
            self.sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=FINAL if chunk.final else 0)
        return done

    def on_error(self, message: str, kind: ErrorKind = "internal") -> None:
        codes = {"client": pb_utils.TritonError.INVALID_ARG, "internal": pb_utils.TritonError.INTERNAL,
                 "unavailable": pb_utils.TritonError.UNAVAILABLE}
        send_error(self.sender, message, codes[kind])

    def on_cancelled(self) -> None:
        self.sender.send(flags=FINAL)

    def is_cancelled(self) -> bool:
        return self.sender.is_cancelled()


def send_error(sender, message: str, code) -> None:
    sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code)),
                flags=FINAL)


class EngineMetrics:
    """Engine counters as Triton gauges, so that clients and tests can see leaks."""

    NAMES = ("active_requests", "blocks_in_use", "blocks_total", "slots_in_use", "slots_total",
             "finished", "cancelled", "failed", "steps", "prefix_cache_queries", "prefix_cache_hits", "cached_tokens")

    def __init__(self, model_name: str) -> None:
        self.family = pb_utils.MetricFamily(name="k3_engine", description="k3-trt engine state and request counts",
                                            kind=pb_utils.MetricFamily.GAUGE)
        self.gauges = {name: self.family.Metric(labels={"model": model_name, "quantity": name})
                       for name in self.NAMES}
        self.last: dict[str, int] = {}

    def update(self, stats: LoopStats) -> None:
        for name, gauge in self.gauges.items():
            value = getattr(stats, name)
            if self.last.get(name) != value:
                gauge.set(value)
                self.last[name] = value


class TritonLogHandler(logging.Handler):
    """Python logging into the server's log (the stub's own stderr goes nowhere useful)."""

    def emit(self, record: logging.LogRecord) -> None:
        message = self.format(record)
        if record.levelno >= logging.ERROR:
            pb_utils.Logger.log_error(message)
        elif record.levelno >= logging.WARNING:
            pb_utils.Logger.log_warn(message)
        else:
            pb_utils.Logger.log_info(message)


class TritonPythonModel:
    def initialize(self, args) -> None:
        from k3_trtllm.runtime.engine import build_engine, snapshot_rows_notice
        from k3_trtllm.trt.segment_layout import is_segmented_engine_dir

        package_log = logging.getLogger("k3_trtllm")
        package_log.addHandler(TritonLogHandler())
        package_log.setLevel(logging.INFO)

        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("the k3 model streams: set model_transaction_policy "
                                                "{ decoupled: true } in config.pbtxt")
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        engine_dir = is_segmented_engine_dir(parameters.get("model_dir", ""))
        model_dir, engine_kwargs, loop_kwargs = engine_kwargs_from_parameters(parameters, engine_dir)
        if engine_dir:  # `k3-trt build --layout segments`: the segments run on EngineExecutor
            from k3_trtllm.trt.engine_executor import engine_dir_engine

            self.engine = engine_dir_engine(model_dir, **engine_kwargs)
        else:
            self.engine = build_engine(model_dir, **engine_kwargs)
        notice = snapshot_rows_notice(self.engine, **{k: engine_kwargs.get(k) for k in (
            "num_blocks", "max_slots", "cache_memory_gb", "snapshot_slots")})
        if notice:
            log.info("%s", notice)
        self.metrics = EngineMetrics(args["model_name"])
        self.loop = EngineLoop(self.engine, on_stats=self.metrics.update, **loop_kwargs)
        self.loop.start()
        log.info("k3 engine ready: %s", model_dir)

    def execute(self, requests):
        for request in requests:
            try:
                generation = parse_request(lambda name: _input(request, name), self.engine.tokenizer)
            except BadRequest as e:
                send_error(request.get_response_sender(), str(e), pb_utils.TritonError.INVALID_ARG)
                continue
            self.loop.submit(generation, TritonStream(request, generation, self.engine.tokenizer))
        return None  # decoupled: responses go through the senders

    def finalize(self) -> None:
        self.loop.stop()
        self.engine.close()  # world size > 1: stops the ranks this model started


def _input(request, name: str):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()

