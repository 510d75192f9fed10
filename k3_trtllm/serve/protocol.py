"""The client contract of TensorRT-LLM's Triton ``ensemble`` model, mapped onto the k3-trt runner.

Every input of the ensemble (tensorrtllm_backend's ``all_models/inflight_batcher_llm/ensemble``,
with the names of its older releases: ``min_length``, ``random_seed``,
``return_kv_cache_reuse_stats``) is declared, each with Triton's leading batch dimension
(batch size 1), plus ``input_ids`` (INT32) as an alternative to ``text_input`` and
``parse_special_tokens`` (BOOL, k3-trt's own). What a sampler can do is served (see
``SamplingParams``); an input asking for what k3-trt does not do (beam search, several
sequences, LoRA, prompt tables, guided decoding, logits or perf outputs, encoder-decoder
input) is refused with an error naming it, and its neutral value (``beam_width`` 1,
``return_context_logits`` false, ...) is accepted.

Outputs: ``text_output`` (BYTES) and ``output_ids`` (INT32): the new tokens of each step
when streaming, all of them at once otherwise, the prompt first unless
``exclude_input_in_output`` (TensorRT-LLM's default: false); with ``return_log_probs``,
``output_log_probs`` (the generated tokens' log-probabilities, [beam=1, tokens]) and
``cum_log_probs`` (their sum so far, [beam=1]). This module knows nothing of Triton: it
reads numpy arrays by name.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from k3_trtllm.runtime.sequence import SamplingParams
from k3_trtllm.runtime.tokenizer import Tokenizer

# name -> (Triton data type, dims without the batch dimension, optional)
INPUTS: dict[str, tuple[str, list[int], bool]] = {
    "text_input": ("TYPE_STRING", [1], True),
    "input_ids": ("TYPE_INT32", [-1], True),
    "decoder_text_input": ("TYPE_STRING", [1], True),
    "max_tokens": ("TYPE_INT32", [1], False),
    "num_return_sequences": ("TYPE_INT32", [1], True),
    "bad_words": ("TYPE_STRING", [-1], True),
    "stop_words": ("TYPE_STRING", [-1], True),
    "exclude_input_in_output": ("TYPE_BOOL", [1], True),
    "end_id": ("TYPE_INT32", [1], True),
    "pad_id": ("TYPE_INT32", [1], True),
    "top_k": ("TYPE_INT32", [1], True),
    "top_p": ("TYPE_FP32", [1], True),
    "temperature": ("TYPE_FP32", [1], True),
    "length_penalty": ("TYPE_FP32", [1], True),
    "repetition_penalty": ("TYPE_FP32", [1], True),
    "min_tokens": ("TYPE_INT32", [1], True),
    "min_length": ("TYPE_INT32", [1], True),
    "presence_penalty": ("TYPE_FP32", [1], True),
    "frequency_penalty": ("TYPE_FP32", [1], True),
    "seed": ("TYPE_UINT64", [1], True),
    "random_seed": ("TYPE_UINT64", [1], True),
    "return_log_probs": ("TYPE_BOOL", [1], True),
    "return_context_logits": ("TYPE_BOOL", [1], True),
    "return_generation_logits": ("TYPE_BOOL", [1], True),
    "return_perf_metrics": ("TYPE_BOOL", [1], True),
    "return_kv_cache_reuse_stats": ("TYPE_BOOL", [1], True),
    "beam_width": ("TYPE_INT32", [1], True),
    "stream": ("TYPE_BOOL", [1], True),
    "prompt_embedding_table": ("TYPE_FP16", [-1, -1], True),
    "prompt_table_extra_id": ("TYPE_UINT64", [1], True),
    "prompt_vocab_size": ("TYPE_INT32", [1], True),
    "embedding_bias_words": ("TYPE_STRING", [-1], True),
    "embedding_bias_weights": ("TYPE_FP32", [-1], True),
    "lora_task_id": ("TYPE_UINT64", [1], True),
    "lora_weights": ("TYPE_FP16", [-1, -1], True),
    "lora_config": ("TYPE_INT32", [-1, 3], True),
    "guided_decoding_guide_type": ("TYPE_STRING", [1], True),
    "guided_decoding_guide": ("TYPE_STRING", [1], True),
    "parse_special_tokens": ("TYPE_BOOL", [1], True),
}
OUTPUTS: dict[str, tuple[str, list[int]]] = {
    "text_output": ("TYPE_STRING", [-1]),
    "output_ids": ("TYPE_INT32", [-1]),
    "cum_log_probs": ("TYPE_FP32", [-1]),
    "output_log_probs": ("TYPE_FP32", [-1, -1]),
}

# Inputs for features k3-trt does not have: refused when present, except with the value
# that switches the feature off (None: refused whatever the value).
UNSUPPORTED: dict[str, tuple[object, str]] = {
    "beam_width": (1, "beam search is not supported (beam_width must be 1)"),
    "num_return_sequences": (1, "one sequence per request (num_return_sequences must be 1)"),
    "return_context_logits": (False, "context logits are not returned"),
    "return_generation_logits": (False, "generation logits are not returned"),
    "return_perf_metrics": (False, "perf metrics are not returned"),
    "return_kv_cache_reuse_stats": (False, "KV-cache reuse stats are not returned"),
    "prompt_vocab_size": (0, "prompt tables (p-tuning) are not supported"),
    "prompt_embedding_table": (None, "prompt tables (p-tuning) are not supported"),
    "prompt_table_extra_id": (None, "prompt tables (p-tuning) are not supported"),
    "lora_task_id": (None, "LoRA is not supported"),
    "lora_weights": (None, "LoRA is not supported"),
    "lora_config": (None, "LoRA is not supported"),
    "guided_decoding_guide_type": (None, "guided decoding is not supported"),
    "guided_decoding_guide": (None, "guided decoding is not supported"),
    "decoder_text_input": (None, "K3 is decoder-only: there is no encoder-decoder input"),
}
# (current name, older name): give one of them.
ALIASES = (("seed", "random_seed"), ("min_tokens", "min_length"))

GetInput = Callable[[str], "np.ndarray | None"]


class BadRequest(ValueError):
    """A request the model cannot serve; its message goes back to the client."""


@dataclass(frozen=True)
class GenerationRequest:
    prompt: list[int]  # token ids (a text prompt is encoded here, so the echo can be decoded)
    sampling: SamplingParams
    stream: bool
    stop_sequences: tuple[tuple[int, ...], ...]  # token sequences that end the request (kept in the output)
    exclude_input_in_output: bool = True  # parse_request defaults it to False, as TensorRT-LLM does
    return_log_probs: bool = False


def parse_request(get_input: GetInput, tokenizer: Tokenizer | None) -> GenerationRequest:
    """Validate one request's tensors; raise BadRequest naming the tensor at fault."""
    _refuse_unsupported(get_input)
    parse_special = _flag(get_input, "parse_special_tokens", False)
    text = _row(get_input, "text_input")
    ids = _row(get_input, "input_ids")
    if (text is None) == (ids is None):
        raise BadRequest("give exactly one of 'text_input' (BYTES) or 'input_ids' (INT32)")
    if text is not None:
        if text.size != 1:
            raise BadRequest(f"'text_input' must hold one string, got {text.size}")
        prompt_text = _decode_utf8(text.reshape(-1)[0], "text_input")
        if not prompt_text:
            raise BadRequest("'text_input' is empty")
        if tokenizer is None:
            raise BadRequest("'text_input' needs a tokenizer and this model has none; send 'input_ids'")
        prompt = tokenizer.encode(prompt_text, parse_special_tokens=parse_special)
    else:
        prompt = [int(t) for t in ids.reshape(-1)]
    if not prompt:
        raise BadRequest("'input_ids' is empty")

    max_tokens = _scalar(get_input, "max_tokens")
    if max_tokens is None:
        raise BadRequest("'max_tokens' (INT32) is required")
    if max_tokens < 1:
        raise BadRequest(f"'max_tokens' must be >= 1, got {max_tokens}")

    sampling = {"max_new_tokens": int(max_tokens)}
    for name, cast in (("temperature", float), ("top_k", int), ("top_p", float), ("repetition_penalty", float),
                       ("presence_penalty", float), ("frequency_penalty", float)):
        value = _scalar(get_input, name)
        if value is not None:
            sampling[name] = cast(value)
    for name, older in ALIASES:
        value, old_value = _scalar(get_input, name), _scalar(get_input, older)
        if value is not None and old_value is not None:
            raise BadRequest(f"give one of '{name}' or '{older}' (the same input under its older name)")
        value = value if value is not None else old_value
        if value is not None:
            sampling[name] = int(value)
    end_id = _scalar(get_input, "end_id")
    if end_id is not None:
        # TensorRT-LLM's end_id replaces the model's EOS token.
        sampling.update(stop_token_ids=(int(end_id),), ignore_eos=True)
    # pad_id only pads TensorRT-LLM's batched outputs; k3-trt answers one request per response.
    _scalar(get_input, "pad_id")
    # length_penalty only scores beams; with beam_width 1 TensorRT-LLM ignores it too.
    _scalar(get_input, "length_penalty")
    return_log_probs = _flag(get_input, "return_log_probs", False)
    sampling["logprobs"] = return_log_probs
    sampling["bad_words"] = _word_sequences(get_input, "bad_words", tokenizer)
    sampling["logit_bias"] = _embedding_bias(get_input, tokenizer)
    try:
        params = SamplingParams(**sampling)
    except ValueError as e:
        raise BadRequest(f"bad sampling parameters: {e}") from None

    return GenerationRequest(prompt, params, _flag(get_input, "stream", False),
                             _word_sequences(get_input, "stop_words", tokenizer),
                             exclude_input_in_output=_flag(get_input, "exclude_input_in_output", False),
                             return_log_probs=return_log_probs)


