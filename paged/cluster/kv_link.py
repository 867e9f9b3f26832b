"""Where a disaggregated fleet's KV travels: which replicas share a node, and what one copy costs.

Replicas take GPUs in order, the prefill pool first and then the decode pool (replica i holds GPUs
i x num_gpus onwards), on nodes of `hardware.gpus_per_node` GPUs. Two replicas on one node copy over
NVLink (`interconnect_bandwidth`, `interconnect_latency_s`), others over the network
(`network_bandwidth`: per GPU, its NIC; `network_latency_s`). Each GPU of a tensor-parallel replica
holds its KV heads' share of every block and sends it over its own link, so a replica's copy runs at
num_gpus times one GPU's bandwidth. A copy costs its latency plus its bytes over that bandwidth: one
bulk transfer of all its blocks, as NIXL or Mooncake's transfer engine issue it. Only the links a
fleet's pairs use must be given; a missing one is a one-line error before anything is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paged.config import ConfigError

NVLINK = "nvlink"
NETWORK = "network"
# the hardware keys each link is priced by: (bandwidth, latency)
LINK_KEYS = {
    NVLINK: ("interconnect_bandwidth", "interconnect_latency_s"),
    NETWORK: ("network_bandwidth", "network_latency_s"),
}


@dataclass(frozen=True)
class Link:
    name: str  # NVLINK or NETWORK
    bandwidth: float  # B/s one way, all GPUs of a replica together
    latency_s: float

    def seconds(self, num_bytes: int) -> float:
        return self.latency_s + num_bytes / self.bandwidth


class Placement:
    """Replicas on nodes, and the link between a prefill and a decode replica (by their indices)."""

    def __init__(self, hardware: Any, num_prefill: int, num_decode: int) -> None:
        gpus, per_node = int(hardware.num_gpus), hardware.gpus_per_node
        where = f"cluster.prefill_replicas={num_prefill} + decode_replicas={num_decode} replicas of {gpus} GPU(s)"
        if per_node is None:
            raise ConfigError(
                f"hardware={hardware.name} gives no gpus_per_node: disaggregated prefill/decode places its {where} on "
                "nodes of that many GPUs to price KV transfers (NVLink within one, the network across); set it"
            )
        if per_node <= 0 or per_node % gpus:
            raise ConfigError(
                f"hardware.gpus_per_node={per_node} must be a positive multiple of hardware.num_gpus={gpus}: a "
                "replica's GPUs sit in one node"
            )
        self.node = [i * gpus // per_node for i in range(num_prefill + num_decode)]
        pairs = {(p, d) for p in range(num_prefill) for d in range(num_prefill, num_prefill + num_decode)}
        used = {NVLINK if self.node[p] == self.node[d] else NETWORK for p, d in pairs}
        self.links = {name: _link(hardware, name, gpus, where, len(set(self.node)), per_node) for name in used}

    def link(self, src: int, dst: int) -> Link:
        return self.links[NVLINK if self.node[src] == self.node[dst] else NETWORK]


def _link(hardware: Any, name: str, gpus: int, where: str, num_nodes: int, per_node: int) -> Link:
    bandwidth_key, latency_key = LINK_KEYS[name]
    bandwidth, latency = getattr(hardware, bandwidth_key), getattr(hardware, latency_key)
    for key, value in ((bandwidth_key, bandwidth), (latency_key, latency)):
        if value is None:
            across = (
                f"span {num_nodes} nodes of gpus_per_node={per_node}, so KV crosses the network" if name == NETWORK
                else "share a node, so KV crosses NVLink"
            )
            raise ConfigError(f"hardware.{key} is not given (null) for hardware={hardware.name}: the {where} {across}")
    if bandwidth <= 0 or latency < 0:
        raise ConfigError(
            f"hardware.{bandwidth_key}={bandwidth} must be > 0 and hardware.{latency_key}={latency} >= 0"
        )
    return Link(name, float(bandwidth) * gpus, float(latency))
