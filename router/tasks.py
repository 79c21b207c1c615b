"""The event loop and its tasks: which loop runs the router, and stopping background tasks
reliably at shutdown. (Kept free of aiohttp, so the command line starts fast.)"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


async def stop_task(task: asyncio.Task) -> None:
    """Cancel ``task`` and wait until it has ended, cancelling again if it shrugged one off.

    A cancellation that lands just as an awaited call completes can be swallowed (by
    ``asyncio.wait_for`` before Python 3.12, or by a client library's cleanup); a loop task
    then runs on, and a plain ``await task`` would hang shutdown forever.
    """
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)
    if not task.cancelled():
        task.exception()  # retrieved, so asyncio does not log it as never retrieved


def run_event_loop(main: Coroutine[Any, Any, Any]) -> Any:
    """Run ``main`` on uvloop where it is installed (a dependency on Linux and macOS): the one
    place that picks the event loop, for ``kvroute serve`` and each of its router processes."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
