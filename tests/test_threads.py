"""CPU threads: ``--threads N`` on run / bench / serve, and a default that caps torch's
intra-op pool at the physical cores this process may use (affinity, SMT siblings, cgroup
quota) less those other processes keep busy (load average), never raising a smaller count;
serve runs one Triton instance, its stub sized the same."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from k3_trtllm.cli import main
from k3_trtllm.serve.repository import config_pbtxt
from k3_trtllm.utils import threads

POOL = ["--dtype", "float32", "--device", "cpu", "--num-blocks", "64", "--max-slots", "4", "--block-size", "8"]


@pytest.fixture
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def fake_sysfs(root, cores_of_cpu):
    """/sys/devices/system/cpu with cpuN/topology for each (package, core) given."""
    for cpu, (package, core) in enumerate(cores_of_cpu):
        topology = root / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(f"{package}\n")
        (topology / "core_id").write_text(f"{core}\n")
    return root


def test_physical_cores_count_smt_siblings_once(tmp_path):
    # 2 packages x 2 cores x 2 hardware threads; core ids repeat across packages.
    sysfs = fake_sysfs(tmp_path, [(0, 0), (0, 1), (1, 0), (1, 1), (0, 0), (0, 1), (1, 0), (1, 1)])
    assert threads.physical_cores(range(8), sysfs) == 4
    assert threads.physical_cores([0, 4], sysfs) == 1  # two siblings of one core
    assert threads.physical_cores([0, 1, 2], sysfs) == 3
    assert threads.physical_cores([0, 9], sysfs) == 2  # cpu9 has no topology: a core of its own


@pytest.mark.parametrize("text, cpus", [("max 100000\n", None), ("150000 100000\n", 1.5), ("50000 100000", 0.5),
                                        ("garbage", None), ("-1 100000", None)])
def test_cgroup_v2_quota(text, cpus):
    assert threads.parse_cpu_max(text) == cpus


def test_cgroup_quota_caps_the_cores(tmp_path):
    sysfs = fake_sysfs(tmp_path / "cpu", [(0, i) for i in range(os.cpu_count() or 1)])
    affinity = threads.physical_cores(os.sched_getaffinity(0), sysfs)
    v2 = tmp_path / "cg2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("max 100000\n")
    assert threads.usable_cores(sysfs, v2) == affinity
    (v2 / "cpu.max").write_text("100000 100000\n")
    assert threads.usable_cores(sysfs, v2) == 1
    (v2 / "cpu.max").write_text("10000 100000\n")  # a tenth of a CPU still runs one thread
    assert threads.usable_cores(sysfs, v2) == 1
    v1 = tmp_path / "cg1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert threads.cgroup_cpu_limit(v1) == 1.0 and threads.usable_cores(sysfs, v1) == 1


@pytest.mark.parametrize("cores, load, cpus, free", [
    (2, 0.2, 2, 2),    # idle: every core
    (2, 0.6, 2, 1),    # one core's worth busy
    (2, 7.4, 2, 1),    # overloaded (this machine, measured): still one thread
    (4, 0.0, 8, 4),
    (2, 30.0, 64, 1),  # 2 of a busy 64-CPU host's cores: ~0.94 of ours busy
    (16, 16.0, 32, 8),  # SMT host half busy: half the physical cores
    (3, -1.0, 3, 3),
])
def test_free_cores_subtract_what_other_processes_keep_busy(cores, load, cpus, free):
    assert threads.free_cores(cores, load, cpus) == free


def test_default_threads_read_this_machine(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda *a: 4)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr(os, "getloadavg", lambda: (4.0, 0.0, 0.0))
    assert threads.default_threads() == 2
    monkeypatch.setattr(os, "getloadavg", lambda: (_ for _ in ()).throw(OSError("no loadavg")))
    assert threads.default_threads() == 4


def test_default_caps_but_never_raises(keep_threads, monkeypatch):
    monkeypatch.setattr(threads, "default_threads", lambda: 3)
    torch.set_num_threads(1)
    assert threads.set_torch_threads(None) == 1  # the smaller count set before stays
    torch.set_num_threads(8)
    assert threads.set_torch_threads(None) == 3  # capped
    assert threads.set_torch_threads(5) == 5  # asked for explicitly
    with pytest.raises(ValueError):
        threads.set_torch_threads(0)


def test_run_and_bench_threads_option(keep_threads, ckpt_dir):
    ckpt = str(ckpt_dir("tiny"))
    res = CliRunner().invoke(main, ["run", ckpt, "--prompt", "hi", "--max-new-tokens", "2", "--threads", "2",
                                    "--quiet", *POOL], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert torch.get_num_threads() == 2
    res = CliRunner().invoke(main, ["bench", ckpt, "--num-requests", "2", "--prompt-len", "3", "--output-len", "2",
                                    "--threads", "1", "--quiet", *POOL], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["config"]["threads"] == torch.get_num_threads() == 1
    bad = CliRunner().invoke(main, ["bench", ckpt, "--threads", "0", *POOL])
    assert bad.exit_code == 2 and "--threads" in bad.output


def test_serve_stub_threads_come_from_the_environment(monkeypatch):
    monkeypatch.setattr(threads, "default_threads", lambda: 3)
    assert threads.child_thread_env(4, {"OMP_NUM_THREADS": "9"}) == {"OMP_NUM_THREADS": "4"}
    assert threads.child_thread_env(None, {"OMP_NUM_THREADS": "9"}) == {}  # the user's setting stays
    assert threads.child_thread_env(None, {}) == {"OMP_NUM_THREADS": "3"}
    # ... and a fresh torch (the Triton stub's) takes its pool size from it (torch itself
    # clamps a larger OMP_NUM_THREADS at the machine's cores, so 1 is the portable check).
    env = {**os.environ, **threads.child_thread_env(1, {})}
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "1", out.stderr
    # One model instance: the engine batches all requests itself, so Triton must not run a
    # second engine (and thread pool) in the same stub.
    assert "instance_group [{ count: 1 kind: KIND_CPU }]" in config_pbtxt("k3", 4, {"model_dir": "/m"})


def test_serve_accepts_threads(ckpt_dir, monkeypatch):
    """`serve --threads` is an option (checked before the server starts: the bad device
    stops it here)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = CliRunner().invoke(main, ["serve", str(ckpt_dir("tiny")), "--threads", "2", "--device", "cuda"])
    assert res.exit_code == 1 and "--device cuda:" in res.output
    assert CliRunner().invoke(main, ["serve", str(ckpt_dir("tiny")), "--threads", "0"]).exit_code == 2
