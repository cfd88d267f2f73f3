"""ClusterConfig's ports: every service of a test cluster gets a port the kernel picked,
never one merely next to a free one (a client's source port may sit there)."""

from __future__ import annotations

import socket
from pathlib import Path

from plexrl_tools.cluster import ClusterConfig, free_ports


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = free_ports(6)
    assert len(set(ports)) == 6
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_each_worker_of_a_free_port_cluster_has_its_own_picked_port(tmp_path: Path) -> None:
    config = ClusterConfig.on_free_ports(tmp_path, tmp_path, "t", workers=3)
    workers = [config.worker_port(i) for i in range(3)]
    assert list(config.worker_ports) == workers
    others = [config.gateway_port, config.scheduler_port, config.state_store_port]
    assert len(set(workers + others)) == 6


def test_a_fixed_port_cluster_still_counts_up_from_its_base(tmp_path: Path) -> None:
    config = ClusterConfig(tmp_path, tmp_path, worker_port_base=9100, workers=2)
    assert [config.worker_port(0), config.worker_port(1)] == [9100, 9101]


def test_a_cluster_on_another_address_is_reached_there(tmp_path: Path) -> None:
    config = ClusterConfig(tmp_path, tmp_path, host="10.77.0.4", gateway_port=9000)
    assert config.gateway_url == "http://10.77.0.4:9000"
