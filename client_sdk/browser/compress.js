// Request bodies, gzip-compressed when that saves round trips (docs/browser.md, "A long
// conversation: compressed requests").
//
// A new or idle TCP connection sends at most its initial window (10 segments, ~14.5 KB with
// TLS and HTTP/2 framing) before the first ACK comes back; a body beyond it waits a round trip
// per doubling. A long conversation's history (8K tokens: ~26-40 KB of JSON) then pays one
// more round trip just to upload, warm-up or not. English compresses about 3x with gzip, which
// brings that history under the window. A body up to COMPRESS_MIN_BYTES already fits in the
// first flight with its headers: it is sent as it is (compressing it would save nothing).
//
// The router inflates what it reads (bounded by its body limit) and forwards JSON: backends
// never see the encoding. How the encoding is said depends on the request: `Content-Encoding`
// where the request may carry it; the query parameter `encoding=` on a CORS simple request
// (`Content-Encoding` is not a CORS-safelisted header: it would cost a preflight).

import { CONTENT_CODING } from "./protocol.js";

/** Bodies up to this many bytes go as they are (10 KiB). */
export const COMPRESS_MIN_BYTES = CONTENT_CODING.COMPRESS_MIN_BYTES;
/** The query parameter naming a simple request's body encoding (`encoding=gzip`). */
export const ENCODING_PARAM = CONTENT_CODING.QUERY_PARAM;

/** True where this browser can gzip (CompressionStream: Chromium 80, Firefox 113, Safari
 * 16.4); elsewhere bodies go uncompressed. */
export function canCompress() {
  return typeof CompressionStream === "function";
}

/**
 * `text` (a JSON string) as the request body to send, `{ body, encoding, bytes }`: `encoding`
 * "gzip" and `body` its gzip bytes (the library's default level) when `compress` is on, the
 * browser can and the UTF-8 body is over COMPRESS_MIN_BYTES; else `encoding` null and `body`
 * the text itself. `bytes`: the body's size as sent. Never rejects.
 */
export async function encodeBody(text, { compress = true } = {}) {
  const bytes = new TextEncoder().encode(text);
  const plain = { body: text, encoding: null, bytes: bytes.length };
  if (!compress || !canCompress() || bytes.length <= COMPRESS_MIN_BYTES) return plain;
  try {
    const gzipped = new Blob([bytes]).stream().pipeThrough(new CompressionStream("gzip"));
    const body = new Uint8Array(await new Response(gzipped).arrayBuffer());
    return { body, encoding: "gzip", bytes: body.length };
  } catch {
    return plain; // a browser that refuses: the message still goes
  }
}

/**
 * Where a POST says its body's `encoding` (from encodeBody; null: nothing to say): `[href,
 * headers]` for `url` and the request's own `headers`. A CORS simple request (`simple`: the
 * body as text/plain, the token in the URL) says it as `?encoding=`; any other as
 * `Content-Encoding`.
 */
export function declareEncoding(url, headers, encoding, simple) {
  if (encoding === null) return [url, headers];
  if (!simple) return [url, { ...headers, "content-encoding": encoding }];
  const target = new URL(url);
  target.searchParams.set(ENCODING_PARAM, encoding);
  return [target.href, headers];
}
