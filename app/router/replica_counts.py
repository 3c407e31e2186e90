"""Running replica counts per deployment, read from Serve's status (`serve.status()`); pure, so it tests without Ray.

The batch dispatcher's window is per cold-lane replica and every Router replica runs a dispatcher, so each Router
needs both counts to take its share (app.batch.dispatcher.dispatch_capacity). The status object is duck-typed:
status.applications[app].deployments[name].replica_states maps a replica state (an enum whose value is e.g.
"RUNNING") to a count.
"""

from __future__ import annotations

from typing import Any

RUNNING = "RUNNING"


def _state_name(state: Any) -> str:
    return str(getattr(state, "value", state))


def running_replicas(status: Any, app_name: str, deployment: str) -> int | None:
    """Replicas of `deployment` in `app_name` that are RUNNING; None when the status does not list the deployment
    (the caller then keeps what it last knew rather than guessing)."""
    application = (getattr(status, "applications", None) or {}).get(app_name)
    overview = (getattr(application, "deployments", None) or {}).get(deployment) if application else None
    if overview is None:
        return None
    states = getattr(overview, "replica_states", None) or {}
    return sum(int(count) for state, count in states.items() if _state_name(state) == RUNNING)
