"""Start ``mtpserve serve`` as a subprocess for a load test, with its own tenant and key.

The key is random, lives only in this process, and the tenants file holds its SHA-256. Ports are
free ones picked by the OS; the server's output goes to a log file. Leaving the context sends
SIGTERM (the server drains and exits) and kills it only if it does not stop in time.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

import httpx

from bench.meta import REPO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    def __init__(self, model: str, spec_method: str, device: str = "cpu",
                 extra_args: list[str] | None = None, log_path: Path | None = None,
                 ready_timeout_s: float = 300.0, threads: int | None = None) -> None:
        self.model = model
        self.spec_method = spec_method
        self.device = device
        self.extra_args = extra_args or []
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        self.threads = threads  # torch CPU threads of the server (OMP_NUM_THREADS)
        self.key = "bench-" + secrets.token_urlsafe(24)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp = tempfile.TemporaryDirectory(prefix="mtpserve-bench-")

    def __enter__(self) -> ServerProcess:
        tenants = Path(self._tmp.name) / "tenants.toml"
        digest = hashlib.sha256(self.key.encode()).hexdigest()
        tenants.write_text(f'[tenants.bench]\napi_key_sha256 = "{digest}"\n')
        cmd = [sys.executable, "-m", "engine", "serve", "--model", self.model,
               "--host", "127.0.0.1", "--port", str(self.port), "--metrics-port", str(free_port()),
               "--tenants", str(tenants), "--spec-method", self.spec_method,
               "--device", self.device, *self.extra_args]
        log = open(self.log_path or os.devnull, "ab")  # noqa: SIM115 (closed by the child's exit)
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        if self.threads:
            env["OMP_NUM_THREADS"] = str(self.threads)
        self._proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"server exited with status {self._proc.returncode} before ready"
                                   f" (log: {self.log_path})")
            try:
                if httpx.get(self.url + "/ready", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self._stop()
        raise RuntimeError(f"server not ready after {self.ready_timeout_s:.0f} s (log: {self.log_path})")

    def _stop(self) -> None:
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop()
        self._tmp.cleanup()
