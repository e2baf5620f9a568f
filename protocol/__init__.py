"""patchswarm.protocol: sans-IO formats and decisions (patch codec, manifests, wire, picker, trajectories)."""
