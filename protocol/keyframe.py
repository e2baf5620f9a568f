"""Keyframes: a full served state as a patch from nothing, for nodes that join late.

The coding itself (byte planes, rotated floats, zstd) lives in planes.py and
the container in patch.py; this module is the name callers look for.
"""

from .patch import Patch, apply, keyframe

__all__ = ["Patch", "apply", "keyframe"]
