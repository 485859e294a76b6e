"""``python -m cluster up|down``: local Ray + Serve bring-up (see ``cluster/local.py``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cluster import local
from configs.cli_args import existing_file, number, port


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster",
                                description="Start or stop specload on a local Ray.")
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="start Ray if needed, deploy every strategy, print the URL")
    u.add_argument("--config", type=existing_file(), default=local.DEFAULT_CONFIG,
                   help="Serve config (default: configs/serve.yaml)")
    u.add_argument("--port", type=port(), default=local.DEFAULT_PORT, help="HTTP port (8000)")
    u.add_argument("--address", default=None,
                   help="existing Ray cluster (GCS host:port); default RAY_ADDRESS, else "
                        "start a local head")
    u.add_argument("--dashboard", default=None,
                   help="its dashboard URL (default RAY_DASHBOARD_ADDRESS or :8265)")
    u.add_argument("--num-cpus", type=number(int, ge=1), default=None,
                   help="CPUs the local head advertises (default: all)")
    u.add_argument("--timeout", type=number(gt=0), default=600, help="seconds to wait for readiness")
    u.add_argument("--direct-ingress", action=argparse.BooleanOptionalAction, default=True,
                   help="Ray Serve's direct ingress on the head this starts (on by default): each "
                        "strategy replica also answers HTTP on a port of its own (from 30000 up, "
                        "on the config's http_options host), listed by GET /specload/routes; "
                        "python -m loadgen's default route loads them (no Serve proxy in the "
                        "path) and falls back to the proxy's route when one refuses or drops a "
                        "connection")
    d = sub.add_parser("down", help="stop what `up` started on this port")
    d.add_argument("--port", type=port(), default=local.DEFAULT_PORT)
    a = p.parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    if a.cmd == "up" and "--direct-ingress" in given and "--no-direct-ingress" in given:
        u.error("argument --direct-ingress/--no-direct-ingress: give one of them, not both")
    if a.cmd == "up":
        try:   # both are checked before Ray starts
            url = local.up(Path(a.config), a.port, a.address, a.dashboard, a.num_cpus, a.timeout,
                           a.direct_ingress)
        except local.ConfigError as err:
            u.error(f"argument --config: {err}")
        except local.PortInUse as err:
            u.error(f"argument --port: {err}")
        print(url, flush=True)   # the last stdout line: scripts read it
        return 0
    local.down(a.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
