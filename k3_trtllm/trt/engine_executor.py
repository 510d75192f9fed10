"""``EngineExecutor``: runs a segmented engine dir (``trt/segment_build.py``) for the runner
(the ``Executor`` protocol of ``runtime/executor.py``).

Per step it strings the segments in layer order (DESIGN §10): embed, then per layer the
attention segment and the FFN segment(s), then the head, binding each layer's weights
(loaded once from ``rank{r}.safetensors``), the step tensors, the layer's cache pools (the
same tensor as input and updated output) and the activations between segments; between
segments it does the collectives through torch.distributed (all-reduce after every
partial product, all-gather of the vocab shards; none at world size 1) and keeps the
AttnRes stream: the stacked block snapshots and the partial sum.

Backends run one segment given its inputs and its preallocated outputs:
- ``CpuSegments``: onnx's ReferenceEvaluator on the ONNX segments, the ``k3`` nodes calling
  the reference ops (``export/cpu_eval.py``); what CI runs.
- ``TensorRTSegments``: one deserialised plan and execution context per segment kind,
  tensors bound by address, the profile picked by the runner's phase, everything on
  torch's current CUDA stream. It has never executed: TensorRT proper is not installable
  on our machines and TensorRT-RTX plans do not run on the H200 (DESIGN §6)."""
from __future__ import annotations

import dataclasses
import json
import os
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ..checkpoint.errors import CheckpointError
from ..checkpoint.safetensors_format import SafetensorsFormatError, read_header, read_tensor
from ..checkpoint.trtllm import rank_file, read_trtllm_config
from ..config import parse_config
from ..checkpoint.rank_layout import RankLayout
from ..export.segments import DTYPES, weight_dtype
from ..model.caches import K3Caches
from ..model.step import StepInputs, with_snapshot_tensors
from .profiles import DECODE, PREFILL
from .segment_layout import LAYOUT, engine_kv_cache_dtype, engine_writes_snapshots, kv_cache_conflict


class EngineDirError(ValueError):
    """An engine dir, or the checkpoint given to run it, that cannot be run; one line."""


def read_engine_config(engine_dir: str | Path) -> dict:
    p = Path(engine_dir) / "config.json"
    try:
        config = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EngineDirError(f"{p}: cannot read the engine config ({e})") from e
    if not isinstance(config, dict) or config.get("layout") != LAYOUT:
        raise EngineDirError(f"{engine_dir}: not a segmented engine dir (config.json has no layout {LAYOUT!r}; "
                             "build one with `k3-trt build --layout segments`)")
    _check_fields(config, p)
    return config


_FIELDS = {"model": dict, "mapping": dict, "limits": dict, "segments": list, "layers": list, "ranks": list,
           "embed": dict, "head": dict, "dtype": str}


def _check_fields(config: dict, p: Path) -> None:
    """The fields the executor reads, with their types, so that a damaged config is one line
    naming the field rather than a KeyError deep in a step."""
    for key, kind in _FIELDS.items():
        if not isinstance(config.get(key), kind):
            raise EngineDirError(f"{p}: field `{key}` missing or not a{'n' if kind is dict else ''} {kind.__name__}")
    if config["dtype"] not in DTYPES:
        raise EngineDirError(f"{p}: field `dtype` = {config['dtype']!r} is not one of {sorted(DTYPES)}")
    if engine_kv_cache_dtype(config) not in ("fp8", config["dtype"]):
        raise EngineDirError(f"{p}: field `kv_cache_dtype` = {config['kv_cache_dtype']!r} is neither fp8 nor the "
                             f"engine dtype {config['dtype']}")
    m, lim = config["mapping"], config["limits"]
    for key in ("world_size", "tp_size", "moe_ep_size"):
        if not isinstance(m.get(key), int) or m[key] < 1:
            raise EngineDirError(f"{p}: field `mapping.{key}` must be a positive integer")
    for key in ("max_batch_size", "max_num_tokens", "max_seq_len", "block_size", "max_num_blocks"):
        if not isinstance(lim.get(key), int) or lim[key] < 1:
            raise EngineDirError(f"{p}: field `limits.{key}` must be a positive integer")
    if len(config["ranks"]) != m["world_size"]:
        raise EngineDirError(f"{p}: field `ranks` lists {len(config['ranks'])} ranks, mapping says {m['world_size']}")
    kinds = {s.get("kind") for s in config["segments"] if isinstance(s, dict)}
    for layer in config["layers"]:
        used = [s.get("kind") for s in layer.get("segments", [])] if isinstance(layer, dict) else [None]
        if not used or not set(used) <= kinds:
            raise EngineDirError(f"{p}: field `layers` names segments {used} that `segments` does not hold")


