"""k3-trt never destroys what it did not write (utils.atomic, issue 15 items 1, 2 and 8).

Every writer (synth, convert, build, triton-repo) marks its output; --force replaces only
a marked output of the same kind holding nothing else; no output may be, contain or lie
inside an input; temp dirs of killed runs are cleaned up by the next run; OS errors are
one line naming the path, with nothing left behind. Each refusal is checked through the
CLI, with every input file compared byte for byte before and after.

The suite runs as root, for whom chmod does not make a directory read-only: read-only
locations are /sys (the kernel refuses even root) or a monkeypatched os.mkdir raising
PermissionError, and a full disk is a monkeypatched os.write / os.pwrite /
os.copy_file_range raising ENOSPC."""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from click.testing import CliRunner

from k3_trtllm.cli import main
from k3_trtllm.utils.atomic import MARKER


def _cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


def _snapshot(root: Path) -> dict[str, bytes | str]:
    """Every entry under ``root`` (hidden ones included): file bytes, link targets, dirs."""
    found = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        found[rel] = (f"-> {os.readlink(path)}" if path.is_symlink() else "<dir>" if path.is_dir()
                      else path.read_bytes())
    return found


def _one_error_line(output: str, message: str) -> None:
    """The command failed with exactly one line saying ``message``, and no traceback."""
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if "rror" in line]
    assert len(errors) == 1 and message in errors[0], output


@pytest.fixture
def hf(ckpt_dir, tmp_path):
    """A private copy of the tiny checkpoint inside ``par/`` with a sibling file of the user's."""
    par = tmp_path / "par"
    par.mkdir()
    shutil.copytree(ckpt_dir("tiny"), par / "model")
    (par / "notes.txt").write_text("the user's notes")
    return par / "model"


# ---- item 1: never in or around an input ------------------------------------------------

def test_convert_into_the_inputs_parent_with_force_is_refused(hf):
    """The issue's report: `convert par/model par --force` deleted the checkpoint and notes.txt."""
    par = hf.parent
    before = _snapshot(par)
    code, output = _cli("convert", hf, par, "--force", "--quiet")
    assert code == 1
    _one_error_line(output, f"output {par} contains the input {hf}: choose an output outside the input")
    assert _snapshot(par) == before


@pytest.mark.parametrize("where, relation", [("model", "is"), ("model/out", "lies inside"), (".", "contains")])
def test_output_overlapping_the_input_is_refused_by_every_writer(hf, tmp_path, where, relation):
    par = hf.parent
    out = par / where if where != "." else par
    before = _snapshot(tmp_path)
    for args in (["convert", hf, out, "--force", "--quiet"],
                 ["build", hf, out, "--force", "--builder", "none"],
                 ["triton-repo", hf, out.parent if where != "." else par.parent, "--name", out.name, "--force"]):
        code, output = _cli(*args)
        assert code == 1, (args, output)
        assert f"output {out} {relation} the input {hf}" in output, (args, output)
        assert "Traceback" not in output
    assert _snapshot(tmp_path) == before


def test_overlap_is_found_through_symlinks(hf, tmp_path):
    """A link to the checkpoint is the checkpoint; and a shard linked into a blob store (the
    HF cache layout) makes the store an input too."""
    link = tmp_path / "link"
    link.symlink_to(hf)
    before = _snapshot(tmp_path)
    code, output = _cli("convert", link, hf, "--force", "--quiet")
    assert code == 1
    _one_error_line(output, f"output {hf} is the input {link} ({link} resolves to {hf})")

    cache = tmp_path / "cache"
    (cache / "blobs").mkdir(parents=True)
    snapshot = cache / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    for f in (f for f in hf.iterdir() if f.name != MARKER):  # as the HF hub stores a model
        shutil.copy(f, cache / "blobs" / f.name)
        (snapshot / f.name).symlink_to(Path("../../blobs") / f.name)
    before = _snapshot(tmp_path)
    code, output = _cli("convert", snapshot, cache / "blobs", "--force", "--quiet")
    assert code == 1
    first = snapshot / "config.json"  # the links are checked in name order
    _one_error_line(output, f"output {cache / 'blobs'} contains the input {first} ({first} resolves to "
                            f"{cache / 'blobs' / 'config.json'})")
    assert _snapshot(tmp_path) == before


