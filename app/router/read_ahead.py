"""A lane call's chunks read ahead of its client. No Ray.

The engine's sequence is done at the lane's last chunk, however slowly the client reads: under load the Router and
the proxy write slower than the engine generates, and a hot slot held until the client's last byte leaves the engine
idle while interactive requests wait for a slot. `ReadAhead` reads one lane call's stream into a queue and calls
`on_last_chunk` as that chunk arrives; its reader takes the chunks, and the error that ended the stream, in order.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


class ReadAhead:
    def __init__(self, stream: Any, on_last_chunk: Callable[[], None]):
        self._queue: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.ensure_future(self._read(stream, on_last_chunk))

    async def _read(self, stream: Any, on_last_chunk: Callable[[], None]) -> None:
        try:
            while True:
                chunk = await anext(stream)
                self._queue.put_nowait((chunk, None))
                if chunk.finish_reason is not None:
                    on_last_chunk()
                    return
        except BaseException as error:  # delivered to the reader, in order, as the direct read would raise it
            self._queue.put_nowait((None, error))

    async def get(self) -> tuple[Any, BaseException | None]:
        """The next (chunk, None), or (None, the error that ended the stream)."""
        return await self._queue.get()

    def stop(self) -> None:
        if not self._task.done():
            self._task.cancel()
