"""Running replica counts per deployment, read from the Serve controller's details; pure, so it tests without Ray.

The batch dispatcher's window is per cold-lane replica and every Router replica runs a dispatcher, so each Router
needs both counts to take its share (app.batch.dispatcher.dispatch_capacity). The details are the plain dictionary
the controller's `get_serve_instance_details` returns (what `serve.status()` parses into pydantic models):
details["applications"][app]["deployments"][name]["replicas"] is a list of replicas, each with a "state" (an enum
whose value is e.g. "RUNNING", or that string).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

RUNNING = "RUNNING"
# The lanes' deployment names, as app.main binds them.
LANE_DEPLOYMENTS = {"hot": "HotLane", "cold": "ColdLane"}
ROUTER_DEPLOYMENT = "Router"


def _state_name(state: Any) -> str:
    return str(getattr(state, "value", state))


def running_replicas(details: Mapping[str, Any], app_name: str, deployment: str) -> int | None:
    """Replicas of `deployment` in `app_name` that are RUNNING; None when the details do not list the deployment
    (the caller then keeps what it last knew rather than guessing)."""
    application = (details.get("applications") or {}).get(app_name)
    overview = (application.get("deployments") or {}).get(deployment) if application else None
    if overview is None:
        return None
    return sum(1 for replica in overview.get("replicas") or () if _state_name(replica.get("state")) == RUNNING)


def health_response(lane_replicas: Mapping[str, int | None]) -> tuple[int, dict[str, Any]]:
    """GET /health for a load balancer: (status code, body) from the lanes' running replica counts.

    503 while the hot lane has no running replica (starting up, or every replica down): realtime and interactive
    requests sent here would only wait out their deadlines. A cold lane at zero replicas is normal (scale to zero:
    the next batch line brings one back), so it stays 200. A count not read yet (None) counts as up: the first read
    of the controller's details comes a few seconds after the Router starts, and health must not flap on a failed
    read.
    """
    hot = lane_replicas.get("hot")
    body: dict[str, Any] = {"status": "ok", "running_replicas": dict(lane_replicas)}
    if hot == 0:
        body.update(status="unavailable", reason="the hot lane has no running replica (starting, or down)")
        return 503, body
    return 200, body
