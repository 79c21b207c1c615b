"""Certificates for the TLS tests, made by ``openssl`` in the test's own directory."""

from __future__ import annotations

import subprocess
from pathlib import Path


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


class Authority:
    """A certificate authority of this test, issuing certificates for 127.0.0.1 (P-256 keys: quick)."""

    def __init__(self, directory: Path, name: str) -> None:
        self.directory = directory
        self.cert, self.key = directory / f"{name}.pem", directory / f"{name}.key"
        openssl(
            "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", str(self.key), "-out", str(self.cert), "-days", "1", "-subj", f"/CN={name}",
        )  # fmt: skip

    def issue(self, name: str, usage: str = "serverAuth") -> tuple[Path, Path]:
        """A certificate (and its key) named ``name`` for 127.0.0.1, signed by this authority."""
        cert, key, request = (self.directory / f"{name}{ext}" for ext in (".pem", ".key", ".csr"))
        extensions = self.directory / f"{name}.ext"
        extensions.write_text(f"subjectAltName=IP:127.0.0.1\nextendedKeyUsage={usage}\n")
        openssl(
            "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", str(key), "-out", str(request), "-subj", f"/CN={name}",
        )  # fmt: skip
        openssl(
            "x509", "-req", "-in", str(request), "-CA", str(self.cert), "-CAkey", str(self.key),
            "-CAcreateserial", "-out", str(cert), "-days", "1", "-extfile", str(extensions),
        )  # fmt: skip
        return cert, key
