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


def test_retry_after_as_date_is_not_guessed() -> None:
    err = api_error_from_response(429, b"{}", retry_after="Wed, 21 Oct 2015 07:28:00 GMT")
    assert isinstance(err, RateLimitError)
    assert err.retry_after is None
