"""--nnodes 2 on one machine: two launcher processes ("nodes") on 127.0.0.1, gloo, joined through
--dist-init-addr. The same greedy ids as one rank; a node with the wrong secret is refused; a
node that dies takes node 0 down; node 0's SIGTERM stops the other node; a late node times out.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import psutil
import pytest

from tests.conftest import REPO, ServerProcess
from tests.random_models import save_random_llama

PROMPTS = [[5 + i, 17, 99, 3, 42 + i, 7, 250, 31, 64, 11][: 3 + i] for i in range(8)]
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
SECRET = "a-secret-every-node-of-the-test-shares"
RUN = ["--device", "cpu", "--dtype", "float32", "--random-seed", "0", "--max-total-tokens",
       "2048"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: Any) -> str:
    return save_random_llama(str(tmp_path_factory.mktemp("llama_nodes")), num_hidden_layers=2,
                             hidden_size=256, intermediate_size=512, num_attention_heads=8,
                             num_key_value_heads=4)


@pytest.fixture(scope="module")
def reference(llama: str) -> list[Any]:
    srv = ServerProcess(["--model-path", llama, "--tp-size", "1", *RUN]).start()
    try:
        return _greedy(srv)
    finally:
        srv.stop()


def _greedy(srv: ServerProcess) -> list[Any]:
    return [r["output_ids"] for r in
            srv.generate({"input_ids": PROMPTS, "sampling_params": GREEDY})]


def _dist_port() -> int:
    """A port P with P, P+1 and P+2 free on 127.0.0.1."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + 2 > 65535:
            continue
        try:
            for p in (base, base + 1, base + 2):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise AssertionError("no three consecutive free ports")


class Node:
    """A launcher process of another node (--node-rank K), in its own process group."""

    def __init__(self, args: list[str], secret: str | None) -> None:
        fd, self.log_path = tempfile.mkstemp(prefix="srt-node-", suffix=".log")
        env = {k: v for k, v in os.environ.items() if k != "SRT_NODE_SECRET"}
        env.update(PYTHONUNBUFFERED="1", PYTHONPATH=REPO)
        if secret is not None:
            env["SRT_NODE_SECRET"] = secret
        self.proc = subprocess.Popen([sys.executable, "-m", "srt.server", *args], stdout=fd,
                                     stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                     start_new_session=True)
        os.close(fd)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def _node_args(model: str, tp: int, rank: int, port: int, *extra: str) -> list[str]:
    return ["--model-path", model, "--tp-size", str(tp), "--nnodes", "2", "--node-rank",
            str(rank), "--dist-init-addr", f"127.0.0.1:{port}", *RUN, *extra]


def _start_two(model: str, tp: int, timeout: str = "60") -> tuple[ServerProcess, Node]:
    """Node 1 with the secret in SRT_NODE_SECRET, node 0 with it in --node-secret-file."""
    port = _dist_port()
    fd, secret_file = tempfile.mkstemp(prefix="srt-secret-")
    with os.fdopen(fd, "w") as f:
        f.write(SECRET + "\n")
    node1 = Node(_node_args(model, tp, 1, port, "--dist-timeout", timeout), SECRET)
    node0 = ServerProcess(_node_args(model, tp, 0, port, "--dist-timeout", timeout,
                                     "--node-secret-file", secret_file))
    try:
        node0.start(timeout=120)
    except BaseException:
        node1.kill()
        raise
    return node0, node1


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _assert_gone(procs: list[psutil.Process]) -> None:
    _, alive = psutil.wait_procs(procs, timeout=10)
    assert alive == [], alive


