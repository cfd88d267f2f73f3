"""PlexRL: a cluster runtime for RLVR jobs that share one accelerator pool.

This package holds what more than one service needs at run time: the wire contracts
(`plexrl.messages`), Kafka and Redis helpers, settings, tracing and the pure
scheduling policy (`plexrl.policy`). It imports no service; the command line, the
local cluster and the test tooling are in `plexrl_tools`.
"""

__version__ = "0.1.0"
