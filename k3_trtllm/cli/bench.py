"""``k3-trt bench``: throughput and latency of the engine under synthetic load."""
from __future__ import annotations

import click

from k3_trtllm.utils import strict_json

from ._progress import progress_bar
from .run import build_engine_from_options, engine_options, quiet_option, rank_failures, threads_option


def _length_range(ctx, param, value: str) -> tuple[int, int]:
    try:
        lo, _, hi = value.partition(":")
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected N or MIN:MAX") from None
    if not 1 <= lo <= hi:
        raise click.BadParameter(f"{value!r}: need 1 <= MIN <= MAX")
    return lo, hi


@click.command()
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--num-requests", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--arrival-rate", type=click.FloatRange(min=0, min_open=True), default=float("inf"),
              show_default=True, help="Poisson arrivals, requests/s; inf sends all at once (null in the "
              "JSON report).")
@click.option("--prompt-len", default="16:256", show_default=True, callback=_length_range,
              help="Prompt tokens, N or MIN:MAX (uniform).")
@click.option("--output-len", default="16:128", show_default=True, callback=_length_range,
              help="Generated tokens, N or MIN:MAX (uniform; EOS is ignored).")
@click.option("--shared-prefix-len", type=click.IntRange(min=0), default=0, show_default=True,
              help="Tokens every prompt starts with (one random run of them, like a system prompt; the warmup "
                   "requests do not have it), before its own --prompt-len tokens: load for --prefix-cache.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the synthetic workload.")
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True,
              help="Requests run before timing (first-call overheads).")
@engine_options
@threads_option
@quiet_option
def bench(model_dir, num_requests, arrival_rate, prompt_len, output_len, shared_prefix_len, seed, warmup, quiet,
          **engine_kwargs):
    """Serve N random requests arriving over time; print throughput, TTFT/TPOT
    percentiles, the scheduler's CPU time per step and the prefix cache's hits as strict
    JSON (non-finite numbers are null), with a progress bar on stderr."""
    import dataclasses
    import random

    import torch

    from k3_trtllm.runtime.distributed import step_broadcast_cost
    from k3_trtllm.runtime.testing.workload import FIRST_TEXT_ID, make_workload, run_workload

    engine = build_engine_from_options(model_dir, notices=not quiet, **engine_kwargs)
    try:
        with rank_failures():
            limit = engine.config.max_seq_len
            longest = shared_prefix_len + prompt_len[1] + output_len[1]
            if limit is not None and longest > limit:  # else a long request would fail the run half way
                raise ValueError(f"--shared-prefix-len {shared_prefix_len} + --prompt-len max {prompt_len[1]} + "
                                 f"--output-len max {output_len[1]} = {longest} tokens exceeds --max-seq-len {limit}")
            work = make_workload(num_requests, prompt_len, output_len, arrival_rate, engine.vocab_size, seed)
            if shared_prefix_len:
                rng = random.Random(f"shared prefix {seed}")
                prefix = [rng.randrange(FIRST_TEXT_ID, engine.vocab_size) for _ in range(shared_prefix_len)]
                work = dataclasses.replace(work, prompts=[prefix + p for p in work.prompts])
            if warmup:
                warm = make_workload(warmup, prompt_len, (2, 2), float("inf"), engine.vocab_size, seed + 1)
                run_workload(engine, warm)
                engine.reset_stats()
            with progress_bar(num_requests, "bench", "req", quiet) as bar:
                report = run_workload(engine, work, on_finished=bar.update)
            report["prefix_cache"] = engine.summary()["prefix_cache"]
            broadcast = step_broadcast_cost(engine)  # world size > 1 only
            if broadcast is not None:
                report["step_broadcast"] = broadcast
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    report["config"] = {"model_dir": model_dir, "num_requests": num_requests, "arrival_rate": arrival_rate,
                        "prompt_len": list(prompt_len), "output_len": list(output_len),
                        "shared_prefix_len": shared_prefix_len, "seed": seed,
                        **{k: v for k, v in engine_kwargs.items()}, "threads": torch.get_num_threads()}
    click.echo(strict_json.dumps(report, indent=2))
