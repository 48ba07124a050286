// The SDK's stream rules, sans-IO, in JS: the same rules as client_sdk/_core/stream.py
// (StreamAssembler), _core/longpoll.py (PollCursor) and _core/resume.py (ResumePolicy), tested
// against the same case table (tests/client_sdk/stream_rules.py) in Python and in Chromium.
//
// Every transport hands the assembler (seq, payload) pairs; it drops events it has already
// seen (a resume replays from the last confirmed sequence), refuses to skip a missing one
// (SequenceGapError: resume from last_seq) and turns chunks into deltas. That is what makes
// resume lose and repeat nothing.

import { SSE } from "./protocol.js";

export class FirstbyteError extends Error {
  constructor(message) {
    super(message);
    this.name = new.target.name;
  }
}
export class StreamBrokenError extends FirstbyteError {}
export class StreamStalledError extends StreamBrokenError {}
export class SequenceGapError extends StreamBrokenError {
  constructor(expected, got) {
    super(`stream skipped from event ${expected - 1} to ${got}`);
    this.expected = expected;
    this.got = got;
  }
}
/** The router answered an error (HTTP status, or null for an error event inside a stream). */
export class APIError extends FirstbyteError {
  constructor(status, error) {
    super(error?.message || `HTTP ${status}`);
    this.status = status;
    this.code = error?.code ?? null;
    this.type = error?.type ?? null;
  }
}

export class StreamAssembler {
  constructor({ after = 0 } = {}) {
    this.lastSeq = after;
    this.done = false;
    this.usage = null;
    this.chunkId = null;
    this.model = null;
  }

  /** Take one event; a delta for a chunk that carries something, else null. */
  receive(seq, payload) {
    if (seq != null) {
      if (seq <= this.lastSeq) return null; // a replay overlapping what we had
      if (this.lastSeq && seq !== this.lastSeq + 1) {
        throw new SequenceGapError(this.lastSeq + 1, seq);
      }
      this.lastSeq = seq;
    }
    if (this.done) return null;
    let chunk = payload;
    if (typeof payload === "string") {
      if (payload.trim() === SSE.DONE) {
        this.done = true;
        return null;
      }
      try {
        chunk = JSON.parse(payload);
      } catch (err) {
        throw new StreamBrokenError(`undecodable stream event: ${err.message}`);
      }
    }
    if (chunk && typeof chunk === "object" && "error" in chunk) {
      this.done = true;
      throw new APIError(null, chunk.error);
    }
    if (!isChunk(chunk)) throw new StreamBrokenError("invalid chunk in stream");
    this.chunkId = chunk.id;
    this.model = chunk.model;
    if (chunk.usage != null) this.usage = chunk.usage;
    if (chunk.choices.length === 0) return null;
    const choice = chunk.choices[0];
    const delta = choice.delta || {};
    const out = {
      text: delta.content || "",
      toolCalls: delta.tool_calls || [],
      finishReason: choice.finish_reason ?? null,
      role: delta.role ?? null,
      seq,
    };
    out.isContent = Boolean(out.text) || out.toolCalls.length > 0;
    if (!out.isContent && out.finishReason === null && out.role === null) return null;
    return out;
  }

  /** The transport saw the end by other means (WS `done`, poll `done`). */
  markDone() {
    this.done = true;
  }
}

function isChunk(c) {
  return c !== null && typeof c === "object" && typeof c.id === "string" &&
    Number.isInteger(c.created) && typeof c.model === "string" && Array.isArray(c.choices);
}

/**
 * The retry budget (client_sdk/_core/retry.py): a request refused before its stream started
 * (429, 503) is sent again after the server's Retry-After (a WebSocket refusal's
 * `retry_after`; a doubling backoff from 1 s without one), a stream that ended with
 * `draining` before any token at once; at most `retries` times and `budgetS` of waiting in
 * all. `delay` is null when out of budget.
 */
export const RETRY_STATUSES = Object.freeze([429, 503]);
export class RetryBudget {
  constructor({ retries = 2, budgetS = 5 } = {}) {
    this.retries = retries;
    this.budgetS = budgetS;
    this.used = 0;
    this.waitedS = 0;
  }

