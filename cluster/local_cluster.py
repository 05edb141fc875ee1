"""Command line for a local multi-node Ray cluster (the library is cluster/local.py).

    scripts/local-cluster start --nodes 3 --cpus-per-node 2   # head + 3 worker nodes
    scripts/local-cluster status
    scripts/local-cluster kill-node 2      # SIGKILL node 2's processes: a node loss
    scripts/local-cluster start-node 2     # the node comes back (same IP and temp dir)
    scripts/local-cluster preempt-node 2 --deadline 30   # a spot reclaim: notice, then kill at 30 s
    scripts/local-cluster stop

The head serves Ray's job API on 127.0.0.1 (`ray job submit`, `raylm submit`), and Ray's token
authentication is on: `start` prints the `export` lines that a driver or `ray` command needs
(RAY_ADDRESS, RAY_API_SERVER_ADDRESS, RAY_AUTH_MODE=token); the token itself stays in this
user's token file.

Also `python -m cluster.local_cluster ...` from the repository root. Each command is a new
process: the cluster's node layout and PIDs live in a state file (--state, or
$RAYLM_LOCAL_CLUSTER_STATE, default /tmp/raylm-local-cluster.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional

from cluster.local import LocalCluster, LocalClusterError

DEFAULT_STATE = "/tmp/raylm-local-cluster.json"


def _load(path: str) -> LocalCluster:
    if not os.path.exists(path):
        raise LocalClusterError(f"no cluster state at {path}: run `start` first (or pass --state)")
    return LocalCluster.load(path)


def _status(cluster: LocalCluster) -> str:
    try:
        ids = cluster.node_ids()
    except Exception as e:  # noqa: BLE001 - a dead GCS is a status to show, not a crash
        ids, note = {}, f" (GCS at {cluster.address} unreachable: {type(e).__name__})"
    else:
        note = ""
    server = f"; job server {cluster.dashboard_url}" if cluster.dashboard else ""
    lines = [f"address {cluster.address}{server}{note}", f"{'node':>4}  {'ip':<10} {'cpus':>4}  {'ray':<5}  "
             f"{'pids':<5} node id"]
    for node in cluster.nodes:
        pids = cluster.processes(node.index)
        state = "alive" if node.index in ids else "dead"
        lines.append(f"{node.index:>4}  {node.ip:<10} {node.cpus:>4}  {state:<5}  {len(pids):<5} "
                     f"{ids.get(node.index, '-')}{'  (head)' if node.is_head else ''}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="local-cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--state", default=os.environ.get("RAYLM_LOCAL_CLUSTER_STATE", DEFAULT_STATE),
                        help="state file with the cluster's nodes and PIDs (default: %(default)s)")
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("start", help="start a head and N worker nodes")
    start.add_argument("--nodes", type=int, default=2, help="worker nodes (default: %(default)s)")
    start.add_argument("--cpus-per-node", type=int, default=2, help="CPUs per worker node (default: %(default)s)")
    start.add_argument("--head-cpus", type=int, default=0,
                       help="CPUs of the head (default: %(default)s, so work lands on worker nodes)")
    start.add_argument("--system-config", type=json.loads, default=None,
                       help="JSON merged over the fast failure-detection GCS settings")
    start.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                       help="extra environment for every node's processes (repeatable)")
    for name, text in (("kill-node", "SIGKILL every process of worker node N"),
                       ("start-node", "start worker node N again after kill-node")):
        commands.add_parser(name, help=text).add_argument("index", type=int, metavar="N")
    preempt = commands.add_parser("preempt-node", help="drain worker node N with a preemption deadline (a "
                                  "spot reclaim's notice), then kill it at the deadline")
    preempt.add_argument("index", type=int, metavar="N")
    preempt.add_argument("--deadline", type=int, default=30, help="seconds from the notice to the kill "
                         "(default: %(default)s; AWS gives 120, GCP 30)")
    commands.add_parser("status", help="nodes, Ray's view of them, their process counts")
    commands.add_parser("stop", help="kill every process the cluster started")
    args = parser.parse_args(argv)

    try:
        if args.command == "start":
            if os.path.exists(args.state):
                raise LocalClusterError(f"{args.state} exists: a cluster is running (`stop` it) or "
                                        "pass another --state")
            env = dict(item.split("=", 1) for item in args.env)
            cluster = LocalCluster(args.nodes, args.cpus_per_node, args.head_cpus, args.system_config, env)
            began = time.monotonic()
            try:
                cluster.start()
            except BaseException:
                cluster.stop()
                raise
            cluster.save(args.state)
            print(f"started in {time.monotonic() - began:.1f} s; logs under {cluster.root}\n"
                  f"{_status(cluster)}\n\n# for a driver:")
            print("".join(f"export {k}={v}\n" for k, v in cluster.driver_env().items()), end="")
        elif args.command == "kill-node":
            cluster = _load(args.state)
            pids = cluster.kill_node(args.index)
            cluster.save(args.state)
            running = [n.index for n in cluster.nodes if cluster.processes(n.index)]
            waited = cluster.wait_for_alive(running, timeout_s=60)
            print(f"killed node {args.index} (pids {' '.join(map(str, pids))}); "
                  f"Ray declared it dead {waited:.1f} s later")
        elif args.command == "start-node":
            cluster = _load(args.state)
            began = time.monotonic()
            cluster.start_node(args.index)
            cluster.save(args.state)
            print(f"node {args.index} rejoined in {time.monotonic() - began:.1f} s\n{_status(cluster)}")
        elif args.command == "preempt-node":
            cluster = _load(args.state)
            node_id = cluster.drain_node(args.index, args.deadline)
            print(f"node {args.index} ({node_id}) drained for preemption; killing it in {args.deadline} s", flush=True)
            time.sleep(args.deadline)
            pids = cluster.kill_node(args.index)
            cluster.save(args.state)
            print(f"killed node {args.index} (pids {' '.join(map(str, pids))})")
        elif args.command == "status":
            print(_status(_load(args.state)))
        elif args.command == "stop":
            _load(args.state).stop()
            os.remove(args.state)
            print("stopped")
    except (LocalClusterError, TimeoutError, ValueError) as e:
        print(f"local-cluster: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
