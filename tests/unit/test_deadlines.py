import pytest

from app.classes import RequestClass
from app.config import DeadlineConfig
from app.router.deadlines import DeadlinePolicy, percentile_nearest_rank

FLOOR_FIELD = {RequestClass.REALTIME: "realtime_timeout_floor_s", RequestClass.INTERACTIVE: "interactive_timeout_floor_s",
               RequestClass.BATCH: "batch_timeout_floor_s"}


def policy_with(floors_s=None, **settings) -> DeadlinePolicy:
    floors = {FLOOR_FIELD[cls]: floor for cls, floor in (floors_s or {}).items()}
    return DeadlinePolicy(DeadlineConfig(**floors, **settings))

RT, IA, BA = RequestClass.REALTIME, RequestClass.INTERACTIVE, RequestClass.BATCH


def test_percentile_nearest_rank():
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile_nearest_rank(values, 99) == 99.0
    assert percentile_nearest_rank(values, 50) == 50.0
    assert percentile_nearest_rank(values, 100) == 100.0
    assert percentile_nearest_rank([7.0], 99) == 7.0
    assert percentile_nearest_rank([3.0, 1.0, 2.0], 1) == 1.0
    with pytest.raises(ValueError):
        percentile_nearest_rank([], 99)
    with pytest.raises(ValueError):
        percentile_nearest_rank([1.0], 0)


def test_floor_until_enough_samples():
    policy = policy_with(floors_s={IA: 2.0}, min_samples=10, window=100)
    for _ in range(9):
        policy.record(IA, 5.0)
    assert policy.p99_s(IA) is None
    assert policy.timeout_s(IA) == 2.0
    policy.record(IA, 5.0)
    assert policy.p99_s(IA) == 5.0
    assert policy.timeout_s(IA) == 15.0  # 3 x P99 above the floor


def test_floor_wins_when_three_p99_is_smaller():
    policy = policy_with(floors_s={RT: 10.0}, min_samples=5, window=50)
    for _ in range(50):
        policy.record(RT, 0.4)
    assert policy.timeout_s(RT) == 10.0


def test_p99_tracks_the_tail_and_classes_are_separate():
    policy = policy_with(floors_s={IA: 1.0, BA: 1.0}, min_samples=100, window=1000)
    for i in range(1000):
        policy.record(IA, 10.0 if i % 100 == 99 else 1.0)  # 1 % slow requests
    for _ in range(100):
        policy.record(BA, 2.0)
    # Nearest-rank P99 of 990 x 1.0 and 10 x 10.0 is 1.0; at 11 slow ones in 1000 it becomes 10.0.
    assert policy.p99_s(IA) == 1.0
    policy.record(IA, 10.0)  # evicts the oldest (fast) sample, adds a slow one
    assert policy.p99_s(IA) == 10.0
    assert policy.timeout_s(IA) == 30.0
    assert policy.timeout_s(BA) == 6.0


def test_window_forgets_old_samples():
    policy = policy_with(floors_s={IA: 1.0}, min_samples=3, window=5)
    for _ in range(5):
        policy.record(IA, 100.0)
    assert policy.timeout_s(IA) == 300.0
    for _ in range(5):
        policy.record(IA, 2.0)
    assert policy.sample_count(IA) == 5
    assert policy.timeout_s(IA) == 6.0


def test_the_schemas_floors_apply_until_enough_samples_and_bad_samples_are_refused():
    policy = DeadlinePolicy(DeadlineConfig())
    for cls in RequestClass:
        assert policy.timeout_s(cls) == DeadlineConfig.model_fields[FLOOR_FIELD[cls]].default
    with pytest.raises(ValueError):
        policy.record(IA, -1.0)