def test_build_refuses_an_output_holding_its_plugin_library(ckpt_dir, tmp_path):
    out = tmp_path / "engine"
    out.mkdir()
    (out / "libk3_trt_plugins.so").write_bytes(b"\x7fELF")
    before = _snapshot(tmp_path)
    code, output = _cli("build", ckpt_dir("tiny"), out, "--force", "--plugin-lib", out / "libk3_trt_plugins.so",
                        "--builder", "none")
    assert code == 1
    _one_error_line(output, f"output {out} contains the input {out / 'libk3_trt_plugins.so'}")
    assert _snapshot(tmp_path) == before


# ---- item 1: --force replaces only what k3-trt wrote -------------------------------------

def _write(kind, ckpt, out, *extra):
    """One writer's CLI call producing ``out``."""
    if kind == "synth":
        return _cli("synth", out, *extra)
    if kind == "convert":
        return _cli("convert", ckpt, out, "--quiet", *extra)
    return _cli("triton-repo", ckpt, out.parent, "--name", out.name, *extra)


WRITERS = {"synth": "hf-checkpoint", "convert": "trtllm-checkpoint", "triton-repo": "triton-model"}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_force_replaces_only_a_marked_output_of_the_same_kind(writer, ckpt_dir, tmp_path):
    ckpt, out = ckpt_dir("tiny"), tmp_path / "out"
    # the user's own directory, and a user's file where the output would go: never replaced
    out.mkdir()
    (out / "mine.txt").write_text("mine")
    for target in (out, tmp_path / "file"):
        (tmp_path / "file").write_text("a file")
        before = _snapshot(tmp_path)
        code, output = _write(writer, ckpt, target, "--force")
        if target == out:
            assert code == 1
            _one_error_line(output, f"{target}: not replaced: it has no {MARKER}, so k3-trt did not write it")
        else:  # convert and synth take OUT_DIR as click.Path(file_okay=False): a usage error (2)
            assert code in (1, 2) and "is a file" in output, output
        assert _snapshot(tmp_path) == before
    shutil.rmtree(out)

    # k3-trt's own output: marked with kind, version and the files it holds; replaced
    code, output = _write(writer, ckpt, out)
    assert code == 0, output
    marker = json.loads((out / MARKER).read_text())
    assert marker["written_by"] == "k3-trt" and marker["kind"] == WRITERS[writer] and marker["state"] == "complete"
    assert marker["version"] == metadata.version("k3-trt")
    assert marker["files"] == sorted(p.relative_to(out).as_posix() for p in out.rglob("*")
                                     if p.is_file() and p.name != MARKER)
    code, output = _write(writer, ckpt, out)
    assert code == 1 and "already exists (pass --force to replace it)" in output
    code, output = _write(writer, ckpt, out, "--force")
    assert code == 0, output

    # ... but not once the user has put a file of their own into it
    (out / "notes.txt").write_text("mine")
    before = _snapshot(tmp_path)
    code, output = _write(writer, ckpt, out, "--force")
    assert code == 1
    _one_error_line(output, f"{out}: not replaced: it holds files k3-trt did not write (notes.txt); "
                            "move them out first")
    assert _snapshot(tmp_path) == before


def test_force_does_not_replace_another_kind_of_k3_output(ckpt_dir, tmp_path):
    synth = tmp_path / "synth"
    assert _cli("synth", synth)[0] == 0
    before = _snapshot(tmp_path)
    for args in (["convert", ckpt_dir("tiny"), synth, "--force", "--quiet"],
                 ["build", ckpt_dir("tiny"), synth, "--force", "--builder", "none"]):
        code, output = _cli(*args)
        assert code == 1
        assert f"{synth}: not replaced: it holds a k3-trt HF checkpoint (k3-trt synth), not a" in output, output
    assert _snapshot(tmp_path) == before


def test_force_does_not_follow_a_symlinked_output(ckpt_dir, tmp_path):
    real = tmp_path / "real"
    assert _cli("synth", real)[0] == 0
    (tmp_path / "link").symlink_to(real)
    before = _snapshot(tmp_path)
    code, output = _cli("synth", tmp_path / "link", "--force")
    assert code == 1
    _one_error_line(output, f"{tmp_path / 'link'}: not replaced: it is a symbolic link")
    assert _snapshot(tmp_path) == before


