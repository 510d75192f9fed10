"""One LLMEngine stepped by a background thread; requests from any thread join it.

The engine is not thread-safe, so only the loop thread touches it: other threads hand
requests over through a queue, and each request reports back through its ``Sink``.
Shutting down (``stop``, or ``should_drain`` turning true) stops admitting and ends every
open request with the error SHUTTING_DOWN at once, so that clients learn it within one
loop turn instead of when the host gives up on them.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from k3_trtllm.runtime.engine import LLMEngine
from k3_trtllm.serve.protocol import GenerationRequest

log = logging.getLogger(__name__)
SHUTTING_DOWN = "server shutting down"
# Why a request failed: it was bad, the engine failed, or the server is going away.
ErrorKind = Literal["client", "internal", "unavailable"]


class Sink(Protocol):
    """Where one request's results go. Exceptions it raises end that request only."""

    def on_tokens(self, new_ids: list[int], finish_reason: str | None,
                  new_log_probs: list[float] | None = None) -> bool:
        """New tokens (with their log-probabilities when the request asked for them);
        ``finish_reason`` is set when the engine finished the request. Return True when
        the request is done (finished, or it hit a stop sequence); the sink has then
        sent its last response."""

    def on_error(self, message: str, kind: ErrorKind = "internal") -> None:
        """The request failed or was dropped; send the error and close."""

    def on_cancelled(self) -> None:
        """The client cancelled: close without an answer."""

    def is_cancelled(self) -> bool: ...


@dataclass(frozen=True)
class LoopStats:
    active_requests: int
    blocks_in_use: int
    blocks_total: int
    slots_in_use: int
    slots_total: int
    finished: int
    cancelled: int
    failed: int
    steps: int
    # the prefix cache (0 without it): admissions that looked a prefix up, those that found
    # one, and the prompt tokens the found prefixes covered
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    cached_tokens: int = 0


