// firstbyte's browser client: stream a chat completion from a firstbyte router over
// fetch-streamed SSE, EventSource, WebSocket or long-poll; resume a broken stream exactly
// as the Python SDK does; record the same Timings plus paint time and long tasks.
//
//   import { Client } from "https://router.example/v1/edge/client/firstbyte.js";
//   const client = new Client({ baseUrl: "https://router.example/v1", token, transport: "websocket" });
//   const stream = client.stream({ model, messages }, { into: document.querySelector("#answer") });
//   for await (const delta of stream) { /* into: already appended */ }
//   console.log(stream.timings);   // JSON: the Python SDK's Timings fields + render_ms, long_tasks
//
// `reportTimings: true` sends each finished stream's Timings (phases and offsets only) to the
// router, batched (report.js): the operator's client-perceived latency histograms.
//
// `token` is a client token minted by the application's backend (POST /v1/edge/tokens with
// its API key; docs/browser.md): a browser never holds an API key. EventSource and WebSocket
// cannot send headers; the token then travels as ?token= (EventSource) or a subprotocol.
//
// No preflight on the critical path: with `simpleStart` (the default) a stream starts,
// resumes and long-polls with CORS simple requests (a text/plain body, the token as ?token=,
// no custom header), so a cold page's first message costs no OPTIONS round trip. `client.prewarm()`
// opens the connection before the user sends; `client.warmOnIntent(promptBox)` does it on
// focus or a keystroke and keeps it warm while the page is visible (warm.js).
//
// A request body over 10 KiB (a long conversation) is sent gzip-compressed where the browser
// has CompressionStream, so that it fits in a new connection's first flight (compress.js);
// `compressRequests: false` sends every body as it is.

import { ERROR_CODES, HEADERS, PATHS, TOKENS, WS } from "./protocol.js";
import { declareEncoding, encodeBody } from "./compress.js";
import { SSEDecoder, SSEProtocolError, seqOf } from "./sse.js";
import { EventAssembler, STREAMED } from "./formats.js";
import {
  APIError, PollCursor, ResumePolicy, RETRY_STATUSES, RetryBudget, retryAfterS,
  SequenceGapError, StreamAssembler, StreamBrokenError,
} from "./stream.js";
import { TimingRecorder } from "./timings.js";
import { TimingsReporter } from "./report.js";
import { IntentWarmer } from "./warm.js";

export {
  APIError, FirstbyteError, StreamBrokenError, StreamStalledError, SequenceGapError,
} from "./stream.js";
export { IntentWarmer, WarmSchedule } from "./warm.js";

export const TRANSPORTS = Object.freeze(["sse-fetch", "eventsource", "websocket", "longpoll"]);

/** The connection broke after the request was sent; the stream may be resumable. */
export class TransportCut extends StreamBrokenError {}
class Stalled extends StreamBrokenError {}

const END = Symbol("end");
/** The longest a stalled stream's probe of its router waits (ChatStream.#routerAnswers). */
const PROBE_TIMEOUT_MAX_S = 10;

/** A push queue between a transport's callbacks and the stream's loop. */
class Channel {
  constructor() {
    this.items = [];
    this.waiter = null;
    this.closed = false;
    this.abort = new AbortController();
    this.onClose = [];
    this.ended = new Promise((resolve) => { this.settle = resolve; });
  }
  push(item) {
    if (this.closed) return;
    if (this.waiter) {
      const { resolve } = this.waiter;
      this.waiter = null;
      resolve(item);
    } else this.items.push(item);
  }
  fail(error) {
    if (this.closed) return;
    if (this.waiter) {
      const { reject } = this.waiter;
      this.waiter = null;
      reject(error);
    } else this.items.push({ error });
    this.closed = true;
    this.settle();
  }
  end() {
    this.push(END);
    this.settle();
  }
  /** The next item, or throws the transport's error; rejects with Stalled after idleMs. */
  next(idleMs) {
    if (this.items.length) {
      const item = this.items.shift();
      return item?.error ? Promise.reject(item.error) : Promise.resolve(item);
    }
    if (this.closed) return Promise.reject(new TransportCut("transport closed"));
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        this.waiter = null;
        reject(new Stalled("stalled"));
      }, idleMs);
      this.waiter = {
        resolve: (v) => { clearTimeout(timer); resolve(v); },
        reject: (e) => { clearTimeout(timer); reject(e); },
      };
    });
  }
  close() {
    this.closed = true;
    this.abort.abort();
    for (const fn of this.onClose) fn();
  }
}

