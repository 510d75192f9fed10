"""Start and stop the tritonserver bundled in the ``nvidia-pytriton`` wheel.

The wheel ships the server binary, the Python backend and one backend stub per Python
version, but not a runnable layout: the server wants a backend directory holding
``python/{libtriton_python.so, triton_python_backend_utils.py, triton_python_backend_stub}``,
the libraries of ``nvidia_pytriton.libs`` and of this interpreter on ``LD_LIBRARY_PATH``,
and this interpreter's ``bin`` first on ``PATH`` so that the stub runs in this environment
(where k3-trt and numpy < 2 are installed). On CPU machines the pinned and CUDA memory
pools must be off.
"""
from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import importlib.util
import os
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
INSTALL_HINT = "pip install 'nvidia-pytriton==0.7.0' 'numpy<2' 'tritonclient[grpc]'"
BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")


@dataclass(frozen=True)
class TritonInstall:
    server_dir: Path  # pytriton/tritonserver inside the wheel
    libs_dir: Path  # the wheel's bundled shared libraries

    @property
    def binary(self) -> Path:
        return self.server_dir / "bin" / "tritonserver"

    @property
    def stub(self) -> Path:
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        return self.server_dir / "python_backend_stubs" / version / "triton_python_backend_stub"


def find_triton_install() -> TritonInstall:
    """The tritonserver of the installed nvidia-pytriton wheel; RuntimeError when it is
    missing or unusable from this Python."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"tritonserver not found: the nvidia-pytriton wheel is not installed ({INSTALL_HINT})")
    root = Path(next(iter(spec.submodule_search_locations)))
    install = TritonInstall(root / "tritonserver", root.parent / "nvidia_pytriton.libs")
    if not install.binary.is_file():
        raise RuntimeError(f"{install.binary} is missing; reinstall nvidia-pytriton ({INSTALL_HINT})")
    if not install.stub.is_file():
        have = sorted(p.name for p in (install.server_dir / "python_backend_stubs").iterdir())
        raise RuntimeError(f"nvidia-pytriton has no Python backend stub for Python "
                           f"{sys.version_info.major}.{sys.version_info.minor} (it has {', '.join(have)})")
    numpy_version = importlib.metadata.version("numpy")
    if int(numpy_version.split(".")[0]) >= 2:
        raise RuntimeError(f"the Triton Python backend stub needs numpy < 2, this environment has {numpy_version} "
                           "(pip install 'numpy<2')")
    return install


def make_backend_dir(install: TritonInstall, dest: Path) -> Path:
    """``dest/python`` with links to the Python backend and this Python's stub."""
    python_dir = dest / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    links = {name: install.server_dir / "backends" / "python" / name for name in BACKEND_FILES}
    links["triton_python_backend_stub"] = install.stub
    for name, target in links.items():
        link = python_dir / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    return dest


def server_env(install: TritonInstall, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["PATH"] = os.pathsep.join(filter(None, [str(Path(sys.executable).parent), env.get("PATH")]))
    # This interpreter's libpython first: the system may carry another build of the same version.
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [sysconfig.get_config_var("LIBDIR"),
                                                           str(install.libs_dir), env.get("LD_LIBRARY_PATH")]))
    return env


def _stub_shm_regions(process_group: int) -> list[str]:
    """The shared-memory region names of the live Python backend stubs in ``process_group``
    (a stub's second argument)."""
    regions = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            pgid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2])
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if (pgid == process_group and len(argv) > 2 and argv[0].endswith(b"triton_python_backend_stub")
                and argv[2].startswith(b"triton_python_backend_shm_region_") and b"/" not in argv[2]):
            regions.append(argv[2].decode())
    return regions


