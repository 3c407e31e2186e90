"""GET /health's decision from the lanes' running replica counts (app.router.replica_counts.health_response)."""

from __future__ import annotations

from app.router.replica_counts import health_response


def test_ok_while_the_hot_lane_runs():
    assert health_response({"hot": 2, "cold": 1}) == (200, {"status": "ok", "running_replicas": {"hot": 2, "cold": 1}})


def test_unavailable_while_the_hot_lane_has_no_running_replica():
    status, body = health_response({"hot": 0, "cold": 1})
    assert status == 503 and body["status"] == "unavailable" and "hot lane" in body["reason"]


def test_a_cold_lane_scaled_to_zero_is_normal():
    assert health_response({"hot": 1, "cold": 0})[0] == 200


def test_counts_not_read_yet_count_as_up():
    assert health_response({"hot": None, "cold": None}) == (
        200, {"status": "ok", "running_replicas": {"hot": None, "cold": None}})