async function errorFrom(response) {
  let error = null;
  try {
    error = (await response.json()).error;
  } catch { /* not JSON */ }
  const err = new APIError(response.status, error);
  err.retryAfter = retryAfterS(response.headers.get("retry-after"));
  return err;
}

function asCut(err) {
  if (err instanceof StreamBrokenError || err instanceof APIError) return err;
  return new TransportCut(err?.message || String(err));
}

export class Client {
  constructor({ baseUrl, token, transport = "sse-fetch", idleTimeoutS = 30, maxResumes = 5,
                resumeBackoffS = 0.05, stallRetries = 1, pollWaitS = 10,
                reportTimings = false, reportIntervalS = 10, reportBatch = 50,
                retries = 2, retryBudgetS = 5, simpleStart = true, compressRequests = true }) {
    if (!TRANSPORTS.includes(transport)) {
      throw new TypeError(`transport must be one of ${TRANSPORTS.join(", ")}`);
    }
    this.baseUrl = baseUrl.replace(/\/+$/, "");
    // "/v1", or a proxy's own base; no trailing "/" (a bare origin's "/" made "//chat/...")
    this.apiBase = new URL(this.baseUrl).pathname.replace(/\/+$/, "");
    this.token = token;
    this.transport = transport;
    this.idleTimeoutS = idleTimeoutS;
    this.maxResumes = maxResumes;
    this.resumeBackoffS = resumeBackoffS;
    this.stallRetries = stallRetries;
    this.pollWaitS = pollWaitS;
    /** A refusal before the stream started (429, 503), or a `draining` end before any token,
     * is sent again within this budget per stream (stream.js RetryBudget; 0 retries: off). */
    this.retries = retries;
    this.retryBudgetS = retryBudgetS;
    /** Starts (and SSE resumes) as CORS simple requests: no preflight (docs/browser.md). */
    this.simpleStart = simpleStart;
    /** Bodies over 10 KiB (a stream's start, a prompt warm-up) go gzip-compressed where the
     * browser can (compress.js): a long history then fits in the first flight. */
    this.compressRequests = compressRequests;
    /** When this client last sent a request to the router (seconds, performance.now()):
     * what keeps its connection warm. */
    this.lastUseS = null;
    /** When a stream of this client last sent a request: the user's activity (a prewarm,
     * the keep-warm's own, is not). */
    this.lastStreamS = null;
    /** A prewarm on intent opened the connection and no stream has used it yet. */
    this.intentWarm = false;
    /** With `reportTimings`: finished streams' Timings go to the router (report.js). */
    this.timingsReporter = reportTimings
      ? new TimingsReporter(this, { intervalS: reportIntervalS, batchRecords: reportBatch })
      : null;
  }

  /** Send the queued timings reports now (with `reportTimings`); resolves when answered. */
  flushTimings() {
    return this.timingsReporter ? this.timingsReporter.flush() : Promise.resolve([]);
  }

  /** ``PATHS.X`` under this client's base URL. */
  url(path) {
    return new URL(this.baseUrl).origin + this.apiBase + path.slice(PATHS.API_BASE.length);
  }

  /** The `wait` a long-poll asks the router for (the start and every poll): `pollWaitS`, at
   * most half of `idleTimeoutS`, as the Python SDK. The start's 201 (the stream id) comes
   * once the wait is over, however slow the upstream's head, so it must come before the
   * watchdog fires: then a stall is resumed by the stream's id, not waited on without one.
   * Half leaves the other half for the round trip and the router's own time. */
  get longPollWaitS() {
    return Math.min(this.pollWaitS, this.idleTimeoutS / 2);
  }

