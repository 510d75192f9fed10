"""Peak memory and throughput of ``k3-trt convert`` on a multi-GB synthetic checkpoint.

    PYTHONPATH=. python bench/convert_memory.py [--workdir DIR] [--keep]   (from the repo root)

Synthesises a "wide" K3-shaped checkpoint (hidden 4096, vocab 65536, 8 layers, 128 MXFP4
experts per MoE layer: ≈5.3 GB in 1 GB shards, written tensor by tensor so this script
stays light), then runs ``k3-trt convert`` in a subprocess per configuration and records
the child's peak RSS (``/usr/bin/time``) and its throughput (output tensor bytes / wall
time, Python start-up and the final fsync included). Before each run the source shards
are evicted from the page cache (``posix_fadvise(DONTNEED)``), so reads come from disk.
A bare ``import`` of the CLI is measured the same way as the fixed baseline.
Writes bench/results/convert_memory.json and deletes the big files unless --keep.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from k3_trtllm.checkpoint.loader import expected_parts
from k3_trtllm.checkpoint.synth import MXFP4_QUANT, preset_config
from k3_trtllm.config import parse_config
from k3_trtllm.convert.plan import Entry
from k3_trtllm.convert.writer import RankFile

ROOT = Path(__file__).resolve().parents[1]
SHARD_BYTES = 1 << 30
RUNS = [{"tp": 1, "ep": 1, "workers": 1}, {"tp": 1, "ep": 1, "workers": 2}, {"tp": 1, "ep": 1, "workers": 4},
        {"tp": 4, "ep": 2, "workers": 2}, {"tp": 4, "ep": 2, "workers": 4},
        {"tp": 1, "ep": 1, "workers": 2, "experts": "bf16"}]


def wide_config() -> dict:
    config = preset_config("tiny")
    config.update(
        vocab_size=65536, hidden_size=4096, intermediate_size=11264, num_hidden_layers=8,
        num_attention_heads=32, q_lora_rank=1024, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, num_experts=128, num_experts_per_token=8, num_shared_experts=1,
        moe_intermediate_size=1024, routed_expert_hidden_size=2048, attn_res_block_size=4,
        quantization_config=MXFP4_QUANT,
    )
    config["linear_attn_config"].update(kda_layers=[1, 2, 3, 5, 6, 7], full_attn_layers=[4, 8], num_heads=32,
                                        head_dim=128)
    return config


def _random(shape, dtype, gen) -> torch.Tensor:
    if dtype == torch.uint8:
        return torch.randint(118, 130, shape, generator=gen, dtype=torch.uint8)  # sane E8M0 scales / codes
    return (torch.randn(shape, generator=gen) * 0.02).to(dtype)


def synthesise(out: Path) -> int:
    """Write the wide checkpoint shard by shard, tensor by tensor; return its tensor bytes."""
    config = wide_config()
    parts = list(expected_parts(parse_config(config)).values())
    shards, current, size = [], [], 0
    for p in parts:
        nbytes = math.prod(p.shape) * torch.empty((), dtype=p.dtypes[0]).element_size()
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    shards.append(current)
    out.mkdir(parents=True)
    gen, weight_map, total = torch.Generator().manual_seed(0), {}, 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        f = RankFile(out / name, [Entry(p.source, p.dtypes[0], p.shape) for p in shard])
        for p in shard:
            f.write(p.source, 0, _random(p.shape, p.dtypes[0], gen))
            weight_map[p.source] = name
        f.close()
        total += f.data_bytes
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                 "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return total


def evict(directory: Path) -> None:
    for f in directory.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_baseline(work: Path, source: Path) -> dict[str, float]:
    """Sequential write (2 GiB, fsync) and cold read of the source: the ceilings for convert."""
    block, path = bytes(16 << 20), work / "disk_probe"
    start = time.monotonic()
    with open(path, "wb") as f:
        for _ in range(128):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    write = (128 << 24) / 1e6 / (time.monotonic() - start)
    path.unlink()
    evict(source)
    start, total = time.monotonic(), 0
    for shard in sorted(source.glob("*.safetensors")):
        with open(shard, "rb", buffering=0) as f:
            while chunk := f.read(16 << 20):
                total += len(chunk)
    return {"write_fsync_mb_per_s": round(write, 1),
            "cold_read_mb_per_s": round(total / 1e6 / (time.monotonic() - start), 1)}


def measure(args: list[str]) -> tuple[float, int, str]:
    """Wall seconds, peak RSS (bytes) and stderr tail of one child process. The child is
    started by /usr/bin/time: Linux carries the high-water RSS of the process that forks
    across exec, so a child forked from this (multi-GB) process would report our peak."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.monotonic()
    proc = subprocess.run(["/usr/bin/time", "-f", "maxrss_kib=%M", sys.executable, *args], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{args} failed:\n{proc.stderr[-2000:]}")
    lines = proc.stderr.strip().splitlines()
    rss_kib = int(lines[-1].removeprefix("maxrss_kib="))
    return seconds, rss_kib * 1024, "\n".join(lines[:-1])[-600:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "k3_convert_memory")
    ap.add_argument("--keep", action="store_true")
    opts = ap.parse_args()
    work = opts.workdir
    if work.exists():
        shutil.rmtree(work)
    try:
        t0 = time.monotonic()
        source_bytes = synthesise(work / "hf")
        synth_s = time.monotonic() - t0
        cli = "from k3_trtllm.cli import main; main()"
        disk = disk_baseline(work, work / "hf")
        _, baseline_rss, _ = measure(["-c", "import k3_trtllm.cli.convert, k3_trtllm.convert"])
        largest = max(f.stat().st_size for f in (work / "hf").glob("*.safetensors"))
        runs = []
        for run in RUNS:
            out = work / f"out-{len(runs)}"
            experts = ["--experts", run["experts"]] if "experts" in run else []
            evict(work / "hf")
            seconds, rss, tail = measure(["-c", cli, "convert", str(work / "hf"), str(out), "--tp", str(run["tp"]),
                                          "--ep", str(run["ep"]), "--workers", str(run["workers"]), *experts])
            manifest = json.loads((out / "config.json").read_text())["manifest"]
            out_bytes = sum(m["bytes"] for m in manifest.values())
            runs.append({**run, "seconds": round(seconds, 2), "peak_rss_mb": round(rss / 1e6, 1),
                         "output_bytes": out_bytes, "mb_per_s": round(out_bytes / 1e6 / seconds, 1),
                         "summary": tail.strip().splitlines()[-1]})
            print(json.dumps(runs[-1]), flush=True)
            shutil.rmtree(out)
        result = {
            "date": datetime.date.today().isoformat(), "host": platform.node(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "source_bytes": source_bytes, "source_tensors": len(json.loads(
                (work / "hf" / "model.safetensors.index.json").read_text())["weight_map"]),
            "largest_shard_bytes": largest, "synthesis_seconds": round(synth_s, 1),
            "baseline_import_rss_mb": round(baseline_rss / 1e6, 1), "disk": disk,
            "page_cache": "source evicted before each run",
            "runs": runs,
        }
        path = ROOT / "bench" / "results" / "convert_memory.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(path)
    finally:
        if not opts.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
