"""Mutation testing of protocol/ with the fast tests: which deliberate breaks do the tests miss?

A bench, not a CI gate: for each module it asks cosmic-ray for every mutant (an operator
swapped, a comparison flipped, a constant changed, a `break` turned into `continue`...),
runs the fast (non-slow) tests that cover that module against each, and prints killed /
survived per module, then each survivor's diff so a person can judge it (an equivalent
mutant, or a missing test). Run from the repository root with the bench extra installed:

    pip install -e '.[bench]'
    python bench/mutation.py                                  # every module, every mutant (hours)
    python bench/mutation.py --modules versions,wire --max-mutants 40
    python bench/mutation.py --modules versions,wire --rerun-survivors   # after adding tests

Why cosmic-ray (not mutmut or pytest-gremlins): it applies each mutant to the real file in
place and runs an arbitrary test command, so it needs nothing of the package layout. Here
`protocol/` is installed (editable) as `patchswarm.protocol` through a path mapping;
mutmut 3 runs the tests against a copy of the sources under mutants/, which that mapping
never imports, and pytest-gremlins instruments modules through pytest's own import of the
project, with the same problem. cosmic-ray keeps its sessions in SQLite, so a run can stop
and continue (`--keep` keeps a session), and a timed-out test run counts as a kill.

The mutants are written into protocol/ itself (cosmic-ray restores each file after its
run): run nothing else from this checkout meanwhile, and let a run finish or stop it with
Ctrl-C (never kill -9), then check `git status`.

Mutants inside annotations (`int | None` made `int >> None`) are left out and counted
apart: every module here has `from __future__ import annotations`, so an annotation is
never evaluated and such a mutant cannot change behaviour.

After tests were added, `--rerun-survivors` runs only the survivors of the sessions in
--out again (a killed mutant stays killed: tests are only added), so the bench itself
confirms each kill. Survivors judged equivalent (no test of behaviour can tell them from
the original) are listed in bench/mutation-equivalents.txt with a reason each; the table
prints the kill rate both ways: of every mutant run, and of the killable ones.

`--max-mutants N` takes a seeded sample of N mutants per module, the same ones for the
same seed and source (the rest are recorded as skipped): on a 2-core machine a mutant
costs one pytest start (torch import) plus the module's tests, seconds each. Survivors
go to --out (default bench/.mutation/). Must not be imported by the package or the tests.
"""

from __future__ import annotations

import argparse
import ast
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# module (protocol/<name>.py) -> the fast tests that exercise it
MODULE_TESTS: dict[str, list[str]] = {
    "versions": ["tests/test_versions.py"],
    "manifest": ["tests/test_versions.py", "tests/test_revocation.py", "tests/test_store.py", "tests/test_trust.py"],
    "trajectory": ["tests/test_trajectory_storage.py", "tests/test_trajectory_bounds.py", "tests/test_uploader.py"],
    "wire": ["tests/test_wire.py"],
    "picker": ["tests/test_picker.py", "tests/test_picker_swarm.py", "tests/test_fetcher.py"],
    # the picker's piece state: the picker's tests drive it through the policy
    "piecestate": ["tests/test_piecestate.py", "tests/test_picker.py", "tests/test_picker_swarm.py",
                   "tests/test_fetcher.py"],
    "responsibility": ["tests/test_responsibility.py", "tests/test_picker.py"],
    "patchformat": ["tests/test_codec.py"],
    "patchencode": ["tests/test_codec.py", "tests/test_streaming_encode.py"],
    "patchdecode": ["tests/test_codec.py", "tests/test_streaming_encode.py"],
    # the codec's internals (protocol/patch.py only re-exports, no mutants): the kernel tests
    # first (they compare the compiled passes with the numpy reference, which only they and
    # tests that clear KERNEL run), then the round trips and the hostile inputs
    "deltacode": ["tests/test_deltacode.py", "tests/test_kernels.py", "tests/test_codec.py", "tests/test_hostile_patches.py"],
    "ricecode": ["tests/test_ricecode.py", "tests/test_kernels.py", "tests/test_codec.py", "tests/test_hostile_patches.py"],
    "contexts": ["tests/test_kernels.py", "tests/test_codec.py", "tests/test_hostile_patches.py"],
    "planes": ["tests/test_codec.py", "tests/test_hostile_patches.py"],
    "dtypes": ["tests/test_dtypes.py", "tests/test_kernels.py", "tests/test_changes.py", "tests/test_codec.py", "tests/test_hostile_patches.py"],
    # the patch's change stream (apply's recorder) and the bounded msgpack reader under the
    # patch table, manifests, wire messages and trajectories
    "changes": ["tests/test_changes.py", "tests/test_changelog.py"],
    "packreader": ["tests/test_packreader.py", "tests/test_wire.py", "tests/test_trust.py"],
    # a chunk in parts on the wire (wire.Piece)
    "assembly": ["tests/test_assembly.py", "tests/test_relay.py", "tests/test_peers.py"],
}


