"""``k3-trt bench``: throughput and latency of the engine under synthetic load."""
from __future__ import annotations

import json

import click

from .run import build_engine_from_options, engine_options


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
              show_default=True, help="Poisson arrivals, requests/s; inf sends all at once.")
@click.option("--prompt-len", default="16:256", show_default=True, callback=_length_range,
              help="Prompt tokens, N or MIN:MAX (uniform).")
@click.option("--output-len", default="16:128", show_default=True, callback=_length_range,
              help="Generated tokens, N or MIN:MAX (uniform; EOS is ignored).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the synthetic workload.")
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True,
              help="Requests run before timing (first-call overheads).")
@engine_options
def bench(model_dir, num_requests, arrival_rate, prompt_len, output_len, seed, warmup, **engine_kwargs):
    """Serve N random requests arriving over time; print throughput, TTFT/TPOT
    percentiles and the scheduler's CPU time per step as JSON."""
    from k3_trtllm.runtime.benchmark import make_workload, run_workload

    engine = build_engine_from_options(model_dir, **engine_kwargs)
    try:
        work = make_workload(num_requests, prompt_len, output_len, arrival_rate, engine.vocab_size, seed)
        if warmup:
            warm = make_workload(warmup, prompt_len, (2, 2), float("inf"), engine.vocab_size, seed + 1)
            run_workload(engine, warm)
            engine.reset_stats()
        report = run_workload(engine, work)
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    report["config"] = {"model_dir": model_dir, "num_requests": num_requests, "arrival_rate": arrival_rate,
                        "prompt_len": list(prompt_len), "output_len": list(output_len), "seed": seed,
                        **{k: v for k, v in engine_kwargs.items()}}
    click.echo(json.dumps(report, indent=2))
