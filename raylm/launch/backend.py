"""Ray Train's torch backend with the process group's rendezvous bound to the node's Ray address,
kept free of torch where it runs outside the workers.

Ray Train sets up torch.distributed with `init_process_group("tcp://addr:port")`, whose rank 0
hosts the TCPStore; torch's store listens on all interfaces (it has no bind address), so a
local run exposed its rendezvous beside Ray's loopback-only ports. Here rank 0 binds the
listening socket itself, on the address Ray gave its node (127.0.0.1 in a local run, the node's
cluster interface on a cluster), and hands it to a multi-tenant TCPStore; the process group that
Ray's setup then creates on the same port in the same process shares that server (torch caches
multi-tenant servers by port) and opens no socket of its own.

The config and the backend are Ray's `BackendConfig` and `Backend`, not subclasses of its
`TorchConfig` and torch backend, whose module imports torch: the driver pickles them to Train's
controller, which would import torch (2 s on 2 cores) on the way to the first step only to
unpickle them. Torch is imported in the workers, by the functions they run.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import ray
from ray._private.ray_constants import env_integer
from ray.exceptions import GetTimeoutError
from ray.train.backend import Backend, BackendConfig
from ray.train.constants import DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S

logger = logging.getLogger(__name__)

# Rank 0's store server: alive as long as the worker, so that the process group keeps its server.
_hosted: Optional[tuple[socket.socket, Any]] = None


def _host_store(timeout_s: int) -> tuple[str, int]:
    """On rank 0: listen on this node's Ray address, on a free port; returns the address."""
    import torch.distributed as dist

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


def _join_process_group(backend: str, world_rank: int, world_size: int, init_method: str, timeout_s: int) -> None:
    """On each worker: torchrun's environment variables, then Ray's own process-group setup."""
    from ray.train.torch.config import _set_torch_distributed_env_vars, _setup_torch_process_group

    _set_torch_distributed_env_vars()
    _setup_torch_process_group(backend=backend, world_rank=world_rank, world_size=world_size,
                               init_method=init_method, timeout_s=timeout_s)


def _leave_process_group(destroy_process_group: bool) -> None:
    from ray.train.torch.config import _shutdown_torch

    _shutdown_torch(destroy_process_group=destroy_process_group)


class _DeviceContext:
    """TorchConfig's context around the training function (each worker's default CUDA device),
    made in the worker, where its module's torch import belongs."""

    def __enter__(self) -> None:
        from ray.train.torch.config import TorchConfigContextManager

        self._context = TorchConfigContextManager()
        self._context.__enter__()

    def __exit__(self, *exc_info: Any) -> bool:
        return self._context.__exit__(*exc_info)


class _NodeBoundTorchBackend(Backend):
    share_cuda_visible_devices = True  # as Ray's torch backend: NCCL reaches the node's other GPUs

    def on_start(self, worker_group, backend_config: "NodeBoundTorchConfig") -> None:
        address, port = worker_group.execute_single(0, _host_store, timeout_s=backend_config.timeout_s)
        init_method = f"tcp://[{address}]:{port}" if ":" in address else f"tcp://{address}:{port}"
        ray.get([worker_group.execute_single_async(
            rank, _join_process_group, backend=backend_config.backend, world_rank=rank,
            world_size=len(worker_group), init_method=init_method, timeout_s=backend_config.timeout_s)
            for rank in range(len(worker_group))])

    def on_shutdown(self, worker_group, backend_config: "NodeBoundTorchConfig") -> None:
        # As Ray's torch backend: the group is destroyed only when there are peers to leave.
        futures = worker_group.execute_async(_leave_process_group, destroy_process_group=len(worker_group) > 1)
        timeout_s = env_integer(TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S)
        try:
            ray.get(futures, timeout=timeout_s)
        except GetTimeoutError:
            logger.warning(f"Torch process group shutdown timed out after {timeout_s} seconds")


@dataclass
class NodeBoundTorchConfig(BackendConfig):
    """What Ray Train's TorchConfig configures, with the rendezvous bound to the node's address;
    `backend` is required (raylm knows whether it runs gloo or nccl)."""

    backend: str
    timeout_s: int = 1800

    @property
    def backend_cls(self) -> type:
        return _NodeBoundTorchBackend

    @property
    def train_func_context(self) -> type:
        return _DeviceContext

    @property
    def framework(self) -> None:
        # None, not TrainingFramework.TORCH: with run tracking (a joined cluster), Train then asks
        # rank 0 for torch's version, a TorchVersion, whose unpickling imported torch into the
        # controller at every start of the worker group: 1.5 s of CPU and 200 MB on the head node
        # for a name and a version in the dashboard's record of the run.
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "init_method": "tcp", "timeout_s": self.timeout_s}
