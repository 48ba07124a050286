// The browser's Timings record: the Python SDK's fields (firstbyte.client_sdk.timings.Timings,
// same names, milliseconds) filled from what a page can observe, plus the paint time and the
// long tasks while streaming. Plain JSON, so it can be POSTed as is.
//
// Offsets (request_sent_ms, first_byte_ms, first_token_ms, last_token_ms, render_ms) count
// from the moment stream() was called, on the performance.now() clock. Connection phases come
// from the first HTTP request's Resource Timing entry (cross-origin they need the router's
// Timing-Allow-Origin, which it sends to listed origins); WebSocket has no Resource Timing, so
// a WebSocket stream has no phases, only first byte (first message) and tokens.

const PROTOCOLS = { "http/1.0": "HTTP/1.0", "http/1.1": "HTTP/1.1", h2: "HTTP/2", h3: "HTTP/3" };

/** A fresh record with every field of the Python Timings, plus the browser's own. */
export function newTimings(transport) {
  return {
    client: "browser",
    transport,
    http_version: "",
    warm: false,
    zero_rtt: false,
    prewarmed: false, // a prewarm on intent opened the connection (Client.prewarm, warm.js)
    region: null,
    better_region: null,
    better_region_url: null,
    stream_id: null,
    started_at: (performance.timeOrigin + performance.now()) / 1000,
    dns_ms: null,
    tcp_connect_ms: null,
    tls_handshake_ms: null,
    quic_handshake_ms: null,
    ws_upgrade_ms: null,
    pool_wait_ms: null,
    request_sent_ms: null,
    first_byte_ms: null,
    first_token_ms: null,
    last_token_ms: null,
    render_ms: null, // the paint time: first animation frame after the first token is in the DOM
    inter_token_ms: [],
    output_chunks: 0,
    resumes: 0,
    request_bytes: null, // the request body as sent (gzipped when the client compressed it)
    server_timing: {},
    // The browser's own:
    resource_timing: "none", // "full" | "restricted" (no Timing-Allow-Origin) | "none"
    long_tasks: 0, // long tasks (> 50 ms on the main thread) while streaming
    long_task_ms: 0,
    navigation: null, // the page's own load phases (Navigation Timing), same field names
  };
}

/** Phase fields of one PerformanceResourceTiming (or navigation) entry, offsets from `base`. */
export function phasesOf(entry, base) {
  const out = { http_version: PROTOCOLS[entry.nextHopProtocol] || entry.nextHopProtocol || "" };
  if (!entry.requestStart && !entry.responseStart) {
    out.resource_timing = "restricted";
    return out;
  }
  out.resource_timing = "full";
  const cold = entry.connectEnd > entry.connectStart;
  out.warm = !cold;
  if (cold) {
    out.dns_ms = entry.domainLookupEnd - entry.domainLookupStart;
    if (out.http_version === "HTTP/3") {
      out.quic_handshake_ms = entry.connectEnd - entry.connectStart;
    } else {
      const tls = entry.secureConnectionStart > 0;
      out.tcp_connect_ms = (tls ? entry.secureConnectionStart : entry.connectEnd) -
        entry.connectStart;
      if (tls) out.tls_handshake_ms = entry.connectEnd - entry.secureConnectionStart;
    }
  }
  out.request_sent_ms = entry.requestStart - base;
  out.first_byte_ms = entry.responseStart - base;
  return out;
}

/** The page's own load, as phases (base: the navigation start, 0). */
export function navigationPhases() {
  const [nav] = performance.getEntriesByType("navigation");
  return nav ? phasesOf(nav, 0) : null;
}

