"""What runs a step: the engine only needs ``execute(step, decode) -> logits``."""
from __future__ import annotations

import warnings
from dataclasses import fields
from typing import Protocol

import torch

from k3_trtllm.model.step import StepInputs
from k3_trtllm.ops.kda.verdicts import check_snapshot_verdicts


class Executor(Protocol):
    """Runs one step of the model against cache pools it owns.

    ``execute`` returns fp32 logits ``[len(step.logits_indices), vocab_size]`` and
    updates the latent-cache blocks and KDA state rows named by the step in place.
    ``decode`` is the step's phase as the model runner decided it on the host
    (``model/step.py: is_pure_decode``); an executor acts on it and never re-derives it.
    """

    vocab_size: int
    device: torch.device
    # whether a prefill writes the KDA snapshots its step asks for (``step.snapshot_offsets``);
    # without it the prefix cache ends chunks at snapshot positions and copies the state rows
    writes_snapshots: bool

    def execute(self, step: StepInputs, decode: bool) -> torch.Tensor: ...

    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        """Copy KDA conv + recurrent state row ``src`` to row ``dst`` for each pair, in every
        KDA layer (the prefix cache's snapshots; rows as in ``block_manager.PrefixCache``)."""


def padded_width(width: int) -> int:
    """The block-table width a decode step runs at: the next power of two, so a batch whose
    contexts grow reuses one CUDA graph for many steps."""
    return 1 << max(0, width - 1).bit_length()


def pad_block_tables(step: StepInputs, width: int) -> StepInputs:
    """``step`` with its block tables widened to ``width`` by zeros. Entries past a
    sequence's context are never read (context_lens bounds every read), so this changes only
    the launch shape, which the MLA decode kernel's split plan is chosen from."""
    tables = step.block_tables
    if tables.shape[1] == width:
        return step
    wide = tables.new_zeros(tables.shape[0], width)
    wide[:, : tables.shape[1]] = tables
    return StepInputs(**{**{f.name: getattr(step, f.name) for f in fields(StepInputs)}, "block_tables": wide})


_ALIGN = 4  # int32 elements in 16 bytes
_SNAPSHOT_FIELDS = ("snapshot_offsets", "snapshot_rows")


