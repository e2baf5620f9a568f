"""Versions handed to inference engines, as real processes on loopback (issue 20).

A node configured with `--engine sglang --engine-url` keeps the current version
as a model directory and posts each version to an HTTP server speaking SGLang's
request and response shape, which really loads the directory (index, shards,
side files) and hashes what it loaded (tests/engines/fake_engine.py); one with
`--engine vllm` asks the same server, started on its `D/current`, to reload
through that link. A node with `--on-version` runs its command once per
version. A node whose engine is down keeps applying versions and hands the
newest over once the engine is back.
"""

from __future__ import annotations

import json
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarmlab import SwarmLab, load_weights

pytestmark = pytest.mark.slow  # real processes

HERE = Path(__file__).parent
ORIGIN_ARGS = ["--chunk-bytes", "32768", "--segment-elements", "65536", "--served", "as-is"]


def _checkpoint(step: int):
    """A small pre-quantized served model: fp8 e4m3 weights with block scales, bf16 norms;
    each step changes a few elements of some tensors and none of the others."""
    import torch

    from patchswarm.protocol.served import serve_state

    g = torch.Generator().manual_seed(0)
    master = {f"layers.{i}.weight": torch.randn(256, 256, generator=g) for i in range(4)}
    master.update({f"layers.{i}.norm": torch.ones(256) for i in range(4)})
    for s in range(1, step + 1):
        master["layers.0.weight"][s, :8] += 0.5  # layers.1-3 never change: their shard is not rewritten
        master["layers.0.norm"][s] += 0.25
    return serve_state(master, "fp8-block")


