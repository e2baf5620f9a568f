"""patchswarm.node: the I/O side of a swarm member (trio).

Rooms by role: the rollout daemon's modules at this level (daemon, peers,
relay, store, weights, spool, localapi, client, lowprio, checkpoint, seglog);
`net/` the network layer the tracker shares; `trainer/` the origin role and
the trajectory store; `cli/` the `patchswarm` command; `demo/` the demo
(behind the `demo` extra). Lower rooms never import higher ones:
net < the daemon's modules < trainer < cli (tests/test_layers.py).
"""
