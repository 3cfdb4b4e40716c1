"""Start real `splitserve` processes for tests, on 127.0.0.1 and free ports, and stop them
(by PID, with their whole process group) afterwards."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], log_path: Path, ready_status: int = 200,
                 timeout: float = 240.0, command: str = "serve") -> None:
        self.port = free_port() if command == "serve" else None
        cmd = [sys.executable, "-m", "server.cli", "--log-level", "INFO", command]
        if command == "serve":
            cmd += ["--port", str(self.port)]
        cmd += args
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}" if self.port else None
        if command == "serve":
            self.wait_ready(ready_status, timeout)

    def wait_ready(self, status: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == status:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"server not ready in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def children_alive(self) -> list[int]:
        """PIDs still alive in this server's process group (none after a clean stop)."""
        alive = []
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    if os.getpgid(int(pid)) == self.proc.pid:
                        alive.append(int(pid))
                except (ProcessLookupError, PermissionError):
                    pass
        return alive


def make_tiny_model_with_tokenizer(folder: Path, tokenizer, max_pos: int = 2048) -> Path:
    """A random tiny Llama with SmolLM2's vocabulary and tokenizer: a server that starts in
    seconds, for mechanics (errors, metrics, cancellation) rather than text quality."""
    from tests.conftest import make_tiny_llama

    make_tiny_llama(folder, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128,
                    vocab=len(tokenizer), max_pos=max_pos)
    tokenizer.save_pretrained(str(folder))
    return folder


def metric_samples(url: str) -> dict[tuple, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(samples: dict, name: str, **labels) -> float:
    """Sum of the samples named `name` whose labels include `labels`."""
    return sum(v for (n, lb), v in samples.items()
               if n == name and all(dict(lb).get(k) == str(x) for k, x in labels.items()))
