"""Shared fixtures: the default model (prepared once), a real server in a subprocess, tokenizer.

`ServerProcess` starts `python -m srt.server` on a free port exactly as a user would, waits for
/health, and keeps the server's log in a file the tests can read.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import requests

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _no_cuda() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:
        return True


# Without a GPU, Triton kernels run in Triton's interpreter. The mode is fixed when Triton is
# first imported, which other libraries (transformers' Llama) may do as a side effect, so it is
# set here, before any test module is imported.
if _no_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    from srt.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def free_port() -> int:
    from srt.utils import free_port as _free_port

    return _free_port()


class PortTaken(RuntimeError):
    """The server's port was taken before the server could bind it."""


@dataclass
class ServerProcess:
    args: list[str]
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    log_path: str = ""
    env: dict[str, str] = field(default_factory=dict)  # added to the server's environment

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 300.0) -> "ServerProcess":
        """Start and wait for /health. The port is picked before the server binds it, so another
        process can take it in between: the server then exits at once saying so (it claims its
        port first, srt/http/listen.py), and the start is retried on a new port."""
        for attempt in range(3):
            try:
                return self._start_once(timeout)
            except PortTaken:
                if attempt == 2:
                    raise
                self.port = free_port()
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float) -> "ServerProcess":
        fd, self.log_path = tempfile.mkstemp(prefix="srt-server-", suffix=".log")
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "srt.server", "--port", str(self.port), *self.args],
            stdout=fd, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True,
        )
        os.close(fd)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.log()
                if self.proc.returncode == 2 and "cannot serve on" in log and "in use" in log:
                    raise PortTaken(log)
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{log}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)

    # -- helpers the tests share
    def generate(self, body: dict[str, Any], timeout: float = 600.0) -> Any:
        r = requests.post(self.url + "/generate", json=body, timeout=timeout)
        assert r.status_code == 200, r.text
        return r.json()

    def server_info(self) -> dict[str, Any]:
        r = requests.get(self.url + "/get_server_info", timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    def wait_idle(self, timeout: float = 10.0) -> dict[str, Any]:
        """Server info once nothing runs or waits (raises AssertionError after timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.server_info()
            if info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0:
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"server still busy after {timeout} s: {info}")
            time.sleep(0.1)

    def assert_kv_invariant(self) -> None:
        info = self.wait_idle()
        assert info["locked_kv_tokens"] == 0, info
        assert (
            info["available_kv_tokens"] + info["evictable_kv_tokens"]
            == info["max_total_num_tokens"]
        ), info


# float32 SmolLM2 on the CPU: the configuration every end-to-end test compares against.
BASE_ARGS = ["--dtype", "float32", "--device", "cpu", "--random-seed", "1234",
             "--log-stats-interval", "2"]


@pytest.fixture(scope="session")
def server(smollm2_dir: str) -> Any:
    # The compile timeout is raised: on a loaded 2-core machine a pattern that compiles in 3 s
    # when idle (test_constrained's slow pattern) took over the default 10 s, and the compile
    # bounds have a test with a server of their own.
    srv = ServerProcess([*BASE_ARGS, "--max-total-tokens", "32768",
                         "--constrained-compile-timeout", "120"]).start()
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def _kv_invariant_after_e2e(request: Any) -> Any:
    """After every test that used a server: nothing running or waiting, and
    available + evictable == max_total_num_tokens with no lock held."""
    yield
    for name in request.fixturenames:
        srv = request.node.funcargs.get(name)
        if isinstance(srv, ServerProcess) and srv.proc is not None and srv.proc.poll() is None:
            srv.assert_kv_invariant()


@pytest.fixture(scope="session")
def sglang_clients() -> str:
    """The folder holding SGLang's own clients (the frontend language and the smg gateway),
    installed by scripts/sglang_clients.sh; put it on PYTHONPATH of the processes that run
    them (never of this one: importing sglang patches transformers)."""
    out = subprocess.run(["bash", os.path.join(REPO, "scripts", "sglang_clients.sh")],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]