def _refuse_unsupported(get_input: GetInput) -> None:
    for name, (neutral, why) in UNSUPPORTED.items():
        row = _row(get_input, name)
        if row is None:
            continue
        if neutral is None or row.size != 1 or row.reshape(-1)[0].item() != neutral:
            raise BadRequest(f"input '{name}': {why}")


def _row(get_input: GetInput, name: str) -> np.ndarray | None:
    """The request's single batch row of ``name`` (None when absent)."""
    value = get_input(name)
    if value is None:
        return None
    value = np.asarray(value)
    if value.ndim == 0 or value.shape[0] != 1:
        raise BadRequest(f"'{name}' must have batch size 1 (one request per call), got shape {list(value.shape)}")
    return value[0]


def _scalar(get_input: GetInput, name: str):
    row = _row(get_input, name)
    if row is None:
        return None
    if row.size != 1:
        raise BadRequest(f"'{name}' must hold one value, got {row.size}")
    return row.reshape(-1)[0].item()


def _flag(get_input: GetInput, name: str, default: bool) -> bool:
    value = _scalar(get_input, name)
    return default if value is None else bool(value)


def _decode_utf8(value, name: str) -> str:
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"'{name}' is not UTF-8: {e}") from None


def _strings(get_input: GetInput, name: str, tokenizer: Tokenizer | None) -> list[str] | None:
    row = _row(get_input, name)
    if row is None:
        return None
    words = [_decode_utf8(w, name) for w in row.reshape(-1)]
    if any(words) and tokenizer is None:
        raise BadRequest(f"'{name}' needs a tokenizer and this model has none")
    return words


