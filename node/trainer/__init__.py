"""The trainer's side: the origin role (publish, sign, seed; trajectories in)
and the trajectory store. Uses the daemon's peer, store and weights modules;
nothing below imports it.

    from patchswarm.node.trainer import SyncOrigin

The origin's names load on first use: `patchswarm trajectories` reads the store
(trajstore, no torch) and would otherwise import the origin and torch with it,
1.5 s of its 2 s.
"""

__all__ = ["Origin", "OriginConfig", "SyncOrigin"]


def __getattr__(name: str):
    if name in __all__:
        from patchswarm.node.trainer import origin

        return getattr(origin, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
