"""preflight --cluster: the GPU checks run where the GPUs are, one Ray task on each GPU node of a running cluster.

The head (no GPU) reads the serve config once; each GPU node gathers its own readings in a task pinned to it
(NodeAffinitySchedulingStrategy) that first asks for all of the node's GPUs, so the timed copies have them to
themselves. A node whose GPUs stay held (replicas already running) gets a second task without GPUs that reads NVML
only, and what it cannot measure is UNCHECKED. The decisions (which nodes, what a missing answer means) are the
plain functions at the top; `gather_on_gpu_nodes` is the only Ray code.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from app.tools.preflight.readings import UNCHECKED, Check, Readings

GPUS_HELD = "the node's GPUs are held by other work (replicas already running?): not measured"


@dataclass(frozen=True)
class GpuNode:
    node_id: str
    address: str
    gpus: int

    @property
    def label(self) -> str:
        return f"node {self.address} ({self.gpus} GPU{'s' if self.gpus != 1 else ''})"


def gpu_nodes(nodes: list[dict[str, Any]]) -> list[GpuNode]:
    """The live nodes that offer GPUs, from `ray.nodes()`; the head of prod's clusters offers none."""
    found = []
    for node in nodes:
        gpus = int(node.get("Resources", {}).get("GPU", 0))
        if node.get("Alive") and gpus >= 1:
            found.append(GpuNode(node["NodeID"], node.get("NodeManagerAddress", node["NodeID"][:8]), gpus))
    return sorted(found, key=lambda n: n.address)


def no_gpu_nodes_check() -> Check:
    return Check("GPU nodes in the Ray cluster", UNCHECKED, "0",
                 "no live node offers a GPU: the GPU items were not checked anywhere (GPU pods or VMs not up yet? "
                 "the autoscaler starts cold-lane nodes on demand; run again once `ray status` lists GPUs)")


def unanswered_node_check(node: GpuNode, reason: str) -> Check:
    return Check(f"GPU checks on {node.label}", UNCHECKED, "no readings", reason)


def node_task_kwargs(head: Readings, bandwidth: bool, copy_bytes: int) -> dict[str, Any]:
    """What a node's task needs from the head's serve config (the path may not resolve on the node)."""
    return dict(tensor_parallel_size=head.tensor_parallel_size, device=head.device, mps_settings=head.mps_settings,
                bandwidth=bandwidth, copy_bytes=copy_bytes)


def _gather_on_node(kwargs: dict[str, Any], holds_gpus: bool) -> Readings:
    from app.tools.preflight.gather import gather_readings

    readings = gather_readings(**{**kwargs, "bandwidth": kwargs["bandwidth"] and holds_gpus})
    if kwargs["bandwidth"] and not holds_gpus:
        readings.bandwidth_unknown_reason = GPUS_HELD
    return readings


def gather_on_gpu_nodes(address: str, kwargs: dict[str, Any], timeout_s: float) -> dict[GpuNode, Readings | str]:
    """Readings of every GPU node (or why there are none), from tasks pinned to each node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    connected_here = not ray.is_initialized()
    if connected_here:
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    try:
        remote = ray.remote(_gather_on_node)

        def launch(node: GpuNode, holds_gpus: bool):
            return remote.options(
                num_cpus=0, num_gpus=node.gpus if holds_gpus else 0, max_retries=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
            ).remote(kwargs, holds_gpus)

        results: dict[GpuNode, Readings | str] = {}
        pending = {launch(node, True): node for node in gpu_nodes(ray.nodes())}
        for holds_gpus in (True, False):
            if not pending:
                break
            ready, late = ray.wait(list(pending), num_returns=len(pending), timeout=timeout_s)
            for ref in ready:
                try:
                    results[pending[ref]] = ray.get(ref)
                except Exception as error:  # noqa: BLE001 - the node's task failed: say why, check the rest
                    results[pending[ref]] = f"the task on the node failed: {error}"
            for ref in late:
                ray.cancel(ref, force=True)
            if holds_gpus:  # GPUs busy: read what needs no GPU of its own
                pending = {launch(pending[ref], False): pending[ref] for ref in late}
            else:
                for ref in late:
                    results[pending[ref]] = f"no answer within {timeout_s:g} s (node busy or unreachable)"
        return results
    finally:
        if connected_here:
            ray.shutdown()