def engine_checkpoint(config: dict, engine_dir, checkpoint: str | Path | None) -> Path:
    """The checkpoint to run: ``checkpoint`` if given, else the one the engine was built for."""
    if checkpoint is None:
        if config.get("checkpoint") is None:
            raise EngineDirError(f"{engine_dir}: built from a config alone (--hf-config); pass --checkpoint with a "
                                 f"converted checkpoint of mapping {config['mapping']}")
        checkpoint = config["checkpoint"]
    return Path(checkpoint)


def check_checkpoint(config: dict, engine_dir, checkpoint: Path):
    """The checkpoint's model config and mapping must be the engine's; returns its K3Config."""
    try:
        cfg, data = read_trtllm_config(checkpoint)
    except ValueError as e:
        raise EngineDirError(f"checkpoint {checkpoint}: {e}") from e
    engine_cfg = parse_config(config["model"], source=f"{engine_dir}/config.json (field model)")
    # the nested (kimi_k3) and flat forms of one text config are the same model
    if dataclasses.replace(cfg, nested=False) != dataclasses.replace(engine_cfg, nested=False):
        diff = sorted(k for k in set(cfg.text_dict()) | set(config["model"])
                      if cfg.text_dict().get(k) != config["model"].get(k))
        raise EngineDirError(f"checkpoint {checkpoint} is another model than engine {engine_dir} was built for "
                             f"(config fields differ: {', '.join(diff[:5]) or 'derived'})")
    layout = RankLayout.from_mapping_json(data["mapping"], cfg, f"{checkpoint}/config.json")
    mapping = config["mapping"]
    if (layout.tp, layout.ep) != (mapping["tp_size"], mapping["moe_ep_size"]):
        raise EngineDirError(f"checkpoint {checkpoint} is converted for tp {layout.tp}, ep {layout.ep}; engine "
                             f"{engine_dir} is built for tp {mapping['tp_size']}, ep {mapping['moe_ep_size']}")
    return cfg


def _dims(step: StepInputs) -> dict[str, int]:
    return {"num_tokens": step.num_tokens, "num_seqs": step.num_seqs, "num_seqs+1": step.num_seqs + 1,
            "num_logits": int(step.logits_indices.shape[0])}


# ---------------------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------------------
class CpuSegments:
    """ReferenceEvaluator per segment kind (created once, reused by every layer)."""

    def __init__(self, engine_dir: Path, config: dict):
        from onnx.reference import ReferenceEvaluator

        from ..export.cpu_eval import K3_OPRUNS
        from ..export.schemas import register_schemas

        register_schemas()
        self.sessions = {s["kind"]: ReferenceEvaluator(str(engine_dir / s["onnx"]), new_ops=list(K3_OPRUNS))
                         for s in config["segments"]}
        self.outputs = {s["kind"]: [t["name"] for t in s["outputs"]] for s in config["segments"]}

    def run(self, kind: str, feeds: dict[str, torch.Tensor], outs: dict[str, torch.Tensor], phase: str) -> None:
        # numpy views of the bound tensors (no copies); the evaluator is functional, so the
        # results, the updated pools included, are written into the bound outputs
        results = self.sessions[kind].run(None, {n: t.numpy() for n, t in feeds.items()})
        for name, value in zip(self.outputs[kind], results):
            outs[name].copy_(torch.from_numpy(np.asarray(value)))