class EngineLoop:
    def __init__(self, engine: LLMEngine, *, cancel_check_period_s: float = 0.05,
                 on_stats=None, should_drain: Callable[[], bool] | None = None,
                 on_drained: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.cancel_check_period_s = cancel_check_period_s
        self.on_stats = on_stats  # called from the loop thread with a LoopStats when they change
        # Asked every loop turn (at least every 0.5 s when idle); True shuts the loop down.
        self.should_drain = should_drain
        self.on_drained = on_drained  # called from the loop thread once every request is answered
        self._incoming: queue.Queue[tuple[GenerationRequest, Sink]] = queue.Queue()
        self._active: dict[int, Sink] = {}  # engine request id -> its sink
        self._stopping = threading.Event()
        # Held while a request is queued and while the stopping loop empties the queue,
        # so that no request slips in behind the last sweep unanswered.
        self._submit_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="k3-engine-loop", daemon=True)
        self._counts = {"finished": 0, "cancelled": 0, "failed": 0}
        self._last_cancel_check = 0.0
        self._last_stats: LoopStats | None = None
        self._stats_lock = threading.Lock()

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: GenerationRequest, sink: Sink) -> None:
        with self._submit_lock:
            if not self._stopping.is_set():
                self._incoming.put((request, sink))
                return
        sink.on_error(SHUTTING_DOWN, "unavailable")

    def stop(self, timeout: float = 10.0) -> None:
        """Stop stepping; requests still open get an error. No stats are published after
        this: the host may no longer serve the callback once it is shutting down."""
        self.on_stats = None
        self._stopping.set()
        self._incoming.put(None)  # wake an idle loop
        self._thread.join(timeout)

    def stats(self) -> LoopStats:
        with self._stats_lock:
            return self._last_stats or self._snapshot()

    # -- the loop thread ----------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                if self._drain_requested():
                    log.info("draining: %d requests in flight get '%s'", len(self._active), SHUTTING_DOWN)
                    self._stopping.set()
                    break
                self._admit(block=not self.engine.has_unfinished())
                self._check_cancelled()
                if self.engine.has_unfinished():
                    self._step()
                self._publish_stats()
        finally:
            self._drain_on_stop()
            if self.on_drained is not None:
                _safely(self.on_drained)

    def _drain_requested(self) -> bool:
        if self.should_drain is None:
            return False
        try:
            return bool(self.should_drain())
        except Exception:  # a broken check must not stop the server
            log.exception("drain check failed")
            return False

    def _admit(self, block: bool) -> None:
        while True:
            try:
                item = self._incoming.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if item is None:
                continue
            request, sink = item
            try:
                rid = self.engine.add_request(request.prompt, request.sampling)
            except ValueError as e:  # prompt too long for the engine, ids outside the vocabulary, ...
                self._counts["failed"] += 1
                _safely(sink.on_error, str(e), "client")
                continue
            self._active[rid] = sink

    def _check_cancelled(self) -> None:
        now = time.monotonic()
        if now - self._last_cancel_check < self.cancel_check_period_s:
            return
        self._last_cancel_check = now
        for rid, sink in list(self._active.items()):
            try:
                cancelled = sink.is_cancelled()
            except Exception:  # a sink that cannot answer has lost its client
                log.exception("request %d: cancellation check failed", rid)
                cancelled = True
            if cancelled:
                self._end(rid, "cancelled")
                _safely(sink.on_cancelled)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # keep serving: fail what was running, free it, go on
            log.exception("engine step failed")
            for rid, sink in list(self._active.items()):
                self._end(rid, "failed")
                _safely(sink.on_error, f"engine step failed: {type(e).__name__}: {e}")
            return
        for out in outputs:
            sink = self._active.get(out.request_id)
            if sink is None:
                continue
            try:
                done = sink.on_tokens(out.new_token_ids, out.finish_reason if out.finished else None,
                                      out.new_log_probs)
            except Exception:
                log.exception("request %d: sending tokens failed; dropping it", out.request_id)
                self._end(out.request_id, "failed")
                continue
            if done or out.finished:
                self._end(out.request_id, "finished")

    def _end(self, rid: int, outcome: str) -> None:
        """Forget ``rid`` in the engine (aborting it if it still runs) and in the loop."""
        self.engine.abort(rid)
        self.engine.take_result(rid)
        del self._active[rid]
        self._counts[outcome] += 1

    def _drain_on_stop(self) -> None:
        for rid, sink in list(self._active.items()):
            self._end(rid, "failed")
            _safely(sink.on_error, SHUTTING_DOWN, "unavailable")
        with self._submit_lock:
            while True:
                try:
                    item = self._incoming.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    _safely(item[1].on_error, SHUTTING_DOWN, "unavailable")
        self._publish_stats()

    def _snapshot(self) -> LoopStats:
        blocks, slots = self.engine.scheduler.blocks, self.engine.scheduler.slots
        prefix = self.engine.scheduler.prefix
        cache = {} if prefix is None else dict(prefix_cache_queries=prefix.queries, prefix_cache_hits=prefix.hits,
                                               cached_tokens=prefix.cached_tokens)
        return LoopStats(active_requests=len(self._active), blocks_in_use=blocks.num_used,
                         blocks_total=blocks.num_blocks, slots_in_use=slots.num_used, slots_total=slots.max_slots,
                         steps=self.engine.stats.num_steps, **self._counts, **cache)

    def _publish_stats(self) -> None:
        stats = self._snapshot()
        with self._stats_lock:
            changed, self._last_stats = stats != self._last_stats, stats
        if changed and self.on_stats is not None:
            _safely(self.on_stats, stats)


def file_drain(path: str) -> dict:
    """EngineLoop keyword arguments that drain the loop when ``path`` appears and then
    write ``path + ".done"`` (how ``k3-trt serve`` reaches the model in Triton's stub)."""
    def drained() -> None:
        with open(path + ".done", "w"):
            pass

    return {"should_drain": lambda: os.path.exists(path), "on_drained": drained}


def _safely(fn, *args) -> None:
    try:
        fn(*args)
    except Exception:
        log.exception("%s failed", getattr(fn, "__qualname__", fn))
