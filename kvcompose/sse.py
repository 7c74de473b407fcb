"""``SSEResponse``: a server-sent event stream that notices the client leaving.

The proxy streams answers with it, and so does the scripted vLLM server that stands in for
vLLM in the proxy's tests; it sits below both, so that neither imports the other.
"""

from __future__ import annotations

import contextlib
from typing import Any

import anyio
from fastapi.responses import StreamingResponse


class SSEResponse(StreamingResponse):
    """A stream that notices the client leaving while the proxy waits on a backend (not
    only at its next write) and always closes its generator, so that the backend request
    is closed (vLLM aborts it) and a prepared hand-off is released."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                async def listen() -> None:
                    await self.listen_for_disconnect(receive)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                tg.start_soon(listen)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
