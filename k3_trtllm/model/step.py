"""The step contract (DESIGN §3): what one forward of the engine consumes.

A step is a packed, ragged batch of T tokens from B sequences; prefill chunks and
decode tokens mix freely. All index tensors are int32. The cache pools are not part
of the step: the executor owns them (``K3Caches``) and binds them to every step.

The step's phase (``is_pure_decode``) is decided once, on the host, by whoever builds the
step (the model runner), and passed down beside it: ``executor.execute(step, decode)`` ->
``model(step, caches, decode)``. Nothing below reads it off the tensors, which on a GPU
would be a device sync.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, fields, replace
from itertools import chain

import numpy as np
import torch

from k3_trtllm.ops.capture import capturing, device_key


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] position of each token in its sequence (RoPE configs only)
    cu_seqlens: torch.Tensor  # [B+1] token offsets of the sequences in this step
    context_lens: torch.Tensor  # [B] tokens of each sequence already in the caches
    logits_indices: torch.Tensor  # [B] index (into T) of the token whose logits are returned
    block_tables: torch.Tensor  # [B, max_blocks] latent-cache blocks of each sequence
    slot_mapping: torch.Tensor  # [T] latent-cache slot (block*block_size+offset) of each token
    state_slots: torch.Tensor  # [B] KDA conv/recurrent state row of each sequence
    has_initial_state: torch.Tensor  # [B] 1 where the KDA state row holds earlier tokens
    # prefix-cache KDA snapshots the prefill writes (contract KDA_PREFILL): [B, N] points (tokens of
    # the sequence's new tokens, -1: none) and their snapshot-pool rows; None: the step takes none
    snapshot_offsets: torch.Tensor | None = None
    snapshot_rows: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.cu_seqlens.shape[0]) - 1

    def to(self, device: torch.device | str) -> "StepInputs":
        """The step on ``device``. A host step bound for a CUDA device travels as one copy (see
        ``_to_cuda_packed``); anything else field by field."""
        device = torch.device(device)
        present = [(f.name, t) for f in fields(self) if (t := getattr(self, f.name)) is not None]
        if (device.type == "cuda" and all(type(t) is torch.Tensor and t.device.type == "cpu" and t.dtype == torch.int32
                                          for _, t in present) and not capturing(device)):
            return _to_cuda_packed(present, device)
        return StepInputs(**{f.name: t if (t := getattr(self, f.name)) is None else t.to(device) for f in fields(self)})


_ALIGN = 4  # int32 elements in 16 bytes


class _Staging:
    """The pinned host buffer of one device that steps are packed into, reused from step to step
    (allocating pinned memory per step cost about a millisecond on the H200's host: more than the
    per-field copies it replaces); ``copied`` marks when the last copy out of it has been read."""

    def __init__(self):
        self.lock = threading.Lock()  # the serve engine loop and a caller's thread may both move steps
        self.host: torch.Tensor | None = None
        self.array = None  # numpy view of host
        self.copied = torch.cuda.Event()
        self.pending = False


_STAGING: dict[int, _Staging] = {}


def _to_cuda_packed(present: list[tuple[str, torch.Tensor]], device: torch.device) -> StepInputs:
    """The host step's int32 fields packed into one pinned buffer and copied in one asynchronous
    transfer, then cut into views: one copy per step where a field-by-field ``to`` issues one per
    field, each from pageable memory (which makes the host wait for the stream first). Each field
    starts on a 16-byte boundary: the kernels read index tensors with vector loads. The fields are
    written through numpy and cut with one split (a torch op per field costs microseconds each on
    the host). The buffer is rewritten only once the previous step's copy out of it has been read
    (long done by then: that copy ran before the previous step's kernels)."""
    sizes = []
    for _, t in present:
        n = t.numel()
        sizes += [n, -n % _ALIGN]  # the field, then its padding to the next 16 bytes
    total = sum(sizes)
    index = device_key(device).index
    staging = _STAGING.get(index)
    if staging is None:
        staging = _STAGING.setdefault(index, _Staging())
    with staging.lock:
        if staging.pending:
            staging.copied.synchronize()
        if staging.host is None or staging.host.numel() < total:
            staging.host = torch.empty(max(total, 4096), dtype=torch.int32, pin_memory=True)
            staging.array = staging.host.numpy()
        buf, at = staging.array, 0
        for (_, t), n, pad in zip(present, sizes[0::2], sizes[1::2]):
            buf[at: at + n] = t.numpy().reshape(-1)
            at += n + pad
        packed = staging.host[:total].to(device, non_blocking=True)
        # the copy runs on the device's current stream: the event goes behind it there
        staging.copied.record(None if index == torch.cuda.current_device() else torch.cuda.current_stream(device))
        staging.pending = True
    pieces = packed.split(sizes)
    views = {name: piece if t.dim() == 1 else piece.view(t.shape)
             for (name, t), piece in zip(present, pieces[0::2])}
    return StepInputs(**{f.name: views.get(f.name) for f in fields(StepInputs)})


# The "no snapshot points" tensors of each (device, batch size): never written, so one pair serves
# every step of that size (two fill launches per step fewer). Kept for the process's life: a CUDA
# graph captured with a pair reads its memory at every replay.
_NO_SNAPSHOTS: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}


