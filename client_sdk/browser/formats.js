// The streamed formats besides chat (completions, OpenAI Responses, Anthropic Messages), sans-IO:
// the same rules as firstbyte.protocol.events and client_sdk/_core/events.py (EventAssembler),
// with the formats' paths, terminal events and output events generated into protocol.js.
//
// Every transport hands the assembler (seq, payload) pairs, the payload an event's JSON (its
// `type` names a Responses or Messages event, as SSE's `event:` line does). Each sequence
// number passes once (a replay's duplicates are dropped, a gap is a SequenceGapError); the
// stream is done at [DONE] or at the format's terminal event; an error event, in the format's
// shape or OpenAI's, throws its APIError. Each event comes out as
// `{event, type, text, isContent, seq}`: `event` the parsed JSON, `text` the output text it adds.

import { FORMATS, SSE } from "./protocol.js";
import { APIError, SequenceGapError, StreamBrokenError } from "./stream.js";

const RESPONSE_CONTENT = new Set(FORMATS.RESPONSE_CONTENT);
const MESSAGE_CONTENT = new Set(FORMATS.MESSAGE_CONTENT_DELTAS);

function counts(u) {
  if (!u || typeof u !== "object") return null;
  return { input_tokens: u.input_tokens ?? u.prompt_tokens ?? null,
           output_tokens: u.output_tokens ?? u.completion_tokens ?? null };
}

const RULES = {
  completions: {
    text: (e) => (Array.isArray(e.choices) && e.choices[0]?.text) || "",
    content: (e) => Array.isArray(e.choices) && e.choices.some((c) => c.text),
    usage: (e) => counts(e.usage),
    error: () => null,
  },
  responses: {
    text: (e) => (e.type === "response.output_text.delta" && typeof e.delta === "string"
      ? e.delta : ""),
    content: (e) => RESPONSE_CONTENT.has(e.type) && Boolean(e.delta),
    usage: (e) => counts(e.response?.usage),
    error: (e) => (e.type === "error"
      ? { message: e.message, type: e.code, code: e.code, param: e.param ?? null } : null),
  },
  messages: {
    text: (e) => (e.type === "content_block_delta" && e.delta?.type === "text_delta"
      ? e.delta.text || "" : ""),
    content: (e) => e.type === "content_block_delta" && MESSAGE_CONTENT.has(e.delta?.type) &&
      Boolean(e.delta.text || e.delta.partial_json),
    usage: (e) => counts(e.type === "message_start" ? e.message?.usage : e.usage),
    error: (e) => (e.type === "error" ? { type: "api_error", ...(e.error || {}) } : null),
  },
};

/** The streamed formats by name: `{NAME, PATH, TERMINAL}` (protocol.js). */
export const STREAMED = Object.freeze({
  completions: FORMATS.COMPLETIONS, responses: FORMATS.RESPONSES, messages: FORMATS.MESSAGES,
});

export class EventAssembler {
  constructor(format, { after = 0 } = {}) {
    if (!(format in STREAMED)) {
      throw new TypeError(`format must be one of ${Object.keys(STREAMED).join(", ")}`);
    }
    this.format = format;
    this.rules = RULES[format];
    this.terminal = new Set(STREAMED[format].TERMINAL);
    this.lastSeq = after;
    this.done = false;
    this.usage = null;
    this.last = null;
  }

  /** Take one event; `{event, type, text, isContent, seq}`, or null (a replay, [DONE]). */
  receive(seq, payload) {
    if (seq != null) {
      if (seq <= this.lastSeq) return null;
      if (this.lastSeq && seq !== this.lastSeq + 1) {
        throw new SequenceGapError(this.lastSeq + 1, seq);
      }
      this.lastSeq = seq;
    }
    if (this.done) return null;
    let event = payload;
    if (typeof payload === "string") {
      if (payload.trim() === SSE.DONE) {
        this.done = true;
        return null;
      }
      try {
        event = JSON.parse(payload);
      } catch (err) {
        throw new StreamBrokenError(`undecodable stream event: ${err.message}`);
      }
    }
    if (event === null || typeof event !== "object" || Array.isArray(event)) {
      throw new StreamBrokenError(`not a ${this.format} event`);
    }
    const error = "type" in event ? this.rules.error(event) : event.error;
    if (error) {
      this.done = true;
      throw new APIError(null, error);
    }
    const usage = this.rules.usage(event);
    if (usage) {
      this.usage = {
        input_tokens: usage.input_tokens ?? this.usage?.input_tokens ?? null,
        output_tokens: usage.output_tokens ?? this.usage?.output_tokens ?? null,
      };
    }
    if (this.terminal.has(event.type)) this.done = true;
    this.last = event;
    return { event, type: event.type ?? null, text: this.rules.text(event),
             isContent: this.rules.content(event), seq };
  }

  markDone() {
    this.done = true;
  }
}
