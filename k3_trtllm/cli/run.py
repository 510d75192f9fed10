"""``k3-trt run``: generate with the inflight-batching engine."""
from __future__ import annotations

import contextlib
import json
import sys
from functools import partial
from pathlib import Path

import click

from k3_trtllm.utils import strict_json

from ._progress import progress_bar

DTYPES = ("bfloat16", "float32")
KV_CACHE_DTYPES = ("auto", "bf16", "fp8")  # model/caches.py KV_CACHE_DTYPES (cli imports no torch at startup)
# Whether --prefix-cache is on when neither it nor --no-prefix-cache is given (run, bench,
# serve, triton-repo): on since the KDA prefill writes the snapshots itself, so a miss costs
# no extra prefill steps, and the cached tokens equal the uncached ones (issue 22's proofs).
PREFIX_CACHE_DEFAULT = True
PREFIX_CACHE_VALUE_FLAGS = {"prefix_cache_interval": "--prefix-cache-interval",
                            "snapshot_slots": "--prefix-cache-snapshots"}
SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids", "ignore_eos"}


def kv_cache_dtype_option():
    """``--kv-cache-dtype``: run, bench, serve, triton-repo and build."""
    return click.option("--kv-cache-dtype", type=click.Choice(KV_CACHE_DTYPES), default="auto", show_default=True,
                        help="Latent-cache rows: auto is the activation dtype (--dtype), bf16 the same stated "
                             "(needs bfloat16 activations), fp8 E4M3 latents with an fp32 scale per group of "
                             "channels and bf16 rope, ~0.57x the bytes (README: fp8 latent cache). An engine dir "
                             "keeps the one it was built with.")


def check_kv_cache_dtype(kv_cache_dtype: str, dtype: str) -> None:
    """``--kv-cache-dtype`` against ``--dtype`` for a checkpoint, before anything loads (the
    rule of ``model/caches.py: is_fp8_cache``, as a one-line error naming the flags)."""
    if kv_cache_dtype == "bf16" and dtype != "bfloat16":
        raise click.ClickException(f"--kv-cache-dtype bf16: needs --dtype bfloat16 (the latent cache is in the "
                                   f"activation dtype, {dtype} here); use auto or fp8")


