"""PlexRL: a cluster runtime for RLVR jobs that share one accelerator pool.

This package holds what more than one service needs: the wire contracts
(`plexrl.messages`), Kafka and Redis helpers, settings, tracing, the pure
scheduling policy (`plexrl.policy`) and the command line (`plexrl.cli`).
"""

__version__ = "0.1.0"
