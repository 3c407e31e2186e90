"""LoRA adapters loaded and unloaded at run time: POST /v1/load_lora_adapter and /v1/unload_lora_adapter, in vLLM's
server's shape (its bodies, its answers), for admin keys.

vLLM's server keeps such adapters in its one process. Here a load must reach every Router replica (those started
later and after a restart too) and every lane replica. So the set lives in the app's durable store (`batch.store`):
each Router reads it every ADAPTER_SYNC_INTERVAL_S (and at start), and a lane replica loads an adapter before the
first request naming it runs (the request carries the adapter's id and folder). A load is tried on one replica of
each lane before any request may name it, so an adapter the engines refuse (its files, a rank above
`engine.lora.max_lora_rank`, shapes of another base model) is refused naming why, and nothing loaded is disturbed.

Ids: model.adapters take 1..N in their order, as vLLM's server numbers them; adapters loaded at run time take ids
from RUNTIME_ADAPTER_FIRST_ID on, never given twice (the engines cache adapters by id, so a replaced adapter must
never be mistaken for its predecessor). Unloading stops the adapter being served at once at the Router that unloads
it and within ADAPTER_SYNC_INTERVAL_S at the others; requests already running on it finish, and the lanes' engines
drop it when their least-recently-used adapter cache (`engine.lora.max_cpu_loras`) needs the room.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

from fastapi import Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from app.config import ADAPTER_NAME_PATTERN, AppConfig
from app.lanes.types import BASE_ADAPTER_NAME, AdapterRef
from app.router import openai_api as api
from app.router.http_api import read_json_body

logger = logging.getLogger(__name__)

RUNTIME_ADAPTER_FIRST_ID = 1_000_000
ADAPTER_SYNC_INTERVAL_S = 1.0
# A load reserved this long ago that never settled (its Router stopped mid-load) no longer blocks its name.
ADAPTER_LOAD_STALE_S = 300.0
# How long the lanes have to load an adapter being tried (read from disk, moved to the device).
ADAPTER_TRY_TIMEOUT_S = 120.0


class LoadAdapterBody(BaseModel):
    # vLLM's LoadLoRAAdapterRequest; a field it does not have is refused naming it. Its `is_3d_lora_weight` (MoE
    # expert weights) is refused the same way: no lane here loads such adapters.
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadAdapterBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_int_id: int | None = None


def load_refusal(name: str, path: str, cfg: AppConfig) -> tuple[str, str] | None:
    """Why a run-time load of adapter `name` is refused before any file is read, and the parameter at fault."""
    if not cfg.serves_lora:
        return ("this app's lanes run no LoRA adapters: set engine.lora on every lane (e.g. {max_loras: 2, "
                "max_lora_rank: 16}) to load adapters", "lora_name")
    if not name or not path:
        return "Both 'lora_name' and 'lora_path' must be provided.", "lora_name" if not name else "lora_path"
    if not re.fullmatch(ADAPTER_NAME_PATTERN, name):
        return (f"lora_name {name!r} is not an adapter name: a letter or digit, then letters, digits and _ . : / -, "
                "128 at most", "lora_name")
    if name == cfg.model.served_name:
        return f"The lora adapter '{name}' conflicts with a served base model.", "lora_name"
    if name == BASE_ADAPTER_NAME:
        return f"'{name}' is the name of the lanes' own identity adapter: choose another name", "lora_name"
    if any(adapter.name == name for adapter in cfg.model.adapters):
        return (f"The lora adapter '{name}' is listed in model.adapters (the serve config): change it there and "
                "redeploy", "lora_name")
    return None


def _parse(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise api.OpenAIError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        param = api.error_param(tuple(first["loc"]))
        message = "unrecognized field" if first["type"] == "extra_forbidden" else first["msg"]
        raise api.OpenAIError(400, f"{param}: {message}", param=param,
                              code="unrecognized_argument" if first["type"] == "extra_forbidden"
                              else "invalid_value") from None


class AdapterApi:
    """Routes of the Router deployment (ADAPTER_ROUTES); it expects `pipeline`, `batch_store`, `lane_handles` and
    `authenticate_http`."""

    async def load_lora_adapter(self, request: Request) -> PlainTextResponse:
        self.authenticate_http(request, admin=True)
        body = _parse(LoadAdapterBody, await read_json_body(request, self.pipeline.cfg.router.max_request_bytes))
        await self.load_adapter(body.lora_name, body.lora_path, replace=body.load_inplace)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload_lora_adapter(self, request: Request) -> PlainTextResponse:
        self.authenticate_http(request, admin=True)
        body = _parse(UnloadAdapterBody, await read_json_body(request, self.pipeline.cfg.router.max_request_bytes))
        await self.unload_adapter(body.lora_name, body.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    async def load_adapter(self, name: str, path: str, replace: bool = False) -> AdapterRef:
        """Check, reserve an id, try it on each lane, then serve it. Raises OpenAIError (400 naming why for an
        adapter that cannot be served, 409 while another load of the name is under way) or a store error."""
        refusal = load_refusal(name, path, self.pipeline.cfg)
        if refusal is not None:
            raise api.OpenAIError(400, refusal[0], param=refusal[1], code="invalid_value")
        try:
            await asyncio.to_thread(self.pipeline.surface.check_adapter_folder, name, path)
        except ValueError as error:
            raise api.OpenAIError(400, str(error), param="lora_path", code="invalid_value") from None
        store = self.batch_store
        record = await asyncio.to_thread(store.reserve_adapter, name, path, replace, RUNTIME_ADAPTER_FIRST_ID,
                                         ADAPTER_LOAD_STALE_S)
        adapter = AdapterRef(record.name, record.id, record.path)
        try:
            refusals = await asyncio.wait_for(
                asyncio.gather(*(handle.try_adapter.remote(adapter) for handle in self.lane_handles.values())),
                timeout=ADAPTER_TRY_TIMEOUT_S)
        except Exception as error:
            await asyncio.to_thread(store.settle_adapter, record.id, False)
            raise api.OpenAIError(503, f"LoRA adapter '{name}' could not be tried on the lanes ({error!r}); nothing "
                                       "changed: retry", type="server_error", code="lane_unavailable") from None
        refused = next((reason for reason in refusals if reason), None)
        await asyncio.to_thread(store.settle_adapter, record.id, refused is None)
        if refused is not None:
            raise api.OpenAIError(400, refused, param="lora_path", code="invalid_value")
        await self.sync_adapters()
        logger.info("LoRA adapter %r loaded from %s (id %d)", name, path, record.id)
        return adapter

    async def unload_adapter(self, name: str, adapter_id: int | None = None) -> None:
        if any(adapter.name == name for adapter in self.pipeline.cfg.model.adapters):
            raise api.OpenAIError(400, f"The lora adapter '{name}' is listed in model.adapters (the serve config): "
                                       "remove it there and redeploy", param="lora_name", code="invalid_value")
        if adapter_id is not None:
            served = {a.name: a.id for a in await asyncio.to_thread(self.batch_store.ready_adapters)}
            if served.get(name, adapter_id) != adapter_id:
                raise api.OpenAIError(400, f"lora_int_id: the lora adapter '{name}' has id {served[name]}, not "
                                           f"{adapter_id}", param="lora_int_id", code="invalid_value")
        await asyncio.to_thread(self.batch_store.unload_adapter, name)
        await self.sync_adapters()
        logger.info("LoRA adapter %r unloaded", name)

    async def sync_adapters(self) -> None:
        """This Router serves the adapters the store has ready, beside model.adapters."""
        records = await asyncio.to_thread(self.batch_store.ready_adapters)
        self.pipeline.surface.set_runtime_adapters(AdapterRef(r.name, r.id, r.path) for r in records)

    async def sync_adapters_forever(self) -> None:
        while True:
            await asyncio.sleep(ADAPTER_SYNC_INTERVAL_S)
            try:
                await self.sync_adapters()
            except Exception as error:  # the store is unreachable for now: the set served stays as it was
                logger.warning("could not read the LoRA adapters from the store: %s", error)


ADAPTER_ROUTES = {
    "load_lora_adapter": lambda app: app.post("/v1/load_lora_adapter"),
    "unload_lora_adapter": lambda app: app.post("/v1/unload_lora_adapter"),
}
