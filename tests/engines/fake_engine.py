"""A stand-in for an SGLang or vLLM server's weight-update endpoints, for tests: really loads what it is given.

    python tests/engines/fake_engine.py --port-file F --log L [--refuse N] [--port P]
        [--vllm-model DIR [--shard-pause S]]

Serves `POST /update_weights_from_disk` with SGLang's request and response shape
(model_path, weight_version, ... -> {"success", "message", "num_paused_requests"};
HTTP 200 on success, 400 otherwise). Each call loads the directory as an engine
would (the index's weight_map, every shard with safetensors, the side files),
computes patchswarm's state hash of what it loaded, and appends one JSON line to
the log: version, state hash, the resolved path. The first N calls are refused
(HTTP 400, success false), to test retries. Writes its port to F once listening.

With `--vllm-model DIR` (the path a vLLM server was started on, `D/current`) it
also serves vLLM's `POST /collective_rpc` `{"method": "reload_weights"}`: it
loads DIR as vLLM does, opening each shard through DIR as it comes to it, and
waits S seconds after each shard (a slow reload); its log line has the state
hash and the directory each shard was read from. `POST /reset_prefix_cache`
answers 200.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

from safetensors.torch import load as safetensors_load

from patchswarm.protocol.served import file_tensor, file_tensor_name
from patchswarm.protocol.statehash import state_hash

INDEX = "model.safetensors.index.json"


def load_dir(d: Path, pause_s: float = 0.0, read_from: list | None = None) -> dict:
    """The state in `d`, each shard opened through `d` in turn; `pause_s` after each one, and
    the directory it was read from appended to `read_from`."""
    state = {}
    index = d / INDEX
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = ["model.safetensors"]
    for shard in shards:
        with open(d / shard, "rb") as f:  # the directory this open resolved to, not the link's later target
            state.update(safetensors_load(f.read()))
            if read_from is not None:
                read_from.append(os.path.dirname(os.readlink(f"/proc/self/fd/{f.fileno()}")))
        time.sleep(pause_s)
    for f in sorted(d.iterdir()):
        if f.is_file() and f.suffix != ".safetensors" and f.name != INDEX:
            state[file_tensor_name(f.name)] = file_tensor(f.read_bytes())
    return state


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port-file", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--refuse", type=int, default=0)
    ap.add_argument("--port", type=int, default=0, help="listen on this port (default: any free one)")
    ap.add_argument("--vllm-model", help="serve vLLM's reload_weights, loading this path (D/current)")
    ap.add_argument("--shard-pause", type=float, default=0.0, help="seconds after each shard of a vLLM reload")
    args = ap.parse_args()
    # Tests stop it with SIGINT; a process started in the background of a non-interactive
    # shell (CI) inherits SIGINT ignored, and then the test waited 10 s before killing it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    refused = [0]

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):  # quiet
            pass

        def _answer(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _log(self, entry: dict) -> None:
            with open(args.log, "a") as f:
                f.write(json.dumps(entry) + "\n")

        def _reload(self, req: dict) -> None:
            if req.get("method") != "reload_weights":
                return self._answer(400, {"detail": f"expected method reload_weights, found {req.get('method')!r}"})
            read_from: list[str] = []
            try:
                state = load_dir(Path(args.vllm_model), args.shard_pause, read_from)
            except Exception as e:  # vLLM answers 500 when a reload fails
                return self._answer(500, {"detail": f"reload failed: {e}"})
            self._log({"state_hash": state_hash(state), "read_from": read_from, "tensors": len(state)})
            self._answer(200, {"results": [None]})

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if args.vllm_model and self.path == "/collective_rpc":
                return self._reload(req)
            if args.vllm_model and self.path == "/reset_prefix_cache":
                return self._answer(200, {})
            if self.path != "/update_weights_from_disk":
                return self._answer(404, {"detail": "Not Found"})
            if refused[0] < args.refuse:
                refused[0] += 1
                return self._answer(400, {"success": False, "message": "refused on purpose (test)",
                                          "num_paused_requests": 0})
            path = Path(req["model_path"])
            try:
                state = load_dir(path)
            except Exception as e:  # an engine that cannot load answers 400, as SGLang does
                return self._answer(400, {"success": False, "message": f"load failed: {e}", "num_paused_requests": 0})
            entry = {"version": req.get("weight_version"), "state_hash": state_hash(state),
                     "path": str(path.resolve()), "tensors": len(state)}
            self._log(entry)
            self._answer(200, {"success": True, "message": "Succeeded to update model weights.",
                               "num_paused_requests": 0})

    server = HTTPServer(("127.0.0.1", args.port), Handler)
    Path(args.port_file).write_text(str(server.server_address[1]))
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    sys.exit(0)


if __name__ == "__main__":
    main()