  delay(retryAfterS) {
    if (this.used >= this.retries) return null;
    const wait = Math.max(retryAfterS ?? 2 ** this.used, 0);
    if (this.waitedS + wait > this.budgetS) return null;
    this.used += 1;
    this.waitedS += wait;
    return wait;
  }
}

const DAYS = "Mon|Tue|Wed|Thu|Fri|Sat|Sun";
const MONTHS = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];
const MONTH = `(${MONTHS.join("|")})`;
const TIME = "([01]\\d|2[0-3]):([0-5]\\d):([0-5]\\d)";
// RFC 9110 section 5.6.7: IMF-fixdate, and the two obsolete forms a recipient must accept.
const IMF_FIXDATE = new RegExp(`^(?:${DAYS}), (\\d\\d) ${MONTH} (\\d{4}) ${TIME} GMT$`);
const RFC850_DATE = new RegExp("^(?:Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday),"
  + ` (\\d\\d)-${MONTH}-(\\d\\d) ${TIME} GMT$`);
const ASCTIME_DATE = new RegExp(`^(?:${DAYS}) ${MONTH} ([ \\d]\\d) ${TIME} (\\d{4})$`);
const DELAY_SECONDS = /^\d+(?:\.\d+)?$/;

/** An HTTP-date as epoch seconds, or null if `value` is not one (client_sdk/errors.py's
 * `_http_date`); `nowS` places an obsolete two-digit year (over 50 years ahead: the century
 * before). Not Date.parse: it takes far more than HTTP-dates ("2" is a year) and reads
 * asctime's zone-less form in local time. */
function httpDate(value, nowS) {
  let m, day, month, year, hh, mm, ss;
  if ((m = IMF_FIXDATE.exec(value))) {
    [, day, month, year, hh, mm, ss] = m;
  } else if ((m = RFC850_DATE.exec(value))) {
    [, day, month, year, hh, mm, ss] = m;
    const thisYear = new Date(nowS * 1000).getUTCFullYear();
    year = thisYear - (thisYear % 100) + Number(year);
    if (year > thisYear + 50) year -= 100;
  } else if ((m = ASCTIME_DATE.exec(value))) {
    [, month, day, hh, mm, ss, year] = m;
  } else {
    return null;
  }
  const when = new Date(Date.UTC(Number(year), MONTHS.indexOf(month), Number(day),
                                 Number(hh), Number(mm), Number(ss)));
  // Date.UTC rolls 30 Feb over into March: no such day is no date.
  if (when.getUTCDate() !== Number(day)) return null;
  return when.getTime() / 1000;
}

/**
 * A Retry-After header's wait in seconds, never negative; null when absent or garbage (the
 * caller's backoff then), as client_sdk/errors.py's `retry_after_s`. Delay-seconds or an
 * HTTP-date (RFC 9110 section 10.2.3): the router sends seconds, a balancer or an upstream's
 * 503 may send a date, read as seconds from `nowS` (epoch seconds; default: this clock).
 */
export function retryAfterS(value, nowS = Date.now() / 1000) {
  if (value === null || value === undefined) return null;
  const text = String(value).trim();
  if (DELAY_SECONDS.test(text)) return Number(text);
  const when = httpDate(text, nowS);
  return when === null ? null : Math.max(when - nowS, 0);
}

/** The long-poll cursor: which poll next, what a batch means, when to back off. */
export class PollCursor {
  constructor(streamId, { after = 0, waitS = 10, maxFailures = 5, backoffS = 0.05,
                          backoffMaxS = 2.0 } = {}) {
    this.streamId = streamId;
    this.after = after;
    this.done = false;
    this.failures = 0;
    this.waitS = waitS;
    this.maxFailures = maxFailures;
    this.backoffS = backoffS;
    this.backoffMaxS = backoffMaxS;
    this.notBefore = 0;
  }

