"""The `patchswarm` CLI as a real process: diff/apply bit-exact, wrong base, inspect, bad patch files."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from patchswarm.node.checkpoint import INDEX_NAME, save_state
from synthetic import served_pairs
from patchswarm.protocol.statehash import state_hash

pytestmark = pytest.mark.slow  # real processes

ROOT = Path(__file__).resolve().parents[1]


def cli(*args, check=True):
    r = subprocess.run([sys.executable, "-m", "patchswarm.node.cli", *map(str, args)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    if check:
        assert r.returncode == 0, r.stderr
    return r


def same_bits(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k


def assert_one_line_error(r):
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("patchswarm: "), r.stderr
    assert "Traceback" not in r.stderr


@pytest.fixture(scope="module")
def pair():
    (base, target), = served_pairs("tiny", lr=1e-5, steps=1)
    return base, target


@pytest.fixture(scope="module")
def files(pair, tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    base, target = pair
    save_state(base, d / "base.safetensors")
    save_state(target, d / "target.safetensors")
    cli("diff", d / "base.safetensors", d / "target.safetensors", "-o", d / "step.patch")
    return d


def test_diff_apply_single_file(files, pair):
    d = files
    out = d / "out.safetensors"
    r = cli("apply", d / "base.safetensors", d / "step.patch", "-o", out)
    same_bits(load_file(str(out)), pair[1])
    assert state_hash(pair[1]) in r.stdout


def test_diff_summary_line(files):
    r = cli("diff", files / "base.safetensors", files / "target.safetensors", "-o", files / "again.patch")
    assert len(r.stdout.strip().splitlines()) == 1
    assert "%" in r.stdout and "bytes" in r.stdout
    assert (files / "again.patch").read_bytes() == (files / "step.patch").read_bytes()


def test_diff_summary_says_larger_when_the_patch_outweighs_the_target(tmp_path):
    """A 40-byte target made a 400-byte patch, and the summary said "0.1x smaller"."""
    save_state({"w": torch.zeros(10)}, tmp_path / "b.safetensors")
    save_state({"w": torch.ones(10)}, tmp_path / "t.safetensors")
    r = cli("diff", tmp_path / "b.safetensors", tmp_path / "t.safetensors", "-o", tmp_path / "p")
    size = (tmp_path / "p").stat().st_size
    assert f"{size / 40:.1f}x larger than target (40 bytes)" in r.stdout and "smaller" not in r.stdout


def test_sharded_round_trip(pair, tmp_path):
    base, target = pair
    names = sorted(target)
    layout = {n: ("model-00001-of-00002.safetensors" if i < len(names) // 2 else "model-00002-of-00002.safetensors")
              for i, n in enumerate(names)}
    save_state(base, tmp_path / "base", layout)
    save_state(target, tmp_path / "target", layout)
    cli("diff", tmp_path / "base", tmp_path / "target", "-o", tmp_path / "p.patch")
    cli("apply", tmp_path / "base", tmp_path / "p.patch", "-o", tmp_path / "out")
    out = tmp_path / "out"
    assert out.is_dir()
    index = json.loads((out / INDEX_NAME).read_text())
    assert index["weight_map"] == layout
    got = {}
    for file in sorted(set(layout.values())):
        got.update(load_file(str(out / file)))
    same_bits(got, target)


def test_apply_refuses_to_replace_a_directory_of_other_files(pair, tmp_path):
    """`-o DIR` naming a directory that is not a shard directory (here one holding the
    patch and unrelated files) was removed whole; now one line, exit 1, DIR untouched."""
    base, target = pair
    layout = {n: "model-00001-of-00001.safetensors" for n in target}
    save_state(base, tmp_path / "base", layout)
    save_state(target, tmp_path / "target", layout)
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("keep me")
    cli("diff", tmp_path / "base", tmp_path / "target", "-o", work / "p.patch")
    assert_one_line_error(cli("apply", tmp_path / "base", work / "p.patch", "-o", work, check=False))
    assert sorted(p.name for p in work.iterdir()) == ["notes.txt", "p.patch"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "target", "work"]


def test_sharded_base_single_file_patch(files, pair, tmp_path):
    """A patch without a layout applied to a shard directory writes a single file."""
    base, _ = pair
    save_state(base, tmp_path / "base", {n: "one.safetensors" for n in base})
    cli("apply", tmp_path / "base", files / "step.patch", "-o", tmp_path / "out.safetensors")
    same_bits(load_file(str(tmp_path / "out.safetensors")), pair[1])


def test_wrong_base(files, pair, tmp_path):
    _, target = pair
    out = tmp_path / "out.safetensors"
    r = cli("apply", files / "target.safetensors", files / "step.patch", "-o", out, check=False)
    assert_one_line_error(r)
    expected = json.loads(cli("inspect", files / "step.patch", "--json").stdout)["base_hash"]
    line = r.stderr.strip()
    assert line == f"patchswarm: wrong base: patch expects state hash {expected}, BASE has {state_hash(target)}"
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_inspect_json(files):
    r = cli("inspect", files / "step.patch", "--json")
    info = json.loads(r.stdout)
    for key in ("kind", "base_hash", "target_hash", "tensors", "params", "changed", "bytes",
                "position_bytes", "value_bytes", "chunks"):
        assert key in info, key
    assert info["bytes"] == (files / "step.patch").stat().st_size
    assert info["kind"] == "patch"
    assert 0 < info["changed"] <= info["params"]


def test_inspect_table(files):
    r = cli("inspect", files / "step.patch")
    assert "target_hash" in r.stdout and "Traceback" not in r.stderr


def test_keyframe_onto_empty(files, pair, tmp_path):
    cli("diff", "-", files / "target.safetensors", "-o", tmp_path / "k.patch")
    assert json.loads(cli("inspect", tmp_path / "k.patch", "--json").stdout)["base_hash"] is None
    cli("apply", "-", tmp_path / "k.patch", "-o", tmp_path / "out.safetensors")
    same_bits(load_file(str(tmp_path / "out.safetensors")), pair[1])


def test_truncated_patch(files, tmp_path):
    data = (files / "step.patch").read_bytes()
    bad = tmp_path / "bad.patch"
    bad.write_bytes(data[: len(data) // 2])
    out = tmp_path / "out.safetensors"
    assert_one_line_error(cli("inspect", bad, "--json", check=False))
    assert_one_line_error(cli("apply", files / "base.safetensors", bad, "-o", out, check=False))
    assert not out.exists()


@pytest.mark.parametrize("args", [
    ("apply", "missing.safetensors", "missing.patch", "-o", "x.safetensors"),
    ("inspect", "missing.patch"),
    ("diff", "README.md", "README.md", "-o", "x.patch"),
])
def test_expected_faults_are_one_line(args):
    assert_one_line_error(cli(*args, check=False))


def test_usage_error_exit_code():
    r = cli("apply", check=False)
    assert r.returncode == 2
    r = cli("frobnicate", check=False)
    assert r.returncode == 2


@pytest.mark.parametrize("flag", ["--apply-threads", "--apply-nice", "--wan-gateways"])
def test_node_count_flags_reject_negatives(flag):
    r = cli("node", "--tracker", "127.0.0.1:1", "--creds", "x", "--data-dir", "y", "--region", "r", flag, "-1",
            check=False)
    assert r.returncode == 2 and flag in r.stderr and "-1" in r.stderr


def test_commands_without_weights_do_not_load_torch():
    """Every command builds the whole parser; a default read from a torch module (the node's
    --compact-every from node/persistence.py) cost `swarm init`, `swarm issue` and the tracker
    ~1.5 s of CPU each at start-up. The node's client too: `patchswarm status` and a rollout
    worker's submits imported torch for `follow` alone (test_client.py follows with it). And
    `patchswarm trajectories`: the trainer package's own import brought the origin in, and the
    object store brought the patch format (2.3 s for a six-record store, 0.3 s without)."""
    code = ("import sys; from patchswarm.node.cli import build_parser; build_parser(); "
            "import patchswarm.node.cli.swarm, patchswarm.tracker.cli, patchswarm.tracker.server; "
            "import patchswarm.node.client; "
            "from patchswarm.node.trainer.trajstore import TrajectoryReader; "
            "from patchswarm.node.store import latest_version; "
            "print(sorted(m for m in ('torch', 'aiortc') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert r.stdout.strip() == "[]", r.stdout


def test_status_without_a_node_is_one_line_naming_the_path_and_what_was_found(tmp_path):
    """`patchswarm status` (and `--json`, whose stdout must stay empty or valid JSON) against no
    socket and a stale socket file: exit 1, one line that says what it expected and found."""
    import socket

    stale = tmp_path / "node.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))
    for args, found in [(("--socket", tmp_path / "none.sock"), "found no such file"),
                        (("--data-dir", tmp_path), "found a socket file no process listens on"),
                        (("--data-dir", tmp_path, "--json"), "found a socket file no process listens on")]:
        r = cli("status", *args, check=False)
        assert_one_line_error(r)
        assert r.stdout == "" and "expected a node's socket" in r.stderr and found in r.stderr, r.stderr


def test_status_shows_peers_dropped_and_refused_by_kind(capsys, monkeypatch):
    """`patchswarm status` showed no peer faults: a member refused over its connection budget
    (node/net/admission.py) or sessions replaced by reconnects were in --json only."""
    from patchswarm.node.cli.services import print_status

    monkeypatch.setenv("COLUMNS", "300")  # one line a row
    st = {"node_id": "n1", "region": "r0", "version": 3, "base_path": "/d/weights.safetensors",
          "bytes_in": {"origin": 0, "same_region": 0, "other_region": 0}, "bytes_out": 0, "chunks_rejected": 0,
          "peers": [], "peers_dropped": {"connections per minute": 1234, "protocol error": 1}, "sessions_replaced": 2}
    print_status(st)
    out = " ".join(capsys.readouterr().out.split())
    assert "connections per minute: 1,234, protocol error: 1; 2 sessions replaced by a reconnect" in out
    del st["peers_dropped"], st["sessions_replaced"]
    print_status(st)
    assert "peers dropped" not in capsys.readouterr().out
    st["manifests_stale"] = 1500  # a member replaying old manifests (protocol/versions.py)
    print_status(st)
    assert "0 manifests (1,500 old ones refused unread)" in " ".join(capsys.readouterr().out.split())


def test_status_shows_a_model_dir_version_written_ahead_of_current(capsys, monkeypatch):
    """With vLLM, `current` moves only between reloads: the version written ahead of it is shown."""
    from patchswarm.node.cli.services import print_status

    monkeypatch.setenv("COLUMNS", "300")
    st = {"node_id": "n1", "region": "r0", "version": 3, "base_path": "/d/weights.safetensors",
          "bytes_in": {"origin": 0, "same_region": 0, "other_region": 0}, "bytes_out": 0, "chunks_rejected": 0,
          "peers": [], "model_dir": "/m/current", "model_dir_version": 1, "model_dir_written": 3}
    print_status(st)
    assert "/m/current (version 1, version 3 written, current before the engine's next reload)" in \
        " ".join(capsys.readouterr().out.split())
    st["model_dir_version"] = 3
    print_status(st)
    assert "/m/current (version 3) " in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("declared, measured, said, slow, shown", [
    (100.0, None, 100.0, [], "│ 100 Mbit/s declared │"),
    (100.0, 9.437, 9.44, ["n3"],
     "│ 100 Mbit/s declared, 9.437 Mbit/s measured while sends backed up, planned on 9.44 Mbit/s │"),
    (100.0, 60.1, 100.0, [], "│ 100 Mbit/s declared, 60.1 Mbit/s measured while sends backed up │"),
    (None, 9.437, 9.44, [], "│ 9.437 Mbit/s measured while sends backed up, planned on 9.44 Mbit/s │"),
    (None, None, None, [], None),
])
def test_status_shows_the_declared_measured_and_said_uplinks_and_slow_neighbours(capsys, monkeypatch, declared,
                                                                                measured, said, slow, shown):
    from patchswarm.node.cli.services import print_status

    monkeypatch.setenv("COLUMNS", "300")
    st = {"node_id": "n1", "region": "r0", "version": 3, "base_path": "/d/weights.safetensors",
          "bytes_in": {"origin": 0, "same_region": 0, "other_region": 0}, "bytes_out": 0, "chunks_rejected": 0,
          "peers": [], "uplink_mbit": declared, "uplink_measured_mbit": measured, "uplink_said_mbit": said,
          "slow_neighbours": slow}
    print_status(st)
    out = " ".join(capsys.readouterr().out.split())
    assert (shown in out) if shown else "Mbit/s" not in out
    assert ("slow neighbours │ n3 (by the uplinks they say" in out) == bool(slow)
    print_status({**st, "part_bytes": 256 << 10})
    out = " ".join(capsys.readouterr().out.split())
    assert ("Mbit/s declared (sends parts of 256 KiB)" in out) == bool(declared)


def test_status_shows_a_snubbed_peer(capsys, monkeypatch):
    from patchswarm.node.cli.services import print_status

    monkeypatch.setenv("COLUMNS", "300")
    st = {"node_id": "n1", "region": "r0", "version": 3, "base_path": "/d/weights.safetensors",
          "bytes_in": {"origin": 0, "same_region": 0, "other_region": 0}, "bytes_out": 0, "chunks_rejected": 0,
          "peers": [{"id": "m", "region": "r0", "role": "node", "snubbed": True},
                    {"id": "n2", "region": "r0", "role": "node", "snubbed": False},
                    {"id": "s", "region": "r0", "role": "node", "snubbed": True, "snub_reason": "slow"}]}
    print_status(st)
    out = " ".join(capsys.readouterr().out.split())
    assert "m (r0, snubbed: sent no part of an answer lately), n2 (r0), s (r0, snubbed: served too slowly lately)" in out