  /** The URL a stream of this client's transport starts at (the preflight cache is per URL). */
  startUrl() {
    const url = new URL(this.url(this.transport === "sse-fetch"
      ? PATHS.CHAT_COMPLETIONS : PATHS.STREAMS));
    if (this.transport === "longpoll") url.searchParams.set("wait", String(this.longPollWaitS));
    if (this.simpleStart) url.searchParams.set(TOKENS.QUERY_PARAM, this.token);
    return url.href;
  }

  /**
   * Open the connection to the router without starting a stream: GET /v1/edge/warm (TCP +
   * TLS, or QUIC once the page has learnt Alt-Svc; no key, 204) and, when this client's
   * starts are preflighted (`simpleStart: false`, or `preflight: true`), a plain OPTIONS to
   * the start URL so that its preflight answer is cached. A WebSocket client opens its socket
   * and keeps it for the next stream. `intent`: the user is about to send (the next stream's
   * Timings say `prewarmed`). With `model` and `messages` (the conversation so far) it then
   * warms the prompt too: POST /v1/edge/warm has the router compute the prefix on the backend
   * the next message will be routed to (best effort: a busy region or a spent budget answers
   * null). Resolves to `{ ms, prompt }`: the milliseconds it took and the router's
   * `{warmed, prompt_tokens, cached_tokens}` (or null). A `429` or `503` to the GET (a
   * balancer or CDN in front, or the router refusing a new connection) rejects with its
   * APIError (`retryAfter` in seconds, or null): the connection is not warm.
   */
  async prewarm({ preflight = !this.simpleStart, intent = true, model = null,
                  messages = null } = {}) {
    const started = performance.now();
    this.lastUseS = started / 1000;
    if (this.transport === "websocket") {
      await this.#openIdleSocket();
    } else {
      // Each answer is read to its end: a response left unread is cancelled (a failed load
      // in the page's console), and may hold the connection's stream open.
      const response = await fetch(this.url(PATHS.EDGE_WARM));
      if (RETRY_STATUSES.includes(response.status)) throw await errorFrom(response);
      await response.arrayBuffer();
      if (preflight) {
        // The preflight asks for these header names; the values never reach an endpoint.
        await (await fetch(this.startUrl(), {
          method: "OPTIONS",
          headers: { authorization: "Bearer prewarm", "content-type": "application/json" },
        })).arrayBuffer();
      }
    }
    if (intent) this.intentWarm = true;
    const prompt = messages ? await this.#warmPrompt(model, messages) : null;
    return { ms: performance.now() - started, prompt };
  }