/** `Server-Timing` value -> {name: dur_ms}, as the Python SDK parses it. */
export function parseServerTiming(value) {
  const out = {};
  for (const entry of (value || "").split(",")) {
    const [name, ...params] = entry.split(";").map((p) => p.trim());
    if (!name) continue;
    let dur = 0;
    for (const p of params) {
      const [k, v = ""] = p.split("=");
      if (k.trim().toLowerCase() === "dur") dur = Number(v.trim().replace(/"/g, "")) || 0;
    }
    out[name] = dur;
  }
  return out;
}

/** Accumulates one stream's events (the Python TimingRecorder's rules, browser clock). */
export class TimingRecorder {
  constructor(transport) {
    this.start = performance.now();
    this.record = newTimings(transport);
    this.lastToken = null;
    this.firstUrl = null;
    this.paint = null;
    this.longTasks = null;
    if (typeof PerformanceObserver !== "undefined" &&
        PerformanceObserver.supportedEntryTypes?.includes("longtask")) {
      this.longTasks = new PerformanceObserver((list) => this.#count(list.getEntries()));
      this.longTasks.observe({ type: "longtask" });
    }
  }

  #count(tasks) {
    for (const task of tasks) {
      if (task.startTime + task.duration < this.start) continue;
      this.record.long_tasks += 1;
      this.record.long_task_ms += task.duration;
    }
  }

  offset(now = performance.now()) {
    return now - this.start;
  }

  /** The first HTTP request of the stream: its Resource Timing entry gives the phases. */
  noteRequest(url) {
    if (this.firstUrl === null) this.firstUrl = url;
  }

  noteResponse(headers, { httpVersion } = {}) {
    const rec = this.record;
    if (rec.first_byte_ms === null) rec.first_byte_ms = this.offset();
    if (!headers) return;
    rec.region = headers.get("x-firstbyte-region") ?? rec.region;
    const better = headers.get("x-firstbyte-better-region");
    if (better !== null) {
      rec.better_region = better;
      rec.better_region_url = headers.get("x-firstbyte-better-region-url");
    }
    rec.stream_id = headers.get("x-firstbyte-stream") ?? rec.stream_id;
    const timing = headers.get("server-timing");
    if (timing && !Object.keys(rec.server_timing).length) {
      rec.server_timing = parseServerTiming(timing);
    }
    if (httpVersion) rec.http_version = httpVersion;
  }

  requestSent() {
    if (this.record.request_sent_ms === null) this.record.request_sent_ms = this.offset();
  }

  token(now = performance.now()) {
    const rec = this.record;
    if (rec.first_token_ms === null) rec.first_token_ms = this.offset(now);
    else if (this.lastToken !== null) rec.inter_token_ms.push(now - this.lastToken);
    this.lastToken = now;
    rec.last_token_ms = this.offset(now);
    rec.output_chunks += 1;
  }

  /** The first token's text is in the DOM now: its paint is the next animation frame. */
  awaitPaint() {
    const inserted = performance.now();
    this.paint = new Promise((resolve) => {
      requestAnimationFrame((frame) => {
        if (this.record.render_ms === null) {
          this.record.render_ms = this.offset(Math.max(frame, inserted));
        }
        resolve();
      });
    });
    return this.paint;
  }

  resume() {
    this.record.resumes += 1;
  }

  /** Fill the phases from Resource Timing and stop observing; the finished record. The
   * entry of a streamed response appears only once its body has ended: wait a little. */
  async finish() {
    // A hidden page paints nothing (no animation frames): render_ms then stays null.
    await Promise.race([this.paint, new Promise((resolve) => setTimeout(resolve, 1000))]);
    // A long task is reported once it has ended: let the current task end first.
    await new Promise((resolve) => setTimeout(resolve, 0));
    if (this.longTasks) {
      this.#count(this.longTasks.takeRecords()); // queued, not yet delivered
      this.longTasks.disconnect();
    }
    const rec = this.record;
    for (let tries = 0; this.firstUrl !== null && tries < 20; tries++) {
      const entry = performance.getEntriesByName(this.firstUrl, "resource")
        .find((e) => e.startTime >= this.start - 1);
      if (entry) {
        // The Resource Timing first byte is more precise than when fetch() resolved.
        for (const [key, value] of Object.entries(phasesOf(entry, this.start))) {
          if (value !== "" && value !== null) rec[key] = value;
        }
        break;
      }
      await new Promise((resolve) => setTimeout(resolve, 10));
    }
    rec.navigation = navigationPhases();
    return rec;
  }
}
