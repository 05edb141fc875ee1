"""The process group's rendezvous bound to the node's Ray address, not to every interface.

Ray Train sets up torch.distributed with `init_process_group("tcp://addr:port")`, whose rank 0
hosts the TCPStore; torch's store listens on all interfaces (it has no bind address), so a
local run exposed its rendezvous beside Ray's loopback-only ports. Here rank 0 binds the
listening socket itself, on the address Ray gave its node (127.0.0.1 in a local run, the node's
cluster interface on a cluster), and hands it to a multi-tenant TCPStore; the process group that
Ray's setup then creates on the same port in the same process shares that server (torch caches
multi-tenant servers by port) and opens no socket of its own.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Optional

import ray
import torch.distributed as dist
from ray.train.torch.config import TorchConfig, _set_torch_distributed_env_vars, _setup_torch_process_group, _TorchBackend

# Rank 0's store server: alive as long as the worker, so that the process group keeps its server.
_hosted: Optional[tuple[socket.socket, dist.TCPStore]] = None


def _host_store(timeout_s: int) -> tuple[str, int]:
    """On rank 0: listen on this node's Ray address, on a free port; returns the address."""
    global _hosted
    address = ray.util.get_node_ip_address()
    listener = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((address, 0))
    listener.listen(2048)
    port = listener.getsockname()[1]
    store = dist.TCPStore(address, port, is_master=True, wait_for_workers=False, multi_tenant=True,
                          master_listen_fd=listener.fileno(), timeout=timedelta(seconds=timeout_s))
    _hosted = (listener, store)
    return address, port


class _NodeBoundTorchBackend(_TorchBackend):
    def on_start(self, worker_group, backend_config: "NodeBoundTorchConfig") -> None:
        address, port = worker_group.execute_single(0, _host_store, timeout_s=backend_config.timeout_s)
        worker_group.execute(_set_torch_distributed_env_vars)
        ray.get([worker_group.execute_single_async(
            rank, _setup_torch_process_group, backend=backend_config.backend, world_rank=rank,
            world_size=len(worker_group), init_method=f"tcp://[{address}]:{port}" if ":" in address
            else f"tcp://{address}:{port}", timeout_s=backend_config.timeout_s)
            for rank in range(len(worker_group))])


class NodeBoundTorchConfig(TorchConfig):
    """Ray Train's TorchConfig with the rendezvous bound to the node's address; `backend` is
    required (raylm knows whether it runs gloo or nccl)."""

    @property
    def backend_cls(self):
        return _NodeBoundTorchBackend
