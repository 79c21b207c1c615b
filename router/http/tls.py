"""HTTPS on a listener (``listen.tls``), its certificates replaced on reload without a restart.

The listening socket is given one SSLContext for good (:attr:`CertificateStore.served`).
Its ``sni_callback``, which OpenSSL calls on every ClientHello (with or without a server
name), hands the handshake the store's :attr:`~CertificateStore.current` context instead:
certificate, key and client CAs all come from there, so a reload that builds a new context
from the files and assigns it changes what the next handshake sees, while connections already
up keep theirs. Reloading in place (``load_cert_chain`` again on the one context) would
rotate the certificate but could only ever add client CAs, never drop a revoked one.
"""

from __future__ import annotations

import ssl

from router.http.settings import TLSConfig, server_context


class CertificateStore:
    """A listener's TLS settings and the context its next handshake is served with."""

    def __init__(self, listener: str, tls: TLSConfig, where: str) -> None:
        self.listener = listener
        self.tls = tls
        #: The settings' path in the config (``listen.tls``), naming them in errors.
        self.where = where
        self.current = server_context(tls)
        #: What the socket holds; its settings match ``current`` (the verify mode is decided
        #: before the callback switches contexts), its certificate is never shown.
        self.served = server_context(tls)
        self.served.sni_callback = self._select

    def _select(self, connection: ssl.SSLObject, server_name: str | None, served: ssl.SSLContext) -> None:
        connection.context = self.current

    def load(self) -> ssl.SSLContext:
        """A context from the files as they are now; ValueError naming the key whose file does not load."""
        try:
            return server_context(self.tls)
        except ValueError as exc:
            raise ValueError(f"{self.where}.{exc}") from None

    def use(self, context: ssl.SSLContext) -> None:
        """Serve ``context`` from the next handshake on."""
        self.current = context
