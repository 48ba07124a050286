from __future__ import annotations

from firstbyte.client_sdk.errors import (
    APIError,
    AuthenticationError,
    NotFoundError,
    RateLimitError,
    ServiceUnavailableError,
    api_error_from_response,
)


def test_status_selects_the_class_and_body_fills_the_fields() -> None:
    body = b'{"error": {"message": "slow down", "type": "rate_limit_error", "param": null, "code": "busy"}}'
    err = api_error_from_response(429, body, retry_after="2.5")
    assert isinstance(err, RateLimitError)
    assert (err.status, err.type, err.code, err.message, err.retry_after) == (
        429, "rate_limit_error", "busy", "slow down", 2.5)
    assert isinstance(api_error_from_response(401, b"{}"), AuthenticationError)
    assert isinstance(api_error_from_response(404, b""), NotFoundError)
    assert isinstance(api_error_from_response(503, b"oops"), ServiceUnavailableError)
    other = api_error_from_response(418, b"<html>teapot</html>")
    assert type(other) is APIError
    assert other.message == "<html>teapot</html>"


def test_retry_after_as_a_date_is_seconds_until_it_and_garbage_is_none() -> None:
    """RFC 9110 allows an HTTP-date; a past one is no wait (tests/client_sdk/stream_rules.py
    has the parser's table, here the error built from an answer's header)."""
    err = api_error_from_response(429, b"{}", retry_after="Wed, 21 Oct 2015 07:28:00 GMT")
    assert isinstance(err, RateLimitError)
    assert err.retry_after == 0.0
    err = api_error_from_response(503, b"{}", retry_after="in a while")
    assert isinstance(err, ServiceUnavailableError)
    assert err.retry_after is None
