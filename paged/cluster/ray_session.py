"""The Ray session a fleet's replicas run in: a local Ray instance, or an existing cluster by address.

Everything that can fail here fails before any replica loads weights, as one line naming the
setting: an address where no cluster answers (checked with a plain TCP connect first, because Ray
itself retries an unreachable address for minutes), and a fleet that needs more CPUs or GPUs than
the cluster has. A process already connected to Ray (a job of `hydra/launcher=ray`, a test's
session) keeps its connection, and the fleet leaves it open.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

import ray

from paged.config import ConfigError
from paged.utils.threads import available_cores

log = logging.getLogger(__name__)

# seconds to wait for a TCP connection to cluster.address before calling it unreachable
CONNECT_TIMEOUT_S = 5.0
# the local instance's object store: the replicas exchange small records, never tensors
LOCAL_OBJECT_STORE_BYTES = 128 * 2**20


@dataclass(frozen=True)
class Placement:
    """What the fleet asks of the cluster: `num_replicas` actors of `cpus` CPUs and `gpus` GPUs each."""

    num_replicas: int
    cpus: float
    gpus: float

    def check(self, cpus: float, gpus: float, where: str) -> None:
        """ConfigError unless a cluster with `cpus` and `gpus` in all (`where`: which cluster) holds them."""
        n = self.num_replicas
        if n * self.cpus > cpus:
            raise ConfigError(
                f"cluster.num_replicas={n} x cluster.num_cpus_per_replica={self.cpus:g} needs {n * self.cpus:g} "
                f"CPUs, but {where} has {cpus:g}; lower either, or give cluster.address of a larger Ray cluster"
            )
        if n * self.gpus > gpus:
            raise ConfigError(
                f"cluster.num_replicas={n} replicas of {self.gpus:g} GPU(s) each need {n * self.gpus:g} GPUs, "
                f"but {where} has {gpus:g}; lower cluster.num_replicas, or run them on the CPU (model.device=cpu)"
            )


def connect(address: str | None, placement: Placement) -> bool:
    """Join or start the Ray session and check that it can place the fleet; returns whether this call
    started it (then the fleet ends it when it shuts down)."""
    if ray.is_initialized():
        _check_room(placement, "the Ray cluster this process is connected to")
        free = ray.available_resources().get("CPU", 0.0)
        if free < placement.num_replicas * placement.cpus:
            # this process may itself hold some (a job of hydra/launcher=ray): the replicas wait for them
            log.warning("the Ray cluster has %g CPUs free, the replicas need %g: they start as others free them",
                        free, placement.num_replicas * placement.cpus)
        return False
    if address is None:
        cores = available_cores()
        where = f"a local Ray instance on this machine's {cores} cores"
        placement.check(cores, float("inf"), where)  # the GPUs are Ray's to detect, checked once it runs
        ray.init(
            address="local", num_cpus=cores, include_dashboard=False, logging_level=logging.WARNING,
            object_store_memory=LOCAL_OBJECT_STORE_BYTES,
        )
        log.info("started %s", where)
    else:
        _check_reachable(address)
        try:
            ray.init(address=address, logging_level=logging.WARNING)
        except ConnectionError as e:
            raise ConfigError(f"cluster.address={address!r}: no Ray cluster answers there ({_one_line(e)})") from None
        where = f"the Ray cluster at {address}"
        log.info("connected to %s", where)
    try:
        _check_room(placement, where)
    except ConfigError:
        ray.shutdown()
        raise
    return True


def _check_room(placement: Placement, where: str) -> None:
    resources = ray.cluster_resources()
    placement.check(resources.get("CPU", 0.0), resources.get("GPU", 0.0), where)


def _check_reachable(address: str) -> None:
    """A TCP connect to `host:port` (`ray://host:port` for Ray Client); `auto` (the cluster this
    machine belongs to) is left to Ray, which answers at once when there is none."""
    if address == "auto":
        return
    target = urlsplit(address if "://" in address else f"//{address}")
    try:
        host, port = target.hostname, target.port
    except ValueError:
        host = port = None
    if not host or port is None:
        raise ConfigError(
            f"cluster.address={address!r} is not host:port, ray://host:port or auto (None: a local Ray instance)"
        )
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise ConfigError(
            f"cluster.address={address!r}: no Ray cluster reachable there ({e.strerror or e}); start one "
            "(ray start --head) or leave cluster.address unset for a local Ray instance"
        ) from None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())
