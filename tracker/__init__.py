"""patchswarm.tracker: the tracker service (membership, peer lists by region, signed version notices)."""
