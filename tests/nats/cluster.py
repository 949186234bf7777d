"""A three-server NATS cluster with JetStream on free ports (`nats-server` processes)."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Sequence

from .conftest import NatsServer, free_port


class NatsCluster:
    """Three `nats-server -js` processes routed to each other (cluster `tr`), each on
    free client, monitoring and route ports with a store of its own; `close()` stops
    them all. `url` lists the three client URLs, comma-separated, as `--nats` takes it."""

    def __init__(self, size: int = 3, *, args: Sequence[str] = ()) -> None:
        routes = [free_port() for _ in range(size)]
        listed = ",".join(f"nats://127.0.0.1:{port}" for port in routes)
        self.servers: list[NatsServer] = []
        self.names = [f"n{index}" for index in range(size)]
        try:
            for index, route in enumerate(routes):
                self.servers.append(NatsServer(args=[
                    "--server_name", self.names[index], "--cluster_name", "tr",
                    "--cluster", f"nats://127.0.0.1:{route}", "--routes", listed, *args],
                    wait=False))
            for server in self.servers:  # healthy once JetStream has its meta leader
                server.until_healthy(within=30)
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        return ",".join(server.url for server in self.servers)

    def leader_of(self, stream: str) -> NatsServer:
        """The server leading `stream` now (asked of a running server's monitoring
        endpoint; bounded poll: a leader is elected within seconds)."""
        deadline = time.monotonic() + 20
        while True:
            for server in self.servers:
                if server.proc.poll() is not None:
                    continue
                try:
                    with urllib.request.urlopen(
                            f"http://127.0.0.1:{server.monitor}/jsz?streams=true",
                            timeout=2) as reply:
                        info = json.load(reply)
                except OSError:
                    continue
                for account in info.get("account_details") or ():
                    for detail in account.get("stream_detail") or ():
                        leader = (detail.get("cluster") or {}).get("leader")
                        if detail.get("name") == stream and leader in self.names:
                            return self.servers[self.names.index(leader)]
            if time.monotonic() > deadline:
                raise RuntimeError(f"no leader of stream {stream} found")
            time.sleep(0.1)

    def close(self) -> None:
        for server in self.servers:
            server.close()
