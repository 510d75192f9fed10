"""The client contract of TensorRT-LLM's Triton backend, mapped onto the k3-trt runner.

Inputs (each with Triton's leading batch dimension, batch size 1): ``text_input`` (BYTES)
or ``input_ids`` (INT32), ``max_tokens`` (INT32), and optionally ``stream`` (BOOL),
``temperature`` / ``top_p`` (FP32), ``top_k`` / ``end_id`` (INT32), ``seed`` (UINT64),
``stop_words`` (BYTES, one string per stop word). Outputs: ``text_output`` (BYTES) and
``output_ids`` (INT32) — the new tokens of each step when streaming, all of them at once
otherwise. This module knows nothing of Triton: it reads numpy arrays by name.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from k3_trtllm.runtime.sampling import SamplingParams
from k3_trtllm.runtime.tokenizer import Tokenizer

# name -> (Triton data type, dims without the batch dimension, optional)
INPUTS: dict[str, tuple[str, list[int], bool]] = {
    "text_input": ("TYPE_STRING", [1], True),
    "input_ids": ("TYPE_INT32", [-1], True),
    "max_tokens": ("TYPE_INT32", [1], False),
    "stream": ("TYPE_BOOL", [1], True),
    "temperature": ("TYPE_FP32", [1], True),
    "top_k": ("TYPE_INT32", [1], True),
    "top_p": ("TYPE_FP32", [1], True),
    "seed": ("TYPE_UINT64", [1], True),
    "end_id": ("TYPE_INT32", [1], True),
    "stop_words": ("TYPE_STRING", [-1], True),
}
OUTPUTS: dict[str, tuple[str, list[int]]] = {
    "text_output": ("TYPE_STRING", [-1]),
    "output_ids": ("TYPE_INT32", [-1]),
}

GetInput = Callable[[str], "np.ndarray | None"]


class BadRequest(ValueError):
    """A request the model cannot serve; its message goes back to the client."""


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str | list[int]
    sampling: SamplingParams
    stream: bool
    stop_sequences: tuple[tuple[int, ...], ...]  # token sequences that end the request (kept in the output)


def parse_request(get_input: GetInput, tokenizer: Tokenizer | None) -> GenerationRequest:
    """Validate one request's tensors; raise BadRequest naming the tensor at fault."""
    text = _row(get_input, "text_input")
    ids = _row(get_input, "input_ids")
    if (text is None) == (ids is None):
        raise BadRequest("give exactly one of 'text_input' (BYTES) or 'input_ids' (INT32)")
    if text is not None:
        if text.size != 1:
            raise BadRequest(f"'text_input' must hold one string, got {text.size}")
        prompt: str | list[int] = _decode_utf8(text.reshape(-1)[0], "text_input")
        if not prompt:
            raise BadRequest("'text_input' is empty")
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
    for name, key, cast in (("temperature", "temperature", float), ("top_k", "top_k", int),
                            ("top_p", "top_p", float), ("seed", "seed", int)):
        value = _scalar(get_input, name)
        if value is not None:
            sampling[key] = cast(value)
    end_id = _scalar(get_input, "end_id")
    if end_id is not None:
        # TensorRT-LLM's end_id replaces the model's EOS token.
        sampling.update(stop_token_ids=(int(end_id),), ignore_eos=True)
    try:
        params = SamplingParams(**sampling)
    except ValueError as e:
        raise BadRequest(f"bad sampling parameters: {e}") from None

    stream = _scalar(get_input, "stream")
    return GenerationRequest(prompt, params, bool(stream) if stream is not None else False,
                             _stop_sequences(get_input, tokenizer))


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


def _decode_utf8(value, name: str) -> str:
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"'{name}' is not UTF-8: {e}") from None


def _stop_sequences(get_input: GetInput, tokenizer: Tokenizer | None) -> tuple[tuple[int, ...], ...]:
    row = _row(get_input, "stop_words")
    if row is None:
        return ()
    if tokenizer is None:
        raise BadRequest("'stop_words' needs a tokenizer and this model has none")
    words = [_decode_utf8(w, "stop_words") for w in row.reshape(-1)]
    sequences = tuple(tuple(tokenizer.encode(w)) for w in words if w)
    return tuple(s for s in sequences if s)


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
    """One response: token ids and their text; ``final`` closes the request."""

    ids: list[int]
    text: str
    final: bool


class ResponseBuilder:
    """Decides what one request sends as its tokens arrive: a chunk per step when
    streaming, a single chunk at the end otherwise. The request ends when the engine
    finishes it or its output ends with a stop sequence (which stays in the output).
    An EOS / end_id token is in ``ids`` but not in the text, as in ``k3-trt run``."""

    def __init__(self, generation: GenerationRequest, tokenizer: Tokenizer | None) -> None:
        self.generation = generation
        self.text = OutputText(tokenizer)

    def add(self, new_ids: list[int], finish_reason: str | None) -> tuple[Chunk | None, bool]:
        """Returns (the chunk to send or None, whether the request is done)."""
        done = finish_reason is not None or ends_with_stop(self.text.ids + new_ids, self.generation.stop_sequences)
        piece = self.text.push(new_ids, finished=done, drop_last=finish_reason in ("stop", "eos"))
        if self.generation.stream:
            return Chunk(list(new_ids), piece, done), done
        if done:
            return Chunk(list(self.text.ids), self.text.shown, True), True
        return None, False


def output_arrays(token_ids: list[int], text: str) -> dict[str, np.ndarray]:
    """One response's tensors, with the batch dimension."""
    return {
        "text_output": np.array([[text.encode("utf-8")]], dtype=np.object_),
        "output_ids": np.array([token_ids], dtype=np.int32).reshape(1, -1),
    }
