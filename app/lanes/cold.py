"""ColdLane: the throughput lane: larger batches, speculative decoding, replica count from its backlog."""

from __future__ import annotations

from ray import serve

from app.batch.autoscaling import autoscaling_stats
from app.lanes.replica import LaneReplica


@serve.deployment(name="ColdLane")
class ColdLane(LaneReplica):
    lane = "cold"

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Custom autoscaling metrics for the queue-depth policy (app.batch.autoscaling:ColdLanePolicy).

        Ray calls this on every replica of a deployment with an autoscaling_config; the durable batch backlog is
        shared by all replicas (the policy takes its max), the engine's waiting requests are this replica's own.
        """
        if getattr(self, "_batch_store", None) is None:
            from app.batch.open_store import open_batch_store

            self._batch_store = open_batch_store(self.cfg.batch.store)
        backlog = self._batch_store.backlog_stats()
        return autoscaling_stats(backlog.pending_lines, backlog.pending_tokens, self.engine.stats().waiting)
