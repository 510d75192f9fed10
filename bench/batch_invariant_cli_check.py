"""On a GPU: ``k3-trt run --batch-invariant`` (the CLI path, ranks and all) gives each of 16
prompts the same greedy tokens batched as alone, and reports whether the same holds without
the flag. Prints one JSON line; exit 1 if the flag's guarantee fails.
    python3 bench/batch_invariant_cli_check.py [MODEL_DIR]"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from click.testing import CliRunner

from k3_trtllm.cli.run import run

MODEL = sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parents[1] / "examples" / "tiny-k3")
rng = random.Random(0)
PROMPTS = [",".join(str(rng.randrange(3, 1000)) for _ in range(rng.randrange(4, 60))) for _ in range(16)]
COMMON = ["--max-new-tokens", "24", "--temperature", "0", "--ignore-eos", "--device", "cuda", "--json", "--quiet"]


def tokens(prompts, flags):
    args = [MODEL, *flags, *COMMON, *[a for p in prompts for a in ("--prompt-ids", p)]]
    result = CliRunner().invoke(run, args, catch_exceptions=False)
    if result.exit_code != 0:
        raise SystemExit(result.output)
    return [r["output_ids"] for r in json.loads(result.stdout)["outputs"]]


report = {}
# default first: the mode is process-wide once an engine turns it on
for name, flags in (("default", []), ("batch_invariant", ["--batch-invariant"])):
    batched = tokens(PROMPTS, flags)
    alone = [tokens([p], flags)[0] for p in PROMPTS]
    report[name] = {"prompts": len(PROMPTS), "equal_to_alone": sum(b == a for b, a in zip(batched, alone))}
print(json.dumps(report))
sys.exit(0 if report["batch_invariant"]["equal_to_alone"] == len(PROMPTS) else 1)
