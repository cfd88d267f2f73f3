"""Ask a Kafka broker whether it serves requests, using only the standard library.

scripts/infra.sh runs this before and after starting the broker. It speaks the Kafka
wire protocol (ApiVersions, then Metadata) rather than only opening a TCP connection,
because the socket can accept connections before the broker serves requests, and
because something other than Kafka might hold the port.

Usage: python3 probe.py HOST:PORT [TIMEOUT_SECONDS]
Exit status: 0 the broker answered and lists at least one live broker;
1 nothing accepts connections there; 2 something answered but not as a ready broker.
"""

import socket
import struct
import sys

API_VERSIONS = 18
METADATA = 3
# Metadata v4..v8 share a non-flexible layout; v4 is the oldest Kafka 4.x still serves.
METADATA_VERSION = 4


class NotReady(Exception):
    """Connected, but the peer did not answer like a ready Kafka broker."""


def _request(sock: socket.socket, api_key: int, version: int, corr: int, body: bytes) -> bytes:
    client_id = b"plexrl-infra-probe"
    # Request header v1: api_key, api_version, correlation_id, client_id (int16 string).
    header = struct.pack(">hhih", api_key, version, corr, len(client_id)) + client_id
    sock.sendall(struct.pack(">i", len(header) + len(body)) + header + body)
    size = struct.unpack(">i", _read(sock, 4))[0]
    payload = _read(sock, size)
    if struct.unpack(">i", payload[:4])[0] != corr:
        raise NotReady("response correlation id does not match the request")
    return payload[4:]


def _read(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise NotReady("connection closed mid-response")
        buf += chunk
    return buf


def _api_ranges(sock: socket.socket) -> dict[int, tuple[int, int]]:
    resp = _request(sock, API_VERSIONS, 0, 1, b"")
    error, count = struct.unpack(">hi", resp[:6])
    if error != 0:
        raise NotReady(f"ApiVersions error code {error}")
    ranges = {}
    for i in range(count):
        key, lo, hi = struct.unpack(">hhh", resp[6 + 6 * i : 12 + 6 * i])
        ranges[key] = (lo, hi)
    return ranges


def _broker_count(sock: socket.socket) -> int:
    # Empty topic list (not null) so the answer stays small; no auto-creation.
    body = struct.pack(">i?", 0, False)
    resp = _request(sock, METADATA, METADATA_VERSION, 2, body)
    _throttle, brokers = struct.unpack(">ii", resp[:8])
    return int(brokers)


def probe(host: str, port: int, timeout: float) -> tuple[int, str]:
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        return 1, f"no connection to {host}:{port}: {e}"
    try:
        with sock:
            sock.settimeout(timeout)
            ranges = _api_ranges(sock)
            lo, hi = ranges.get(METADATA, (0, -1))
            if not lo <= METADATA_VERSION <= hi:
                return 0, f"kafka at {host}:{port} answers ApiVersions (Metadata v{lo}-v{hi})"
            brokers = _broker_count(sock)
            if brokers < 1:
                return 2, f"kafka at {host}:{port} answers but lists no live broker yet"
            return 0, f"kafka at {host}:{port} answers, {brokers} live broker(s)"
    except (OSError, NotReady, struct.error) as e:
        return 2, f"{host}:{port} accepts connections but is not a ready Kafka broker: {e}"


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    host, _, port = sys.argv[1].rpartition(":")
    timeout = float(sys.argv[2]) if len(sys.argv) > 2 else 2.0
    status, message = probe(host or "127.0.0.1", int(port), timeout)
    print(message)
    return status


if __name__ == "__main__":
    sys.exit(main())
