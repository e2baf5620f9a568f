"""The trainer's side: the origin role (publish, sign, seed; trajectories in)
and the trajectory store. Uses the daemon's peer, store and weights modules;
nothing below imports it.

    from patchswarm.node.trainer import SyncOrigin
"""

from patchswarm.node.trainer.origin import Origin, OriginConfig, SyncOrigin

__all__ = ["Origin", "OriginConfig", "SyncOrigin"]
