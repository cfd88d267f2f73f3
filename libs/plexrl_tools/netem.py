"""A lossy, slow link for the host bed, where the kernel has no `netem` qdisc.

`tc qdisc ... netem delay 50ms loss 10%` is the usual way to degrade a link, but this
machine's kernel is built without `sch_netem`. It does have netfilter's NFQUEUE: an
iptables rule in a host's namespace hands each packet leaving the host to this program
(`-j NFQUEUE --queue-num N --queue-bypass`), which drops a share of them and lets the
rest go after a delay. One process per degraded host, in that host's namespace:

    ip netns exec HOST python -m plexrl_tools.netem --queue 7 --delay-ms 50 --loss 0.1

It speaks the kernel's nfnetlink_queue protocol over a raw netlink socket (standard
library only). Only packet ids and verdicts travel (copy mode META: no payload is
copied), and verdicts go out in arrival order once each packet's delay has passed, so
the link keeps its order as a wire does. With `--queue-bypass` a packet goes through
unqueued whenever no program listens, so a crash of this one never cuts the host off.
It stops on SIGTERM or SIGINT, or after `--seconds`.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import select
import signal
import socket
import struct
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET = 0
NFQNL_MSG_VERDICT = 1
NFQNL_MSG_CONFIG = 2
NFQA_PACKET_HDR = 1
NFQA_VERDICT_HDR = 2
NFQA_CFG_CMD = 1
NFQA_CFG_PARAMS = 2
NFQNL_CFG_CMD_BIND = 1
NFQNL_CFG_CMD_UNBIND = 2
NFQNL_COPY_META = 1
NF_DROP = 0
NF_ACCEPT = 1
NLM_F_REQUEST = 1
NLM_F_ACK = 4
NLMSG_ERROR = 2


def _attr(kind: int, payload: bytes) -> bytes:
    head = struct.pack("=HH", 4 + len(payload), kind)
    return head + payload + b"\0" * (-(4 + len(payload)) % 4)


def _message(kind: int, flags: int, queue: int, attrs: bytes, seq: int = 0) -> bytes:
    # nfgenmsg: family (AF_UNSPEC), version 0, the queue number (big-endian).
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
    header = struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, flags, seq, 0)
    return header + body


def _attrs(data: bytes) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    at = 0
    while at + 4 <= len(data):
        length, kind = struct.unpack_from("=HH", data, at)
        if length < 4:
            break
        out[kind & 0x7FFF] = data[at + 4 : at + length]
        at += (length + 3) & ~3
    return out


class Link:
    """One queue's packets: each dropped with probability `loss`, else let go after
    `delay_s`."""

    def __init__(self, queue: int, delay_s: float, loss: float, seed: int | None = None) -> None:
        if not 0 <= loss < 1 or delay_s < 0:
            raise ValueError(f"loss {loss} must be in [0, 1) and delay {delay_s}s not negative")
        self.queue = queue
        self.delay_s = delay_s
        self.loss = loss
        self._rng = random.Random(seed)
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self._sock.bind((0, 0))
        self._held: collections.deque[tuple[float, int]] = collections.deque()
        self.passed = 0
        self.dropped = 0
        self.stopping = False

    def _config(self, attrs: bytes) -> None:
        self._sock.send(_message(NFQNL_MSG_CONFIG, NLM_F_REQUEST | NLM_F_ACK, self.queue, attrs))
        reply = self._sock.recv(65536)
        kind = struct.unpack_from("=H", reply, 4)[0]
        if kind == NLMSG_ERROR:
            (error,) = struct.unpack_from("=i", reply, 16)
            if error != 0:
                raise OSError(-error, f"nfnetlink_queue refused the config: {os.strerror(-error)}")

    def bind(self) -> None:
        command = struct.pack("=BxH", NFQNL_CFG_CMD_BIND, 0)
        self._config(_attr(NFQA_CFG_CMD, command))
        params = struct.pack("!IB", 0, NFQNL_COPY_META) + b"\0\0\0"
        self._config(_attr(NFQA_CFG_PARAMS, params[:5]))

    def unbind(self) -> None:
        command = struct.pack("=BxH", NFQNL_CFG_CMD_UNBIND, 0)
        try:
            self._config(_attr(NFQA_CFG_CMD, command))
        finally:
            self._sock.close()

    def _verdict(self, packet_id: int, verdict: int) -> None:
        attrs = _attr(NFQA_VERDICT_HDR, struct.pack("!II", verdict, packet_id))
        self._sock.send(_message(NFQNL_MSG_VERDICT, NLM_F_REQUEST, self.queue, attrs))

    def _receive(self) -> None:
        data = self._sock.recv(65536)
        at = 0
        now = time.monotonic()
        while at + 16 <= len(data):
            length, kind = struct.unpack_from("=IH", data, at)
            if length < 16:
                break
            if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                hdr = _attrs(data[at + 20 : at + length]).get(NFQA_PACKET_HDR)
                if hdr is not None:
                    (packet_id,) = struct.unpack_from("!I", hdr)
                    if self._rng.random() < self.loss:
                        self._verdict(packet_id, NF_DROP)
                        self.dropped += 1
                    else:
                        self._held.append((now + self.delay_s, packet_id))
            at += (length + 3) & ~3

    def run(self, until: float) -> None:
        """Handle packets until the monotonic time `until`, or until `stopping`."""
        while not self.stopping and time.monotonic() < until:
            now = time.monotonic()
            while self._held and self._held[0][0] <= now:
                _, packet_id = self._held.popleft()
                self._verdict(packet_id, NF_ACCEPT)
                self.passed += 1
            wait = until - now
            if self._held:
                wait = min(wait, max(0.0, self._held[0][0] - now))
            readable, _, _ = select.select([self._sock], [], [], min(wait, 0.5))
            if readable:
                self._receive()
        while self._held:  # let what is held go before leaving
            _, packet_id = self._held.popleft()
            self._verdict(packet_id, NF_ACCEPT)


def main() -> None:
    parser = argparse.ArgumentParser(description="delay and drop the packets of one NFQUEUE")
    parser.add_argument("--queue", type=int, required=True)
    parser.add_argument("--delay-ms", type=float, default=50.0)
    parser.add_argument("--loss", type=float, default=0.1, help="share of packets dropped")
    parser.add_argument("--seconds", type=float, default=3600.0, help="stop after this long")
    args = parser.parse_args()
    link = Link(args.queue, args.delay_ms / 1000.0, args.loss)

    def stop(*_: object) -> None:
        link.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    link.bind()
    print(f"queue {args.queue}: delay {args.delay_ms} ms, loss {args.loss:.0%}", flush=True)
    try:
        link.run(time.monotonic() + args.seconds)
    finally:
        link.unbind()
        print(f"passed {link.passed}, dropped {link.dropped}", flush=True)


if __name__ == "__main__":
    main()