  async #warmPrompt(model, messages) {
    const { body, encoding } = await encodeBody(JSON.stringify({ model, messages }),
                                                { compress: this.compressRequests });
    const url = new URL(this.url(PATHS.EDGE_WARM));
    let headers;
    if (this.simpleStart) {
      url.searchParams.set(TOKENS.QUERY_PARAM, this.token);
      headers = { "content-type": "text/plain" };
    } else {
      headers = { authorization: `Bearer ${this.token}`, "content-type": "application/json" };
    }
    const [href, sent] = declareEncoding(url.href, headers, encoding, this.simpleStart);
    const response = await fetch(href, { method: "POST", body, headers: sent });
    if (response.ok) return await response.json();
    const err = await errorFrom(response);
    if (err.code === ERROR_CODES.PROMPT_WARM_BUSY || err.code === ERROR_CODES.PROMPT_WARM_LIMITED) {
      return null; // the region is busy or the user's warm-ups are spent: send as usual
    }
    throw err;
  }

  /** Prewarm on the user's intent in `element` (focus, a keystroke) and keep the connection
   * warm while the page is visible; warm.js states the cost. `.stop()` ends it. */
  warmOnIntent(element, options = {}) {
    return new IntentWarmer(this, element, options);
  }

  async #openIdleSocket() {
    if (this.idleSocket?.readyState === WebSocket.OPEN) return;
    const socket = openSocket(this);
    await new Promise((resolve, reject) => {
      socket.onopen = resolve;
      socket.onerror = () => reject(new TransportCut("WebSocket prewarm failed"));
    });
    socket.onopen = socket.onerror = null;
    if (this.idleSocket?.readyState === WebSocket.OPEN) socket.close();
    else {
      this.idleSocket?.close();
      this.idleSocket = socket;
    }
  }

  /**
   * Stream one chat completion. `onFirstToken(delta)` runs when the first token arrives and
   * should put its text in the DOM; or give `into` (an Element) and the client appends every
   * token's text there itself. Either way `timings.render_ms` is the next animation frame.
   */
  stream(request, { onFirstToken = null, into = null } = {}) {
    // As the Python SDK: usage in the last chunk, so the token count is known.
    const body = { stream_options: { include_usage: true }, ...request, stream: true };
    return new ChatStream(this, body, { onFirstToken, into });
  }

  /**
   * Stream a request of another format: `"completions"`, `"responses"` (OpenAI's Responses)
   * or `"messages"` (Anthropic's), read by formats.js. Iterating yields
   * `{event, type, text, isContent, seq}` per event the upstream sent; `text`, `usage`
   * (`{input_tokens, output_tokens}`), `timings`, resume and retries as for chat. Over
   * EventSource only completions (its `onmessage` never sees named events).
   */
  streamEvents(format, request, { onFirstToken = null, into = null } = {}) {
    if (!(format in STREAMED)) {
      throw new TypeError(`format must be one of ${Object.keys(STREAMED).join(", ")}`);
    }
    if (this.transport === "eventsource" && STREAMED[format].TERMINAL.length) {
      throw new TypeError(`EventSource cannot read ${format} events; use sse-fetch`);
    }
    const usage = format === "completions" ? { stream_options: { include_usage: true } } : {};
    const body = { ...usage, ...request, stream: true };
    return new ChatStream(this, body, { onFirstToken, into, format });
  }
}

export class ChatStream {
  constructor(client, body, { onFirstToken, into, format = null }) {
    this.client = client;
    this.body = JSON.stringify(body);
    /** The start's body as sent (compress.js), encoded once on the first start. */
    this.encoded = null;
    this.onFirstToken = onFirstToken;
    this.into = into;
    /** null (chat) or a formats.js format name: its path, assembler and `endpoint`. */
    this.format = format;
    this.recorder = new TimingRecorder(client.transport);
    this.assembler = this.newAssembler();
    this.policy = new ResumePolicy({
      maxResumes: client.maxResumes, backoffS: client.resumeBackoffS,
      stallRetries: client.stallRetries, idleTimeoutS: client.idleTimeoutS,
    });
    this.retry = new RetryBudget({ retries: client.retries, budgetS: client.retryBudgetS });
    this.streamId = null;
    this.parts = [];
    this.finished = false;
    this.channel = null;
    /** A prewarm on intent opened the connection this stream is the first to use. */
    this.prewarmed = client.intentWarm;
    client.intentWarm = false;
  }

  get timings() {
    return this.recorder.record;
  }
  get text() {
    return this.parts.join("");
  }
  get usage() {
    return this.assembler.usage;
  }

  /** Read the whole stream; resolves to the text. */
  async collect() {
    for await (const _ of this); // eslint-disable-line no-unused-vars
    return this.text;
  }

  async *[Symbol.asyncIterator]() {
    this.channel = this.#open(null, 0);
    try {
      while (!this.finished) {
        const delta = await this.#step();
        if (delta) yield delta;
      }
      // Let the response end on its own (it does right after [DONE]): an aborted body may
      // leave no Resource Timing entry behind.
      await Promise.race([this.channel.ended, new Promise((r) => setTimeout(r, 1000))]);
    } finally {
      this.channel?.close();
      this.finished = true;
      await this.recorder.finish();
      const record = this.recorder.record;
      record.prewarmed = this.prewarmed && record.warm;
      this.client.timingsReporter?.note(record);
    }
  }