def _word_sequences(get_input: GetInput, name: str, tokenizer: Tokenizer | None) -> tuple[tuple[int, ...], ...]:
    """One token sequence per non-empty string (TensorRT-LLM's preprocessing skips empty
    ones). Special-token text is its control token here: a stop word "<|im_end|>" means
    that token."""
    words = _strings(get_input, name, tokenizer) or []
    sequences = (tuple(tokenizer.encode(w, parse_special_tokens=True)) for w in words if w)
    return tuple(s for s in sequences if s)


def _embedding_bias(get_input: GetInput, tokenizer: Tokenizer | None) -> tuple[tuple[int, float], ...]:
    """Each word's weight added to the logit of every token of the word, as TensorRT-LLM's
    preprocessing builds its embedding bias."""
    words = _strings(get_input, "embedding_bias_words", tokenizer)
    weights_row = _row(get_input, "embedding_bias_weights")
    if words is None and weights_row is None:
        return ()
    weights = [] if weights_row is None else [float(w) for w in weights_row.reshape(-1)]
    words = words or []
    if len(words) != len(weights):
        raise BadRequest(f"'embedding_bias_words' has {len(words)} words but 'embedding_bias_weights' "
                         f"{len(weights)} weights")
    return tuple((t, weight) for word, weight in zip(words, weights) if word
                 for t in tokenizer.encode(word, parse_special_tokens=True))


