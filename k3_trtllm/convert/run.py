"""``convert_checkpoint``: HF K3 checkpoint → TensorRT-LLM checkpoint, streaming.

Every check happens before the first byte is written: options, config, the inventory
(all missing and unexpected names), every tensor's shape and dtype (from the shard
headers), divisibility by --tp/--ep, and OUT_DIR against the input (``utils.atomic``: never
the input or around it; replaced only when k3-trt wrote it). The output is then written
into a temp dir beside OUT_DIR and renamed at the end; any exception or Ctrl-C removes it.
"""
from __future__ import annotations

import errno
import json
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from tqdm import tqdm

from ..checkpoint.hf import HFCheckpoint
from ..checkpoint.loader import check_checkpoint
from ..checkpoint.mapping import BYTE_COPY, targets, unit_output
from ..checkpoint.tokenizer_files import copy_tokenizer_files, find_tokenizer_files
from ..checkpoint.trtllm import k3_text_config, rank_file, trtllm_config
from ..config import parse_config
from ..utils.atomic import atomic_output_dir, check_output, input_paths, write_file
from ..checkpoint.rank_layout import rank_layout_for
from .errors import ConvertError
from .plan import CHUNK_BYTES, Dest, Piece, Planner
from .writer import RankFile

EXPERT_FORMATS = ("mxfp4", "bf16")
OUTPUT_KIND = "trtllm-checkpoint"
# copy_file_range errnos where the tensor path copies instead: the kernel cannot copy these
# files (other filesystems, no support), or the source ran short (the tensor path reads it and
# says what is wrong). Any other error (disk full) is the output's and is raised.
_NO_KERNEL_COPY = {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF, errno.EPERM, errno.EIO}


@dataclass(frozen=True)
class ConvertResult:
    out_dir: Path
    world_size: int
    tensors: int
    bytes: int  # tensor data written over all ranks
    seconds: float


def convert_checkpoint(hf_dir: str | Path, out_dir: str | Path, tp: int = 1, ep: int = 1,
                       experts: str | None = None, dtype: str = "bfloat16", workers: int = 4,
                       force: bool = False, progress: bool = True, chunk_bytes: int = CHUNK_BYTES) -> ConvertResult:
    """Convert ``hf_dir`` into ``out_dir``. ``experts``: ``"mxfp4"`` / ``"bf16"`` / None
    (as stored). ``workers``: pieces converted concurrently (threads; memory grows with it).
    ``chunk_bytes``: the most source bytes one piece reads (larger tensors go in row chunks)."""
    started = time.monotonic()
    hf, out = Path(hf_dir), Path(out_dir)
    inputs = input_paths(hf)
    check_output(out, OUTPUT_KIND, force=force, inputs=inputs)  # before reading a byte
    if tp < 1 or ep < 1 or workers < 1:
        raise ConvertError(f"--tp {tp}, --ep {ep}, --workers {workers}: expected positive integers")
    if dtype != "bfloat16":
        raise ConvertError(f"--dtype {dtype}: K3 converts to bfloat16 only (its fp32 tensors stay fp32)")
    with HFCheckpoint(hf) as ckpt:
        cfg = ckpt.config
        source_mxfp4 = cfg.moe is not None and cfg.moe.mxfp4
        out_mxfp4 = _experts_format(experts, source_mxfp4)
        par = rank_layout_for(cfg, tp, ep, source_mxfp4)
        check_checkpoint(ckpt)
        k3 = k3_text_config(cfg, json.loads((hf / "config.json").read_text()), out_mxfp4)
        parse_config(k3, source="converted config (field k3)")  # what the reader will parse
        planner = Planner(cfg, par, list(targets(cfg, dequantize_experts=source_mxfp4 and not out_mxfp4)), chunk_bytes,
                          file_dtypes={name: info.dtype for name, info in ckpt.index.items()})
        per_rank = planner.rank_entries()
        total = sum(e.nbytes for entries in per_rank for e in entries)
        tokenizer = find_tokenizer_files(hf, ckpt._check_inside)  # the checkpoint's links are checked like its shards
        with atomic_output_dir(out, OUTPUT_KIND, force=force, inputs=inputs) as tmp:
            copy_tokenizer_files(tokenizer, tmp)
            manifest = _write_ranks(tmp, ckpt, planner, per_rank, workers, total, progress)
            config = trtllm_config(cfg, k3, par.mapping_json(), out_mxfp4, manifest)
            write_file(tmp / "config.json", json.dumps(config, indent=2) + "\n")
    return ConvertResult(out, par.world_size, sum(len(e) for e in per_rank), total, time.monotonic() - started)