class TensorRTSegments:
    """One plan and execution context per segment kind; never executed here (see module doc)."""

    def __init__(self, engine_dir: Path, config: dict, plugin_lib: str | Path, builder: str = "auto"):
        from .bindings import import_tensorrt
        from .builder import PROFILE_ORDER, load_plugin_library

        missing = [s["kind"] for s in config["segments"] if s["plan"] is None]
        if missing:
            raise EngineDirError(f"{engine_dir}: no plans for {', '.join(missing)} (built with --builder none)")
        trt = import_tensorrt(builder)
        load_plugin_library(trt, plugin_lib)
        self._order = PROFILE_ORDER
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.engines, self.contexts, self.profile = {}, {}, {}
        for s in config["segments"]:
            engine = self._runtime.deserialize_cuda_engine((engine_dir / s["plan"]).read_bytes())
            if engine is None:
                raise EngineDirError(f"{engine_dir / s['plan']}: TensorRT could not deserialise the plan")
            self.engines[s["kind"]] = engine
            self.contexts[s["kind"]] = engine.create_execution_context()
            self.profile[s["kind"]] = None

    def run(self, kind: str, feeds: dict[str, torch.Tensor], outs: dict[str, torch.Tensor], phase: str) -> None:
        context, stream = self.contexts[kind], torch.cuda.current_stream().cuda_stream
        if self.profile[kind] != phase:
            context.set_optimization_profile_async(self._order.index(phase), stream)
            self.profile[kind] = phase
        for name, t in feeds.items():
            context.set_input_shape(name, tuple(t.shape))
            context.set_tensor_address(name, t.data_ptr())
        for name, t in outs.items():  # a pool's output is the pool itself: updated in place
            context.set_tensor_address(name, t.data_ptr())
        if not context.execute_async_v3(stream):
            raise RuntimeError(f"TensorRT execute_async_v3 failed in segment {kind}")