def config_text(module: str, timeout: float) -> str:
    tests = " ".join(MODULE_TESTS[module])
    # -x: the first failing test kills the mutant; -p no:cacheprovider: no .pytest_cache churn
    command = f"{shlex.quote(sys.executable)} -B -m pytest -x -q -p no:cacheprovider -m 'not slow' {tests}"
    return (f'[cosmic-ray]\nmodule-path = "protocol/{module}.py"\ntimeout = {timeout}\n'
            f'excluded-modules = []\ntest-command = "{command}"\n\n'
            f'[cosmic-ray.distributor]\nname = "local"\n')


ANNOTATION = "in an annotation: never evaluated (from __future__ import annotations)"


def annotation_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(start, end) (line, column) of every annotation in `source`."""
    spans = []
    for node in ast.walk(ast.parse(source)):
        found = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None:
            found.append(node.returns)
        elif isinstance(node, ast.arg) and node.annotation is not None:
            found.append(node.annotation)
        elif isinstance(node, ast.AnnAssign):
            found.append(node.annotation)
        spans += [((a.lineno, a.col_offset), (a.end_lineno, a.end_col_offset)) for a in found]
    return spans


def sample(session: Path, module_path: Path, max_mutants: int | None, seed: int) -> tuple[int, int]:
    """Mark mutants inside annotations, then all but a seeded sample of `max_mutants` of
    the rest, as skipped; (annotation mutants, mutants to run)."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    source = module_path.read_text()
    assert "from __future__ import annotations" in source, f"{module_path}: annotations are evaluated here"
    spans = annotation_spans(source)
    with use_db(str(session), mode=WorkDB.Mode.open) as db:
        # by where each mutant is: job ids are random per `init`, and sorted by them one
        # seed drew another sample on every run
        items = sorted(db.pending_work_items, key=lambda item: (
            tuple(item.mutations[0].start_pos), item.mutations[0].operator_name, item.mutations[0].occurrence))
        inert = [i.job_id for i in items
                 if any(a <= tuple(i.mutations[0].start_pos) < b for a, b in spans)]
        db.set_multiple_results(inert, WorkResult(worker_outcome=WorkerOutcome.SKIPPED, output=ANNOTATION))
        ids = [i.job_id for i in items if i.job_id not in set(inert)]
        keep = set(ids) if max_mutants is None or len(ids) <= max_mutants else set(random.Random(seed).sample(ids, max_mutants))
        db.set_multiple_results([i for i in ids if i not in keep], WorkResult(worker_outcome=WorkerOutcome.SKIPPED))
        return len(inert), len(keep)


def mutant_key(mutation) -> str:
    """`<file>:<line> <operator> #<occurrence>`: how EQUIVALENTS names a mutant (for this source)."""
    return f"{Path(mutation.module_path).name}:{mutation.start_pos[0]} {mutation.operator_name} #{mutation.occurrence}"


def read_equivalents(path: Path) -> dict[str, str]:
    """mutant key -> why it cannot change behaviour, from `path` (one per line: key, ` -- `, reason)."""
    if not path.exists():
        return {}
    entries = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, sep, reason = line.partition(" -- ")
            assert sep and reason.strip(), f"{path}: expected 'KEY -- REASON', found {line!r}"
            entries[key.strip()] = reason.strip()
    return entries


def rerun_survivors(session: Path) -> int:
    """Forget the results of the survivors so the next `exec` runs them again (with the tests as
    they are now); killed mutants stay killed: tests were only added. How many will re-run."""
    from cosmic_ray.work_db import WorkDB, WorkResultStorage, use_db
    from cosmic_ray.work_item import TestOutcome

    with use_db(str(session), mode=WorkDB.Mode.open) as db, db._session_maker.begin() as s:
        return s.query(WorkResultStorage).filter(WorkResultStorage.test_outcome == TestOutcome.SURVIVED).delete()


