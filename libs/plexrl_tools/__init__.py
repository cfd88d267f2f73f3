"""PlexRL's operator and test tooling: what runs the services, never what they run.

The `plexrl` command line (`plexrl_tools.cli`), the local cluster that starts the four
services as processes (`plexrl_tools.cluster`), the tiny model's warm-up pretraining, and
the fault workloads and infrastructure the tests and benchmarks drive (a private Kafka and
Redis, the host bed of network namespaces, a lossy link). Only this package imports the
services; the runtime code they share lives in `plexrl`.
"""
