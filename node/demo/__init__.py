"""The `make demo` RL loop, the parts that need no swarm.

task.py (policy, task, rollouts, update), learner.py (the trainer's side and
the same loop in one process), rollout_worker.py (one per node), view.py (the
live terminal view), figure.py (the PNG). The orchestrator that starts the
swarm processes wires these to SyncOrigin and NodeClient.
"""