def tally(session: Path, equivalents: dict[str, str]) -> tuple[dict[str, int], list[str]]:
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome

    counts = {"killed": 0, "survived": 0, "equivalent": 0, "incompetent": 0, "annotation": 0, "skipped": 0,
              "total": 0}
    survivors = []
    with use_db(str(session), mode=WorkDB.Mode.open) as db:
        for item, result in db.completed_work_items:
            counts["total"] += 1
            if result.worker_outcome == WorkerOutcome.SKIPPED:
                counts["annotation" if result.output == ANNOTATION else "skipped"] += 1
            elif result.test_outcome == TestOutcome.SURVIVED:
                counts["survived"] += 1
                key = mutant_key(item.mutations[0])
                why = equivalents.get(key)
                counts["equivalent"] += why is not None
                survivors.append(f"--- {key}" + (f"  [equivalent: {why}]" if why else "") + f"\n{result.diff}")
            elif result.test_outcome == TestOutcome.KILLED:
                counts["killed"] += 1
            else:
                counts["incompetent"] += 1
    return counts, survivors


def run_module(module: str, out: Path, max_mutants: int | None, seed: int, timeout: float, keep: bool,
               rerun: bool, equivalents: dict[str, str]) -> dict:
    cfg, session = out / f"{module}.toml", out / f"{module}.sqlite"
    cfg.write_text(config_text(module, timeout))
    if rerun and session.exists():
        print(f"{module}: {rerun_survivors(session)} survivors to run again", flush=True)
    elif not (keep and session.exists()):
        session.unlink(missing_ok=True)
        subprocess.run([sys.executable, "-m", "cosmic_ray.cli", "init", str(cfg), str(session)], cwd=ROOT, check=True)
        inert, sampled = sample(session, ROOT / "protocol" / f"{module}.py", max_mutants, seed)
        print(f"{module}: {sampled} mutants to run ({inert} in annotations left out), seed {seed}", flush=True)
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "cosmic_ray.cli", "exec", str(cfg), str(session)], cwd=ROOT, check=True)
    counts, survivors = tally(session, equivalents)
    counts["seconds"] = round(time.monotonic() - t0)
    (out / f"{module}-survivors.txt").write_text("\n".join(survivors))
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modules", default=",".join(MODULE_TESTS),
                    help=f"comma-separated, of {', '.join(MODULE_TESTS)} (default: all)")
    ap.add_argument("--max-mutants", type=int, default=None, help="a seeded sample of this many per module")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant's test run (a timeout kills)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / ".mutation")
    ap.add_argument("--keep", action="store_true", help="continue the sessions already in --out")
    ap.add_argument("--rerun-survivors", action="store_true",
                    help="in the sessions already in --out, run the survivors again (after tests were added)")
    ap.add_argument("--equivalents", type=Path, default=ROOT / "bench" / "mutation-equivalents.txt",
                    help="survivors judged equivalent, one a line: KEY -- REASON (KEY as the survivor list prints it)")
    args = ap.parse_args()
    modules = [m for m in args.modules.split(",") if m]
    unknown = [m for m in modules if m not in MODULE_TESTS]
    if unknown:
        ap.error(f"unknown modules {unknown}: expected some of {sorted(MODULE_TESTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    equivalents = read_equivalents(args.equivalents)
    rows = {m: run_module(m, args.out, args.max_mutants, args.seed, args.timeout, args.keep, args.rerun_survivors,
                          equivalents) for m in modules}

    # killed %: of every mutant run (an equivalent survivor counts against it);
    # of killable: the equivalent survivors (--equivalents) left out
    def pct(part: int, whole: int) -> str:
        return f"{100 * part / whole:.1f}" if whole else "-"

    print(f"\n{'module':<16}{'killed':>8}{'survived':>10}{'equivalent':>12}{'incompetent':>13}{'annotation':>12}"
          f"{'skipped':>9}{'killed %':>10}{'of killable %':>15}{'s':>7}")
    for m, c in rows.items():
        ran = c["killed"] + c["survived"]
        print(f"{m:<16}{c['killed']:>8}{c['survived']:>10}{c['equivalent']:>12}{c['incompetent']:>13}"
              f"{c['annotation']:>12}{c['skipped']:>9}{pct(c['killed'], ran):>10}"
              f"{pct(c['killed'], ran - c['equivalent']):>15}{c['seconds']:>7}")
    killed = sum(c["killed"] for c in rows.values())
    ran = killed + sum(c["survived"] for c in rows.values())
    equivalent = sum(c["equivalent"] for c in rows.values())
    if ran:
        print(f"{'all':<16}{killed:>8}{ran - killed:>10}{equivalent:>12}{'':>13}{'':>12}{'':>9}"
              f"{pct(killed, ran):>10}{pct(killed, ran - equivalent):>15}")
    for m in modules:
        text = (args.out / f"{m}-survivors.txt").read_text()
        if text:
            print(f"\n=== survivors in protocol/{m}.py\n{text}")


if __name__ == "__main__":
    main()
