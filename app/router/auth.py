"""API keys: who a request comes from (its tenant), what it may ask for, and nothing about the key itself kept.

Pure, no Ray. The keys are SHA-256 hashes (auth.keys, auth.keys_file, auth.keys_env of the schema); a request's
key is hashed once and looked up. A `Principal` is what the rest of the Router sees: the tenant, the classes it may
use, the admin flag, the rate limits, and a label for logs (the key's name or a prefix of its hash, never the key).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import TypeAdapter, ValidationError

from app.batch.store import DEFAULT_TENANT
from app.classes import RequestClass
from app.config import ApiKeyConfig, AuthConfig, format_validation_error
from app.router import openai_api as api

logger = logging.getLogger(__name__)

AUTHORIZATION_HEADER = "authorization"  # HTTP header and gRPC metadata key alike (gRPC keys are lower-case)
KEY_LIST = TypeAdapter(list[ApiKeyConfig])


@dataclass(frozen=True)
class Principal:
    """The caller of one request, as its key says."""

    tenant: str
    label: str  # for logs and the limiter: the key's name, or the first 8 hex digits of its hash
    classes: frozenset[RequestClass]
    admin: bool
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    key_id: str = "open"  # the first 16 hex digits of the key's hash: which rate-limit buckets it draws from
    # The LoRA adapters the key may use (None: every one); the base model is always allowed.
    adapters: frozenset[str] | None = None

    def may_use(self, request_class: RequestClass) -> bool:
        return request_class in self.classes

    def may_use_model(self, name: str | None, base_model: str) -> bool:
        """Whether the key may name model `name` (none, or the base model's name: the base model)."""
        return self.adapters is None or not name or name == base_model or name in self.adapters


# auth.mode none: one tenant, every class, every endpoint.
OPEN_PRINCIPAL = Principal(tenant=DEFAULT_TENANT, label="anonymous", classes=frozenset(RequestClass), admin=True)


class KeySourceError(ValueError):
    """A keys file or variable that is missing or malformed: the Router refuses to start, naming it."""


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def bearer_token(authorization: str | None) -> str | None:
    """`Bearer <key>` -> the key (the scheme is case-insensitive, as RFC 9110 has it); anything else -> None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def parse_key_list(text: str, source: str) -> list[ApiKeyConfig]:
    """A YAML or JSON list of key entries (JSON is YAML) -> the entries, validated as auth.keys is."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise KeySourceError(f"{source} is not YAML or JSON: {error}") from None
    if data is None:
        return []
    try:
        return KEY_LIST.validate_python(data)
    except ValidationError as error:
        raise KeySourceError(f"{source}: {format_validation_error(error)}") from None


def load_keys(auth: AuthConfig, environ: Mapping[str, str] | None = None) -> list[ApiKeyConfig]:
    """Every key the config names: inline, from its file, from its environment variable."""
    environ = os.environ if environ is None else environ
    keys = list(auth.keys)
    if auth.keys_file:
        path = Path(auth.keys_file)
        if not path.is_file():
            raise KeySourceError(f"auth.keys_file {auth.keys_file!r} does not exist on this node: mount it (e.g. a "
                                 "Kubernetes secret) or drop auth.keys_file")
        keys += parse_key_list(path.read_text(), f"auth.keys_file {auth.keys_file!r}")
    if auth.keys_env:
        if auth.keys_env not in environ:
            raise KeySourceError(f"auth.keys_env names {auth.keys_env}, which is not set in the Router's "
                                 "environment: set it (a JSON list of keys) or drop auth.keys_env")
        keys += parse_key_list(environ[auth.keys_env], f"environment variable {auth.keys_env}")
    return keys


class KeyRing:
    """The keys a Router accepts. `authenticate(Authorization value)` -> the Principal, or a 401 OpenAIError."""

    def __init__(self, auth: AuthConfig, keys: Iterable[ApiKeyConfig] = ()):
        self.open = auth.mode == "none"
        self._principals: dict[str, Principal] = {}
        for key in keys:
            if key.sha256 in self._principals:
                raise KeySourceError(f"key {key.name or key.sha256[:8]} is listed twice across auth.keys, "
                                     "auth.keys_file and auth.keys_env: keep one entry per key")
            self._principals[key.sha256] = Principal(
                tenant=key.tenant, label=key.name or key.sha256[:8],
                classes=frozenset(RequestClass(name) for name in key.classes), admin=key.admin,
                requests_per_minute=key.requests_per_minute, tokens_per_minute=key.tokens_per_minute,
                key_id=key.sha256[:16], adapters=frozenset(key.adapters) if key.adapters is not None else None)
        unknown = sorted(set(auth.tenant_weights) - {p.tenant for p in self._principals.values()})
        if unknown:
            raise KeySourceError(f"auth.tenant_weights names {', '.join(map(repr, unknown))}, the tenant of no key: "
                                 "fix the name, or add a key of that tenant")
        if not self.open and not self._principals:
            raise KeySourceError("auth.mode is 'keys' but no key is configured: add auth.keys (SHA-256 hashes), "
                                 "auth.keys_file or auth.keys_env, or set auth.mode: none explicitly to serve "
                                 "without keys (only where nobody else can reach the app)")

    def tenant_adapters(self, tenant: str) -> frozenset[str] | None:
        """The LoRA adapters the keys of `tenant` may use together (None: every one), which its batch lines run
        with: a batch belongs to its tenant, not to the key that created it."""
        allowed: set[str] = set()
        for principal in self._principals.values():
            if principal.tenant == tenant:
                if principal.adapters is None:
                    return None
                allowed |= principal.adapters
        return frozenset(allowed) if not self.open else None

    @classmethod
    def from_config(cls, auth: AuthConfig, environ: Mapping[str, str] | None = None) -> "KeyRing":
        ring = cls(auth, load_keys(auth, environ))
        if ring.open:
            logger.warning("auth.mode is 'none': every request is served without an API key, as tenant %r, and "
                           "the admin endpoints are open; use it only where nobody else can reach the app",
                           DEFAULT_TENANT)
        else:
            logger.info("API keys loaded: %d keys of %d tenants", len(ring._principals),
                        len({p.tenant for p in ring._principals.values()}))
        return ring

    @property
    def has_rate_limits(self) -> bool:
        return any(p.requests_per_minute or p.tokens_per_minute for p in self._principals.values())

    @property
    def tenants(self) -> set[str]:
        return {principal.tenant for principal in self._principals.values()}

    def authenticate(self, authorization: str | None) -> Principal:
        if self.open:
            return OPEN_PRINCIPAL
        token = bearer_token(authorization)
        principal = self._principals.get(hash_key(token)) if token is not None else None
        if principal is None:
            # The same answer for a missing and a wrong key, and never the key in it (OpenAI's shape and code).
            message = ("Incorrect API key provided." if token is not None else
                       "You didn't provide an API key. Send it as 'Authorization: Bearer <key>' (HTTP) or in the "
                       "'authorization' metadata (gRPC).")
            raise api.OpenAIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return principal

    def authenticate_metadata(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Principal:
        """gRPC: the `authorization` entry of the invocation metadata."""
        value = None
        for key, item in metadata or ():
            if key.lower() == AUTHORIZATION_HEADER:
                value = item.decode("utf-8", "replace") if isinstance(item, bytes) else item
                break
        return self.authenticate(value)


def require_admin(principal: Principal) -> None:
    if not principal.admin:
        raise api.OpenAIError(403, "this endpoint needs an admin key", type="permission_error",
                              code="admin_key_required")


def check_class(principal: Principal, request_class: RequestClass, param: str = "service_tier") -> None:
    """A key asking for a class it may not use is refused (403), not moved to another class."""
    if not principal.may_use(request_class):
        allowed = sorted(c.value for c in principal.classes)
        raise api.OpenAIError(403, f"this API key may not use the {request_class.value} request class; it may use "
                                   f"{allowed}", type="permission_error", param=param,
                              code="request_class_not_allowed")