def test_triton_repo_output_is_the_model_folder(ckpt_dir, tmp_path):
    """REPO_DIR may hold other models (left alone); a missing REPO_DIR is created when its
    parent exists (and removed again when the model cannot be written: see the disk-full test)."""
    repo = tmp_path / "repo"
    (repo / "other" / "1").mkdir(parents=True)
    (repo / "other" / "config.pbtxt").write_text('name: "other"')
    before = _snapshot(repo / "other")
    assert _cli("triton-repo", ckpt_dir("tiny"), repo)[0] == 0
    assert sorted(p.name for p in repo.iterdir()) == ["k3", "other"] and _snapshot(repo / "other") == before
    assert _cli("triton-repo", ckpt_dir("tiny"), tmp_path / "new")[0] == 0
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["k3"]


# ---- item 2: leftovers of killed runs ------------------------------------------------------

_KILLED_WRITER = """
import sys, time
from k3_trtllm.utils.atomic import atomic_output_dir
with atomic_output_dir(sys.argv[1], "trtllm-checkpoint") as tmp:
    (tmp / "rank0.safetensors").write_bytes(b"half")
    print(tmp, flush=True)
    time.sleep(600)
"""


def _killed_run(out: Path) -> tuple[Path, int]:
    """The temp dir of a k3-trt writer killed with SIGKILL half way, and its pid."""
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        tmp = Path(proc.stdout.readline().strip())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    assert tmp.is_dir() and tmp.name.startswith(f".{out.name}.tmp.{proc.pid}.")
    return tmp, proc.pid


def test_next_run_removes_what_a_killed_run_left(ckpt_dir, tmp_path):
    out = tmp_path / "out"
    tmp, pid = _killed_run(out)
    # a swap cut short leaves the previous output as .NAME.old.PID.TOKEN, marker and all
    old = tmp_path / f".out.old.{pid}.0123abcd"
    shutil.copytree(ckpt_dir("tiny"), old)
    shutil.copy(tmp / MARKER, old / MARKER)
    # not ours to remove: no marker / a live process (this one) writing the same output
    foreign = tmp_path / ".out.tmp.mine"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    live = tmp_path / f".out.tmp.{os.getpid()}.0123abcd"
    shutil.copytree(tmp, live)
    unrelated = tmp_path / ".other.tmp.1.0123abcd"
    shutil.copytree(tmp, unrelated)
    keep = {p: _snapshot(p) for p in (foreign, live, unrelated)}

    result = CliRunner().invoke(main, ["convert", str(ckpt_dir("tiny")), str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    assert not tmp.exists() and not old.exists()
    assert f"k3-trt: removed {old}, left by an interrupted k3-trt run (pid {pid})" in result.output
    assert f"k3-trt: removed {tmp}, left by an interrupted k3-trt run (pid {pid})" in result.output
    assert f"k3-trt: left {foreign} in place (it carries no k3-trt marker)" in result.output
    assert f"k3-trt: left {live} in place (process {os.getpid()} is still running)" in result.output
    assert str(unrelated) not in result.output
    assert {p: _snapshot(p) for p in keep} == keep
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, foreign.name, live.name, unrelated.name])


# ---- item 8: OS errors ------------------------------------------------------------------------