def with_snapshot_tensors(step: StepInputs) -> StepInputs:
    """``step`` with its absent snapshot fields made explicit: one -1 column (no points) and
    row 0. The KDA ops take them in every step; the model adds them once per step, not per
    layer, and reuses one pair per device and batch size. Traced steps (export, fake tensors)
    and a pair first asked for during a CUDA-graph capture (whose memory belongs to the graph)
    get fresh tensors, as before."""
    if step.snapshot_offsets is not None:
        return step
    slots = step.state_slots
    if type(slots) is not torch.Tensor or torch.compiler.is_compiling() or torch.compiler.is_exporting():
        offsets = torch.full_like(slots, -1).unsqueeze(1)  # traced: shapes may be symbolic, keys are not
        return replace(step, snapshot_offsets=offsets, snapshot_rows=torch.zeros_like(offsets))
    key = (slots.device, slots.shape[0])
    pair = _NO_SNAPSHOTS.get(key)
    if pair is None:
        with torch.inference_mode(False):  # a plain tensor: usable inside and outside inference mode
            offsets = torch.full((slots.shape[0], 1), -1, dtype=torch.int32, device=slots.device)
            pair = offsets, torch.zeros_like(offsets)
        if not capturing(slots.device):  # the pair's device, which need not be the current one
            _NO_SNAPSHOTS[key] = pair
    return replace(step, snapshot_offsets=pair[0], snapshot_rows=pair[1])


def is_pure_decode(seqs: list[tuple[list[int], int, int, list[int]]]) -> bool:
    """The phase of the step ``build_step(seqs)`` makes: every sequence brings exactly one new
    token and continues a cached context. Such a step runs the decode forms of the ops
    (recurrent KDA, absorbed MLA), a CUDA graph in the torch executor and the decode profile
    of an engine; any other step runs the prefill forms, which are exact for decode tokens too."""
    return bool(seqs) and all(len(new_ids) == 1 and context_len > 0 for new_ids, context_len, *_ in seqs)


