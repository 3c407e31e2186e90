"""What the app adds to Serve's HTTP proxy: the arrival stamp (app/router/arrival_stamp.py) and the replay of
refusals to early retries (app/router/refusal_replay.py).

Serve runs an operator's ASGI middlewares in its HTTP proxy (and in the Router replicas' own servers under direct
ingress): `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH` names a function returning them, read from the environment of
`ray start` / `serve run` (the proxy is Ray's actor, not the app's, so the application's runtime_env does not reach
it). `proxy_middlewares` is that function. `app.tools.serve_run`, the test app, the load tests and the cluster
manifests set the variable (`PROXY_ENV`).
"""

from __future__ import annotations

from app.router.arrival_stamp import ArrivalStamp
from app.router.refusal_replay import RefusalReplay

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK_IMPORT_PATH = "app.router.proxy_middlewares:proxy_middlewares"
# The environment a Ray cluster starts in for its proxies to run the middlewares.
PROXY_ENV = {CALLBACK_ENV: CALLBACK_IMPORT_PATH}


def proxy_middlewares() -> list:
    """What RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH returns to Serve: its proxy's extra middlewares. Serve wraps
    them in list order, so the last is outermost: a replayed refusal is answered before anything else runs."""
    from starlette.middleware import Middleware

    return [Middleware(ArrivalStamp), Middleware(RefusalReplay)]
