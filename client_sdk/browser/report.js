// Opt-in reports of what the page felt (`new Client({..., reportTimings: true})`): after a
// stream that got its first token ends, its Timings become a record of the fields
// POST /v1/edge/timings accepts (TIMINGS.FIELDS, generated from firstbyte.protocol: phases,
// offsets, how it was sent, region, stream id; never the prompt, the output or any text),
// queued and POSTed as {"records": [...]} to the router that served, with the client token.
//
// The rules are the Python SDK's (firstbyte.client_sdk.timings_report): a batch goes when
// `batchRecords` are queued or the oldest waited `intervalS`; the queue drops the oldest past
// `maxQueued`; a failed post drops its batch (statistics, not data). A page being hidden or
// closed flushes what is queued: the POST is a `fetch(..., {keepalive: true})`, which outlives
// the page (and, unlike sendBeacon, carries the Authorization header).

import { PATHS, TIMINGS } from "./protocol.js";

// The record's transport: how the bytes came, not which browser API read them.
const TRANSPORT = { "sse-fetch": "sse", eventsource: "sse", websocket: "websocket",
                    longpoll: "longpoll" };

const SETUP = ["dns_ms", "tcp_connect_ms", "tls_handshake_ms", "quic_handshake_ms",
               "ws_upgrade_ms", "pool_wait_ms"];
const OFFSETS = ["request_sent_ms", "first_byte_ms", "first_token_ms", "last_token_ms"];

/** The record to report for a finished stream's timings, or null (no first token, no region,
 * or implausible: the router would refuse the whole report). Absent phases are omitted. */
export function timingsRecord(timings) {
  if (timings.first_token_ms === null || !timings.region) return null;
  const source = {
    ...timings,
    transport: TRANSPORT[timings.transport] ?? timings.transport,
    // A WebSocket has no Resource Timing: Chromium opens it over HTTP/1.1.
    http_version: timings.http_version || (timings.transport === "websocket" ? "HTTP/1.1" : ""),
  };
  const record = {};
  for (const name of TIMINGS.FIELDS) {
    const value = source[name];
    if (value !== null && value !== undefined) record[name] = value;
  }
  return implausible(record) === null ? record : null;
}

/** Why the router would refuse `record` (firstbyte.protocol.timings.implausible), or null. */
export function implausible(record) {
  if (!TIMINGS.TRANSPORTS.includes(record.transport)) return "unknown_transport";
  if (!TIMINGS.HTTP_VERSIONS.includes(record.http_version)) return "unknown_http_version";
  const slack = TIMINGS.ORDER_SLACK_MS;
  const setup = SETUP.map((n) => record[n]).filter((v) => v !== undefined);
  const offsets = OFFSETS.map((n) => record[n]).filter((v) => v !== undefined);
  const figures = [...setup, ...offsets, ...(record.render_ms !== undefined
    ? [record.render_ms] : [])];
  if ((record.resumes ?? 0) < 0 ||
      figures.some((v) => !(v >= 0 && v <= TIMINGS.MAX_MS))) return "out_of_range";
  const setupSum = setup.reduce((a, b) => a + b, 0);
  if (record.request_sent_ms !== undefined && setupSum > record.request_sent_ms + slack) {
    return "unordered";
  }
  for (let i = 1; i < offsets.length; i++) {
    if (offsets[i] < offsets[i - 1] - slack) return "unordered";
  }
  if (record.render_ms !== undefined && record.render_ms < record.first_token_ms - slack) {
    return "unordered";
  }
  return null;
}

/** Queues records and POSTs them in batches (see the module comment). */
export class TimingsReporter {
  constructor(client, { intervalS = 10, batchRecords = 50, maxQueued = 1000 } = {}) {
    this.client = client;
    this.intervalS = intervalS;
    this.batchRecords = batchRecords;
    this.maxQueued = maxQueued;
    this.records = [];
    this.timer = null;
    this.dropped = 0;
    this.sentReports = 0;
    this.failedReports = 0;
    this.pending = new Set();
    if (typeof document !== "undefined") {
      const leaving = () => { if (document.visibilityState === "hidden") this.flush(); };
      document.addEventListener("visibilitychange", leaving);
      addEventListener("pagehide", () => this.flush());
    }
  }

  /** Queue a finished stream's timings (nothing if there is no record). */
  note(timings) {
    const record = timingsRecord(timings);
    if (record === null) return;
    if (this.records.length >= this.maxQueued) {
      this.records.shift();
      this.dropped += 1;
    }
    this.records.push(record);
    if (this.records.length >= this.batchRecords) this.flush();
    else if (this.timer === null) {
      this.timer = setTimeout(() => this.flush(), this.intervalS * 1000);
    }
  }

  /** POST everything queued now; resolves when every report sent so far has an answer. */
  flush() {
    clearTimeout(this.timer);
    this.timer = null;
    while (this.records.length) {
      const batch = this.records.splice(0, this.batchRecords);
      const sent = this.#post(batch);
      this.pending.add(sent);
      sent.finally(() => this.pending.delete(sent));
    }
    return Promise.all([...this.pending]);
  }

  async #post(records) {
    try {
      const response = await fetch(this.client.url(PATHS.EDGE_TIMINGS), {
        method: "POST", keepalive: true,
        headers: { authorization: `Bearer ${this.client.token}`,
                   "content-type": "application/json" },
        body: JSON.stringify({ records }),
      });
      if (response.ok) this.sentReports += 1;
      else this.failedReports += 1;
    } catch {
      this.failedReports += 1; // never the application's problem
    }
  }
}
