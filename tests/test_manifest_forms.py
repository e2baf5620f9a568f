"""Form-2 manifests (a patch version lists only what it changes) between real processes.

An origin told `--manifest-form 2` watches shard directories whose versions change elements in
place, add a tensor, then remove one and reshape another; nodes on loopback take every version
bit-exactly: one keeping a model directory (its index must map every tensor to the shard the
trainer's directory had), one killed mid-way and restarted (it replays the stored form-2 patches
against its base file) that also compacts every 2 versions (the compaction reads each patch
against the base file's table), and one that joins late.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from swarmlab import SwarmLab, load_weights, same_bits

pytestmark = pytest.mark.slow  # real processes

ORIGIN_ARGS = ["--chunk-bytes", "32768", "--segment-elements", "65536", "--served", "as-is", "--manifest-form", "2"]
FILE_PREFIX = "patchswarm.file:"


def _checkpoint(step: int) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The trainer's served state at `step` and its shard layout."""
    g = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.weight": torch.randn(128, 128, generator=g).bfloat16() for i in range(4)}
    state.update({f"layers.{i}.norm": torch.ones(128, dtype=torch.bfloat16) for i in range(4)})
    for s in range(1, step + 1):
        state["layers.0.weight"][s, :8] += 0.5
    if step >= 2:
        state["layers.4.weight"] = torch.randn(64, 128, generator=g).bfloat16()  # added
    if step >= 3:
        del state["layers.3.norm"]                                             # removed
        state["layers.2.norm"] = torch.ones(2, 64, dtype=torch.bfloat16)       # reshaped
    layout = {n: f"model-0000{1 + int(n.split('.')[1]) % 2}-of-00002.safetensors" for n in state}
    return state, layout


def _write_model_dir(watch: Path, step: int) -> None:
    from patchswarm.node.checkpoint import save_state, write_side_files

    state, layout = _checkpoint(step)
    tmp = watch / f".step{step:04d}.partial"
    save_state(state, tmp, layout)
    write_side_files(tmp, {"config.json": json.dumps({"step": step}).encode()})
    tmp.rename(watch / f"step{step:04d}")


def _forms(node) -> dict[tuple[int, bool], int]:
    """The form of every manifest a member's store holds, by object."""
    from patchswarm.node.net.trust import Credentials
    from patchswarm.node.store import ObjectStore
    from patchswarm.protocol.versions import VersionBook

    c = Credentials.load(node.creds)
    store = ObjectStore.read_only(node.data_dir / "objects", VersionBook(c.swarm_id(), c.trainer_public_key()))
    return {k: store.manifest(k).form for k in store.keys()}


def test_form_2_versions_reach_every_node_across_a_restart_a_compaction_and_a_late_join(tmp_path):
    watch = tmp_path / "watch"
    watch.mkdir()
    with SwarmLab(tmp_path) as lab:
        lab.start_tracker()
        origin = lab.start_origin(region="r0", watch=watch, extra=ORIGIN_ARGS, wait=False)
        a = lab.start_node("a", region="r1", extra=["--on-version", "true"], wait=False)
        b = lab.start_node("b", region="r1", extra=["--compact-every", "2"], wait=False)
        lab.listening(origin, a, b)
        for step in range(2):
            _write_model_dir(watch, step)
            lab.wait_version([a, b], step)
        lab.kill(b)
        _write_model_dir(watch, 2)
        lab.wait_version([a], 2)
        lab.restart(b)
        lab.wait_version([b], 2)
        _write_model_dir(watch, 3)
        lab.wait_version([a, b], 3)
        c = lab.start_node("c", region="r1")
        lab.wait_version([c], 3)

        expected, layout = _checkpoint(3)
        for node in (a, b, c):
            got = {k: v for k, v in load_weights(node).items() if not k.startswith(FILE_PREFIX)}
            assert same_bits(got, expected), node.name
        # The patch versions went out as form 2 (the keyframe too: the origin was told so).
        forms = _forms(a)
        assert forms and set(forms.values()) == {2}, forms
        # b compacted through form-2 patches (reading each against its base file's table).
        deadline = time.monotonic() + 60
        while (st := b.status())["compactions"] < 1:
            assert time.monotonic() < deadline, f"b never compacted: {st}"
            time.sleep(0.2)
        # The model directory has the trainer's shard layout, from the form-2 layout rows.
        model_dir = Path(a.status()["model_dir"])
        index = json.loads((model_dir / "model.safetensors.index.json").read_text())
        assert index["weight_map"] == layout
        assert json.loads((model_dir / "config.json").read_text()) == {"step": 3}