class OutputText:
    """Turns a request's growing token ids into text pieces, holding back an incomplete
    UTF-8 character until the token that completes it arrives."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.shown = ""  # the text returned so far

    def push(self, new_ids: list[int], *, finished: bool, drop_last: bool = False) -> str:
        """Add ``new_ids``; return the text they complete. ``drop_last`` leaves the last
        id out of the text (an EOS or end_id token)."""
        self.ids.extend(new_ids)
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.ids[:-1] if drop_last else self.ids)
        if text.endswith("\ufffd") and not finished:
            text = text[:-1]
        piece = text[len(self.shown):]
        self.shown += piece
        return piece


def ends_with_stop(ids: list[int], stop_sequences: tuple[tuple[int, ...], ...]) -> bool:
    return any(len(ids) >= len(s) and tuple(ids[-len(s):]) == s for s in stop_sequences)


@dataclass(frozen=True)
class Chunk:
    """One response: token ids, their text and (when asked for) their log-probabilities
    with the running sum; ``final`` closes the request."""

    ids: list[int]
    text: str
    final: bool
    log_probs: list[float] | None = None
    cum_log_prob: float | None = None


class ResponseBuilder:
    """Decides what one request sends as its tokens arrive: a chunk per step when
    streaming, a single chunk at the end otherwise (led by the prompt's ids and text
    unless ``exclude_input_in_output``). The request ends when the engine finishes it
    or its output ends with a stop sequence (which stays in the output). An EOS /
    end_id token is in ``ids`` but not in the text, as in ``k3-trt run``."""

    def __init__(self, generation: GenerationRequest, tokenizer: Tokenizer | None) -> None:
        self.generation = generation
        self.tokenizer = tokenizer
        self.text = OutputText(tokenizer)
        self.log_probs: list[float] = []

    def add(self, new_ids: list[int], finish_reason: str | None,
            new_log_probs: list[float] | None = None) -> tuple[Chunk | None, bool]:
        """Returns (the chunk to send or None, whether the request is done)."""
        gen = self.generation
        done = finish_reason is not None or ends_with_stop(self.text.ids + new_ids, gen.stop_sequences)
        drop_last = finish_reason in ("stop", "eos")
        piece = self.text.push(new_ids, finished=done, drop_last=drop_last)
        if gen.return_log_probs:
            self.log_probs += new_log_probs or []
        if gen.stream:
            log_probs = (new_log_probs or []) if gen.return_log_probs else None
            return self._chunk(list(new_ids), piece, done, log_probs), done
        if not done:
            return None, False
        ids, text = list(self.text.ids), self.text.shown
        if not gen.exclude_input_in_output:
            ids = gen.prompt + ids
            if self.tokenizer is not None:
                # Decoded as one sequence, as TensorRT-LLM's postprocessing does.
                text = self.tokenizer.decode(ids[:-1] if drop_last else ids)
        return self._chunk(ids, text, True, list(self.log_probs) if gen.return_log_probs else None), True

    def _chunk(self, ids: list[int], text: str, final: bool, log_probs: list[float] | None) -> Chunk:
        if log_probs is None:
            return Chunk(ids, text, final)
        return Chunk(ids, text, final, log_probs, float(sum(self.log_probs)))


def output_arrays(chunk: Chunk) -> dict[str, np.ndarray]:
    """One response's tensors, with the batch dimension (and the beam dimension of the
    log-probabilities)."""
    arrays = {
        "text_output": np.array([[chunk.text.encode("utf-8")]], dtype=np.object_),
        "output_ids": np.array([chunk.ids], dtype=np.int32).reshape(1, -1),
    }
    if chunk.log_probs is not None:
        arrays["cum_log_probs"] = np.array([[chunk.cum_log_prob]], dtype=np.float32)
        arrays["output_log_probs"] = np.array([[chunk.log_probs]], dtype=np.float32).reshape(1, 1, -1)
    return arrays