# ---------------------------------------------------------------------------------------
# The executor
# ---------------------------------------------------------------------------------------
class EngineExecutor:
    """``writes_snapshots``: the KDA segment takes the step's snapshot points and the snapshot
    pools (``segment_layout.engine_writes_snapshots``), so prefills write the prefix cache's
    snapshots mid-chunk as the torch executor's do; in an engine dir built before that the
    prefix cache ends chunks at snapshot positions and copies the state rows (``copy_states``)."""

    def __init__(self, engine_dir: str | Path, *, num_blocks: int, max_slots: int, checkpoint: str | Path | None = None,
                 device: str | torch.device = "cpu", backend: str = "auto", plugin_lib: str | Path | None = None,
                 snapshot_slots: int = 0):
        engine_dir = Path(engine_dir)
        config = read_engine_config(engine_dir)
        self.config, self.device = config, torch.device(device)
        world = config["mapping"]["world_size"]
        running = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if running != world:
            raise EngineDirError(f"{engine_dir}: built for world size {world}, this process runs "
                                 f"{'a process group of ' + str(running) if running > 1 else 'no process group'}")
        self.rank = dist.get_rank() if running > 1 else 0
        self.world = world
        checkpoint = engine_checkpoint(config, engine_dir, checkpoint)
        cfg = self.cfg = check_checkpoint(config, engine_dir, checkpoint)
        lim = config["limits"]
        if not 1 <= num_blocks <= lim["max_num_blocks"] or not 1 <= max_slots <= lim["max_batch_size"]:
            raise EngineDirError(f"num_blocks must be in [1, {lim['max_num_blocks']}] and max_slots in "
                                 f"[1, {lim['max_batch_size']}] (the engine's profiles)")
        self.writes_snapshots = engine_writes_snapshots(config)
        most = check_snapshot_rows(config, engine_dir, snapshot_slots)
        self.act = DTYPES[config["dtype"]]
        self.specs = {s["kind"]: s for s in config["segments"]}
        self.vocab_size = cfg.vocab_size
        self.backend = self._open_backend(engine_dir, backend, plugin_lib)  # before the (slow) weight load
        self._load_weights(engine_dir, checkpoint)
        # the prefix cache's snapshot rows are pools of their own, which the KDA segment binds beside
        # the running slots; without the cache it binds one row that no point writes (TensorRT
        # takes no zero-size dims), allocated here once
        rows = max(snapshot_slots, 1) if most else snapshot_slots
        self.caches = K3Caches.allocate(cfg, num_blocks, lim["block_size"], max_slots, self.act, self.device,
                                        config["mapping"]["tp_size"], rows, _allocated_kv(config))
        rank_info = config["ranks"][self.rank]
        i32 = dict(dtype=torch.int32, device=self.device)
        self.max_slots = max_slots  # where the snapshot rows start in copy_states' row namespace
        self.rank_inputs = {"vocab_start": torch.tensor([rank_info["vocab_start"]], **i32),
                            "expert_offset": torch.tensor([rank_info["expert_offset"]], **i32)}

    def _open_backend(self, engine_dir: Path, backend: str, plugin_lib):
        if backend == "auto":
            backend = "tensorrt" if self.device.type == "cuda" else "cpu"
        if backend == "cpu":
            if self.device.type != "cpu":
                raise EngineDirError("the CPU backend runs on device cpu")
            return CpuSegments(engine_dir, self.config)
        if backend == "tensorrt":
            if plugin_lib is None:
                raise EngineDirError("the TensorRT backend needs the K3 plugin library (--plugin-lib)")
            return TensorRTSegments(engine_dir, self.config, plugin_lib)
        raise EngineDirError(f"backend must be auto, cpu or tensorrt, got {backend!r}")

    def _load_weights(self, engine_dir: Path, checkpoint: Path) -> None:
        """Every tensor of this rank's file, once, in the engine's types, checked against the
        segment inputs it feeds; each layer's segments bind them by name. Read one tensor at
        a time straight to the device: host memory holds one tensor, not the rank."""
        path = rank_file(checkpoint, self.rank)
        try:
            stored = read_header(path)
            fd = os.open(path, os.O_RDONLY)
        except (OSError, SafetensorsFormatError) as e:
            raise CheckpointError(f"{path}: {e}") from e
        try:
            self._bind_all(engine_dir, path, fd, stored)
        except (OSError, SafetensorsFormatError) as e:
            raise CheckpointError(f"{path}: {e}") from e
        finally:
            os.close(fd)

    def _bind_all(self, engine_dir: Path, path: Path, fd: int, stored: dict) -> None:
        tensors: dict[str, torch.Tensor] = {}

        def bind(kind: str, feeds: dict[str, str]) -> dict[str, torch.Tensor]:
            inputs = {t["name"]: t for t in self.specs[kind]["inputs"]}
            out = {}
            for name, tensor in feeds.items():
                if tensor not in stored and tensor not in tensors:
                    raise EngineDirError(f"{path}: no tensor {tensor} (segment {kind} input {name})")
                if tensor not in tensors:
                    src = read_tensor(fd, stored.pop(tensor))
                    dt = weight_dtype(src.dtype, self.act)
                    t = src.view(torch.int8) if dt == torch.int8 else src.to(dt)
                    tensors[tensor] = t.to(self.device).contiguous()
                t, want = tensors[tensor], inputs[name]
                if list(t.shape) != want["shape"] or t.dtype != DTYPES[want["dtype"]]:
                    raise EngineDirError(f"{path}: {tensor} is {str(t.dtype).removeprefix('torch.')} {list(t.shape)}, "
                                         f"engine {engine_dir} segment {kind} input {name} takes {want['dtype']} "
                                         f"{want['shape']}")
                out[name] = t
            return out

        c = self.config
        self.embed_weights = bind("embed", c["embed"]["weights"])
        self.layers = [(layer, [(s["kind"], bind(s["kind"], s["weights"])) for s in layer["segments"]])
                       for layer in c["layers"]]
        self.head_weights = bind("head", c["head"]["weights"])
        if stored:
            raise EngineDirError(f"{path}: tensors no segment of engine {engine_dir} takes: {sorted(stored)[:5]}")

    @torch.inference_mode()
    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        self.caches.copy_states(copies)

    # -- one step --------------------------------------------------------------------
    def _run(self, kind: str, feeds: dict[str, torch.Tensor], dims: dict[str, int], phase: str,
             pools: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Runs one segment; returns its first output (the pools are updated in place)."""
        spec, pools = self.specs[kind], pools or {}
        outs = {}
        for t in spec["outputs"]:
            if t["role"] == "pool":
                outs[t["name"]] = pools[t["name"].removesuffix("_out")]
            else:
                shape = [d if isinstance(d, int) else dims[d] for d in t["shape"]]
                outs[t["name"]] = torch.empty(shape, dtype=DTYPES[t["dtype"]], device=self.device)
        self.backend.run(kind, {**feeds, **pools}, outs, phase)
        return outs[spec["outputs"][0]["name"]]

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(x)
        return x

    def _layer_pools(self, kind: str, index: int) -> dict[str, torch.Tensor]:
        c = self.caches
        if kind == "kda_attention":
            pools = {"conv_state": c.conv[index], "recurrent_state": c.recurrent[index]}
            if self.writes_snapshots:
                pools.update(snapshot_conv=c.snapshot_conv[index], snapshot_recurrent=c.snapshot_recurrent[index])
            return pools
        return {"latent_cache": c.latent[index]}

    @torch.inference_mode()
    def execute(self, step: StepInputs, decode: bool) -> torch.Tensor:
        copies = self._one_token_snapshots(step)
        if copies:
            step = dataclasses.replace(step, snapshot_offsets=None, snapshot_rows=None)
        # a step taking no snapshots binds one -1 point per sequence (the KDA segment's inputs)
        step = (with_snapshot_tensors(step) if self.writes_snapshots else step).to(self.device)
        logits = self._execute(step, decode)
        self.caches.copy_states(copies)
        return logits

    def _one_token_snapshots(self, step: StepInputs) -> list[tuple[int, int]]:
        """The snapshots of a step of one token per sequence that is no pure decode (a 1-token
        prompt beside decode tokens), as state-row copies after it: the KDA plugin runs such a
        step as a decode (it tells from the extents, without reading the device), which takes no
        points. Each point of a one-token chunk is its end, whose state is the row the step leaves."""
        if step.snapshot_offsets is None or step.num_tokens != step.num_seqs:
            return []
        slots = step.state_slots.tolist()
        return [(slots[b], self.max_slots + row)
                for b, (offsets, rows) in enumerate(zip(step.snapshot_offsets.tolist(), step.snapshot_rows.tolist()))
                for offset, row in zip(offsets, rows) if offset >= 0]

    def _execute(self, step: StepInputs, decode: bool) -> torch.Tensor:
        # the runner's phase picks the profile: a pure-decode step fits the decode profile
        # (one token per sequence, at most max_batch_size sequences)
        phase = DECODE if decode else PREFILL
        dims = _dims(step)
        step_tensors = {f: getattr(step, f) for f in StepInputs.__dataclass_fields__}
        run = partial(self._run, dims=dims, phase=phase)

        def inputs(kind: str, weights: dict, extra: dict) -> dict[str, torch.Tensor]:
            names = [t["name"] for t in self.specs[kind]["inputs"]]
            pool_names = {t["name"] for t in self.specs[kind]["inputs"] if t["role"] == "pool"}
            given = {**weights, **extra}
            for n in names:
                if n not in given and n not in pool_names:
                    given[n] = step_tensors[n] if n in step_tensors else self.rank_inputs[n]
            return given

        attn_res = self.cfg.attn_res_block_size is not None and self.cfg.attn_res_block_size > 0
        partial_sum = self._all_reduce(run("embed", inputs("embed", self.embed_weights, {})))
        T, d = partial_sum.shape
        blocks = torch.empty(self.cfg.num_attn_res_blocks, T, d, dtype=self.act, device=self.device)
        written = 0

        def stream(sources: int) -> dict[str, torch.Tensor]:
            if not attn_res:
                return {"partial": partial_sum}
            if sources > written:
                raise RuntimeError(f"engine layer plan reads {sources} AttnRes blocks, {written} written")
            return {"blocks": blocks[:sources], "partial": partial_sum}

        for layer, segments in self.layers:
            (attn_kind, attn_w), (ffn_kind, ffn_w), *combine = segments
            pools = self._layer_pools(attn_kind, layer["index"])
            a = self._all_reduce(run(attn_kind, inputs(attn_kind, attn_w, stream(layer["attn_sources"])),
                                     pools=pools))
            if layer["block_write"]:
                blocks[written] = partial_sum
                written += 1
                partial_sum = a  # the block starts from P = 0: 0 + a
            else:
                partial_sum = partial_sum + a
            out = self._all_reduce(run(ffn_kind, inputs(ffn_kind, ffn_w, stream(layer["mlp_sources"]))))
            for kind, w in combine:  # the routed and shared sums were reduced together
                out = run(kind, inputs(kind, w, {"moe_partial": out}))
            partial_sum = partial_sum + out
        logits = run("head", inputs("head", self.head_weights, stream(written)))
        if self.world > 1:
            parts = [torch.empty_like(logits) for _ in range(self.world)]
            dist.all_gather(parts, logits.contiguous())
            logits = torch.cat(parts, -1)
        return logits


# ---------------------------------------------------------------------------------------
# An LLMEngine over an engine dir (``k3-trt run ENGINE_DIR``)
# ---------------------------------------------------------------------------------------
def check_snapshot_rows(config: dict, engine_dir, snapshot_slots: int) -> int | None:
    """The most snapshot rows the engine's KDA segment binds (its profiles' ``snapshot_slots``
    dim), None when it binds none (built before snapshots, or no KDA layers);
    ``snapshot_slots`` past it is an error naming the flag."""
    if not engine_writes_snapshots(config) or not any(s["kind"] == "kda_attention" for s in config["segments"]):
        return None
    most = config["limits"].get("max_snapshot_slots")
    if not isinstance(most, int) or most < 1:
        raise EngineDirError(f"{engine_dir}/config.json: field `limits.max_snapshot_slots` must be a positive integer")
    if snapshot_slots > most:
        raise EngineDirError(f"--prefix-cache-snapshots {snapshot_slots}: the engine binds at most {most} snapshot "
                             "rows (its max_num_blocks: a held snapshot needs a cached block of its own)")
    return most


def _allocated_kv(config: dict) -> str:
    """``K3Caches.allocate``'s kv_cache_dtype for the rows the engine's segments take."""
    return "fp8" if engine_kv_cache_dtype(config) == "fp8" else "auto"


def _rank_executor(engine_dir: str, checkpoint: str, backend: str, plugin_lib, spec, device) -> EngineExecutor:
    """``runtime.distributed``'s ``make_executor`` for one rank (module level: pickled to
    spawned ranks; the engine-dir arguments are bound with ``functools.partial``)."""
    return EngineExecutor(engine_dir, num_blocks=spec.num_blocks, max_slots=spec.max_slots, checkpoint=checkpoint,
                          device=device, backend=backend, plugin_lib=plugin_lib, snapshot_slots=spec.snapshot_slots)


def _within(name: str, given, engine_value, equal: bool = False):
    """``given`` (None: not asked for) checked against the engine's build limit."""
    if given is None:
        return engine_value
    if (given != engine_value) if equal else (given > engine_value):
        raise EngineDirError(f"--{name.replace('_', '-')} {given}: the engine is built for "
                             f"{'' if equal else 'at most '}{engine_value}")
    return given