def _write_model_dir(watch: Path, step: int) -> None:
    from patchswarm.node.checkpoint import save_state, write_side_files

    state = _checkpoint(step)
    layout = {n: "model-00001-of-00002.safetensors" if n.startswith("layers.0.") else "model-00002-of-00002.safetensors"
              for n in state}
    tmp = watch / f".step{step:04d}.partial"
    save_state(state, tmp, layout)
    write_side_files(tmp, {"config.json": json.dumps({"model_type": "tiny"}).encode()})
    tmp.rename(watch / f"step{step:04d}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeEngine:
    def __init__(self, root: Path, port: int = 0, refuse: int = 0, vllm_model: Path | None = None):
        name = f"engine-{port}" + ("" if vllm_model is None else "-vllm")
        self.log = root / f"{name}.jsonl"
        port_file = root / f"{name}.port"
        vllm = [] if vllm_model is None else ["--vllm-model", str(vllm_model)]
        self.proc = subprocess.Popen([sys.executable, str(HERE / "engines" / "fake_engine.py"), "--port-file",
                                      str(port_file), "--log", str(self.log), "--refuse", str(refuse),
                                      "--port", str(port), *vllm])
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text():
            assert time.monotonic() < deadline and self.proc.poll() is None, "the fake engine did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port_file.read_text()}"

    def calls(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []

    def wait_calls(self, n: int, timeout: float = 90.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while len(self.calls()) < n:
            assert time.monotonic() < deadline, f"the engine got {self.calls()} within {timeout} s, expected {n} calls"
            time.sleep(0.1)
        return self.calls()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def test_engine_and_command_get_each_version_in_order_from_a_model_directory(tmp_path):
    watch = tmp_path / "watch"
    watch.mkdir()
    engine = FakeEngine(tmp_path, refuse=1)  # the first call is refused: the hand-off retries it
    vllm = None
    seen = tmp_path / "on-version.txt"
    cmd = f'echo "$PATCHSWARM_VERSION $PATCHSWARM_STATE_HASH $PATCHSWARM_MODEL_DIR" >> {shlex.quote(str(seen))}'
    try:
        vllm = FakeEngine(tmp_path, vllm_model=tmp_path / "c-model" / "current")  # `vllm serve D/current`
        with SwarmLab(tmp_path) as lab:
            lab.start_tracker()
            origin = lab.start_origin(region="r0", watch=watch, extra=ORIGIN_ARGS, wait=False)
            a = lab.start_node("a", region="r1", extra=["--engine", "sglang", "--engine-url", engine.url], wait=False)
            b = lab.start_node("b", region="r1", extra=["--on-version", cmd], wait=False)
            vl = lab.start_node("c", region="r1", extra=["--engine", "vllm", "--engine-url", vllm.url,
                                                         "--model-dir", str(tmp_path / "c-model")], wait=False)
            lab.listening(origin, a, b, vl)
            hashes = []
            for step in range(3):
                _write_model_dir(watch, step)
                hashes.append(lab.wait_version([a, b, vl], step)[0]["state_hash"])
                engine.wait_calls(step + 1)  # each version reaches the engine before the next is published
                vllm.wait_calls(step + 1)
            # vLLM reloaded each version through c's `current`, whole.
            assert [r["state_hash"] for r in vllm.calls()] == hashes
            assert [{Path(d).name for d in r["read_from"]} for r in vllm.calls()] == [{f"v{v:010d}"} for v in range(3)]
            calls = engine.calls()
            # One call per version, in order, each loading exactly the published state.
            assert [c["version"] for c in calls] == ["0", "1", "2"]
            assert [c["state_hash"] for c in calls] == hashes
            # The engine has the call; the node records its answer a moment later.
            deadline = time.monotonic() + 30
            while (st := a.status())["engine"]["version"] != 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert st["engine"]["version"] == 2 and st["engine"]["last_error"] is None
            assert st["engine"]["attempts"] == 4 and st["engine"]["publish_to_engine_s"] is not None
            current = Path(st["model_dir"])
            assert sorted(f.name for f in current.iterdir()) == [
                "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                "model.safetensors.index.json"]
            # The shard whose tensors never changed was written once, then linked.
            assert st["model_dir_bytes_written"] < 3 * sum(f.stat().st_size for f in current.iterdir())
            deadline = time.monotonic() + 30
            while len(seen.read_text().splitlines() if seen.exists() else []) < 3:
                assert time.monotonic() < deadline, "--on-version did not run for every version"
                time.sleep(0.1)
            lines = [line.split() for line in seen.read_text().splitlines()]
            assert [int(v) for v, _, _ in lines] == [0, 1, 2]
            assert [h for _, h, _ in lines] == hashes
            assert all(Path(d).name == f"v{int(v):010d}" for v, _, d in lines)
            assert b.status()["engine"]["name"] == "command"
    finally:
        engine.stop()
        if vllm is not None:
            vllm.stop()


def test_a_node_whose_engine_is_down_keeps_applying_and_hands_the_newest_version_over_later(tmp_path):
    watch = tmp_path / "watch"
    watch.mkdir()
    port = _free_port()
    engine = None
    try:
        with SwarmLab(tmp_path) as lab:
            lab.start_tracker()
            lab.start_origin(region="r0", watch=watch, extra=ORIGIN_ARGS)
            a = lab.start_node("a", region="r1", extra=["--engine", "sglang", "--engine-url",
                                                        f"http://127.0.0.1:{port}"])
            for step in range(2):
                _write_model_dir(watch, step)
                lab.wait_version([a], step)
            st = a.status()
            assert st["version"] == 1 and st["engine"]["version"] is None
            assert st["engine"]["last_error"], "a refused connection should be shown"
            engine = FakeEngine(tmp_path, port=port)
            calls = engine.wait_calls(1, timeout=120)  # within the hand-off's backoff
            assert calls[0]["version"] == "1" and calls[0]["state_hash"] == st["state_hash"]
            time.sleep(1.0)
            assert len(engine.calls()) == 1, "version 0 was superseded, never handed over late"
            assert a.popen.poll() is None
            assert len(load_weights(a)) == len(_checkpoint(1)) + 1  # the side file travels as a tensor
    finally:
        if engine is not None:
            engine.stop()