def _full_disk(monkeypatch, budget: int) -> None:
    """Writes succeed for ``budget`` more bytes, then fail with ENOSPC as on a full disk
    (the errors os.write, os.pwrite and os.copy_file_range raise carry no file name)."""
    left = [budget]

    def spend(n):
        if n > left[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        left[0] -= n

    write, pwrite, copy = os.write, os.pwrite, os.copy_file_range
    monkeypatch.setattr(os, "write", lambda fd, data: (spend(len(data)), write(fd, data))[1])
    monkeypatch.setattr(os, "pwrite", lambda fd, data, off: (spend(len(data)), pwrite(fd, data, off))[1])
    monkeypatch.setattr(os, "copy_file_range", lambda src, dst, n, *a: (spend(n), copy(src, dst, n, *a))[1])


DISK_FULL = os.strerror(errno.ENOSPC)


@pytest.mark.parametrize("force", [False, True])
def test_disk_full_during_convert(hf, tmp_path, monkeypatch, force):
    out = tmp_path / "out"
    if force:
        assert _cli("convert", hf, out, "--quiet")[0] == 0
    before = _snapshot(tmp_path)
    _full_disk(monkeypatch, 1 << 20)  # the tiny rank file is 5.6 MB
    code, output = _cli("convert", hf, out, "--quiet", *(["--force"] if force else []))
    assert code == 1
    left = f"{out} is unchanged" if force else "nothing was written"
    _one_error_line(output, f"Error: {out}: cannot write rank0.safetensors: {DISK_FULL}; {left}")
    assert _snapshot(tmp_path) == before


def test_disk_full_during_synth_and_triton_repo(ckpt_dir, tmp_path, monkeypatch):
    before = _snapshot(tmp_path)
    _full_disk(monkeypatch, 1 << 20)  # the first tiny shard is 2 MB
    code, output = _cli("synth", tmp_path / "s")
    assert code == 1
    _one_error_line(output, f"Error: {tmp_path / 's'}: cannot write model-00001-of-00003.safetensors: {DISK_FULL}; "
                            "nothing was written")
    _full_disk(monkeypatch, 0)
    code, output = _cli("triton-repo", ckpt_dir("tiny"), tmp_path / "repo")
    assert code == 1
    _one_error_line(output, f"Error: {tmp_path / 'repo' / 'k3'}: cannot write .k3-trt-output.json: {DISK_FULL}; "
                            "nothing was written")
    assert _snapshot(tmp_path) == before


WRITER_ARGS = {
    "synth": lambda ckpt, out: ["synth", out],
    "convert": lambda ckpt, out: ["convert", ckpt, out, "--quiet"],
    "triton-repo": lambda ckpt, out: ["triton-repo", ckpt, out.parent, "--name", out.name],
    "build": lambda ckpt, out: ["build", ckpt, out, "--builder", "none"],
}


@pytest.mark.parametrize("writer", sorted(WRITER_ARGS))
def test_missing_or_file_parent(writer, ckpt_dir, tmp_path):
    (tmp_path / "file").write_text("a file")
    before = _snapshot(tmp_path)
    for parent, what in ((tmp_path / "missing", "does not exist"), (tmp_path / "file", "is not a directory")):
        # triton-repo creates a missing REPO_DIR (REPO_DIR/NAME is its output); REPO_DIR's parent must exist
        out = parent / "repo" / "k3" if writer == "triton-repo" else parent / "out"
        checked = out.parent if writer == "triton-repo" else out
        code, output = _cli(*WRITER_ARGS[writer](ckpt_dir("tiny"), out))
        assert code == 1
        _one_error_line(output, f"{checked}: cannot write it: its parent directory {parent} {what}")
        assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("writer", sorted(WRITER_ARGS))
def test_permission_denied(writer, ckpt_dir, tmp_path, monkeypatch):
    """Root ignores directory permissions, so os.mkdir raises PermissionError as it does for
    a user writing into someone else's directory."""
    def denied(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    out = tmp_path / "out"
    if writer == "triton-repo":
        (tmp_path / "repo").mkdir()
        out = tmp_path / "repo" / "k3"
    before = _snapshot(tmp_path)
    monkeypatch.setattr(os, "mkdir", denied)
    code, output = _cli(*WRITER_ARGS[writer](ckpt_dir("tiny"), out))
    assert code == 1
    _one_error_line(output, f"{out}: cannot create it in {out.parent}: {os.strerror(errno.EACCES)}")
    assert _snapshot(tmp_path) == before


def _sys_is_read_only() -> bool:
    try:
        os.mkdir("/sys/k3-trt-probe")
    except OSError:
        return True
    os.rmdir("/sys/k3-trt-probe")
    return False


@pytest.mark.skipif(not _sys_is_read_only(), reason="/sys is writable here")
def test_read_only_location(ckpt_dir):
    """/sys refuses a new directory even to root: a real read-only location."""
    for args in (["synth", "/sys/k3-out"], ["convert", ckpt_dir("tiny"), "/sys/k3-out", "--quiet"]):
        code, output = _cli(*args)
        assert code == 1
        _one_error_line(output, "/sys/k3-out: cannot create it in /sys: ")
        assert not os.path.lexists("/sys/k3-out")
