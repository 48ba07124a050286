"""The client's trust options, checked once when the client is built.

``verify`` takes what httpx and requests users pass: ``True`` (the system's CAs), ``False`` (no
verification), a CA bundle path, or a ready :class:`ssl.SSLContext`. ``ca_file`` is a CA bundle
path too. :func:`check_trust` reduces both to one ``(verify, ca_file)`` pair and proves the file
is a readable PEM bundle, so a mistake surfaces as a
:class:`~firstbyte.client_sdk.errors.ConfigurationError` naming the option and the file, at
construction, instead of as a certificate failure on the first request.
"""

from __future__ import annotations

import os
import ssl

from firstbyte.client_sdk.errors import ConfigurationError

__all__ = ["Verify", "build_ssl_context", "check_trust"]

Verify = bool | str | os.PathLike[str] | ssl.SSLContext


def _load(context: ssl.SSLContext, option: str, path: str) -> None:
    try:
        context.load_verify_locations(cafile=path)
    except FileNotFoundError:
        raise ConfigurationError(option, f"{path}: no such file") from None
    except IsADirectoryError:
        raise ConfigurationError(option, f"{path}: is a directory, not a PEM file") from None
    except PermissionError:
        raise ConfigurationError(option, f"{path}: permission denied") from None
    except ssl.SSLError as exc:
        raise ConfigurationError(
            option, f"{path}: no PEM certificate in it ({exc.reason or exc})") from None


def check_trust(
    verify: object = True, ca_file: object = None
) -> tuple[bool | ssl.SSLContext, str | None]:
    """``(verify, ca_file)`` with a ``verify`` path moved to ``ca_file`` and the file checked.

    Raises :class:`TypeError` for a ``verify`` or ``ca_file`` of another type, and
    :class:`~firstbyte.client_sdk.errors.ConfigurationError` for a file that is missing or
    holds no certificate, or for two different CA files.
    """
    if ca_file is not None and not isinstance(ca_file, str | os.PathLike):
        raise TypeError(f"ca_file must be a path, not {type(ca_file).__name__}")
    path = None if ca_file is None else os.fspath(ca_file)
    option = "ca_file"
    if isinstance(verify, str | os.PathLike):
        named = os.fspath(verify)
        if path is not None and path != named:
            raise ConfigurationError("verify", f"{named} and ca_file {path} name two CA files;"
                                               " give one")
        path, option, verify = str(named), "verify", True
    elif not isinstance(verify, bool | ssl.SSLContext):
        raise TypeError("verify must be True, False, a CA file path or an ssl.SSLContext, "
                        f"not {type(verify).__name__}")
    if path is not None:
        _load(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), option, str(path))
    return verify, None if path is None else str(path)


def build_ssl_context(
    verify: Verify = True, ca_file: str | None = None, keylog_file: str | None = None
) -> ssl.SSLContext:
    """The one SSLContext a client uses for every TCP connection (verification on by default).

    With ``keylog_file`` the TLS secrets are appended there in the NSS key log format
    (Wireshark's ``tls.keylog_file``), also on a context the caller passed in.
    """
    checked, path = check_trust(verify, ca_file)
    if isinstance(checked, ssl.SSLContext):
        context = checked
    else:
        context = ssl.create_default_context(cafile=path)
        if not checked:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
    if keylog_file:
        context.keylog_filename = keylog_file
    return context
