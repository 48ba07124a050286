// Generated from firstbyte.protocol by `python -m firstbyte.client_sdk.browser_protocol --write`.
// Do not edit: change protocol/ and regenerate (tests/client_sdk/test_browser_protocol.py checks).

export const PATHS = Object.freeze({
  "API_BASE": "/v1",
  "CHAT_COMPLETIONS": "/v1/chat/completions",
  "EDGE_CLIENT": "/v1/edge/client",
  "EDGE_STATUS": "/v1/edge/status",
  "EDGE_TIMINGS": "/v1/edge/timings",
  "EDGE_TOKENS": "/v1/edge/tokens",
  "EDGE_WARM": "/v1/edge/warm",
  "HEALTHZ": "/healthz",
  "METRICS": "/metrics",
  "MODELS": "/v1/models",
  "STREAMS": "/v1/streams",
  "WEBSOCKET": "/v1/ws"
});

export const HEADERS = Object.freeze({
  "BETTER_REGION": "x-firstbyte-better-region",
  "BETTER_REGION_URL": "x-firstbyte-better-region-url",
  "FORWARDED": "x-firstbyte-forwarded",
  "PEER_KEY": "x-firstbyte-peer-key",
  "REGION": "x-firstbyte-region",
  "STREAM": "x-firstbyte-stream"
});

export const ERROR_CODES = Object.freeze({
  "API_KEY_REQUIRED": "api_key_required",
  "CANCELLED": "cancelled",
  "CLIENT_TOKEN_EXPIRED": "client_token_expired",
  "CLIENT_TOKEN_REVOKED": "client_token_revoked",
  "DRAINING": "draining",
  "INVALID_AFTER": "invalid_after",
  "INVALID_API_KEY": "invalid_api_key",
  "INVALID_CLIENT_TOKEN": "invalid_client_token",
  "INVALID_CONTENT_ENCODING": "invalid_content_encoding",
  "INVALID_MESSAGE": "invalid_message",
  "INVALID_REQUEST": "invalid_request",
  "INVALID_TIMINGS": "invalid_timings",
  "INVALID_WAIT": "invalid_wait",
  "KEY_CONCURRENCY_EXCEEDED": "key_concurrency_exceeded",
  "KEY_OVER_FAIR_SHARE": "key_over_fair_share",
  "KEY_RATE_LIMITED": "key_rate_limited",
  "KEY_STORE_FULL": "key_store_full",
  "MISSING_API_KEY": "missing_api_key",
  "MODEL_NOT_FOUND": "model_not_found",
  "NOT_FOUND": "not_found",
  "NO_HEALTHY_BACKEND": "no_healthy_backend",
  "ORIGIN_NOT_ALLOWED": "origin_not_allowed",
  "OVERLOADED": "overloaded",
  "PROMPT_WARM_BUSY": "prompt_warm_busy",
  "PROMPT_WARM_LIMITED": "prompt_warm_limited",
  "REGION_SATURATED": "region_saturated",
  "REQUEST_TIMEOUT": "request_timeout",
  "REQUEST_TOO_LARGE": "request_too_large",
  "SERVICE_UNAVAILABLE": "service_unavailable",
  "STATE_UNAVAILABLE": "state_unavailable",
  "STREAM_HISTORY_TRIMMED": "stream_history_trimmed",
  "STREAM_LOST": "stream_lost",
  "STREAM_NOT_FOUND": "stream_not_found",
  "STREAM_STORE_FULL": "stream_store_full",
  "SUBJECT_CONCURRENCY_EXCEEDED": "subject_concurrency_exceeded",
  "SUBJECT_OVER_FAIR_SHARE": "subject_over_fair_share",
  "TOO_MANY_STREAMS": "too_many_streams",
  "UNAVAILABLE": "unavailable",
  "UNSUPPORTED_CONTENT_ENCODING": "unsupported_content_encoding",
  "UNSUPPORTED_MEDIA_TYPE": "unsupported_media_type",
  "UPSTREAM_EOF": "upstream_eof",
  "UPSTREAM_ERROR": "upstream_error"
});

export const WS = Object.freeze({
  "REQUEST": "request",
  "RESUME": "resume",
  "START": "start",
  "EVENT": "event",
  "DONE": "done",
  "ERROR": "error",
  "SUBPROTOCOL": "firstbyte.v1",
  "TOKEN_SUBPROTOCOL_PREFIX": "firstbyte.token.",
  "CLOSE_INVALID_PAYLOAD": 1007,
  "CLOSE_POLICY": 1008
});

export const SSE = Object.freeze({
  "DONE": "[DONE]"
});

export const TOKENS = Object.freeze({
  "TOKEN_PREFIX": "fbt1.",
  "QUERY_PARAM": "token"
});

export const TIMINGS = Object.freeze({
  "FIELDS": [
    "transport",
    "http_version",
    "region",
    "warm",
    "zero_rtt",
    "prewarmed",
    "stream_id",
    "dns_ms",
    "tcp_connect_ms",
    "tls_handshake_ms",
    "quic_handshake_ms",
    "ws_upgrade_ms",
    "pool_wait_ms",
    "request_sent_ms",
    "first_byte_ms",
    "first_token_ms",
    "last_token_ms",
    "render_ms",
    "resumes"
  ],
  "TRANSPORTS": [
    "sse",
    "websocket",
    "longpoll"
  ],
  "HTTP_VERSIONS": [
    "HTTP/1.1",
    "HTTP/2",
    "HTTP/3"
  ],
  "MAX_MS": 600000.0,
  "ORDER_SLACK_MS": 1.0
});

export const FORMATS = Object.freeze({
  "COMPLETIONS": {
    "NAME": "completions",
    "PATH": "/v1/completions",
    "TERMINAL": []
  },
  "RESPONSES": {
    "NAME": "responses",
    "PATH": "/v1/responses",
    "TERMINAL": [
      "error",
      "response.completed",
      "response.failed",
      "response.incomplete"
    ]
  },
  "MESSAGES": {
    "NAME": "messages",
    "PATH": "/v1/messages",
    "TERMINAL": [
      "error",
      "message_stop"
    ]
  },
  "RESPONSE_CONTENT": [
    "response.function_call_arguments.delta",
    "response.output_text.delta",
    "response.refusal.delta"
  ],
  "MESSAGE_CONTENT_DELTAS": [
    "input_json_delta",
    "text_delta"
  ]
});

export const CONTENT_CODING = Object.freeze({
  "ACCEPT_ENCODING": "gzip, deflate",
  "QUERY_PARAM": "encoding",
  "COMPRESS_MIN_BYTES": 10240
});
