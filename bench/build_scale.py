"""K3's real config built for a whole world from the config alone (DESIGN §10, issue 17):

    python bench/build_scale.py --out bench/results/build_scale.json

runs ``k3-trt build --hf-config CONFIG --tp 8 --ep 8 OUT --builder none`` under
``/usr/bin/time -v`` (wall time, peak RSS), sums the engine dir's files, and with
``--rtx`` does the same with ``--builder tensorrt-rtx``. CI machines have TensorRT-RTX's
builder but not the TensorRT headers the C++ plugin library compiles against, so the RTX
run registers the Python build-phase creators of ``tests/trt_creators.py`` (same names,
fields, I/O as the C++ plugins; the builder never calls enqueue); ``--plugin-lib
build/libk3_trt_plugins.so`` (``build_scripts/build_plugins.sh`` against fetched TensorRT
headers) builds the plans with the C++ plugin library instead. The monolithic build's
figures of DESIGN §10 (measured 2026-12-01, tiny width) go beside them for comparison."""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOALS = {"wall_s": 300, "peak_rss_gb": 4.0, "engine_mb": 200}
MONOLITHIC = {
    "source": "DESIGN §10, the monolithic build of 2026-12-01 (2-core CPU, TensorRT-RTX 1.7.1)",
    "tiny_width_export_s": {"12": 19, "24": "40-47", "48": 310, "93": "> 900 (stopped)"},
    "tiny_width_rtx_build_s": {"12": 5, "24": "16-33", "48": "67-130"},
    "tiny_width_plan_mb": {"12": 25, "24": 47, "48": 87},
    "k3_tp8_ep8_one_rank_estimate": {"builder_ram_gb": 670, "plan_gb": 206,
                                     "why": "builder RAM ~3.25x the rank's 192 GiB of weights; plan = weights"},
}


def _child_rtx(argv: list[str]) -> None:
    """The CLI in this process, with the Python plugin creators registered first."""
    sys.path.insert(0, str(ROOT / "tests"))
    from trt_creators import register_python_creators

    from k3_trtllm.cli import main
    from k3_trtllm.trt.bindings import import_tensorrt

    register_python_creators(import_tensorrt("tensorrt-rtx"))
    main(argv, standalone_mode=True)


def _timed(cmd: list[str]) -> dict:
    with tempfile.NamedTemporaryFile("r", suffix=".time") as t:
        proc = subprocess.run(["/usr/bin/time", "-v", "-o", t.name, *cmd], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        report = t.read()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
    wall = re.search(r"Elapsed \(wall clock\) time.*: (?:(\d+):)?(\d+):([\d.]+)", report)
    h, m, s = (float(x) if x else 0.0 for x in wall.groups())
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", report).group(1))
    return {"wall_s": round(3600 * h + 60 * m + s, 1), "peak_rss_gb": round(rss_kb / 2**20, 3),
            "log_tail": proc.stderr.strip().splitlines()[-1]}


def _files(out: Path) -> dict:
    sizes = {str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()}
    return {"engine_mb": round(sum(sizes.values()) / 2**20, 3), "files": sizes}


def run(config: Path, tp: int, ep: int, builder: str, work: Path, plugin_lib: Path | None = None) -> dict:
    out = work / f"k3-tp{tp}-ep{ep}-{builder}"
    args = ["build", "--hf-config", str(config), "--tp", str(tp), "--ep", str(ep), str(out), "--builder", builder]
    if plugin_lib is not None:
        args += ["--plugin-lib", str(plugin_lib)]
    cmd = ([sys.executable, __file__, "--child-rtx", *args] if builder == "tensorrt-rtx" and plugin_lib is None
           else [sys.executable, "-c", "from k3_trtllm.cli import main; main()", *args])
    shown = " ".join(a if a != str(out) else "OUT" for a in args)
    result = {"command": f"k3-trt {shown}", **_timed(cmd), **_files(out)}
    result["log_tail"] = result["log_tail"].replace(str(out), "OUT")
    engine = json.loads((out / "config.json").read_text())
    result["segments"] = [s["kind"] for s in engine["segments"]]
    result["layers"], result["ranks"] = len(engine["layers"]), len(engine["ranks"])
    if builder == "tensorrt-rtx":
        result["plugins"] = (f"the C++ plugin library ({plugin_lib.name})" if plugin_lib is not None
                             else "Python build-phase creators (tests/trt_creators.py), not the C++ library")
    result["within_goals"] = {k: result[k] <= v for k, v in GOALS.items()}
    return result


def main() -> None:
    if sys.argv[1:2] == ["--child-rtx"]:
        return _child_rtx(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=ROOT.parent / "shared/k3/config.json")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--rtx", action="store_true", help="also build the plans with TensorRT-RTX")
    ap.add_argument("--plugin-lib", type=Path, default=None,
                    help="with --rtx: the C++ plugin library instead of the Python creators")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        report = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "goals": GOALS,
                  "segmented": {"none": run(a.config, a.tp, a.ep, "none", Path(work))}, "monolithic": MONOLITHIC}
        if a.rtx:
            report["segmented"]["tensorrt-rtx"] = run(a.config, a.tp, a.ep, "tensorrt-rtx", Path(work),
                                                      a.plugin_lib and a.plugin_lib.resolve())
    text = json.dumps(report, indent=2) + "\n"
    if a.out:
        a.out.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
