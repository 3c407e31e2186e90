"""auth: API keys (stored as SHA-256 hashes), their tenants, classes, admin flag and rate limits."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from app.config.base import StrictModel


REQUEST_CLASS_NAMES = ("realtime", "interactive", "batch")
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
TENANT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
MAX_TENANT_WEIGHT = 100


class ApiKeyConfig(StrictModel):
    """One API key, stored as the SHA-256 of the key (hex): `printf %s "$KEY" | sha256sum`."""

    sha256: str = Field(description="Hex SHA-256 of the key; the key itself is never stored or logged.")
    tenant: str = Field(pattern=TENANT_PATTERN, description="Owns the key's files and batches.")
    name: str | None = Field(None, pattern=TENANT_PATTERN, description="In logs; default: its hash's first 8 digits.")
    classes: list[Literal["realtime", "interactive", "batch"]] = Field(
        default_factory=lambda: list(REQUEST_CLASS_NAMES),
        description="Request classes the key may use; another class is refused with 403.")
    admin: bool = Field(False, description="May call /v1/admin/*, gRPC GetStats and the LoRA load/unload endpoints.")
    # null: every adapter the app serves. A list: only those (and always the base model); another adapter is 404
    # for the key, as a model that does not exist, and is not in its GET /v1/models.
    adapters: list[str] | None = Field(None, description="LoRA adapters (model names) the key may use.")
    # Over either: 429 (None: no limit). Tokens: prompt + max_tokens at admission, the ungenerated given back.
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _check(self) -> "ApiKeyConfig":
        if not SHA256_HEX.match(self.sha256):
            raise ValueError("sha256 must be 64 lower-case hex digits: the SHA-256 of the key "
                             "(printf %s \"$KEY\" | sha256sum), never the key itself")
        if not self.classes:
            raise ValueError("classes is empty: a key must be allowed at least one request class")
        return self


class AuthConfig(StrictModel):
    """API keys (app/router/auth.py). The keys come from `keys`, `keys_file` and `keys_env` together."""

    # keys: every request needs a key (none configured: the Router does not start); none: no keys, a warning.
    mode: Literal["keys", "none"] = "keys"
    keys: list[ApiKeyConfig] = Field(default_factory=list)
    # More keys, read when each Router replica starts (e.g. from a Kubernetes secret): a YAML or JSON file of a list
    # of keys, and an environment variable of the Router replicas holding a JSON list of keys.
    keys_file: str | None = None
    keys_env: str | None = None
    # Fair share between tenants waiting for the hot lane's slots: a tenant of weight w takes up to w freed slots in
    # a row on its turn (weighted round robin); a tenant not named here has weight 1. Each name must be the tenant of
    # some key (checked when the Router loads its keys).
    tenant_weights: dict[str, int] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> "AuthConfig":
        if self.mode == "none" and (self.keys or self.keys_file or self.keys_env):
            raise ValueError("mode 'none' would ignore the keys given: set mode: keys, or drop keys, keys_file and "
                             "keys_env")
        if self.mode == "none" and self.tenant_weights:
            raise ValueError("tenant_weights needs keys (mode 'none' serves one tenant): set mode: keys with keys of "
                             "those tenants, or drop tenant_weights")
        for tenant, weight in self.tenant_weights.items():
            if not re.fullmatch(TENANT_PATTERN, tenant):
                raise ValueError(f"tenant_weights: {tenant!r} is not a tenant id (a letter or digit, then letters, "
                                 "digits, '.', '_', '-'; 64 at most)")
            if not 1 <= weight <= MAX_TENANT_WEIGHT:
                raise ValueError(f"tenant_weights: {tenant!r} has weight {weight}; a weight is 1 to "
                                 f"{MAX_TENANT_WEIGHT} (the slots it takes in a row on its turn)")
        hashes = [key.sha256 for key in self.keys]
        if len(hashes) != len(set(hashes)):
            raise ValueError("the same key (sha256) is listed twice: keep one entry per key")
        return self