  async #step() {
    let item;
    try {
      item = await this.channel.next(this.client.idleTimeoutS * 1000);
      if (item === END) {
        if (this.assembler.done) {
          this.finished = true;
          return null;
        }
        throw new TransportCut("stream ended before its last event");
      }
      if (item.opened !== undefined) {
        if (item.opened) this.streamId = item.opened;
        return null;
      }
      const delta = this.assembler.receive(item.seq, item.payload);
      if (this.assembler.done) this.finished = true;
      if (!delta) return null;
      if (delta.isContent) {
        const first = this.recorder.record.first_token_ms === null;
        this.recorder.token();
        if (this.into) this.into.append(document.createTextNode(delta.text));
        if (first) {
          if (this.onFirstToken) this.onFirstToken(delta);
          this.recorder.awaitPaint(); // not awaited: later tokens keep their arrival times
        }
      }
      this.parts.push(delta.text);
      return delta;
    } catch (err) {
      if (err instanceof APIError && await this.#retried(err)) return null;
      if (!(err instanceof TransportCut || err instanceof SequenceGapError ||
            err instanceof Stalled)) {
        this.finished = true;
        throw err;
      }
      if (err instanceof Stalled && this.streamId === null && await this.#routerAnswers()) {
        // Nothing to resume by, and the router still answers: it holds the request (queued,
        // or its upstream slow to answer: a long prefill). Sent again, the model would run
        // it twice; wait on it, on the same request, instead.
        try {
          this.policy.held({ lastSeq: this.assembler.lastSeq });
        } catch (stalled) {
          // Given up; the iterator's `finally` closes the request: an SSE request gone
          // before its head is cancelled upstream.
          this.finished = true;
          throw stalled;
        }
        return null;
      }
      await this.#recover(err);
      return null;
    }
  }

