"""A real tinkerd on loopback for the client's tests: the embedded default model in float64, so
equalities between two ways of sending the same data are exact, not within a rounding bound."""

import os
import re
import subprocess
import tempfile
import threading
import time
import urllib.request

import pytest

import tinkerd

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
class Server:
    def __init__(self, micro_batch_tokens: int, *flags: str):
        binary = os.environ.get("TINKERD_BINARY", os.path.join(REPO, "build/server/tinkerd"))
        self.checkpoints = tempfile.TemporaryDirectory(prefix="tinkerd-pytest-")
        self.process = subprocess.Popen(
            [binary, "--listen=127.0.0.1:0", "--metrics_port=0", "--compute_dtype=float64",
             f"--micro_batch_tokens={micro_batch_tokens}",
             f"--checkpoint_root={self.checkpoints.name}", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.ports = {}
        self.log = []
        ready = threading.Event()

        def drain():  # reads the ports, then keeps the pipe from filling up
            for line in self.process.stdout:
                self.log.append(line)
                m = re.match(r"tinkerd (\w+ )?listening on port (\d+)", line)
                if m:
                    self.ports[(m.group(1) or "grpc ").strip()] = int(m.group(2))
                if "metrics" in self.ports:
                    ready.set()
            ready.set()

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(120) or "metrics" not in self.ports:
            self.stop()
            raise RuntimeError("tinkerd did not start:\n" + "".join(self.log))
        self.target = f"127.0.0.1:{self.ports['grpc']}"

    def metric(self, name: str) -> float:
        url = f"http://127.0.0.1:{self.ports['metrics']}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        assert m, f"{name} not in /metrics"
        return float(m.group(1))

    def stop(self):
        self.process.terminate()
        self.process.wait(60)
        self.checkpoints.cleanup()


def wait_for(condition, what: str, timeout: float = 60.0):
    """Polls `condition` until it holds; fails naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture(scope="session")
def server():
    """Small micro-batches, so a stream's datums run as they arrive (lazy intake)."""
    s = Server(micro_batch_tokens=64)
    yield s
    s.stop()


@pytest.fixture(scope="session")
def float32_server():
    """float32, where the sampler's logprobs are the trainer's to the bit (docs/sampling.md)."""
    s = Server(64, "--compute_dtype=float32")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def wide_server():
    """One micro-batch holds every call of these tests: a call's plan never depends on how its
    datums arrived, so two ways of sending the same data sum in the same order."""
    s = Server(micro_batch_tokens=1 << 16)
    yield s
    s.stop()


@pytest.fixture
def conn(server):
    with tinkerd.Connection(server.target, max_attempts=3) as c:
        yield c
