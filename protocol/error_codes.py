"""The ``code`` values of firstbyte's own errors (``{"error": {..., "code": CODE}}``).

Errors passed through from an upstream keep the upstream's code; these are the ones the router
itself answers with. A client may act on them (``region_saturated`` -> try another region).
"""

from __future__ import annotations

__all__ = [
    "API_KEY_REQUIRED",
    "CANCELLED",
    "CLIENT_TOKEN_EXPIRED",
    "CLIENT_TOKEN_REVOKED",
    "DRAINING",
    "INVALID_AFTER",
    "INVALID_API_KEY",
    "INVALID_CLIENT_TOKEN",
    "INVALID_CONTENT_ENCODING",
    "INVALID_MESSAGE",
    "INVALID_REQUEST",
    "INVALID_TIMINGS",
    "INVALID_WAIT",
    "KEY_CONCURRENCY_EXCEEDED",
    "KEY_OVER_FAIR_SHARE",
    "KEY_RATE_LIMITED",
    "KEY_STORE_FULL",
    "MISSING_API_KEY",
    "MODEL_NOT_FOUND",
    "NOT_FOUND",
    "NO_HEALTHY_BACKEND",
    "ORIGIN_NOT_ALLOWED",
    "OVERLOADED",
    "PROMPT_WARM_BUSY",
    "PROMPT_WARM_LIMITED",
    "REGION_SATURATED",
    "REQUEST_TIMEOUT",
    "REQUEST_TOO_LARGE",
    "SERVICE_UNAVAILABLE",
    "STATE_UNAVAILABLE",
    "STREAM_HISTORY_TRIMMED",
    "STREAM_LOST",
    "STREAM_NOT_FOUND",
    "STREAM_STORE_FULL",
    "SUBJECT_CONCURRENCY_EXCEEDED",
    "SUBJECT_OVER_FAIR_SHARE",
    "TOO_MANY_STREAMS",
    "UNAVAILABLE",
    "UNSUPPORTED_CONTENT_ENCODING",
    "UNSUPPORTED_MEDIA_TYPE",
    "UPSTREAM_EOF",
    "UPSTREAM_ERROR",
]

