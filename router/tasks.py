"""Stopping background tasks reliably at shutdown."""

from __future__ import annotations

import asyncio


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
