"""Two "nodes" on loopback: two `torchrun --nnodes 2 --nproc-per-node 1` invocations that
rendezvous on 127.0.0.1 (torchrun's c10d rendezvous, as on a real cluster) run `k3-trt run`
on a world-2 checkpoint; the node that got global rank 0 prints, the other prints nothing,
and the tokens are those of `k3-trt run` at world 1 (greedy, fp32: the reordered sums of
the all-reduces are ~1e-6 of the logits, far below the gaps between the tiny model's top
logits for these prompts)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from click.testing import CliRunner
from helpers import free_port, live_processes

from k3_trtllm.cli.run import run as run_command
from k3_trtllm.convert import convert_checkpoint

BIN = Path(sys.executable).parent
ARGS = ["--prompt-ids", "5,6,7", "--prompt-ids", "9,10,11,12,13", "--prompt-ids", "700", "--max-new-tokens", "8",
        "--ignore-eos", "--json", "--no-stream", "--quiet", "--device", "cpu", "--dtype", "float32",
        "--num-blocks", "8", "--max-slots", "4", "--max-seq-len", "64"]
TIMEOUT_S = 120


def test_two_torchrun_nodes_on_loopback_give_the_world1_tokens(ckpt_dir, tmp_path):
    convert_checkpoint(ckpt_dir("tiny"), tmp_path / "tp2", 2, 1, progress=False)
    world1 = CliRunner().invoke(run_command, [str(ckpt_dir("tiny")), *ARGS], catch_exceptions=False)
    assert world1.exit_code == 0, world1.output
    reference = [o["output_ids"] for o in json.loads(world1.stdout)["outputs"]]

    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [subprocess.Popen([str(BIN / "torchrun"), "--nnodes", "2", "--nproc-per-node", "1",
                               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "k3-test",
                               "--no-python", str(BIN / "k3-trt"), "run", str(tmp_path / "tp2"), *ARGS],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for _ in range(2)]
    try:
        outs = [node.communicate(timeout=TIMEOUT_S) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
    for node, (_, err) in zip(nodes, outs):
        assert node.returncode == 0, err
    printed = [out for out, _ in outs if out.strip()]
    assert len(printed) == 1  # only global rank 0 (on whichever node the rendezvous made it) prints
    assert [o["output_ids"] for o in json.loads(printed[0])["outputs"]] == reference
    deadline = time.monotonic() + 5
    while any(live_processes(process_group=node.pid) for node in nodes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(live_processes(process_group=node.pid) for node in nodes)
