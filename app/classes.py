"""Request classes: how a request asks for one, which lane serves it, and the vLLM priority it carries.

vLLM's priority scheduler serves *lower* numbers first, so realtime is the smallest.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class RequestClass(str, Enum):
    REALTIME = "realtime"
    INTERACTIVE = "interactive"
    BATCH = "batch"


class Lane(str, Enum):
    HOT = "hot"
    COLD = "cold"


@dataclass(frozen=True)
class ClassPolicy:
    lane: Lane
    priority: int


CLASS_POLICIES: dict[RequestClass, ClassPolicy] = {
    RequestClass.REALTIME: ClassPolicy(Lane.HOT, priority=0),
    RequestClass.INTERACTIVE: ClassPolicy(Lane.HOT, priority=10),
    RequestClass.BATCH: ClassPolicy(Lane.COLD, priority=20),
}

# OpenAI's `service_tier` values mapped onto our classes.
SERVICE_TIER_CLASSES: dict[str | None, RequestClass] = {
    None: RequestClass.INTERACTIVE,
    "auto": RequestClass.INTERACTIVE,
    "default": RequestClass.INTERACTIVE,
    "priority": RequestClass.REALTIME,
    "flex": RequestClass.BATCH,
}
REQUEST_CLASS_HEADER = "x-request-class"


class UnknownRequestClass(ValueError):
    def __init__(self, param: str, value: str, allowed: list[str]):
        super().__init__(f"unknown {param} {value!r}: use one of {allowed}")
        self.param = param


def classify(service_tier: str | None, header_value: str | None = None) -> RequestClass:
    """The header (`X-Request-Class`) wins over `service_tier`; unknown values are the client's error."""
    if header_value is not None:
        try:
            return RequestClass(header_value.strip().lower())
        except ValueError:
            raise UnknownRequestClass(
                "X-Request-Class header", header_value, [c.value for c in RequestClass]
            ) from None
    # A JSON body may carry any type here: anything but a known string (or none) is refused, never looked up.
    if not (service_tier is None or isinstance(service_tier, str)) or service_tier not in SERVICE_TIER_CLASSES:
        raise UnknownRequestClass("service_tier", str(service_tier), [t for t in SERVICE_TIER_CLASSES if t])
    return SERVICE_TIER_CLASSES[service_tier]


def policy_for(request_class: RequestClass) -> ClassPolicy:
    return CLASS_POLICIES[request_class]
