"""Runtime overhead without a model: the engine driven by SyntheticExecutor.

    python bench/bench_runner.py --num-requests 256 --output-len 64

Everything the engine does per step except the forward pass (scheduling, step
tensors, sampling, bookkeeping) is timed; the JSON report's
``scheduler_cpu_ms_per_step`` is the scheduler's own CPU time (schedule +
postprocess) and ``scheduler_cpu_ms_at_full_batch`` the same over steps that ran
every request at once.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from k3_trtllm.runtime.testing.workload import make_workload, run_workload  # noqa: E402
from k3_trtllm.runtime.engine import EngineConfig, LLMEngine  # noqa: E402
from k3_trtllm.runtime.engine import summarize  # noqa: E402
from k3_trtllm.runtime.testing.synthetic_executor import SyntheticExecutor  # noqa: E402


def length_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=length_range, default=(16, 48))
    parser.add_argument("--output-len", type=length_range, default=(64, 64))
    parser.add_argument("--arrival-rate", type=float, default=float("inf"))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-tokens", type=int, default=8192)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    n = args.num_requests
    blocks_each = -(-(args.prompt_len[1] + args.output_len[1]) // args.block_size)
    config = EngineConfig(num_blocks=n * blocks_each, max_slots=n, block_size=args.block_size,
                          max_batch_size=n, max_num_tokens=args.max_num_tokens)
    executor = SyntheticExecutor(args.vocab_size, config.num_blocks, args.block_size, n)
    engine = LLMEngine(executor, config)
    work = make_workload(n, args.prompt_len, args.output_len, args.arrival_rate, args.vocab_size, args.seed)
    report = run_workload(engine, work)
    stats = engine.stats
    full = [cpu for cpu, b in zip(stats.scheduler_cpu_s, stats.batch_per_step) if b == n]
    report["scheduler_cpu_ms_at_full_batch"] = summarize(full, 1e3)
    report["config"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()}
    if report["config"]["arrival_rate"] == float("inf"):
        report["config"]["arrival_rate"] = "inf"  # JSON has no infinity
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
