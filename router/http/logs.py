"""The router's log lines: text or JSON, each carrying the id of the request it is about.

``configure_logging`` installs one handler on the root logger, replacing
``logging.basicConfig``: its filter stamps every record with the id of the request being
handled (router/request_path/context.py's :data:`REQUEST_ID`, None outside requests), and a
writer thread formats it to stderr as

* ``text``: ``2026-12-05 08:00:00,123 INFO kvroute.dispatch [3f2a…]: message``;
* ``json``: one object per line, ``{"ts", "level", "logger", "msg", "request_id", ...}``,
  with the access log's fields as keys of their own (orjson; no other dependency).

The access log (``logging.access_log``) is logger ``kvroute.access``: one line per request
when its response has ended, written by :func:`log_access`.
"""

from __future__ import annotations

import atexit
import logging
import re
import sys
from datetime import datetime, timezone
from logging.handlers import QueueHandler, QueueListener
from queue import SimpleQueue
from typing import Any

import orjson

from router.http.settings import LoggingConfig
from router.request_path.context import REQUEST_ID, RequestContext

ACCESS_LOG = logging.getLogger("kvroute.access")


class RequestIdFilter(logging.Filter):
    """Stamps each record with the id of the request whose task wrote it."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        return True


class TextFormatter(logging.Formatter):
    def __init__(self, process: bool = False) -> None:
        name = "%(name)s[%(process)d]" if process else "%(name)s"
        super().__init__(f"%(asctime)s %(levelname)s {name}%(request_tag)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        request_id = getattr(record, "request_id", None)
        record.request_tag = f" [{request_id}]" if request_id else ""
        return super().format(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per line; the message formatted with its arguments, as text would be."""

    def __init__(self, process: bool = False) -> None:
        super().__init__()
        self._process = process

    def format(self, record: logging.LogRecord) -> str:
        access = record.msg if isinstance(record.msg, AccessLine) else None
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": "request" if access is not None else record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id:
            line["request_id"] = request_id
        if self._process:
            line["pid"] = record.process
        if access is not None:
            line.update(access.fields)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(line, default=str).decode()


class _Enqueue(QueueHandler):
    """Hands records to the writer thread as they are: the request id is already stamped (by
    the filter, in the request's task), and formatting is the writer's job, off the event loop
    (the stock ``prepare`` would format here, and flatten an access line's fields to text)."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        return record


#: The thread writing log lines, while logging is configured (one per process).
_writer: QueueListener | None = None


def configure_logging(config: LoggingConfig, level: str, process: bool = False) -> None:
    """Log to stderr in ``config.format`` at ``level``; ``process`` adds the pid (``--workers``).

    Records are formatted and written by a thread of their own (the stdlib's QueueListener):
    a write to stderr can block (a slow disk, a full pipe to a log collector), and a blocked
    write on the event loop would stall every request in flight. The loop only queues.
    """
    global _writer
    if _writer is not None:
        _writer.stop()  # configured again: the new writer takes over (at-exit stop stays registered)
    stream = logging.StreamHandler(sys.stderr)
    stream.setFormatter(JsonFormatter(process) if config.format == "json" else TextFormatter(process))
    queue: SimpleQueue[logging.LogRecord] = SimpleQueue()
    enqueue = _Enqueue(queue)
    enqueue.addFilter(RequestIdFilter())
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(enqueue)
    root.setLevel(level.upper())
    if _writer is None:
        atexit.register(_stop_writer)
    _writer = QueueListener(queue, stream)
    _writer.start()


def _stop_writer() -> None:
    """At exit: write what is queued, then stop the thread."""
    global _writer
    if _writer is not None:
        _writer.stop()
        _writer = None


class AccessLine:
    """An access log line's message: its fields, written as logfmt only when a text formatter
    asks (the JSON formatter writes the fields as keys of their own instead)."""

    __slots__ = ("fields",)

    def __init__(self, fields: dict[str, Any]) -> None:
        self.fields = fields

    def __str__(self) -> str:
        return " ".join(f"{key}={_logfmt(value)}" for key, value in self.fields.items())


def log_access(context: RequestContext, status: int, duration_s: float) -> None:
    """The access log line of one request (its id is stamped by the filter, as for every line).

    The record is made directly (``makeRecord`` + ``handle``): ``Logger.info`` would also walk
    the stack for the caller's file and line, the largest cost of a line, and useless here.
    """
    if not ACCESS_LOG.isEnabledFor(logging.INFO):
        return
    ttft_ms = None if context.ttft is None else round(context.ttft * 1000, 2)
    fields = {
        "tenant": context.tenant,
        "endpoint": context.endpoint,
        "model": context.model,
        "backend": context.backend,
        "reason": context.reason,
        "status": status,
        "attempts": context.attempts,
        "prompt_tokens": context.prompt_tokens,
        "matched_tokens": context.matched_tokens,
        "cached_tokens": context.cached_tokens,
        "ttft_ms": ttft_ms,
        "duration_ms": round(duration_s * 1000, 2),
    }
    if context.pair is not None:
        # Prefill/decode disaggregation: both engines of the pair and why each was chosen.
        names = ("prefill_backend", "prefill_reason", "decode_backend", "decode_reason")
        fields.update(zip(names, context.pair, strict=True))
    ACCESS_LOG.handle(
        ACCESS_LOG.makeRecord(ACCESS_LOG.name, logging.INFO, "", 0, AccessLine(fields), None, None)
    )


#: A logfmt value left bare: printable ASCII without space, quote, ``=`` or backslash.
_BARE = re.compile(r"[!#-<>-\[\]-~]+")


def _logfmt(value: object) -> str:
    """A logfmt value: ``-`` for none, quoted (JSON) unless it is bare (see ``_BARE``)."""
    if value is None:
        return "-"
    if type(value) is not str:
        return str(value)
    return value if _BARE.fullmatch(value) else orjson.dumps(value).decode()
