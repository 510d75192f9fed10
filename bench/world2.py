#!/usr/bin/env python3
"""World size 2 against world size 1 (issue 19): one script for its three results.

    python bench/world2.py tokens --device cuda --out bench/results/world2_tokens_h200x2.json
    python bench/world2.py slice --device cuda --config .carry/k3/config.json --tp 8 --ep 8 --layers 8 \\
        --out bench/results/world2_slice_h200x2.json
    python bench/world2.py kill --device cuda --out bench/results/world2_kill_h200x2.json
    python bench/world2.py slice --device cpu --config examples/tiny-k3/config.json --tp 1 --ep 1 \\
        --layers 4 --batches 1,2 --context 16      # the same code on CPU (gloo), as the tests run it

``tokens``: ``examples/tiny-k3`` converted at tp1 and tp2/ep2, each run by ``k3-trt run`` (the
multi-rank runner starts the second rank itself) on the same prompts, greedy; bf16 (the CUDA
kernels) reports the agreement, fp32 (the reference ops) whether the tokens are equal. The two
worlds sum the row-parallel products in different orders, so even fp32 may flip a near-tie.

``slice``: the rank slice of ``bench/rank_slice.py`` (one ``--tp/--ep`` rank's dims, random
weights) at world 1, and split over 2 ranks (each holds half of that rank: a ``2*tp``/``2*ep``
rank's dims) whose all-reduces and the LM head's all-gather really run (NCCL on CUDA, gloo on
CPU). Per batch: the eager decode step (and the CUDA-graph one on CUDA), the collectives per step
(count and bytes, counted by wrapping torch.distributed) and the time the profiler sees in them;
and the all-reduce bus bandwidth measured in the same processes.

``kill``: a long world-2 run whose second rank gets SIGKILL once tokens stream: the seconds
until ``k3-trt run`` exits, its exit code, its one error line, and whether any process is left.

NVLink multicast stays off (the device docs): NCCL_NVLS_ENABLE=0 and the other variables below
are set for every process this script starts.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import rank_slice as rs  # noqa: E402  (bench/ is on sys.path when run as a script)
from k3_trtllm.checkpoint.errors import CheckpointError  # noqa: E402
from k3_trtllm.checkpoint.rank_layout import rank_layout_for  # noqa: E402
from k3_trtllm.runtime.executor import TorchExecutor  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny-k3"
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
CLI = [sys.executable, "-c", "import sys; from k3_trtllm.cli import main; sys.exit(main())"]
PROMPTS = [[5 + 7 * i + j for j in range(4 + 9 * i)] for i in range(6)]
KILL_WITHIN_S = 30.0


class WorldError(Exception):
    """A step of the check failed (a convert or run that exited non-zero, a rank missing)."""


def _env(device: str) -> dict[str, str]:
    env = dict(os.environ, **NO_MULTICAST, PYTHONPATH=str(ROOT))
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _cli(args: list[str], device: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + args, capture_output=True, text=True, timeout=timeout, env=_env(device))


def _last_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    return lines[-1][:400] if lines else ""


# ---------------------------------------------------------------------------
# tokens
# ---------------------------------------------------------------------------
def _convert(work: Path, tp: int, ep: int, device: str) -> Path:
    out = work / f"tiny-tp{tp}-ep{ep}"
    done = _cli(["convert", str(TINY), str(out), "--tp", str(tp), "--ep", str(ep), "--quiet"], device, 300)
    if done.returncode:
        raise WorldError(f"convert --tp {tp} --ep {ep}: {_last_error(done.stderr)}")
    return out


def _greedy(model_dir: Path, dtype: str, device: str, new_tokens: int) -> list[list[int]]:
    args = ["run", str(model_dir), "--device", device, "--dtype", dtype, "--json", "--ignore-eos",
            "--max-new-tokens", str(new_tokens)]
    for p in PROMPTS:
        args += ["--prompt-ids", ",".join(map(str, p))]
    done = _cli(args, device, 600)
    if done.returncode:
        raise WorldError(f"run {model_dir.name} --dtype {dtype}: {_last_error(done.stderr)}")
    return [o["output_ids"] for o in json.loads(done.stdout)["outputs"]]


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for s, t in zip(a, b) for x, y in zip(s, t))
    total = sum(len(s) for s in a)
    first = [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), None) for s, t in zip(a, b)]
    return {"equal": a == b, "tokens_agreeing": same, "tokens": total, "agreement": same / total,
            "first_divergence_per_request": first}


def run_tokens(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="k3-world2-") as tmp:
        work = Path(tmp)
        one, two = _convert(work, 1, 1, args.device), _convert(work, 2, 2, args.device)
        report = {}
        for dtype in args.dtypes:
            w1 = _greedy(one, dtype, args.device, args.new_tokens)
            w2 = _greedy(two, dtype, args.device, args.new_tokens)
            report[dtype] = {"world1": w1, "world2": w2, **_agreement(w1, w2)}
            print(f"{dtype}: world 2 vs world 1: {report[dtype]['tokens_agreeing']}/{report[dtype]['tokens']} "
                  f"tokens agree, equal={report[dtype]['equal']}", flush=True)
    return {"prompts": PROMPTS, "new_tokens": args.new_tokens, "checkpoints": "tiny-k3 converted tp1 and tp2/ep2",
            "results": report}


# ---------------------------------------------------------------------------
# slice
# ---------------------------------------------------------------------------
class CollectiveCounter:
    """Counts the collectives the model issues (and their bytes) while installed."""

    def __init__(self):
        self.calls: dict[str, list[int]] = {}
        self._saved = {}

    def __enter__(self):
        for name in ("all_reduce", "all_gather"):
            real = getattr(dist, name)
            self._saved[name] = real

            def counted(*a, _real=real, _name=name, **k):
                t = a[1] if _name == "all_gather" else a[0]
                self.calls.setdefault(_name, []).append(t.numel() * t.element_size())
                return _real(*a, **k)
            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, real in self._saved.items():
            setattr(dist, name, real)

    def summary(self) -> dict:
        return {name: {"count": len(sizes), "bytes": sum(sizes)} for name, sizes in self.calls.items()}


def rank_shard(cfg, tp: int, ep: int, world: int, rank: int) -> rs.RankShard:
    """Rank ``rank`` of a world of ``world`` ranks that together hold one ``tp/ep`` rank: each has
    the dims of a ``world*tp``/``world*ep`` rank, and ``tp_size = world`` so the model's
    collectives run over the processes that exist."""
    try:
        layout = rank_layout_for(cfg, tp * world, ep * world, cfg.moe is not None and cfg.moe.mxfp4)
    except CheckpointError as e:
        raise rs.BenchError(str(e).replace("\n  ", "; ")) from None
    return rs.RankShard(tp_size=world, tp_rank=rank, moe_ep_size=layout.ep, moe_ep_rank=layout.moe_ep_rank(rank),
                        moe_tp_size=layout.moe_tp, moe_tp_rank=layout.moe_tp_rank(rank), shard=tp * world)


def collective_ms(fn, device: torch.device) -> float:
    """Time per call of ``fn`` inside collectives, as the profiler sees it: NCCL kernels on a
    GPU, gloo's host-side ops on CPU."""
    fn()
    rs._sync(device)
    activity = torch.profiler.ProfilerActivity.CUDA if device.type == "cuda" else torch.profiler.ProfilerActivity.CPU
    steps = 3
    with torch.profiler.profile(activities=[activity]) as prof:
        for _ in range(steps):
            fn()
        rs._sync(device)
    total_us = 0.0
    for e in prof.events():
        name = e.name.lower()
        if device.type == "cuda":
            if e.device_type == torch.autograd.DeviceType.CUDA and "nccl" in name:
                total_us += e.time_range.elapsed_us()
        elif name.startswith("gloo:") or name.startswith("c10d::"):
            total_us += e.time_range.elapsed_us()
    return total_us / steps / 1e3


