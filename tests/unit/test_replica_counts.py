"""Reading running replica counts out of the Serve controller's details (the dictionary get_serve_instance_details
returns)."""

from __future__ import annotations

import enum

from app.router.replica_counts import running_replicas


class ReplicaState(str, enum.Enum):  # the shape of Serve's own enum: members whose value is the state's name
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    STOPPING = "STOPPING"


def status_with(**deployments: dict) -> dict:
    """Details listing, per deployment, `count` replicas in each state of {state: count}."""
    overviews = {name: {"status": "HEALTHY", "replicas": [{"replica_id": f"{name}-{state}-{i}", "state": state}
                                                         for state, count in states.items() for i in range(count)]}
                 for name, states in deployments.items()}
    return {"applications": {"llm-lanes": {"status": "RUNNING", "deployments": overviews}}}


def test_counts_only_running_replicas():
    status = status_with(ColdLane={ReplicaState.RUNNING: 2, ReplicaState.STARTING: 1, ReplicaState.STOPPING: 1},
                         Router={ReplicaState.RUNNING: 4})
    assert running_replicas(status, "llm-lanes", "ColdLane") == 2
    assert running_replicas(status, "llm-lanes", "Router") == 4


def test_plain_string_states_count_too():
    assert running_replicas(status_with(ColdLane={"RUNNING": 3}), "llm-lanes", "ColdLane") == 3


def test_a_lane_scaled_to_zero_has_no_running_replicas():
    assert running_replicas(status_with(ColdLane={}), "llm-lanes", "ColdLane") == 0


def test_unknown_app_or_deployment_is_none_not_zero():
    status = status_with(Router={ReplicaState.RUNNING: 1})
    assert running_replicas(status, "llm-lanes", "ColdLane") is None
    assert running_replicas(status, "other-app", "Router") is None
    assert running_replicas({"applications": {}}, "llm-lanes", "Router") is None
    assert running_replicas({}, "llm-lanes", "Router") is None
