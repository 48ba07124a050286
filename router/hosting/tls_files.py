"""Whether the files a server opens at start can be opened and used: a certificate and key
loaded as one pair, never asking for a pass phrase. The router's config checks
(:mod:`firstbyte.router.config_check`) and the sim's flags both use it; it lives with the
hosting, the one part of the router the sim may import."""

from __future__ import annotations

import ssl
from pathlib import Path

__all__ = ["file_problem", "tls_pair_problem"]


def file_problem(key: str, path: str) -> str | None:
    """Why the file at ``path`` cannot be used at all: not there, or not readable by this
    process (a key readable by root only, the router running as its own user), which the
    later checks would otherwise report as a file without a certificate, or not catch."""
    if not Path(path).is_file():
        return f"{key}: no such file: {path}"
    try:
        with Path(path).open("rb"):
            pass
    except OSError as exc:
        return f"{key}: cannot read {path}: {exc.strerror or exc}"
    return None


def tls_pair_problem(
    certfile: str, keyfile: str, names: tuple[str, str] = ("listen.certfile", "listen.keyfile")
) -> str | None:
    """Why the certificate and key cannot serve TLS, naming them as ``names`` (the config's
    keys, or the sim's flags), or None: loaded as the server will load them, but never
    asking for an encrypted key's pass phrase on the terminal."""
    cert_name, key_name = names
    for key, path in ((cert_name, certfile), (key_name, keyfile)):
        missing = file_problem(key, path)
        if missing is not None:
            return missing
    cert_text = _read_text(certfile)
    key_text = _read_text(keyfile)
    if "CERTIFICATE-----" not in cert_text:
        swapped = f" (swapped with {key_name}?)" if "CERTIFICATE-----" in key_text else ""
        return f"{cert_name}: no PEM certificate in {certfile}{swapped}"
    if "PRIVATE KEY-----" not in key_text:
        swapped = f" (swapped with {cert_name}?)" if "CERTIFICATE-----" in key_text else ""
        return f"{key_name}: no PEM private key in {keyfile}{swapped}"
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # password: an encrypted key fails here instead of prompting on the terminal.
        context.load_cert_chain(certfile, keyfile, password=_no_password)
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc) or "key values mismatch" in str(exc):
            reason = "the private key does not belong to the certificate"
        else:
            reason = f"cannot load them ({exc.reason or exc})"
        return f"{cert_name}, {key_name}: {reason} ({certfile}, {keyfile})"
    except (OSError, TypeError) as exc:
        return f"{cert_name}, {key_name}: cannot load them ({exc})"
    return None


def _no_password() -> bytes:
    raise TypeError("the private key is encrypted; give an unencrypted key")


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="ascii", errors="replace")
    except OSError:
        return ""