  /** {after, waitS, notBefore} of the next poll, or null once the stream is done. */
  nextPoll(now) {
    if (this.done) return null;
    return { after: this.after, waitS: this.waitS, notBefore: Math.max(now, this.notBefore) };
  }

  /** Apply one poll answer; its events not yet seen, in sequence order. */
  receiveBatch(batch, now) {
    if (batch.stream !== this.streamId) {
      throw new StreamBrokenError(`poll answer for stream ${JSON.stringify(batch.stream)}, not ours`);
    }
    this.failures = 0;
    this.notBefore = now;
    const fresh = batch.events.filter((e) => e.seq > this.after).sort((a, b) => a.seq - b.seq);
    if (fresh.length) this.after = fresh[fresh.length - 1].seq;
    if (batch.next > this.after && !fresh.length) {
      throw new StreamBrokenError(`poll answer skips to ${batch.next} with no events`);
    }
    if (batch.done) this.done = true;
    return fresh;
  }

  /** Record a failed poll; the delay (s) before the retry, or throw when out of tries. */
  receiveFailure(now, reason = "poll failed") {
    this.failures += 1;
    if (this.failures > this.maxFailures) {
      throw new StreamBrokenError(
        `${reason}; gave up after ${this.maxFailures} retries at event ${this.after}`);
    }
    const delay = Math.min(this.backoffS * 2 ** (this.failures - 1), this.backoffMaxS);
    this.notBefore = now + delay;
    return delay;
  }
}

/** When a broken stream is resumed, after what delay, and when to give up. */
export class ResumePolicy {
  constructor({ maxResumes = 5, backoffS = 0.05, stallRetries = 1, idleTimeoutS = 30 } = {}) {
    this.maxResumes = maxResumes;
    this.backoffS = backoffS;
    this.stallRetries = stallRetries;
    this.idleTimeoutS = idleTimeoutS;
    this.resumes = 0;
    this.stalls = 0;
  }

  /**
   * The stream broke (`stalled`: no event for idleTimeoutS). Returns {delayS, resend}:
   * resend the request (never opened: nothing to resume) or resume after lastSeq. Throws
   * StreamStalledError / StreamBrokenError when out of attempts.
   */
  broken(reason, { opened, stalled = false, lastSeq = 0 }) {
    if (stalled && this.#stalledOut()) {
      throw new StreamStalledError(
        `no event for ${this.idleTimeoutS} s (heartbeats do not count) after event ` +
        `${lastSeq}; resumed ${this.resumes} times`);
    }
    this.resumes += 1;
    if (this.resumes > this.maxResumes && !opened) {
      // Never answered: the browser hides why (a network error and a CORS refusal are
      // both "Failed to fetch").
      throw new StreamBrokenError(
        `stream not started: ${this.maxResumes + 1} tries failed: ${reason} (the router is` +
        " unreachable, or this page's origin is not in its cors.allow_origins)");
    }
    if (this.resumes > this.maxResumes) {
      throw new StreamBrokenError(
        `stream broken and ${this.maxResumes} resumes failed: ${reason}`);
    }
    // Cut before any answer, the first time: most likely a kept-alive connection the server
    // had closed; retried at once. Everything else backs off.
    const backoff = opened || this.resumes > 1 || stalled;
    const delayS = backoff ? Math.min(this.backoffS * 2 ** (this.resumes - 1), 2.0) : 0;
    return { delayS, resend: !opened };
  }

  /**
   * A stall with no stream id to resume by, while the server still answers, so it holds the
   * request (queued, or a long prefill): wait on, spending no resume; sent again, the model
   * would run it twice. Throws StreamStalledError when out of stallRetries.
   */
  held({ lastSeq = 0 } = {}) {
    if (this.#stalledOut()) {
      throw new StreamStalledError(
        `no event for ${this.idleTimeoutS} s (heartbeats do not count) after event ` +
        `${lastSeq}; not sent again: the server still answers, so it holds the request`);
    }
  }

  /** Count a stall; whether it is one more than stallRetries allows. */
  #stalledOut() {
    this.stalls += 1;
    return this.stalls > this.stallRetries;
  }
}