  /**
   * Whether the router answers a probe now: any HTTP answer (any status) to GET
   * /v1/edge/status under this client's base URL, within min(idleTimeoutS, 10 s: the Python
   * SDK's default connect timeout). A simple request (no preflight); the router answers it
   * with the CORS headers the stream's own requests got. Not `no-cors`: Chromium blocks an
   * opaque JSON answer's body, a failed load in the page's console.
   */
  async #routerAnswers() {
    const abort = new AbortController();
    const timer = setTimeout(() => abort.abort(),
                             Math.min(this.client.idleTimeoutS, PROBE_TIMEOUT_MAX_S) * 1000);
    try {
      // no-store: an answer from the HTTP cache would say nothing about the router now.
      const response = await fetch(this.client.url(PATHS.EDGE_STATUS), {
        cache: "no-store", signal: abort.signal,
      });
      await response.arrayBuffer(); // read to its end: an unread answer may hold its stream
      return true;
    } catch {
      return false;
    } finally {
      clearTimeout(timer);
    }
  }

  async #recover(reason) {
    this.channel.close();
    let step;
    try {
      step = this.policy.broken(reason.message, {
        opened: this.streamId !== null, stalled: reason instanceof Stalled,
        lastSeq: this.assembler.lastSeq,
      });
    } catch (err) {
      this.finished = true;
      throw err;
    }
    if (step.delayS) await new Promise((r) => setTimeout(r, step.delayS * 1000));
    if (!step.resend) this.recorder.resume();
    this.channel = this.#open(step.resend ? null : this.streamId, this.assembler.lastSeq);
  }

  /** Send the request again if `err` allows it (never after a token: it would repeat). */
  async #retried(err) {
    const refused = this.streamId === null && RETRY_STATUSES.includes(err.status);
    const drained = err.code === "draining" && err.status === null &&
      this.recorder.record.first_token_ms === null;
    if (!refused && !drained) return false;
    const wait = this.retry.delay(drained ? 0 : err.retryAfter ?? null);
    if (wait === null) return false;
    this.channel.close();
    if (wait) await new Promise((r) => setTimeout(r, wait * 1000));
    this.assembler = this.newAssembler();
    this.streamId = null;
    this.finished = false;
    this.channel = this.#open(null, 0);
    return true;
  }

  #open(streamId, after) {
    const channel = new Channel();
    const run = {
      "sse-fetch": sseFetch, eventsource: eventSource, websocket: webSocket, longpoll: longPoll,
    }[this.client.transport];
    run(this, channel, streamId, after).catch((err) => channel.fail(asCut(err)));
    return channel;
  }

  // -- helpers the transports share --------------------------------------------------------
  newAssembler() {
    return this.format ? new EventAssembler(this.format) : new StreamAssembler();
  }

  /** A chat stream's start URL made this stream's format's: the format's path in place of
   * chat completions' (SSE), or `endpoint=NAME` on `POST /v1/streams` (long-poll,
   * EventSource). Unchanged for chat. */
  formatUrl(href) {
    if (!this.format) return href;
    const url = new URL(href);
    const chat = new URL(this.client.url(PATHS.CHAT_COMPLETIONS));
    if (url.pathname === chat.pathname) {
      url.pathname = new URL(this.client.url(STREAMED[this.format].PATH)).pathname;
    } else url.searchParams.set("endpoint", this.format);
    return url.href;
  }

  headers(extra = {}) {
    return { authorization: `Bearer ${this.client.token}`, ...extra };
  }

  async fetch(url, init, channel) {
    this.client.lastUseS = this.client.lastStreamS = performance.now() / 1000;
    this.recorder.noteRequest(url);
    // No `cache: "no-store"`: Chromium then bypasses its CORS preflight cache too, and every
    // request of a warm page paid one more round trip (measured: bench browser). The router's
    // answers carry no validators or freshness, so no HTTP cache can answer them anyway.
    const response = await fetch(url, { ...init, signal: channel.abort.signal });
    this.recorder.requestSent();
    this.recorder.noteResponse(response.headers);
    if (!response.ok) throw await errorFrom(response);
    return response;
  }

  /** A POST that starts a stream (chat completions SSE, or /v1/streams for the others), at
   * this stream's format's URL. With `simpleStart` a CORS simple request: the token in the
   * URL, the JSON as text/plain. A body over 10 KiB goes gzip-compressed
   * (`compressRequests`; the encoding as `?encoding=` on a simple request). */
  async start(channel) {
    this.encoded ??= encodeBody(this.body, { compress: this.client.compressRequests });
    const { body, encoding, bytes } = await this.encoded;
    this.recorder.record.request_bytes = bytes;
    const simple = this.client.simpleStart;
    const own = simple ? { "content-type": "text/plain" }
      : this.headers({ "content-type": "application/json" });
    const [url, headers] = declareEncoding(
      this.formatUrl(this.client.startUrl()), own, encoding, simple);
    return this.fetch(url, { method: "POST", body, headers }, channel);
  }

  /** GET /v1/streams/{id}/poll from `after`, waiting up to `waitS`: the URL and the fetch
   * options. With `simpleStart` a simple request too (the token in the URL, no header): a
   * cold page's long-poll stream then sends no OPTIONS before any of its polls. */
  poll(streamId, after, waitS) {
    const url = new URL(this.client.url(`${PATHS.STREAMS}/${streamId}/poll`));
    url.searchParams.set("after", String(after));
    url.searchParams.set("wait", String(waitS));
    if (this.client.simpleStart) {
      url.searchParams.set(TOKENS.QUERY_PARAM, this.client.token);
      return [url.href, {}];
    }
    return [url.href, { headers: this.headers() }];
  }

  /** GET /v1/streams/{id} from `after` as SSE (a simple request with `simpleStart`). */
  resume(streamId, after, channel) {
    const url = new URL(this.client.url(`${PATHS.STREAMS}/${streamId}`));
    if (this.client.simpleStart) {
      url.searchParams.set(TOKENS.QUERY_PARAM, this.client.token);
      url.searchParams.set("after", String(after));
      return this.fetch(url.href, { headers: { accept: "text/event-stream" } }, channel);
    }
    return this.fetch(url.href, {
      headers: this.headers({ "last-event-id": String(after), accept: "text/event-stream" }),
    }, channel);
  }
}

// -- transports: each pushes {opened: id} once, then {seq, payload} items, then END -----------