def _stop_with_parent() -> None:
    """In the child before exec: SIGINT when the starting thread dies, so that a killed
    launcher does not leave the server running."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGINT)


class TritonServer:
    """A tritonserver subprocess in its own process group (with its backend stubs), so
    that stopping it leaves nothing behind."""

    def __init__(self, repo_dir: str | Path, work_dir: str | Path, *, host: str = "127.0.0.1",
                 http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002,
                 log_file: str | Path | None = None, exit_timeout_s: int = 10, verbose: int = 0) -> None:
        self.repo_dir = Path(repo_dir).resolve()
        self.work_dir = Path(work_dir)
        self.host = host
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.log_file = Path(log_file) if log_file else None
        self.exit_timeout_s = exit_timeout_s
        self.verbose = verbose
        self.process: subprocess.Popen | None = None
        self.forced = False  # whether the last stop had to kill the server

    # Clients reach a server listening on all interfaces through loopback.
    @property
    def client_host(self) -> str:
        return "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host

    @property
    def grpc_url(self) -> str:
        return f"{self.client_host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.client_host}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.client_host}:{self.metrics_port}/metrics"

    def command(self, install: TritonInstall, backend_dir: Path) -> list[str]:
        return [
            str(install.binary),
            f"--model-repository={self.repo_dir}",
            f"--backend-directory={backend_dir}",
            f"--http-address={self.host}", f"--http-port={self.http_port}",
            f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
            "--allow-gpu-metrics=false", "--allow-cpu-metrics=false",
            # No CUDA on CPU machines: the default pinned and CUDA pools fail to allocate.
            "--pinned-memory-pool-byte-size=0", "--cuda-memory-pool-byte-size=0:0",
            f"--exit-timeout-secs={self.exit_timeout_s}",
            "--exit-on-error=true", "--strict-readiness=true",
            f"--log-verbose={self.verbose}",
        ]

    def start(self) -> None:
        if self.process is not None:
            raise RuntimeError("the server is already started")
        install = find_triton_install()
        backend_dir = make_backend_dir(install, self.work_dir / "backends")
        out = open(self.log_file, "ab") if self.log_file else None  # noqa: SIM115 — the child keeps it
        try:
            self.process = subprocess.Popen(self.command(install, backend_dir), env=server_env(install),
                                            stdin=subprocess.DEVNULL, stdout=out,
                                            stderr=subprocess.STDOUT if out else None, start_new_session=True,
                                            preexec_fn=_stop_with_parent)
        finally:
            if out:
                out.close()

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the server and its models are ready; RuntimeError (server stopped)
        when it exits or does not get ready in time."""
        deadline = time.monotonic() + timeout_s
        while not self.is_ready():
            code = self.process.poll()
            if code is not None:
                raise RuntimeError(f"tritonserver exited with code {code} while starting{self._log_hint()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"tritonserver was not ready after {timeout_s:.0f} s{self._log_hint()}")
            time.sleep(0.2)

    def wait(self) -> int:
        return self.process.wait()

    def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGINT (tritonserver unloads its models and stops their stubs), then SIGKILL to
        whatever of the process group is left after ``timeout_s``, removing the shared
        memory of the stubs it kills. Returns the exit code.

        tritonserver cannot unload a model while a client keeps a gRPC stream open, even
        one whose requests are all answered, and then never exits by itself: the kill is
        what ends it (``forced`` tells)."""
        if self.process is None:
            return None
        timeout_s = self.exit_timeout_s + 10 if timeout_s is None else timeout_s
        self.forced = False
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.forced = True
        regions = _stub_shm_regions(self.process.pid)  # before the kill: read from the stubs' command lines
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # stragglers: a hung server or orphaned stubs
        except ProcessLookupError:
            pass
        code = self.process.wait()
        for region in regions:  # a killed server leaves its stubs' regions behind; a clean exit removes them
            with contextlib.suppress(FileNotFoundError):
                os.unlink(Path("/dev/shm") / region)
        return code

    def _log_hint(self) -> str:
        if self.log_file is None or not self.log_file.is_file():
            return ""
        tail = self.log_file.read_text(errors="replace").splitlines()[-20:]
        return f"; last lines of {self.log_file}:\n" + "\n".join(tail)

    def __enter__(self) -> TritonServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
