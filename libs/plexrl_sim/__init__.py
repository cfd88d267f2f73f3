"""The cluster simulator behind `plexrl sim`: RLVR jobs on a cluster of accelerator
groups, dedicated deployments in closed form, shared ones decided call by call by the
live scheduler's own decision (`plexrl.policy.decide`).

A product of its own: it depends on the pure policy (`plexrl.policy`) and the wire
contracts (`plexrl.messages`), nothing else of `plexrl`. See docs/simulator.md.
"""
