"""HotLane: the latency lane. On GPU each replica is a tensor-parallel group in a STRICT_PACK placement group."""

from ray import serve

from app.lanes.replica import LaneReplica


@serve.deployment(name="HotLane")
class HotLane(LaneReplica):
    lane = "hot"
