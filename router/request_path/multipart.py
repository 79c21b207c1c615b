"""Read one field of a ``multipart/form-data`` body without parsing the rest (RFC 7578).

Audio transcriptions arrive as a form: the audio file and a few small fields, ``model``
among them. Routing needs that one field, so only part headers are read, part by part, up
to it; file contents are skipped with ``bytes.find`` for the next delimiter (a C scan, no
copy), and the body is forwarded as received. Clients write the small fields first (the
``openai`` client, curl in argument order), so the scan usually stops before the file.
"""

from __future__ import annotations

import re

_NAME = re.compile(rb'(?i)^content-disposition:[^\r\n]*?;\s*name="([^"]*)"', re.MULTILINE)
_BOUNDARY = re.compile(r'(?i)boundary="?([^";]{1,70})"?')


class MalformedForm(ValueError):
    """The body is not the multipart form its Content-Type announces."""


def boundary_of(content_type: str) -> bytes | None:
    """The boundary parameter of a ``multipart/form-data`` Content-Type, or None."""
    found = _BOUNDARY.search(content_type)
    return found.group(1).encode("latin-1") if found else None


def form_fields(body: bytes, boundary: bytes, names: frozenset[bytes]) -> dict[bytes, bytes]:
    """The values of the fields ``names`` present in ``body``, read until all were found or the
    form ends; MalformedForm when a part is cut short or the first delimiter is missing."""
    delimiter = b"--" + boundary
    found: dict[bytes, bytes] = {}
    position = body.find(delimiter)
    if position < 0:
        raise MalformedForm("no part delimiter where the Content-Type's boundary says")
    while len(found) < len(names):
        start = position + len(delimiter)
        if body.startswith(b"--", start):  # the closing delimiter: the form ends here
            return found
        head_end = body.find(b"\r\n\r\n", start)
        if head_end < 0:
            raise MalformedForm("a part's headers do not end")
        value_start = head_end + 4
        value_end = body.find(b"\r\n" + delimiter, value_start)
        if value_end < 0:
            raise MalformedForm("a part is not followed by a delimiter")
        named = _NAME.search(body, start, head_end)
        if named is not None and named.group(1) in names:
            found.setdefault(named.group(1), body[value_start:value_end])
        position = value_end + 2
    return found
