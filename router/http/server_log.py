"""The HTTP server's own error log, without request content.

aiohttp logs every request it cannot parse (a header over ``limits.max_field_size``, too many
headers, a bad request line) at ERROR with a traceback whose message quotes up to 100 bytes
of the offending line: that can be an ``Authorization`` header or a prompt sent in a URL, and
any client can fill the log with tracebacks. The router's HTTP server logs through
:data:`HTTP_LOG` instead, where such a record becomes one warning line naming the client,
the kind of fault and the status answered (router/http/protocol_errors.py decides it), and nothing
the client sent.
"""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import HttpProcessingError

from router.http.protocol_errors import classify


class _MalformedRequests(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            record.msg = "refused a malformed request from %s: %s, answered %d %s"
            record.args = (remote, type(exc).__name__, *classify(exc))
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


HTTP_LOG = logging.getLogger("kvroute.http")
HTTP_LOG.addFilter(_MalformedRequests())