def engine_options(fn):
    """Options that size and shape the engine; shared with ``k3-trt bench``."""
    options = [
        click.option("--dtype", type=click.Choice(DTYPES), default="bfloat16", show_default=True,
                     help="Activation dtype, and the cache's unless --kv-cache-dtype fp8."),
        kv_cache_dtype_option(),
        click.option("--device", default=None, help="Torch device [default: cuda if available, else cpu]."),
        click.option("--max-batch-size", type=click.IntRange(min=1), default=64, show_default=True,
                     help="Most sequences running at once."),
        click.option("--max-num-tokens", type=click.IntRange(min=1), default=2048, show_default=True,
                     help="Most tokens in one step; longer prompts are prefilled in chunks."),
        click.option("--block-size", type=click.IntRange(min=1), default=16, show_default=True,
                     help="Tokens per latent-cache block."),
        click.option("--max-seq-len", type=click.IntRange(min=2), default=4096, show_default=True,
                     help="Most prompt + generated tokens of one request (also caps the blocks that "
                          "--cache-memory-gb allocates)."),
        click.option("--num-blocks", type=click.IntRange(min=1), default=None,
                     help="Latent-cache blocks (instead of deriving them from --cache-memory-gb)."),
        click.option("--max-slots", type=click.IntRange(min=1), default=None,
                     help="KDA state rows (instead of deriving them from --cache-memory-gb)."),
        click.option("--cache-memory-gb", type=click.FloatRange(min=0, min_open=True), default=None,
                     help="Memory for latent-cache blocks and KDA state rows together [default: 2 unless "
                          "both --num-blocks and --max-slots are given]."),
        click.option("--tp", type=click.IntRange(min=1), default=None,
                     help="Tensor-parallel ranks for an HF checkpoint, sharded at load as `k3-trt convert` "
                          "shards [default: 1; a converted checkpoint's own mapping]. k3-trt starts the ranks "
                          "on this host itself, or joins the ranks torchrun started (README: Multi-rank)."),
        click.option("--ep", type=click.IntRange(min=1), default=None,
                     help="Expert-parallel groups of the routed experts, with --tp [default: 1]."),
        click.option("--prefix-cache/--no-prefix-cache", default=PREFIX_CACHE_DEFAULT, show_default=True,
                     help="Reuse the latent-cache blocks and the KDA state snapshot of a prompt prefix an earlier "
                          "request computed; the prompt is prefilled from there (README: Prefix caching)."),
        click.option("--prefix-cache-interval", type=click.IntRange(min=0), default=None,
                     help="With --prefix-cache: prompt tokens between KDA state snapshots, a multiple of "
                          "--block-size; a prefix is reused up to its deepest snapshot, which the prefill "
                          "takes mid-step at multiples of 64 [default: 0, the engine's own: README, Prefix "
                          "caching]."),
        click.option("--prefix-cache-snapshots", "snapshot_slots", type=click.IntRange(min=1), default=None,
                     help="With --prefix-cache: KDA state snapshots kept, out of the cache budget [default: a "
                          "share of --cache-memory-gb; with both pool counts and no budget one per --max-slots "
                          "slot, at most one per interval of the --num-blocks blocks, stated on stderr; README: "
                          "Prefix caching]."),
        click.option("--batch-invariant", is_flag=True,
                     help="On CUDA: a request's output does not depend on what else is in the batch (fixed "
                          "reduction tilings; slower, no CUDA-graph decode; README: Reproducibility). The CPU "
                          "reference ops are batch-invariant without it."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def threads_option(fn):
    """``--threads``: torch's intra-op CPU threads (run, bench, serve)."""
    return click.option("--threads", type=click.IntRange(min=1), default=None,
                        help="CPU threads of torch's intra-op pool [default: torch's own count, capped at the "
                             "physical cores this process may use (CPU affinity, cgroup quota) less those other "
                             "processes keep busy (load average)].")(fn)


def quiet_option(fn):
    return click.option("--quiet", is_flag=True, help="No progress bar on stderr.")(fn)


def engine_dir_options(fn):
    """``--checkpoint`` and ``--plugin-lib``: what runs a segmented engine dir (``k3-trt build``)."""
    fn = click.option("--plugin-lib", type=click.Path(dir_okay=False), default=None,
                      help="For an engine dir on cuda: the K3 TensorRT plugin library.")(fn)
    return click.option("--checkpoint", type=click.Path(file_okay=False), default=None,
                        help="For an engine dir: the converted checkpoint whose weights it binds [default: the "
                             "one it was built for].")(fn)


def engine_dir_settings(model_dir: str, options: dict) -> dict:
    """The settings an engine dir takes from the command line (run, serve, triton-repo): those
    the user gave, the rest None, so that the engine's own limits and dtype apply; given ones
    must fit it. ``--tp/--ep`` (the engine fixes its mapping) and ``--batch-invariant`` (the
    segments do not run the torch overrides it installs) are refused. ``--prefix-cache`` is
    no engine limit: on (by default, as for a checkpoint, when the engine's KDA plugins write the
    snapshots; only when asked for in an engine dir built before they did) it is passed, off it is
    left out (the engine's own default is off)."""
    ctx = click.get_current_context()
    explicit = {k: (v if ctx.get_parameter_source(k) != click.core.ParameterSource.DEFAULT else None)
                for k, v in options.items()}
    if explicit.pop("tp", None) is not None or explicit.pop("ep", None) is not None:
        raise click.ClickException(f"--tp/--ep: engine dir {model_dir} fixes its mapping; leave them out")
    if explicit.pop("batch_invariant", None):
        raise click.ClickException(f"--batch-invariant: not available for engine dirs ({model_dir}); "
                                   "run the checkpoint it was built from")
    if "prefix_cache" in options:
        from k3_trtllm.trt.segment_layout import engine_dir_writes_snapshots

        # an engine dir whose KDA plugins take no snapshot points (built before they did) would end every
        # prefill at each snapshot position with the cache on: there it is on only when asked for (the
        # flag or a value flag)
        asked = engine_dir_writes_snapshots(model_dir) or explicit["prefix_cache"] is not None or any(
            explicit.get(k) is not None for k in PREFIX_CACHE_VALUE_FLAGS)
        explicit["prefix_cache"] = True if asked and options["prefix_cache"] else None
    return explicit


def check_prefix_cache(prefix_cache: bool, prefix_cache_interval: int | None, snapshot_slots: int | None,
                       block_size: int | None, max_seq_len: int | None) -> None:
    """The prefix-cache flags, checked before anything loads or is written (``triton-repo``
    hands them to a server that would only fail at model load): the value flags need the
    cache on, and a snapshot interval is a multiple of the block size that a prompt can
    reach. ``block_size``/``max_seq_len`` None: unknown here, checked when the engine loads."""
    if not prefix_cache:
        given = {"prefix_cache_interval": prefix_cache_interval, "snapshot_slots": snapshot_slots}
        for key, flag in PREFIX_CACHE_VALUE_FLAGS.items():
            if given[key] is not None:
                raise click.ClickException(f"{flag}: needs --prefix-cache")
        return
    interval = prefix_cache_interval
    if interval and block_size is not None:
        from k3_trtllm.runtime.block_manager import resolve_prefix_interval

        try:
            resolve_prefix_interval(interval, block_size)
        except ValueError as e:
            raise click.ClickException(str(e)) from None
    if interval and max_seq_len is not None and interval >= max_seq_len:
        raise click.ClickException(f"--prefix-cache-interval {interval}: no request reaches a snapshot "
                                   f"(--max-seq-len {max_seq_len})")


def _engine_dir_engine(model_dir: str, device: str, options: dict):
    """``run ENGINE_DIR``: limits left at their defaults are the engine's, given ones must fit it."""
    from k3_trtllm.trt.engine_executor import engine_dir_engine

    explicit = engine_dir_settings(model_dir, options)
    explicit["prefix_cache"] = bool(explicit["prefix_cache"])
    try:
        return engine_dir_engine(model_dir, device=device, **explicit)
    except (ValueError, OSError, RuntimeError) as e:
        raise click.ClickException(f"cannot run {model_dir}: {e}") from e


def resolve_device(device: str | None) -> str:
    """The torch device to run on: ``device`` checked against this machine (a one-line
    error naming it otherwise), or cuda when available, else cpu."""
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise click.ClickException(f"--device {device}: not a device (cpu, cuda or cuda:N)") from None
    if parsed.type == "cpu":
        return device
    if parsed.type != "cuda":
        raise click.ClickException(f"--device {device}: k3-trt runs on cpu or cuda")
    if not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else \
            "no CUDA device is visible (driver, CUDA_VISIBLE_DEVICES)"
        raise click.ClickException(f"--device {device}: {why}")
    count = torch.cuda.device_count()
    if parsed.index is not None and parsed.index >= count:
        raise click.ClickException(f"--device {device}: this machine has {count} CUDA device"
                                   f"{'s' if count != 1 else ''} (cuda:0 to cuda:{count - 1})")
    return device


def build_engine_from_options(model_dir: str, *, dtype: str, device: str | None, max_batch_size: int,
                              max_num_tokens: int, block_size: int, max_seq_len: int, num_blocks: int | None,
                              max_slots: int | None, cache_memory_gb: float | None, seed: int | None = None,
                              threads: int | None = None, tp: int | None = None, ep: int | None = None,
                              checkpoint: str | None = None, plugin_lib: str | None = None,
                              batch_invariant: bool = False, prefix_cache: bool = PREFIX_CACHE_DEFAULT,
                              prefix_cache_interval: int | None = None, snapshot_slots: int | None = None,
                              kv_cache_dtype: str = "auto", notices: bool = True):
    """The engine of ``model_dir`` (checkpoint or engine dir) from the engine options; ``notices``:
    say on stderr what the flags left for the engine to choose that costs memory (``--quiet``: no)."""
    import torch

    from k3_trtllm.runtime.distributed import RankFailure
    from k3_trtllm.runtime.engine import build_engine
    from k3_trtllm.trt.segment_layout import is_segmented_engine_dir
    from k3_trtllm.utils.threads import set_torch_threads

    device = resolve_device(device)
    set_torch_threads(threads)
    notice = partial(_snapshot_notice, notices, num_blocks=num_blocks, max_slots=max_slots,
                     cache_memory_gb=cache_memory_gb, snapshot_slots=snapshot_slots)
    if is_segmented_engine_dir(model_dir):
        from k3_trtllm.trt.segment_layout import engine_limits

        limits = engine_limits(model_dir)  # the engine's own unless given (they must match it)
        source = click.get_current_context().get_parameter_source
        given = {k: v if source(k) != click.core.ParameterSource.DEFAULT else limits.get(k)
                 for k, v in (("block_size", block_size), ("max_seq_len", max_seq_len))}
        check_prefix_cache(prefix_cache, prefix_cache_interval, snapshot_slots, given["block_size"],
                           given["max_seq_len"])
        engine = _engine_dir_engine(model_dir, device, dict(
            dtype=dtype, block_size=block_size, max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
            max_seq_len=max_seq_len, num_blocks=num_blocks, max_slots=max_slots, cache_memory_gb=cache_memory_gb,
            seed=seed, tp=tp, ep=ep, checkpoint=checkpoint, plugin_lib=plugin_lib, batch_invariant=batch_invariant,
            prefix_cache=prefix_cache, prefix_cache_interval=prefix_cache_interval, snapshot_slots=snapshot_slots,
            kv_cache_dtype=kv_cache_dtype))
        if engine is None:  # a torchrun rank other than 0: it served rank 0's steps
            raise click.exceptions.Exit(0)
        click.get_current_context().call_on_close(engine.close)
        notice(engine)
        return engine
    if checkpoint is not None or plugin_lib is not None:
        raise click.ClickException("--checkpoint/--plugin-lib go with an engine dir from `k3-trt build`")
    check_prefix_cache(prefix_cache, prefix_cache_interval, snapshot_slots, block_size, max_seq_len)
    check_kv_cache_dtype(kv_cache_dtype, dtype)
    if cache_memory_gb is None and (num_blocks is None or max_slots is None):
        from k3_trtllm.runtime.block_manager import DEFAULT_CACHE_MEMORY_GB

        cache_memory_gb = DEFAULT_CACHE_MEMORY_GB
    try:
        engine = build_engine(model_dir, dtype=getattr(torch, dtype), device=device, block_size=block_size,
                              max_batch_size=max_batch_size, max_num_tokens=max_num_tokens, max_seq_len=max_seq_len,
                              num_blocks=num_blocks,
                              max_slots=max_slots, cache_memory_gb=cache_memory_gb, seed=seed, tp=tp, ep=ep,
                              batch_invariant=batch_invariant, prefix_cache=prefix_cache,
                              prefix_cache_interval=prefix_cache_interval, snapshot_slots=snapshot_slots,
                              kv_cache_dtype=kv_cache_dtype)
    except RankFailure as e:  # world size > 1: a rank died, hung or lost rank 0
        raise click.ClickException(str(e)) from None
    except (ValueError, OSError, RuntimeError) as e:  # config/checkpoint errors are ValueErrors
        raise click.ClickException(f"cannot load {model_dir}: {e}") from e
    if engine is None:  # a torchrun rank other than 0: it served rank 0's steps; rank 0 prints
        raise click.exceptions.Exit(0)
    click.get_current_context().call_on_close(engine.close)  # world size > 1: stop the other ranks
    notice(engine)
    return engine


def _snapshot_notice(notices: bool, engine, **given) -> None:
    from k3_trtllm.runtime.engine import snapshot_rows_notice

    line = snapshot_rows_notice(engine, **given) if notices else None
    if line:
        click.echo(line, err=True)


@contextlib.contextmanager
def rank_failures():
    """A rank of a multi-rank engine that died or hung: one line naming it, exit 1."""
    from k3_trtllm.runtime.distributed import RankFailure

    try:
        yield
    except RankFailure as e:
        raise click.ClickException(str(e)) from None


def parse_ids(text: str, what: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected comma-separated integers", param_hint=what) from None
    if not ids:
        raise click.BadParameter(f"{text!r}: no token ids", param_hint=what)
    return ids


def read_prompts_file(path: str) -> list[tuple[str | list[int], dict]]:
    """JSONL lines ``{"prompt": text}`` or ``{"prompt_ids": [...]}`` plus optional
    sampling keys; returns ``(prompt, sampling overrides)``."""
    requests = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise click.ClickException(f"{where}: not JSON ({e})") from e
        if not isinstance(item, dict) or ("prompt" in item) == ("prompt_ids" in item):
            raise click.ClickException(f"{where}: expected an object with exactly one of 'prompt' or 'prompt_ids'")
        unknown = set(item) - {"prompt", "prompt_ids"} - SAMPLING_KEYS
        if unknown:
            raise click.ClickException(f"{where}: unknown keys {sorted(unknown)}; allowed: prompt, prompt_ids, "
                                       f"{', '.join(sorted(SAMPLING_KEYS))}")
        prompt = item.pop("prompt", None)
        if prompt is None:
            prompt = item.pop("prompt_ids")
            if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
                raise click.ClickException(f"{where}: 'prompt_ids' must be a list of integers")
        elif not isinstance(prompt, str):
            raise click.ClickException(f"{where}: 'prompt' must be a string")
        requests.append((prompt, item))
    return requests


class _StreamPrinter:
    """Prints each request's new text as it arrives, holding back an incomplete
    UTF-8 character until the token that completes it."""

    def __init__(self, engine, index_of: dict[int, int], out) -> None:
        self.engine, self.index_of, self.out = engine, index_of, out
        self.ids: dict[int, list[int]] = {rid: [] for rid in index_of}
        self.shown: dict[int, int] = {rid: 0 for rid in index_of}

    def __call__(self, output) -> None:
        rid = output.request_id
        self.ids[rid].extend(output.new_token_ids)
        ids = self.ids[rid]
        if output.finish_reason in ("stop", "eos"):
            ids = ids[:-1]
        text = self.engine.tokenizer.decode(ids)
        if text.endswith("\ufffd") and not output.finished:
            text = text[:-1]
        piece, self.shown[rid] = text[self.shown[rid]:], max(self.shown[rid], len(text))
        if piece:
            click.echo(f"[{self.index_of[rid]}] {piece}", file=self.out)
        if output.finished:
            click.echo(f"[{self.index_of[rid]}] <{output.finish_reason}>", file=self.out)


@click.command()
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--prompt", "prompts", multiple=True, help="A text prompt (repeatable).")
@click.option("--prompt-ids", "prompt_ids", multiple=True, help="A prompt as comma-separated token ids (repeatable).")
@click.option("--prompts-file", type=click.Path(exists=True, dir_okay=False),
              help='JSONL: {"prompt": ...} or {"prompt_ids": [...]} per line, optionally with sampling keys '
                   "(max_new_tokens, temperature, top_k, top_p, seed, stop_token_ids, ignore_eos).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="0 is greedy.")
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0 disables.")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True)
@click.option("--seed", type=int, default=None, help="Makes sampled runs reproducible (each request gets its "
              "own seed from it, in order).")
@click.option("--stop-ids", default=None, help="Comma-separated token ids that end a request.")
@click.option("--ignore-eos", is_flag=True, help="Do not stop at the model's EOS token.")
@engine_options
@click.option("--stream/--no-stream", default=None, help="Print text as it is generated, one piece per line "
              "prefixed by [request index] [default: on, off with --json; with --json it goes to stderr].")
@click.option("--json", "as_json", is_flag=True, help="Print ids, text, latencies and totals as (strict) JSON.")
@threads_option
@quiet_option
@engine_dir_options
def run(model_dir, prompts, prompt_ids, prompts_file, max_new_tokens, temperature, top_k, top_p, seed,
        stop_ids, ignore_eos, stream, as_json, quiet, **engine_kwargs):
    """Generate completions for prompts with the inflight-batching engine."""
    from k3_trtllm.runtime.sequence import SamplingParams

    requests: list[tuple[str | list[int], dict]] = [(p, {}) for p in prompts]
    requests += [(parse_ids(p, "--prompt-ids"), {}) for p in prompt_ids]
    if prompts_file:
        requests += read_prompts_file(prompts_file)
    if not requests:
        raise click.UsageError("give at least one prompt: --prompt, --prompt-ids or --prompts-file")
    defaults = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                    stop_token_ids=tuple(parse_ids(stop_ids, "--stop-ids")) if stop_ids else (),
                    ignore_eos=ignore_eos)
    try:
        params = [SamplingParams(**{**defaults, **overrides}) for _, overrides in requests]
    except (TypeError, ValueError) as e:
        raise click.ClickException(f"bad sampling parameters: {e}") from e

    engine = build_engine_from_options(model_dir, seed=seed, notices=not quiet, **engine_kwargs)
    tokenizer_kind = getattr(engine.tokenizer, "kind", None)
    if tokenizer_kind == "byte-fallback":
        from k3_trtllm.runtime.tokenizer import tokenizer_fallback_reason

        reason = tokenizer_fallback_reason(model_dir) or f"{model_dir}: using the byte tokenizer"
        click.echo(f"k3-trt: warning: {reason}", err=True)
    ids = []
    for i, ((prompt, _), p) in enumerate(zip(requests, params)):
        try:
            ids.append(engine.add_request(prompt, p))
        except ValueError as e:
            raise click.ClickException(f"prompt {i}: {e}") from e
    index_of = {rid: i for i, rid in enumerate(ids)}
    if stream is None:
        stream = not as_json
    printer = _StreamPrinter(engine, index_of, sys.stderr if as_json else sys.stdout) if stream else None
    # The streamed text shows progress by itself; otherwise a bar over the requests does.
    with progress_bar(len(ids), "run", "req", quiet or stream) as bar, rank_failures():
        for output in engine.follow(ids):
            if printer:
                printer(output)
            if output.finished:
                bar.update(1)
    results = [engine.take_result(rid) for rid in ids]

    if as_json:
        click.echo(strict_json.dumps({
            "outputs": [{"prompt_ids": r.prompt_token_ids, "output_ids": r.output_token_ids, "text": r.text,
                         "finish_reason": r.finish_reason, "ttft_s": r.ttft_s, "tpot_s": r.tpot_s,
                         "preemptions": r.num_preemptions, "cached_tokens": r.cached_tokens} for r in results],
            "totals": engine.summary(),
            "tokenizer": tokenizer_kind,
        }))
    elif not stream:
        for i, r in enumerate(results):
            click.echo(f"[{i}] {r.text}")
