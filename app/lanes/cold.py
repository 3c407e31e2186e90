"""ColdLane: the throughput lane: larger batches, speculative decoding, replica count from its backlog."""

from ray import serve

from app.lanes.replica import LaneReplica


@serve.deployment(name="ColdLane")
class ColdLane(LaneReplica):
    lane = "cold"