MISSING_API_KEY = "missing_api_key"
INVALID_API_KEY = "invalid_api_key"
INVALID_CLIENT_TOKEN = "invalid_client_token"
"""401: a client token that is malformed, not signed by this router, or bound to another
``Origin``."""
CLIENT_TOKEN_EXPIRED = "client_token_expired"
"""401: a client token past its ``expires_at``; the application's backend mints a new one."""
CLIENT_TOKEN_REVOKED = "client_token_revoked"
"""401: a client token minted for an API key the router no longer accepts (the key was removed
from the config); a new token needs a key that is configured."""
API_KEY_REQUIRED = "api_key_required"
"""403: a client token where only an API key may act (minting tokens)."""
PROMPT_WARM_LIMITED = "prompt_warm_limited"
"""429: more prompt warm-ups (``POST /v1/edge/warm``) for this key and subject than
``limits.prompt_warms_per_min_per_subject`` allows; ``Retry-After`` says when the next may go."""
PROMPT_WARM_BUSY = "prompt_warm_busy"
"""503: the region is too busy for a prompt warm-up (its backends past
``limits.prompt_warm_max_load``): a warm-up never takes a slot a real request needs. The
message itself is served as usual; ``Retry-After`` says when a warm-up may go again."""
ORIGIN_NOT_ALLOWED = "origin_not_allowed"
"""403: a preflight-free start (the client token in ``?token=``) from a page whose ``Origin``
is not in ``cors.allow_origins``: refused as its preflight would have been, before anything is
spent."""
INVALID_REQUEST = "invalid_request"
INVALID_TIMINGS = "invalid_timings"
"""400: a timings report that is not one, holds too many records, or holds a record no real
client could have felt (:func:`firstbyte.protocol.timings.implausible`, an unknown region)."""
REQUEST_TOO_LARGE = "request_too_large"
REQUEST_TIMEOUT = "request_timeout"
"""408: the request body stalled past the router's ``client_body_timeout_s``."""
OVERLOADED = "overloaded"
"""503: the router is short of memory or file descriptors and refuses new work for now."""
UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
UNSUPPORTED_CONTENT_ENCODING = "unsupported_content_encoding"
"""415: a request body in a coding the router does not take (``br``, ``zstd``) or in more
than one (``gzip, gzip``); the answer's ``Accept-Encoding`` lists the ones it takes."""
INVALID_CONTENT_ENCODING = "invalid_content_encoding"
"""400: a request body that is not valid data of its ``Content-Encoding`` (corrupt,
truncated, trailing bytes)."""
NOT_FOUND = "not_found"
STREAM_NOT_FOUND = "stream_not_found"
"""Unknown stream id, or one created with another API key (the two are not told apart)."""
STREAM_HISTORY_TRIMMED = "stream_history_trimmed"
"""410 (or an in-stream / WebSocket error): a resume from before the stream's oldest kept
event. Its key's streams filled the key's share of the store, so their oldest events were
dropped (read on another process through Redis: also events Redis could not take, or cut by
its bound on a stream's length; the message says which); the stream's later events are
still there, the ones asked for are gone for good."""
STREAM_LOST = "stream_lost"
"""In-stream: the router process producing the stream stopped (killed, crashed) before
``[DONE]``; a reader on another process of the region learns it within a few seconds (its
lease lapsed; a Redis that evicts may have evicted the lease of a process still running, and
the message then says so). The events before the error are all the stream will have."""
INVALID_AFTER = "invalid_after"
INVALID_WAIT = "invalid_wait"
REGION_SATURATED = "region_saturated"
"""429: every backend of the region is saturated; ``Retry-After`` says when to retry."""
MODEL_NOT_FOUND = "model_not_found"
"""404: no backend of this region and no peer region serves the requested ``model`` (as
OpenAI answers an unknown model); nothing was sent upstream. ``GET /v1/models`` lists what
the region serves."""
NO_HEALTHY_BACKEND = "no_healthy_backend"
"""503: no backend of the region answers (down, or ejected by passive health) and no other
region can take the request; ``Retry-After`` says when one may be back. Not load: another
region, or the same one a little later, may serve it."""
KEY_CONCURRENCY_EXCEEDED = "key_concurrency_exceeded"
"""429: this API key has its limit of completions in flight; the others are unaffected."""
KEY_OVER_FAIR_SHARE = "key_over_fair_share"
"""429: the region is full and this API key holds at least its fair share of it (weighted
max-min over the keys asking); keys below their share are still served. ``Retry-After``."""
SUBJECT_OVER_FAIR_SHARE = "subject_over_fair_share"
"""429: the region (or the key's cap) is full and this subject (an app's end user) holds at
least its fair share of its key's share; the key's other subjects are still served."""
SUBJECT_CONCURRENCY_EXCEEDED = "subject_concurrency_exceeded"
"""429: this subject has its limit of completions in flight (the key's table or its token)."""
KEY_RATE_LIMITED = "key_rate_limited"
"""429: this API key's token bucket is empty; ``Retry-After`` is the wait for the next token."""
KEY_STORE_FULL = "key_store_full"
"""429 from older routers: this API key's live streams fill its share of the stream store. A
router now trims the key's own history instead (``stream_history_trimmed``) and admits it."""
STREAM_STORE_FULL = "stream_store_full"
"""429: live streams fill the whole stream store (none is ever evicted to make room)."""
UNAVAILABLE = "unavailable"
SERVICE_UNAVAILABLE = "service_unavailable"
STATE_UNAVAILABLE = "state_unavailable"
"""503: the region's shared state (``state.redis_url``) did not answer in time or refused the
command; nothing was claimed for the request. ``Retry-After`` says when to retry."""
UPSTREAM_ERROR = "upstream_error"
UPSTREAM_EOF = "upstream_eof"
"""The upstream closed the stream without ``[DONE]``."""
CANCELLED = "cancelled"
"""No reader came back within the resume grace period; the upstream request was cancelled."""
DRAINING = "draining"
"""503 (and ``/healthz``): this router process is shutting down and takes no new work; send
the request again (another router of the region takes it). In-stream: the process stopped
after ``listen.drain_timeout_s`` with the stream unfinished; the events before the error are
all the stream will have, so the request must be sent again to get the rest."""
INVALID_MESSAGE = "invalid_message"
"""WebSocket: a message that is not JSON or has an unknown ``type``."""
TOO_MANY_STREAMS = "too_many_streams"
"""WebSocket: one stream more than a socket may follow at once."""