def all_reduce_bandwidth(device: torch.device, world: int, sizes_mib: list[int], iters: int) -> list[dict]:
    rows = []
    for mib in sizes_mib:
        x = torch.ones(mib * 2 ** 19, dtype=torch.bfloat16, device=device)
        dist.barrier()
        t = rs.time_ms(lambda: dist.all_reduce(x), device, iters, 3)
        nbytes = x.numel() * x.element_size()
        rows.append({"MiB": mib, "median_ms": t["median_ms"],
                     "bus_GBps": 2 * (world - 1) / world * nbytes / (t["median_ms"] * 1e-3) / 1e9,
                     "algo_GBps": nbytes / (t["median_ms"] * 1e-3) / 1e9})
    return rows


def _slice_rank(rank: int, world: int, port: int, args, results) -> None:
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        rs.bench_device("cuda")  # the kernel library, or a clear error
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                                init_method=f"tcp://127.0.0.1:{port}", device_id=device if device.type == "cuda" else None)
    try:
        cfg = rs.slice_config(rs.read_config_json(Path(args.config)), args.layers, args.config)
        par = rank_shard(cfg, args.tp, args.ep, world, rank)
        layout = rs.PoolLayout(max(args.batches), args.context + 2, args.block_size)
        model, caches = rs.build_rank(cfg, par, layout, device, args.seed + rank)
        eager = TorchExecutor(model, caches, device, cuda_graphs=False)
        graphs = TorchExecutor(model, caches, device, cuda_graphs=True) if device.type == "cuda" else None
        rows = []
        for batch in args.batches:
            gen = torch.Generator().manual_seed(args.seed)  # every rank builds the same step
            step, decode = rs.make_step([(1, args.context)] * batch, layout, par.tp_local(cfg.vocab_size), gen)
            run = lambda: eager.execute(step, decode)  # noqa: E731
            with CollectiveCounter() as counter:
                run()
            if world > 1:
                dist.barrier()
            row = {"batch": batch, "context": args.context, "eager": rs.time_ms(run, device, args.iters, 2),
                   "collectives_per_step": counter.summary()}
            if world > 1:
                dist.barrier()
                row["collective_ms_per_step"] = collective_ms(run, device)
            if graphs is not None:
                try:
                    if world > 1:
                        dist.barrier()
                    row["graph"] = rs.time_ms(lambda: graphs.execute(step, decode), device, args.iters, 2)
                except RuntimeError as e:  # capture of the collectives refused: the eager figure stands
                    row["graph_error"] = str(e).splitlines()[0][:300]
            rows.append(row)
        bandwidth = all_reduce_bandwidth(device, world, args.allreduce_mib, args.iters) if world > 1 else []
        results[rank] = {"decode": rows, "allreduce_bandwidth": bandwidth,
                         "slice": rs.slice_description(cfg, par, args.tp * world, args.ep * world),
                         "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    except rs.BenchError as e:
        results[rank] = {"error": str(e)}
    finally:
        if world > 1:
            dist.destroy_process_group()


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_slice(args) -> dict:
    os.environ.update(NO_MULTICAST)
    if args.device == "cuda" and torch.cuda.device_count() < max(args.worlds):
        raise rs.BenchError(f"--worlds {max(args.worlds)} needs as many GPUs; this host has {torch.cuda.device_count()}")
    report = {}
    for world in args.worlds:
        manager = mp.get_context("spawn").Manager()
        results = manager.dict()
        if world == 1:
            _slice_rank(0, 1, 0, args, results)
        else:
            mp.start_processes(_slice_rank, args=(world, _free_port(), args, results), nprocs=world, join=True,
                               start_method="spawn")
        ranks = [results[r] for r in range(world)]
        errors = [r["error"] for r in ranks if "error" in r]
        if errors:
            raise rs.BenchError(errors[0])
        rows = []
        for per_rank in zip(*(r["decode"] for r in ranks)):
            row = dict(per_rank[0])
            # a step ends when its slowest rank does
            row["eager_ms"] = max(r["eager"]["median_ms"] for r in per_rank)
            if all("graph" in r for r in per_rank):
                row["graph_ms"] = max(r["graph"]["median_ms"] for r in per_rank)
            if world > 1:
                row["collective_ms_per_step_by_rank"] = [r["collective_ms_per_step"] for r in per_rank]
            rows.append(row)
        report[f"world{world}"] = {"slice_per_rank": ranks[0]["slice"], "gpus": [r["gpu"] for r in ranks],
                                   "decode": rows, "allreduce_bandwidth": ranks[0]["allreduce_bandwidth"]}
        for row in rows:
            coll = f", collectives {max(row['collective_ms_per_step_by_rank']):.3f} ms" if world > 1 else ""
            graph = f", graph {row['graph_ms']:.3f} ms" if "graph_ms" in row else ""
            print(f"world {world} batch {row['batch']}: eager {row['eager_ms']:.3f} ms{graph}{coll}", flush=True)
        manager.shutdown()
    if "world1" in report and "world2" in report:
        report["world2_over_world1"] = [
            {"batch": a["batch"], "eager": b["eager_ms"] / a["eager_ms"],
             **({"graph": b["graph_ms"] / a["graph_ms"]} if "graph_ms" in a and "graph_ms" in b else {})}
            for a, b in zip(report["world1"]["decode"], report["world2"]["decode"])]
    return report


# ---------------------------------------------------------------------------
# kill
# ---------------------------------------------------------------------------
def spawned_children(pid: int) -> list[int]:
    """The multiprocessing-spawned children of ``pid`` (tests/test_runtime_world.py's kill
    checks look for the same processes)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat[1]) == pid and b"spawn_main" in cmdline:
                found.append(int(entry.name))
    return found


def _group_alive(group: int) -> list[int]:
    alive = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == group and fields[0] != "Z":
                alive.append(int(entry.name))
    return alive


def run_kill(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="k3-world2-") as tmp:
        model = _convert(Path(tmp), 2, 2, args.device)
        cmd = CLI + ["run", str(model), "--device", args.device, "--ignore-eos", "--max-new-tokens", "3000",
                     "--max-seq-len", "4096", "--prompt-ids", "5,6,7,8"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, env=_env(args.device))
        try:
            for _ in range(4):  # tokens are streaming: both ranks are stepping
                if not proc.stdout.readline():
                    raise WorldError(f"the world-2 run ended before streaming: {_last_error(proc.stderr.read())}")
            workers = spawned_children(proc.pid)
            if len(workers) != 1:
                raise WorldError(f"expected one spawned worker rank, found {workers}")
            start = time.monotonic()
            os.kill(workers[0], signal.SIGKILL)
            proc.stdout.read()
            code = proc.wait(KILL_WITHIN_S)
            elapsed = time.monotonic() - start
            stderr = proc.stderr.read()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        deadline = time.monotonic() + 5
        while (left := _group_alive(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
    errors = [line for line in stderr.splitlines() if line.startswith("Error:")]
    print(f"rank 1 killed: k3-trt run exited {code} after {elapsed:.2f} s; {errors[:1]}", flush=True)
    return {"killed": "rank 1 (SIGKILL) while tokens stream", "exit_code": code, "seconds_to_exit": elapsed,
            "error_lines": errors, "traceback": "Traceback" in stderr, "processes_left": left}


# ---------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------
def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("tokens", "slice", "kill"))
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", help="JSON report")
    ap.add_argument("--dtypes", type=lambda s: s.split(","), default=["bfloat16", "float32"], help="tokens")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens: generated per prompt")
    ap.add_argument("--config", default=str(rs.DEFAULT_CONFIG), help="slice: HF config.json")
    ap.add_argument("--tp", type=int, default=8, help="slice: the one-rank dims (a --tp/--ep rank)")
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--worlds", type=_ints, default=[1, 2], help="slice: world sizes to run")
    ap.add_argument("--batches", type=_ints, default=[1, 8, 64])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--allreduce-mib", type=_ints, default=[1, 16, 256])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.what == "tokens" and not set(args.dtypes) <= {"bfloat16", "float32"}:
        ap.error(f"--dtypes {','.join(args.dtypes)}: expected bfloat16 and/or float32")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.time()
    try:
        result = {"tokens": run_tokens, "slice": run_slice, "kill": run_kill}[args.what](args)
    except (rs.BenchError, WorldError, subprocess.TimeoutExpired) as e:
        print(f"world2.py {args.what}: {e}", file=sys.stderr)
        return 2
    report = {"meta": {**rs.meta(torch.device(args.device) if args.device == "cpu" else torch.device("cuda", 0),
                                 args, args.config),
                       "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                       if args.device == "cuda" else [], "seconds": time.time() - started},
              args.what: result}
    if args.out:
        rs.write_json(args.out, report)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
