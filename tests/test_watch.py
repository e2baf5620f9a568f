"""`--watch`: a checkpoint is published only once it is whole and has stopped changing.

The defect these pin: the watch took any directory holding one .safetensors file, and any
.safetensors file as soon as it existed. Trainers write in place (Hugging Face Trainer's
checkpoint-N directories, save_pretrained: shard after shard, the index last, side files
around them), so a poll that landed mid-save published part of a model to the whole swarm,
or found a file half written, failed to load it, and marked it done for ever. Each test
runs a real origin over a directory that the test writes step by step, the watch polling
every WATCH_SECONDS (shortened here) in between.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import trio
from safetensors.torch import save, save_file

from patchswarm.node.net import trust
from patchswarm.node.trainer import origin as origin_mod
from patchswarm.node.trainer.origin import Origin, OriginConfig
from patchswarm.protocol.served import split_side_files
from patchswarm.protocol.statehash import state_hash
from synthetic import served

POLL = 0.05
SETTLE = 20 * POLL  # long enough for many polls: what the watch would publish, it has by then


@pytest.fixture
def watch_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(origin_mod, "WATCH_SECONDS", POLL)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    return ckpt


def run_watch(tmp_path, ckpt, script) -> Origin:
    """Run an origin watching `ckpt` while `await script(o)` writes to it; the origin after."""
    swarm = tmp_path / "swarm"
    trust.init_swarm(swarm)
    trust.issue(swarm, "origin", "origin", tmp_path / "creds")
    cfg = OriginConfig(tracker="127.0.0.1:9", creds=tmp_path / "creds", key=swarm / "trainer.key",
                       data_dir=tmp_path / "data", listen="127.0.0.1:0")
    o = Origin(cfg)

    async def main():
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                await n.start(o.run)
                n.start_soon(o.watch, ckpt)
                await script(o)
                n.cancel_scope.cancel()

    trio.run(main)
    return o


def ledger(tmp_path) -> set:
    path = tmp_path / "data" / "watched.json"
    return set(json.loads(path.read_text())) if path.exists() else set()


async def wait_version(o: Origin, version: int) -> None:
    while o.version != version:
        await trio.sleep(POLL / 5)


def states(seed: int, n: int, names=("a", "b", "c", "d")) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{k: torch.randn(16, 32, generator=g) for k in names} for _ in range(n)]


@pytest.mark.slow  # a real origin watching for seconds
def test_a_sharded_save_is_published_once_its_index_is_written(tmp_path, watch_dir):
    """save_pretrained's order: config, shard 1, shard 2, the index last. Neither one shard
    (named 1 of 2) nor both shards without the index is the model; the index makes it whole."""
    (state,) = states(1, 1)
    d = watch_dir / "checkpoint-100"
    layout = {"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
              "c": "model-00002-of-00002.safetensors", "d": "model-00002-of-00002.safetensors"}
    index = {"metadata": {"total_size": 0}, "weight_map": layout}

    async def script(o):
        d.mkdir()
        (d / "config.json").write_text('{"model_type": "tiny"}')
        save_file({k: state[k] for k in "ab"}, d / "model-00001-of-00002.safetensors")
        await trio.sleep(SETTLE)
        assert o.version is None and ledger(tmp_path) == set()  # one shard of two
        save_file({k: state[k] for k in "cd"}, d / "model-00002-of-00002.safetensors")
        await trio.sleep(SETTLE)
        assert o.version is None and ledger(tmp_path) == set()  # both shards, no index yet
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
        await wait_version(o, 0)
        await trio.sleep(SETTLE)  # and not again

    o = run_watch(tmp_path, watch_dir, script)
    assert o.version == 0 and ledger(tmp_path) == {"checkpoint-100"}
    weights, files = split_side_files(o.served.state)
    assert state_hash(weights) == state_hash(served(state, torch.bfloat16))
    assert files == {"config.json": b'{"model_type": "tiny"}'}


@pytest.mark.slow  # a real origin watching for seconds
def test_a_truncated_file_is_published_once_it_has_grown_whole(tmp_path, watch_dir):
    """A .safetensors file written in place: first part of its header, then the header and part
    of the data, then the rest. Not whole until its size is its header's length plus the data
    offsets' end; then published, whole, once (before: it failed to load, was marked done and
    never published)."""
    (state,) = states(2, 1)
    data = save(state)
    f = watch_dir / "step-7.safetensors"

    async def script(o):
        for upto in [5, 8 + int.from_bytes(data[:8], "little") // 2, len(data) // 2, len(data) - 1]:
            with open(f, "ab") as fh:
                fh.write(data[fh.tell():upto])
            await trio.sleep(SETTLE)
            assert o.version is None and ledger(tmp_path) == set(), upto
        with open(f, "ab") as fh:
            fh.write(data[fh.tell():])
        await wait_version(o, 0)
        await trio.sleep(SETTLE)

    o = run_watch(tmp_path, watch_dir, script)
    assert o.version == 0 and ledger(tmp_path) == {"step-7.safetensors"}
    assert o.served.state_hash == state_hash(served(state, torch.bfloat16))


@pytest.mark.slow  # a real origin watching for seconds
def test_a_file_is_not_published_while_it_changes_between_polls(tmp_path, watch_dir):
    """A whole checkpoint rewritten again and again (new contents, new mtime each time) is
    taken only once two consecutive polls find it the same: then its last contents, once."""
    versions = states(3, 40)
    f = watch_dir / "model.safetensors"

    async def script(o):
        for i, state in enumerate(versions):  # every POLL / 5: several times between two polls
            tmp = watch_dir / ".model.safetensors.w"
            save_file(state, tmp)
            os.utime(tmp, ns=(10**18 + i, 10**18 + i))  # a new mtime each time, whatever the clock's grain
            os.replace(tmp, f)
            await trio.sleep(POLL / 5)
            assert o.version is None, i
        await wait_version(o, 0)
        await trio.sleep(SETTLE)

    o = run_watch(tmp_path, watch_dir, script)
    assert o.version == 0 and ledger(tmp_path) == {"model.safetensors"}
    assert o.served.state_hash == state_hash(served(versions[-1], torch.bfloat16))


@pytest.mark.slow  # a real origin watching for seconds
def test_a_save_under_a_temporary_name_is_published_once_under_its_own(tmp_path, watch_dir):
    """Some transformers versions' Trainer saved to tmp-checkpoint-N and then renamed it to
    checkpoint-N: taken under both names, it was published twice."""
    (state,) = states(5, 1)

    async def script(o):
        tmp = watch_dir / "tmp-checkpoint-20"
        tmp.mkdir()
        save_file(state, tmp / "model.safetensors")
        await trio.sleep(SETTLE)
        assert o.version is None and ledger(tmp_path) == set()
        tmp.rename(watch_dir / "checkpoint-20")
        await wait_version(o, 0)
        await trio.sleep(SETTLE)  # and not again

    o = run_watch(tmp_path, watch_dir, script)
    assert o.version == 0 and ledger(tmp_path) == {"checkpoint-20"}


@pytest.mark.slow  # a real origin watching for seconds
def test_a_trainer_checkpoint_ships_its_model_files_not_its_training_state(tmp_path, watch_dir):
    """Hugging Face Trainer's checkpoint-N: the model (model.safetensors, config, generation
    config, tokenizer) beside what resumes training (optimizer.pt, scheduler.pt, scaler.pt,
    rng_state*.pth, trainer_state.json, training_args.bin; DeepSpeed's latest and
    zero_to_fp32.py). Only the model's files travel
    with the version: the rest is no engine's, and the optimizer's is twice the weights."""
    (state,) = states(4, 1)
    model_files = {"config.json": b'{"model_type": "tiny"}', "generation_config.json": b'{"top_p": 0.9}',
                   "tokenizer.json": b'{"vocab": {"a": 0}}', "tokenizer_config.json": b"{}",
                   "special_tokens_map.json": b"{}"}
    training_state = {"optimizer.pt": bytes(4096), "scheduler.pt": b"s", "scaler.pt": b"g",
                      "rng_state.pth": b"r", "rng_state_1.pth": b"r1", "trainer_state.json": b'{"global_step": 10}',
                      "training_args.bin": b"t", "latest": b"global_step10", "zero_to_fp32.py": b"#!"}
    d = watch_dir / "checkpoint-10"

    async def script(o):
        d.mkdir()
        save_file(state, d / "model.safetensors")
        for name, data in {**model_files, **training_state}.items():
            (d / name).write_bytes(data)
        await wait_version(o, 0)
        await trio.sleep(SETTLE)

    o = run_watch(tmp_path, watch_dir, script)
    assert o.version == 0 and ledger(tmp_path) == {"checkpoint-10"}
    weights, files = split_side_files(o.served.state)
    assert files == model_files
    assert state_hash(weights) == state_hash(served(state, torch.bfloat16))


def test_what_makes_a_checkpoint_whole():
    """The check itself, pure over what a poll listed and read: `_shard_of` (a file's first bytes
    and size) and `_not_whole` (why not yet; None: whole, or never readable, which publish
    refuses and the watch logs and skips)."""
    from patchswarm.node.trainer.watch import _not_whole, _shard_of

    data = save({"a": torch.zeros(4), "b": torch.ones(2, 3)})
    whole = _shard_of(data, len(data))
    assert whole.end == len(data) and whole.names == {"a", "b"} and whole.bad is None
    for cut in [0, 7, 8, 20, len(data) - 1]:  # short of its header, then of its data
        assert _not_whole(True, {"m.safetensors": _shard_of(data[:cut], cut)}, None), cut
    assert _not_whole(True, {"m.safetensors": whole}, None) is None
    assert _not_whole(True, {"m.safetensors": _shard_of(data + b"x", len(data) + 1)}, None) is None  # never
    assert _shard_of(b"not a safetensors file", 22).bad  # readable: publish says so
    assert _shard_of(data[:8] + b"{" * (len(data) - 8), len(data)).bad

    s1 = "model-00001-of-00002.safetensors"
    s2 = "model-00002-of-00002.safetensors"
    assert "no model.safetensors.index.json yet" in _not_whole(False, {s1: whole}, None)
    assert "no model.safetensors.index.json yet" in _not_whole(False, {s1: whole, s2: whole}, None)
    assert _not_whole(False, {"model-00001-of-00001.safetensors": whole}, None) is None
    assert _not_whole(False, {}, None)
    index = {"a": s1, "b": s1, "c": s2}
    assert "not written yet" in _not_whole(False, {s1: whole}, index)
    assert "not all written" in _not_whole(False, {s1: whole, s2: whole}, "not all written")
    assert "1 of the tensors" in _not_whole(False, {s1: whole, s2: whole}, index)  # c is in neither
    c = save({"c": torch.zeros(1)})
    assert "of 68 bytes written" in _not_whole(False, {s1: whole, s2: _shard_of(c, len(c) - 1)}, index)
    assert _not_whole(False, {s1: whole, s2: _shard_of(c, len(c))}, index) is None
