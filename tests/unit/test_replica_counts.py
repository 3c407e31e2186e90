"""Reading running replica counts out of Serve's status object (duck-typed, as serve.status() returns it)."""

from __future__ import annotations

import enum
from types import SimpleNamespace

from app.router.replica_counts import running_replicas


class ReplicaState(str, enum.Enum):  # the shape of Serve's own enum: members whose value is the state's name
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    STOPPING = "STOPPING"


def status_with(**deployments: dict) -> SimpleNamespace:
    overviews = {name: SimpleNamespace(replica_states=states) for name, states in deployments.items()}
    return SimpleNamespace(applications={"llm-lanes": SimpleNamespace(deployments=overviews)})


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
    assert running_replicas(SimpleNamespace(applications={}), "llm-lanes", "Router") is None
