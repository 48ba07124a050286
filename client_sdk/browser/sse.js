// Server-sent events decoder, sans-IO: bytes in, events out (firstbyte.protocol.sse in JS).
//
// WHATWG event-stream parsing: \r\n, \r and \n line ends (a CRLF may be split across
// pieces), a leading BOM, comments (the router's ": ping" heartbeats) produce no event, `id`
// without NUL sets lastEventId, `retry`. Indifferent to how the stream is split; a line or an
// event over its limit throws SSEProtocolError instead of growing without end.

export class SSEProtocolError extends Error {}

export class SSEDecoder {
  constructor({ maxLineChars = 1 << 20, maxEventChars = 4 << 20 } = {}) {
    this.maxLine = maxLineChars;
    this.maxEvent = maxEventChars;
    this.text = new TextDecoder("utf-8"); // strips a leading BOM, joins split UTF-8
    this.buffer = "";
    this.skipLF = false;
    this.data = [];
    this.dataSize = 0;
    this.eventType = "";
    this.retry = null;
    this.lastEventId = null; // what a reconnect sends as Last-Event-ID
  }

  /** Feed bytes (Uint8Array) or a string; returns the events they complete, in order. */
  receive(chunk) {
    let text = typeof chunk === "string" ? chunk : this.text.decode(chunk, { stream: true });
    if (!text) return [];
    if (this.skipLF) {
      this.skipLF = false;
      if (text[0] === "\n") text = text.slice(1);
    }
    const buffer = this.buffer + text;
    const events = [];
    let start = 0;
    for (let i = 0; i < buffer.length; i++) {
      const c = buffer[i];
      if (c !== "\n" && c !== "\r") continue;
      const line = buffer.slice(start, i);
      if (c === "\r") {
        if (i + 1 < buffer.length) {
          if (buffer[i + 1] === "\n") i++;
        } else {
          this.skipLF = true; // the LF of this CRLF may start the next piece
        }
      }
      start = i + 1;
      this.#line(line, events);
    }
    this.buffer = buffer.slice(start);
    if (this.buffer.length > this.maxLine) {
      throw new SSEProtocolError(`event-stream line longer than ${this.maxLine} characters`);
    }
    return events;
  }

  #line(line, events) {
    if (line.length > this.maxLine) {
      throw new SSEProtocolError(`event-stream line longer than ${this.maxLine} characters`);
    }
    if (line === "") {
      const event = this.#dispatch();
      if (event) events.push(event);
      return;
    }
    if (line[0] === ":") return; // a comment: heartbeat
    const colon = line.indexOf(":");
    const name = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value[0] === " ") value = value.slice(1);
    if (name === "data") {
      this.dataSize += value.length + 1;
      if (this.dataSize > this.maxEvent) {
        throw new SSEProtocolError(`event larger than ${this.maxEvent} characters`);
      }
      this.data.push(value);
    } else if (name === "id") {
      if (!value.includes("\0")) this.lastEventId = value;
    } else if (name === "event") {
      this.eventType = value;
    } else if (name === "retry" && /^[0-9]+$/.test(value)) {
      this.retry = Number(value);
    }
  }

  #dispatch() {
    const { data, eventType, retry } = this;
    this.data = [];
    this.dataSize = 0;
    this.eventType = "";
    this.retry = null;
    if (data.length === 0) return null;
    return { data: data.join("\n"), event: eventType || "message", id: this.lastEventId, retry };
  }
}

/** The router's sequence number from an event's id (null when absent or not a number). */
export function seqOf(id) {
  return id != null && /^[0-9]+$/.test(id) ? Number(id) : null;
}
