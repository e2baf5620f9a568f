"""A stand-in for an SGLang server's weight-update endpoint, for tests: really loads what it is given.

    python tests/engines/fake_sglang.py --port-file F --log L [--refuse N] [--port P]

Serves `POST /update_weights_from_disk` with SGLang's request and response shape
(model_path, weight_version, ... -> {"success", "message", "num_paused_requests"};
HTTP 200 on success, 400 otherwise). Each call loads the directory as an engine
would (the index's weight_map, every shard with safetensors, the side files),
computes patchswarm's state hash of what it loaded, and appends one JSON line to
the log: version, state hash, the resolved path. The first N calls are refused
(HTTP 400, success false), to test retries. Writes its port to F once listening.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

from safetensors.torch import load_file

from patchswarm.protocol.served import file_tensor, file_tensor_name
from patchswarm.protocol.statehash import state_hash

INDEX = "model.safetensors.index.json"


def load_dir(d: Path) -> dict:
    state = {}
    index = d / INDEX
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = ["model.safetensors"]
    for shard in shards:
        state.update(load_file(str(d / shard)))
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

        def do_POST(self):
            if self.path != "/update_weights_from_disk":
                return self._answer(404, {"detail": "Not Found"})
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
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
            with open(args.log, "a") as f:
                f.write(json.dumps(entry) + "\n")
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