async function sseFetch(stream, channel, streamId, after) {
  const client = stream.client;
  const response = streamId === null
    ? await stream.start(channel)
    : await stream.resume(streamId, after, channel);
  const ctype = response.headers.get("content-type") || "";
  if (!ctype.startsWith("text/event-stream")) {
    throw new StreamBrokenError(`expected an event stream, got content-type ${ctype}`);
  }
  channel.push({ opened: response.headers.get(HEADERS.STREAM) || streamId });
  const decoder = new SSEDecoder();
  // An event without an id line of its own keeps the last id (the SSE spec); the router
  // numbers each event once, so the same id again is one outside the stream's sequence (an
  // error it adds, such as stream_history_trimmed), not a replay to drop.
  let previous = null;
  const reader = response.body.getReader();
  channel.onClose.push(() => reader.cancel().catch(() => {}));
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    let events;
    try {
      events = decoder.receive(value);
    } catch (err) {
      if (err instanceof SSEProtocolError) throw new StreamBrokenError(err.message);
      throw err;
    }
    for (const e of events) {
      channel.push({ seq: e.id === previous ? null : seqOf(e.id), payload: e.data });
      previous = e.id;
    }
  }
  channel.end();
}

async function eventSource(stream, channel, streamId, after) {
  const client = stream.client;
  if (streamId === null) {
    const started = await (await stream.start(channel)).json();
    streamId = started.stream;
  }
  channel.push({ opened: streamId });
  const url = new URL(client.url(`${PATHS.STREAMS}/${streamId}`));
  url.searchParams.set(TOKENS.QUERY_PARAM, client.token);
  url.searchParams.set("after", String(after));
  const source = new EventSource(url);
  channel.onClose.push(() => source.close());
  let opened = false;
  source.onopen = () => { opened = true; };
  let previous = ""; // EventSource's lastEventId before any id: "" (as fetch's SSE, above)
  source.onmessage = (e) => {
    channel.push({ seq: e.lastEventId === previous ? null : seqOf(e.lastEventId), payload: e.data });
    previous = e.lastEventId;
  };
  source.onerror = () => {
    source.close(); // resume is ours (bounded, with backoff), not EventSource's own retry
    if (opened) {
      channel.fail(new TransportCut("EventSource connection lost"));
      return;
    }
    // Refused before opening: EventSource hides the status; ask for it with a poll.
    explain(stream, streamId, after, "EventSource").then((err) => channel.fail(err));
  };
}

const NO_STREAM = "none";

/** Why an EventSource or a WebSocket was refused before opening (the browser hides the
 * status): a poll of its stream with the same token says. Before a stream was made, a poll of
 * no stream: its 404 means the token passed, and the failure was the connection's, or a
 * draining router's `503 draining`, which `/healthz` says too (a poll, a read, is not refused
 * while draining). */
async function explain(stream, streamId, after, what) {
  try {
    const [url, init] = stream.poll(streamId ?? NO_STREAM, after, 0);
    const response = await fetch(url, init);
    const tokenPassed = streamId === null && response.status === 404;
    if (!response.ok && !tokenPassed) return await errorFrom(response);
    if (tokenPassed) {
      // At the origin's root, as the Python SDK asks it (not under the API base).
      const healthz = new URL(stream.client.baseUrl).origin + PATHS.HEALTHZ;
      const health = await fetch(healthz, { cache: "no-store" });
      const text = (await health.text()).trim();
      if (health.status === 503 && text === ERROR_CODES.DRAINING) {
        // The upgrade's own answer (ws.py refuses it with the request's 503), so the retry
        // rules treat it as SSE's: sent again after its Retry-After, on a new connection.
        const err = new APIError(503, {
          message: "The router is shutting down; send the request again.",
          type: "server_error", code: ERROR_CODES.DRAINING,
        });
        err.retryAfter = retryAfterS(health.headers.get("retry-after"));
        return err;
      }
    }
  } catch { /* unreachable: a cut */ }
  return new TransportCut(`${what} could not connect`);
}

