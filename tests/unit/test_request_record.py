"""RequestRecord's two clocks: admission counts from the request's arrival (at Serve's HTTP proxy where it stamped
the request, else at the Router), the Router's TTFT and E2E from its body in hand (the proxy hands the body over
when asked, which a busy proxy delays); its labels, and the per-model metrics of a request whose model is known."""

from app.classes import RequestClass
from app.observability.metrics import LlmLanesMetrics
from app.observability.tracing import Tracing
from app.router.record import RequestRecord
from tests.fakes import FakeClock, FakeMetricsModule


class Observed:
    def __init__(self):
        self.values: dict[str, list[float]] = {}

    def __getattr__(self, name):
        if not name.startswith("observe_"):
            return lambda *args, **kwargs: None
        return lambda seconds, **tags: self.values.setdefault(name.removeprefix("observe_"), []).append(seconds)


def test_the_ttft_starts_with_the_body_in_hand_and_the_wait_for_it_is_its_own_figure():
    clock, metrics = FakeClock(), Observed()
    record = RequestRecord(metrics, Tracing(), None, "completion", clock=clock)
    clock.advance(1.5)  # the proxy took this long to hand the body over
    record.received()
    record.admitted(RequestClass.INTERACTIVE)
    clock.advance(0.25)
    record.first_chunk(streamed=True)
    clock.advance(1.0)
    record.succeeded(output_tokens=5)
    assert metrics.values["request_receive"] == [1.5]
    assert record.ttft_s == 0.25 and metrics.values["ttft"] == [0.25]
    assert metrics.values["e2e"] == [1.25]
    assert clock() - record.arrived_at == 2.75  # what admission's budget counts from


def test_a_request_without_a_body_to_fetch_was_received_on_arrival():
    clock = FakeClock()
    record = RequestRecord(Observed(), Tracing(), None, "chat", clock=clock)
    assert record.received_at == record.arrived_at


def test_a_wait_at_the_proxy_moves_the_arrival_earlier_and_counts_in_the_receive_time():
    clock, metrics = FakeClock(), Observed()
    record = RequestRecord(metrics, Tracing(), None, "chat", clock=clock)
    record.waited_at_proxy(0.5)
    clock.advance(0.25)
    record.received()
    assert metrics.values["request_receive"] == [0.75]
    assert clock() - record.arrived_at == 0.75 and clock() == record.received_at


class Counted:
    def __init__(self):
        self.requests: list[dict] = []

    def count_request(self, **labels):
        self.requests.append(labels)

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def test_a_refusal_before_classification_is_labelled_with_the_class_asked_for_or_unknown():
    from app.router.pipeline import RequestPipeline

    labels = {}
    for name, service_tier, header in [("asked", "priority", None), ("header", "flex", "realtime"),
                                       ("none", None, None), ("bad name", "gold", None), ("list", [], None),
                                       ("object", {"tier": "flex"}, None), ("bad header", None, "vip")]:
        metrics = Counted()
        RequestPipeline.count_refusal(RequestRecord(metrics, Tracing(), None, "chat"), service_tier, header, 400)
        labels[name] = metrics.requests[0]["request_class"]
    assert labels == {"asked": RequestClass.REALTIME, "header": RequestClass.REALTIME,
                      "none": RequestClass.INTERACTIVE, "bad name": "unknown", "list": "unknown",
                      "object": "unknown", "bad header": "unknown"}


def per_model(backend) -> dict[str, list]:
    return {name.removeprefix("llm_lanes_model_"): backend.of(name) for name in (
        "llm_lanes_model_requests_total", "llm_lanes_model_tokens_total", "llm_lanes_model_ttft_seconds")}


def test_an_adapters_request_is_measured_under_its_model_label_next_to_the_lane_and_class_metrics():
    clock, backend = FakeClock(), FakeMetricsModule()
    record = RequestRecord(LlmLanesMetrics(metrics_module=backend), Tracing(), None, "chat", clock=clock)
    record.model, record.prompt_tokens = "tiny-a", 7
    record.admitted(RequestClass.INTERACTIVE)
    clock.advance(0.25)
    record.first_chunk(streamed=True)
    record.succeeded(output_tokens=3)
    assert per_model(backend) == {
        "requests_total": [(1.0, {"model": "tiny-a", "outcome": "success"})],
        "tokens_total": [(7.0, {"model": "tiny-a", "kind": "prompt"}), (3.0, {"model": "tiny-a", "kind": "output"})],
        "ttft_seconds": [(0.25, {"model": "tiny-a"})]}
    assert backend.of("llm_lanes_ttft_seconds") == [(0.25, {"lane": "none", "request_class": "interactive"})]


def test_a_refusal_counts_under_its_model_without_prompt_tokens_and_one_before_any_model_only_in_requests_total():
    backend = FakeMetricsModule()
    metrics = LlmLanesMetrics(metrics_module=backend)
    refused = RequestRecord(metrics, Tracing(), None, "completion")
    refused.model, refused.prompt_tokens = "tiny", 7
    refused.request_class = RequestClass.BATCH
    refused.failed(429)
    RequestRecord(metrics, Tracing(), None, "completion").failed(404)  # no prompt prepared: no model
    assert per_model(backend) == {"requests_total": [(1.0, {"model": "tiny", "outcome": "rejected"})],
                                  "tokens_total": [], "ttft_seconds": []}
    assert len(backend.of("llm_lanes_requests_total")) == 2