def _experts_format(requested: str | None, source_mxfp4: bool) -> bool:
    """Whether the converted routed experts are MXFP4."""
    if requested is None:
        return source_mxfp4
    if requested not in EXPERT_FORMATS:
        raise ConvertError(f"--experts {requested!r}: expected one of {', '.join(EXPERT_FORMATS)}")
    if requested == "mxfp4" and not source_mxfp4:
        raise ConvertError("--experts mxfp4: the checkpoint's routed experts are bf16; k3-trt converts MXFP4 to "
                           "bf16 but does not quantise")
    return requested == "mxfp4"


def _write_ranks(tmp: Path, ckpt: HFCheckpoint, planner: Planner, per_rank, workers: int, total: int,
                 progress: bool) -> dict[str, dict[str, int]]:
    files: list[RankFile] = []
    try:
        for r, entries in enumerate(per_rank):
            files.append(RankFile(rank_file(tmp, r), entries))
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="convert", file=sys.stderr,
                  disable=not progress, dynamic_ncols=True) as bar:
            _run_pieces(planner.pieces(), lambda piece: convert_piece(piece, ckpt, files, planner.cfg),
                        workers, bar.update)
        for f in files:
            f.close()
    except BaseException:
        for f in files:
            f.abandon()
        raise
    return {f"rank{r}": {"tensors": f.num_tensors, "bytes": f.data_bytes, "file_bytes": f.file_bytes}
            for r, f in enumerate(files)}


def convert_piece(piece: Piece, ckpt: HFCheckpoint, files: list[RankFile], cfg) -> int:
    tensors = None
    for dest in piece.dests:
        if _copy_bytes(piece, dest, ckpt, files):
            continue
        if tensors is None:
            tensors = [ckpt.read(p.source, shape=p.shape, rows=piece.rows) for p in piece.parts]
        local = [t if c is None else t[:, c[0]:c[1]] for t, c in zip(tensors, dest.cols)]
        files[dest.rank].write(piece.target.name, dest.offset, unit_output(piece.target, local, cfg))
    return piece.nbytes


def _copy_bytes(piece: Piece, dest: Dest, ckpt: HFCheckpoint, files: list[RankFile]) -> bool:
    """Where the output bytes are the stored bytes, copy them file to file in the kernel.
    False: not such a piece, or the kernel cannot copy here (then the tensor path does it)."""
    part = piece.parts[0]
    if (piece.target.combine not in BYTE_COPY or dest.cols != (None,)
            or ckpt.info(part.source).dtype != piece.target.dtype):
        return False
    try:
        files[dest.rank].copy_from(piece.target.name, dest.offset, *ckpt.span(part.source, part.shape, piece.rows))
    except OSError as e:
        if e.errno not in _NO_KERNEL_COPY:
            raise
        return False
    return True


def _run_pieces(pieces: Iterator[Piece], work: Callable[[Piece], int], workers: int,
                done: Callable[[int], None]) -> None:
    """Run ``work`` over ``pieces`` with at most ``workers`` in flight (bounded memory)."""
    if workers == 1:
        for piece in pieces:
            done(work(piece))
        return
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="k3-convert")
    running: set[Future] = set()
    try:
        for piece in pieces:
            if len(running) >= workers:
                finished, running = wait(running, return_when=FIRST_COMPLETED)
                for fut in finished:
                    done(fut.result())
            running.add(pool.submit(work, piece))
        for fut in running:
            done(fut.result())
    finally:
        # On error or Ctrl-C: let the (at most `workers`) running pieces finish, start no more.
        pool.shutdown(wait=True, cancel_futures=True)