async function webSocket(stream, channel, streamId, after) {
  const client = stream.client;
  // A stream that ended with `done` leaves its socket open for the client's next stream, as
  // the Python SDK keeps its connection: a warm page's WebSocket stream then costs one round
  // trip instead of four (bench browser measured both).
  let socket = client.idleSocket;
  client.idleSocket = null;
  const reused = socket?.readyState === WebSocket.OPEN;
  if (!reused) {
    socket?.close();
    socket = openSocket(client);
  }
  let done = false;
  let reusable = false;
  channel.onClose.push(() => {
    if (reusable && socket.readyState === WebSocket.OPEN && client.idleSocket === null) {
      socket.onopen = socket.onmessage = socket.onclose = null;
      client.idleSocket = socket;
    } else socket.close();
  });
  const send = () => {
    client.lastUseS = client.lastStreamS = performance.now() / 1000;
    stream.recorder.requestSent();
    if (streamId === null) {
      stream.recorder.record.request_bytes = new TextEncoder().encode(stream.body).length;
    }
    socket.send(streamId === null
      ? `{"type":"${WS.REQUEST}",${stream.format ? `"endpoint":"${stream.format}",` : ""}"body":${stream.body}}`
      : JSON.stringify({ type: WS.RESUME, stream: streamId, after }));
  };
  stream.recorder.record.warm = reused;
  socket.onmessage = (e) => {
    stream.recorder.noteResponse(null);
    const message = JSON.parse(e.data);
    if (message.type === WS.START) {
      if (message.region) stream.recorder.record.region = message.region;
      stream.recorder.record.stream_id = message.stream;
      channel.push({ opened: message.stream });
    } else if (message.type === WS.EVENT) {
      channel.push({ seq: message.seq, payload: message.data });
    } else if (message.type === WS.DONE) {
      done = true;
      reusable = true;
      channel.push({ seq: message.seq, payload: "[DONE]" });
      channel.end();
    } else if (message.type === WS.ERROR) {
      done = true;
      // A refusal carries the status SSE would have (429, 503...); an error event, none.
      const err = new APIError(message.stream ? null : message.status ?? null, message.error);
      // And SSE's Retry-After, for the same wait (null from an older router: the backoff).
      err.retryAfter = message.retry_after ?? null;
      channel.fail(err);
    } // a newer router's message type: skipped
  };
  let opened = reused;
  socket.onclose = (e) => {
    if (done) return;
    if (opened) {
      channel.fail(new TransportCut(`WebSocket closed (${e.code})`));
      return;
    }
    // Refused before opening (a 401 for an expired token, a 403...): the browser says only
    // 1006; ask for the status with a poll, so a refusal is the APIError it is, not a cut.
    explain(stream, streamId, after, "WebSocket").then((err) => channel.fail(err));
  };
  if (reused) send();
  else {
    socket.onopen = () => {
      opened = true;
      send();
    };
  }
}

function openSocket(client) {
  const url = new URL(client.url(PATHS.WEBSOCKET));
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  return new WebSocket(url, [WS.SUBPROTOCOL, WS.TOKEN_SUBPROTOCOL_PREFIX + client.token]);
}

async function longPoll(stream, channel, streamId, after) {
  const client = stream.client;
  let batch;
  if (streamId === null) {
    batch = await (await stream.start(channel)).json();
    streamId = batch.stream;
  }
  channel.push({ opened: streamId });
  const cursor = new PollCursor(streamId, { after, waitS: client.longPollWaitS });
  for (;;) {
    if (batch) {
      for (const e of cursor.receiveBatch(batch, performance.now() / 1000)) {
        channel.push({ seq: e.seq, payload: e.data });
      }
      if (cursor.done) {
        channel.push({ seq: null, payload: "[DONE]" });
        channel.end();
        return;
      }
    }
    batch = null;
    const next = cursor.nextPoll(performance.now() / 1000);
    const wait = next.notBefore - performance.now() / 1000;
    if (wait > 0) await new Promise((r) => setTimeout(r, wait * 1000));
    if (channel.closed) return;
    try {
      const [url, init] = stream.poll(streamId, next.after, next.waitS);
      const response = await fetch(url, { ...init, signal: channel.abort.signal });
      if (!response.ok) throw await errorFrom(response);
      batch = await response.json();
    } catch (err) {
      if (err instanceof APIError || channel.closed) throw err;
      cursor.receiveFailure(performance.now() / 1000, err.message); // throws when out of tries
    }
  }
}
