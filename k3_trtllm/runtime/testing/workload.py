"""Synthetic load for the engine: random prompts and output lengths arriving over time."""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Callable

from k3_trtllm.runtime.engine import LLMEngine
from k3_trtllm.runtime.sequence import SamplingParams
from k3_trtllm.runtime.engine import summarize

FIRST_TEXT_ID = 3  # skip pad/bos/eos so a prompt never contains an end marker


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    arrival_s: list[float]  # offsets from the start, non-decreasing


def make_workload(num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
                  arrival_rate: float, vocab_size: int, seed: int = 0) -> Workload:
    """Lengths uniform in the inclusive ranges; arrivals a Poisson process of
    ``arrival_rate`` requests/s (all at once when infinite)."""
    for name, (lo, hi) in (("prompt length", prompt_len), ("output length", output_len)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} range {lo}:{hi} must satisfy 1 <= min <= max")
    if not arrival_rate > 0:
        raise ValueError(f"arrival rate must be > 0 (inf for all at once), got {arrival_rate}")
    rng = random.Random(seed)
    prompts = [[rng.randrange(FIRST_TEXT_ID, vocab_size) for _ in range(rng.randint(*prompt_len))]
               for _ in range(num_requests)]
    output_lens = [rng.randint(*output_len) for _ in range(num_requests)]
    t, arrivals = 0.0, []
    for _ in range(num_requests):
        arrivals.append(t)
        if arrival_rate != float("inf"):
            t += rng.expovariate(arrival_rate)
    return Workload(prompts, output_lens, arrivals)


def run_workload(engine: LLMEngine, work: Workload, on_finished: Callable[[int], object] | None = None) -> dict:
    """Feed ``work`` to ``engine`` in real time (a request joins at the first step
    boundary after it arrives; TTFT counts from its arrival) and report latencies and
    throughput. Output lengths are exact: EOS is ignored. ``on_finished(n)`` is called
    after each step that finished n >= 1 requests (a progress bar)."""
    start = engine.clock()
    pending = list(range(len(work.prompts)))[::-1]
    ids = []
    while pending or engine.has_unfinished():
        now = engine.clock()
        while pending and start + work.arrival_s[pending[-1]] <= now:
            i = pending.pop()
            params = SamplingParams(max_new_tokens=work.output_lens[i], ignore_eos=True)
            ids.append(engine.add_request(work.prompts[i], params, arrival_time=start + work.arrival_s[i]))
        if engine.has_unfinished():
            finished = sum(output.finished for output in engine.step())
            if finished and on_finished is not None:
                on_finished(finished)
        elif pending:
            time.sleep(max(0.0, start + work.arrival_s[pending[-1]] - engine.clock()))
    duration = engine.clock() - start
    results = [engine.take_result(rid) for rid in ids]
    generated = sum(len(r.output_token_ids) for r in results)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in results)
    summary = engine.summary()
    return {
        "requests": len(results),
        "duration_s": duration,
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        "requests_per_s": len(results) / duration,
        "output_tokens_per_s": generated / duration,
        "total_tokens_per_s": (generated + prompt_tokens) / duration,
        "ttft_ms": summarize((r.ttft_s for r in results), 1e3),
        "tpot_ms": summarize((r.tpot_s for r in results), 1e3),
        "scheduler_cpu_ms_per_step": summary["scheduler_cpu_ms_per_step"],
        "step_ms": summary["step_ms"],
        "steps": summary["steps"],
        "preemptions": summary["preemptions"],
        "peak_batch": summary["peak_batch"],
        "blocks": summary["blocks"],
        "slots": summary["slots"],
    }