def engine_dir_engine(engine_dir: str | Path, *, checkpoint: str | Path | None = None, device: str = "cpu",
                      dtype: str | None = None, block_size: int | None = None, max_batch_size: int | None = None,
                      max_num_tokens: int | None = None, max_seq_len: int | None = None,
                      num_blocks: int | None = None, max_slots: int | None = None,
                      cache_memory_gb: float | None = None, seed: int | None = None, backend: str = "auto",
                      plugin_lib: str | Path | None = None, prefix_cache: bool = False,
                      prefix_cache_interval: int | None = None, snapshot_slots: int | None = None,
                      kv_cache_dtype: str | None = None):
    """The runner over ``engine_dir``'s segments. Limits not given are the engine's; given
    ones must fit it (``kv_cache_dtype`` must name the latent rows it was built with).
    The prefix-cache arguments are ``build_engine``'s. At world size N > 1 the ranks are started or joined as for a
    checkpoint (``runtime/distributed.py``); on a torchrun rank other than 0 this serves
    steps and returns None."""
    from ..runtime.block_manager import DEFAULT_CACHE_MEMORY_GB, resolve_prefix_interval, size_pools
    from ..runtime.distributed import RankSpec, rank_threads
    from ..runtime.engine import EngineConfig, start_engine

    config = read_engine_config(engine_dir)
    checkpoint = engine_checkpoint(config, engine_dir, checkpoint)
    cfg = check_checkpoint(config, engine_dir, checkpoint)
    lim, act = config["limits"], DTYPES[config["dtype"]]
    _within("dtype", dtype, config["dtype"], equal=True)
    conflict = kv_cache_conflict(config, kv_cache_dtype)
    if conflict:
        raise EngineDirError(conflict)
    kv = _allocated_kv(config)
    block_size = _within("block_size", block_size, lim["block_size"], equal=True)
    max_batch_size = _within("max_batch_size", max_batch_size, lim["max_batch_size"])
    max_num_tokens = _within("max_num_tokens", max_num_tokens, lim["max_num_tokens"])
    max_seq_len = _within("max_seq_len", max_seq_len, lim["max_seq_len"])
    tp = config["mapping"]["tp_size"]
    if cache_memory_gb is None and (num_blocks is None or max_slots is None):
        cache_memory_gb = DEFAULT_CACHE_MEMORY_GB
    row_bytes = K3Caches.bytes_per_slot(cfg, act, tp)
    pools = size_pools(K3Caches.bytes_per_block(cfg, block_size, act, kv), row_bytes,
                       block_size=block_size, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                       cache_memory_gb=cache_memory_gb, num_blocks=num_blocks, max_slots=max_slots,
                       prefix_cache=prefix_cache, snapshot_slots=snapshot_slots,
                       prefix_cache_interval=prefix_cache_interval)
    interval = resolve_prefix_interval(prefix_cache_interval, block_size) if prefix_cache else 0
    check_snapshot_rows(config, engine_dir, pools.snapshot_slots)  # before any rank starts
    # a derived pool is capped at what the engine's profiles admit; explicit counts are checked
    num_blocks = num_blocks or min(pools.num_blocks, lim["max_num_blocks"])
    max_slots = max_slots or min(pools.max_slots, lim["max_batch_size"])
    make = partial(_rank_executor, str(engine_dir), str(checkpoint), backend, plugin_lib)
    spec = RankSpec(str(engine_dir), act, torch.device(device).type, tp, config["mapping"]["moe_ep_size"],
                    num_blocks, max_slots, block_size, threads=rank_threads(tp), snapshot_slots=pools.snapshot_slots)
    engine_config = EngineConfig(num_blocks=num_blocks, max_slots=max_slots, block_size=block_size,
                                 max_batch_size=max_batch_size, max_num_tokens=max_num_tokens, max_seq_len=max_seq_len,
                                 prefix_cache=prefix_cache, prefix_cache_interval=interval,
                                 snapshot_slots=pools.snapshot_slots, kv_cache_dtype=engine_kv_cache_dtype(config),
                                 state_row_bytes=row_bytes)
    return start_engine(spec, make, cfg, engine_config, device, checkpoint, seed)