class _DecodeGraph:
    """One pure-decode step shape (``num_seqs`` sequences, block tables ``width`` wide)
    captured into a CUDA graph. Its static inputs are views into one int32 device buffer, which
    the graph's first node fills from a pinned staging buffer, so a replay is one call on the host:
    the step's fields copied into the staging buffer (one ``_foreach_copy_``), then the replay."""

    def __init__(self, model: torch.nn.Module, caches, device: torch.device, num_seqs: int, width: int, pool):
        # decode steps take no snapshots (the model runner copies their state rows instead)
        shapes = {f.name: (num_seqs,) for f in fields(StepInputs) if f.name not in _SNAPSHOT_FIELDS}
        shapes["cu_seqlens"] = (num_seqs + 1,)
        shapes["block_tables"] = (num_seqs, width)
        # each field starts on a 16-byte boundary: the kernels read index tensors with
        # vector loads and fall back to the reference op (which syncs) for unaligned ones
        starts, total = {}, 0
        for name, shape in shapes.items():
            starts[name] = total
            total += -(-int(torch.Size(shape).numel()) // _ALIGN) * _ALIGN
        self.staging = torch.zeros(total, dtype=torch.int32, pin_memory=True)
        self.buffer = torch.zeros(total, dtype=torch.int32, device=device)
        self.names = tuple(shapes)
        host, views = {}, {}
        for name, shape in shapes.items():
            n, at = int(torch.Size(shape).numel()), starts[name]
            host[name] = self.staging[at: at + n].view(shape)
            views[name] = self.buffer[at: at + n].view(shape)
        self._host = host
        # per block-table width of a step, the staging views its fields are copied into (the
        # tables' first columns): cut once, not per step
        self._targets: dict[int, list[torch.Tensor]] = {}
        self._written = 0  # block-table columns the staging buffer may hold nonzero
        self.step = StepInputs(**views)
        # The step's copy in is the graph's first node and this event (an event-record node, hence
        # external) its second: a replay is one launch, no copy or record call on the host per step
        # (those cost ~20-35 us there). Once the event has fired the staging buffer may be rewritten.
        self.copied = torch.cuda.Event(external=True)
        # Capturing records the kernels without running them: the caches are not touched.
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.buffer.copy_(self.staging, non_blocking=True)
            self.copied.record()
            self.logits = model(self.step, caches, decode=True)

    def run(self, step: StepInputs) -> torch.Tensor:
        """Replay for ``step`` (on the host; block tables at most this graph's width, their
        columns past the step's own zeroed, which is what ``pad_block_tables`` does)."""
        width = step.block_tables.shape[1]
        targets = self._targets.get(width)
        if targets is None:
            targets = self._targets[width] = [self._host[name][:, :width] if name == "block_tables"
                                              else self._host[name] for name in self.names]
        self.copied.synchronize()  # the previous replay's copy has left the staging buffer
        if self._written > width:  # a narrower step than the last: zero the columns it leaves
            self._host["block_tables"][:, width: self._written].zero_()
        self._written = width
        # one call for every field (a numpy assignment per field cost ~2 us each on the host)
        torch._foreach_copy_(targets, [getattr(step, name) for name in self.names])
        self.graph.replay()
        # the graph's output is overwritten by the next replay; the caller owns what it gets
        return self.logits.clone()


class TorchExecutor:
    """The torch model (reference ops on CPU, CUDA kernels where registered).

    On a CUDA device, with a world-size-1 model and ``cuda_graphs`` (the default there),
    pure-decode steps run as CUDA graphs, one per (batch size, padded block-table width):
    the first step of a shape runs eagerly (its warm-up) and is then captured; later steps of
    that shape copy their inputs into the graph's static buffers and replay it. Decode steps
    run at the padded width on both paths, so a replay computes exactly what the eager step
    does. The phase is the runner's ``decode``, so choosing costs no device sync; a graph
    replays from a step on the host (``build_step`` makes it there). Prefill and mixed steps
    run eagerly.
    Multi-rank models stay eager (every rank would have to capture the same collectives).
    Prefills write the prefix cache's KDA snapshots (the ops take the step's snapshot points).
    The KDA kernels judge a step's snapshot points on the device (``ops/kda/verdicts.py``): after
    every step the verdicts of this device that have landed are read (no sync), and after a step
    that took snapshots all of them, waiting: a refused table raises its ValueError from the step
    that ran it, before the caller samples (which waits for the step anyway) and records it."""

    writes_snapshots = True

    def __init__(self, model: torch.nn.Module, caches, device: torch.device | str,
                 cuda_graphs: bool | None = None, max_graph_batch: int = 256, max_graphs: int = 64) -> None:
        self.model = model
        self.caches = caches
        self.device = torch.device(device)
        self.vocab_size = int(model.config.vocab_size)
        tp_size = getattr(getattr(model, "parallel", None), "tp_size", 1)
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda" and tp_size == 1
        if cuda_graphs and (self.device.type != "cuda" or tp_size != 1):
            raise ValueError("cuda_graphs: needs a CUDA device and a world-size-1 model "
                             f"(device {self.device}, tp size {tp_size})")
        self.cuda_graphs = cuda_graphs
        self.max_graph_batch = max_graph_batch
        # each graph holds its static buffers and a share of the graph pool: bound them, and
        # run shapes past the bound eagerly rather than grow without limit
        self.max_graphs = max_graphs
        self.graphs: dict[tuple[int, int], _DecodeGraph] = {}
        self.eager_shapes: set[tuple[int, int]] = set()  # shapes whose capture failed
        self.graph_replays = 0
        self._pool = None

    @torch.inference_mode()
    def execute(self, step: StepInputs, decode: bool) -> torch.Tensor:
        logits = self._run(step, decode)
        # waiting costs the host little: the step is queued whole, and its verdict lands after the
        # first KDA layer's table kernel, well before the logits the caller's sampling waits for
        check_snapshot_verdicts(wait=step.snapshot_offsets is not None, device=self.device)
        return logits

    def _run(self, step: StepInputs, decode: bool) -> torch.Tensor:
        # a replay stages the step through pinned host memory: a step already on the device runs eagerly
        on_host = step.input_ids.device.type == "cpu"
        if not (self.cuda_graphs and decode and on_host and step.num_seqs <= self.max_graph_batch
                and step.snapshot_offsets is None):
            return self.model(step.to(self.device), self.caches, decode)
        width = padded_width(step.block_tables.shape[1])
        key = (step.num_seqs, width)
        graph = self.graphs.get(key)
        if graph is None:
            step = pad_block_tables(step, width)
            logits = self.model(step.to(self.device), self.caches, True)
            if key not in self.eager_shapes and len(self.graphs) < self.max_graphs:
                self._capture(key, step.num_seqs, width)
            return logits
        self.graph_replays += 1
        return graph.run(step)

    @torch.inference_mode()
    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        self.caches.copy_states(copies)  # on the pools' stream: ordered with the steps around it

    def _capture(self, key: tuple[int, int], num_seqs: int, width: int) -> None:
        """Capture one decode shape. A capture that fails (an op that syncs or falls back to
        a host-side path) leaves that shape eager for good, with one warning: the run goes on,
        only slower."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()  # every shape's graph shares one pool
        try:
            self.graphs[key] = _DecodeGraph(self.model, self.caches, self.device, num_seqs, width, self._pool)
        except RuntimeError as e:
            self.eager_shapes.add(key)
            warnings.warn(f"k3-trt: decode steps of {num_seqs} sequences x {width} blocks run eagerly: "
                          f"CUDA-graph capture failed ({str(e).splitlines()[0] if str(e) else type(e).__name__})",
                          RuntimeWarning, stacklevel=2)