@pytest.mark.parametrize("tp", [2, 4])
def test_two_nodes_equal_one_rank(llama: str, reference: list[Any], tp: int) -> None:
    node0, node1 = _start_two(llama, tp)
    try:
        procs = _tree(node0.proc.pid) + _tree(node1.proc.pid)
        # node 1 runs ranks tp/2 .. tp-1 and nothing else of srt's
        names = sorted(p.name() for p in _tree(node1.proc.pid) if p.name().startswith("srt-"))
        assert names == [f"srt-model-tp{r}" for r in range(tp // 2, tp)]
        assert _greedy(node0) == reference
        node0.assert_kv_invariant()
        assert node0.server_info()["tp_size"] == tp
        if tp == 2:  # node 0's SIGTERM stops node 1 too
            node0.proc.send_signal(signal.SIGTERM)
            assert node0.proc.wait(30) == 0
            assert node1.proc.wait(20) == 0
            _assert_gone(procs)
            assert "node 0 stopped" in node1.log()
    finally:
        node0.stop()
        node1.kill()


def test_node_with_wrong_secret_is_refused(llama: str) -> None:
    port = _dist_port()
    node1 = Node(_node_args(llama, 2, 1, port, "--dist-timeout", "8"), "not-the-right-secret")
    node0 = ServerProcess(_node_args(llama, 2, 0, port, "--dist-timeout", "60"),
                          env={"SRT_NODE_SECRET": SECRET})
    try:
        with pytest.raises(RuntimeError, match="server exited"):
            node0.start(timeout=60)
        assert node0.proc.returncode != 0
        log = node0.log()
        assert "dropped a frame on the control link claiming to come from node 1" in log
        assert "node 1 (TP rank 1) was refused" in log
        assert "ready: serving" not in log
        # node 1 never got in: its ranks never started, and it gives up
        assert node1.proc.wait(30) != 0
        assert "did not admit this node" in node1.log()
        assert "model process" not in node1.log()
    finally:
        node0.stop()
        node1.kill()


def test_multi_node_configuration_errors(llama: str) -> None:
    def run(args: list[str], secret: str | None) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k != "SRT_NODE_SECRET"}
        env["PYTHONPATH"] = REPO
        if secret is not None:
            env["SRT_NODE_SECRET"] = secret
        return subprocess.run([sys.executable, "-m", "srt.server", *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)

    no_secret = run(_node_args(llama, 2, 1, 29500), None)
    assert no_secret.returncode == 2
    assert "--nnodes > 1 needs a secret shared by every node" in no_secret.stderr
    odd = run(_node_args(llama, 3, 0, 29500), SECRET)
    assert odd.returncode == 2
    assert "--tp-size 3 is not a multiple of --nnodes 2" in odd.stderr
    no_addr = run(["--model-path", llama, "--tp-size", "2", "--nnodes", "2"], SECRET)
    assert no_addr.returncode == 2 and "needs --dist-init-addr" in no_addr.stderr


def test_late_node_times_out(llama: str) -> None:
    node0 = ServerProcess(_node_args(llama, 2, 0, _dist_port(), "--dist-timeout", "3"),
                          env={"SRT_NODE_SECRET": SECRET})
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="server exited"):
        node0.start(timeout=60)
    assert time.monotonic() - start < 30
    assert "node 1 (TP rank 1) did not join within --dist-timeout 3 s" in node0.log()


def test_killing_node1_brings_node0_down(llama: str) -> None:
    node0, node1 = _start_two(llama, 2)
    try:
        procs = _tree(node0.proc.pid) + _tree(node1.proc.pid)
        start = time.monotonic()
        os.killpg(node1.proc.pid, signal.SIGKILL)
        code = node0.proc.wait(30)
        assert code != 0 and time.monotonic() - start < 30
        _assert_gone(procs)
        assert "node 1 (TP rank 1)" in node0.log()
    finally:
        node0.stop()
        node1.kill()


def test_dead_rank_on_node1_brings_both_down(llama: str) -> None:
    node0, node1 = _start_two(llama, 2)
    try:
        procs = _tree(node0.proc.pid) + _tree(node1.proc.pid)
        rank1 = next(p for p in _tree(node1.proc.pid) if p.name() == "srt-model-tp1")
        start = time.monotonic()
        rank1.send_signal(signal.SIGKILL)
        assert node0.proc.wait(30) != 0 and time.monotonic() - start < 30
        assert node1.proc.wait(20) != 0
        _assert_gone(procs)
        assert "node 1 (TP rank 1) failed: the model process (TP rank 1) died (killed by " \
               "SIGKILL)" in node0.log()
    finally:
        node0.stop()
        node1.kill()
