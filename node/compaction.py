"""How many versions a member keeps as patches after its base before it writes the state whole.

Owns the default only (node/persistence.py does the compacting). Kept apart and
free of torch because the CLI shows it: every `patchswarm` command builds the
whole parser, so a default read from node/persistence.py loaded torch (~1.5 s
of CPU) into `swarm init`, `swarm issue` and the tracker, which never hold weights.
"""

COMPACT_EVERY = 16  # versions between full writes: amortized, at most state/16 written per version
