"""The model servers the exporter knows: one module each, one row here (blackbox_exporter's
`Probers` table).

A server module holds everything that server is (exporter/servers/server.py says what): how its
command lines start it, its log format, what its HTTP answers give away. The engines read these
rows and know no server by name: exporter/discovery/serverargs.py (argv, config file, environment),
exporter/logs/markers.py (log lines to events), exporter/sources/endpoint.py (answers to a kind);
the config accepts every kind here for `log.format` and `discovery.servers`.

Adding a server is a module beside these and its line below (and, if wanted, a stand-in log
writer in exporter/sim/serverlog.py). The order is the order in which `log.format: auto` tries
the formats' signatures and the prober weighs equal evidence.
"""

from __future__ import annotations

from collections.abc import Mapping

from exporter.servers import llamacpp, sglang, tgi, triton, vllm
from exporter.servers.server import Server

SERVERS: Mapping[str, Server] = {
    server.kind: server
    for server in (
        sglang.SERVER,
        vllm.SERVER,
        llamacpp.SERVER,
        tgi.SERVER,
        triton.SERVER,
    )
}