def build_step(
    seqs: list[tuple[list[int], int, int, list[int]]],
    block_size: int,
    logits_all: bool = False,
    snapshots: list[list[tuple[int, int]]] | None = None,
    block_tables: np.ndarray | None = None,
) -> StepInputs:
    """Build a step from ``(new_token_ids, context_len, state_slot, block_table)`` per
    sequence. Positions continue from ``context_len``; ``has_initial_state`` is set
    where ``context_len > 0``. With ``logits_all`` every token's logits are requested
    (T rows instead of B), which tests use to compare whole prefills. ``snapshots``: per
    sequence, the ``(offset, snapshot-pool row)`` KDA snapshots its prefill takes (any
    empty: the step carries no snapshot tensors when all are). ``block_tables``: the sequences'
    tables already as one array, each row zero-padded to the longest (the model runner keeps them
    between steps); None: read from the lists.

    Every step runs this on the host, so it is a handful of numpy calls whatever the batch: the
    lists are read once each (``np.fromiter`` over them, about 20 ns an element, where a Python loop
    per sequence and token and ``torch.tensor`` of nested lists cost 5-10x that), and the fields
    are numpy arrays handed to torch without a copy."""
    new_ids, ctx_lens, slot_ids, tables = zip(*seqs)
    num_seqs = len(seqs)
    counts = np.fromiter(map(len, new_ids), np.int64, num_seqs)
    ctx = np.array(ctx_lens, dtype=np.int64)
    table_lens = np.fromiter(map(len, tables), np.int64, num_seqs)
    bad = np.flatnonzero((counts == 0) | (ctx + counts > table_lens * block_size))
    if bad.size:
        b = int(bad[0])
        if not counts[b]:
            raise ValueError("every sequence in a step needs at least one new token")
        raise ValueError(f"block table of {len(tables[b])} blocks cannot hold {int(ctx[b] + counts[b])} tokens")
    width = max(1, int(table_lens.max()))
    if block_tables is not None:
        if block_tables.shape != (num_seqs, width):
            raise ValueError(f"block_tables of shape {block_tables.shape} for {num_seqs} sequences whose longest "
                             f"table has {width} blocks")
    elif (table_lens == width).all():
        block_tables = np.fromiter(chain.from_iterable(tables), np.int64, num_seqs * width).reshape(num_seqs, width)
    else:  # rows padded by zeros: the flat entries fill each row's first len(table) columns, in order
        block_tables = np.zeros((num_seqs, width), dtype=np.int64)
        block_tables[np.arange(width) < table_lens[:, None]] = np.fromiter(chain.from_iterable(tables), np.int64,
                                                                           int(table_lens.sum()))
    cu = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(counts, out=cu[1:])
    num_tokens = int(cu[-1])
    if num_tokens == num_seqs:  # one token each (decode): each token is its sequence
        owner, positions = np.arange(num_seqs), ctx
    else:
        owner = np.repeat(np.arange(num_seqs), counts)
        positions = np.arange(num_tokens) - cu[owner] + ctx[owner]
    slot_mapping = block_tables[owner, positions // block_size] * block_size + positions % block_size
    offsets = rows = None
    if snapshots and any(snapshots):
        if len(snapshots) != num_seqs:
            raise ValueError(f"snapshots for {len(snapshots)} sequences in a step of {num_seqs}")
        points = max(len(p) for p in snapshots)
        offsets = np.full((num_seqs, points), -1, dtype=np.int32)
        rows = np.zeros((num_seqs, points), dtype=np.int32)
        for b, taken in enumerate(snapshots):
            for i, (offset, row) in enumerate(taken):
                offsets[b, i], rows[b, i] = offset, row
    ids = np.fromiter(chain.from_iterable(new_ids), np.int64, num_tokens)
    last = cu[1:] - 1

    def i32(a):
        return None if a is None else torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))
    return StepInputs(
        input_ids=i32(ids),
        positions=i32(positions),
        cu_seqlens=i32(cu),
        context_lens=i32(ctx),
        logits_indices=i32(np.arange(num_tokens) if logits_all else last),
        block_tables=i32(block_tables),
        slot_mapping=i32(slot_mapping),
        state_slots=i32(np.array(slot_ids, dtype=np.int64)),
        has_initial_state=i32(ctx > 0),
        snapshot_offsets=i32(offsets),
        snapshot_rows=i32(rows),
    )


# The step as one int32 tensor, for broadcasting it to the other ranks (runtime/distributed.py):
# the fields in StepInputs' declaration order, flattened and concatenated; ``step_shapes`` is
# what the receiver needs to cut it apart again (two dims per field: every field is 1-d or 2-d;
# an absent one, None, is [0, 0], which no present field has).
PACKED_SHAPE_LEN = 2 * len(fields(StepInputs))


def step_shapes(step: StepInputs) -> list[int]:
    shapes = []
    for f in fields(StepInputs):
        t = getattr(step, f.name)
        shape = (0, 0) if t is None else tuple(t.shape)
        shapes += [shape[0], shape[1] if len(shape) == 2 else -1]
    return shapes


def pack_step(step: StepInputs) -> torch.Tensor:
    return torch.cat([t.reshape(-1).to(torch.int32) for f in fields(StepInputs)
                      if (t := getattr(step, f.name)) is not None])


def packed_numel(shapes: list[int]) -> int:
    return sum(a * (b if b >= 0 else 1) for a, b in zip(shapes[0::2], shapes[1::2]))


def unpack_step(shapes: list[int], packed: torch.Tensor) -> StepInputs:
    """The inverse of ``pack_step`` (views into ``packed``)."""
    out, at = {}, 0
    for f, a, b in zip(fields(StepInputs), shapes[0::2], shapes[1::2]):
        if (a, b) == (0, 0):
            out[f.name] = None
            continue
        n = a * (b if b >= 0 else 1)
        out[f.name] = packed[at: at + n].view(a, b) if b >= 0 else packed[at: at + n]
        at += n
    return StepInputs(**out)
