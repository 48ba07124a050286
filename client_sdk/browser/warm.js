// Warm the connection on the user's intent, and keep it warm while the page is visible.
//
//   const warmer = client.warmOnIntent(document.querySelector("#prompt"),
//     { conversation: () => ({ model, messages: history }) });   // optional: warm the prompt
//   // focus or a keystroke in #prompt: client.prewarm() (TCP + TLS or QUIC, and the CORS
//   // preflight cache when the client's starts are preflighted); then every keepWarmS while the
//   // page is visible and the user was active within idleS; nothing while it is hidden.
//   warmer.stop();
//
// With `conversation`, each warm on intent (not the keep-warm ones) also sends the conversation
// so far (POST /v1/edge/warm): the router computes its prefix on the backend the next message
// goes to, at most limits.prompt_warms_per_min_per_subject times a minute per user.
//
// A keep-warm is the client's own request, not the user's: it never extends idleS. A warm
// answered 429 or 503 (a balancer or CDN in front, or the router refusing a new connection)
// says when to come back: no warm goes before its Retry-After, on intent either. With one
// origin there is nowhere else to send a stream; the stream gets the answer and its retry
// rules (docs/browser.md, "Prewarm").
//
// The cost, per page that showed intent and stays visible: one GET /v1/edge/warm every
// keepWarmS (default 20 s: 3 requests a minute, ~150 bytes each way on an open HTTP/2 or
// HTTP/3 connection), for at most idleS (default 600 s) after the user's last intent or
// stream; none while hidden (docs/browser.md, "Prewarm").
//
// WarmSchedule is the decision, sans-IO (times in seconds on one clock, passed in);
// IntentWarmer is the thin shell: DOM events and one timer.

import { RETRY_STATUSES } from "./stream.js";

/** When to warm: on intent, on becoming visible again, and every keepWarmS while visible. */
export class WarmSchedule {
  constructor({ keepWarmS = 20, idleS = 600, visible = true } = {}) {
    this.keepWarmS = keepWarmS;
    this.idleS = idleS;
    this.visible = visible;
    this.lastIntent = null; // the user's last focus, keystroke or stream
    this.lastWarm = null; // the last request that kept the connection open
    this.quietUntil = null; // a refused warm's Retry-After: no warm before it
  }

  /** The user showed intent at `now`; true if a prewarm should go now. */
  intent(now) {
    this.lastIntent = now;
    return this.visible && this.#stale(now);
  }

  /** The page became visible (or hidden) at `now`; true if a prewarm should go now. */
  visibility(visible, now) {
    this.visible = visible;
    return visible && this.#active(now) && this.#stale(now);
  }

  /** A request to the router went at `now` (a prewarm or a stream: both keep it open). */
  warmed(now) {
    this.lastWarm = Math.max(this.lastWarm ?? now, now);
  }

  /** A warm was refused at `now` (429 or 503) with `retryAfterS` (seconds, or null): no
   * warm before that has passed (the keep-warm's own pace, keepWarmS, still holds). */
  refused(now, retryAfterS) {
    this.quietUntil = Math.max(this.quietUntil ?? now, now + (retryAfterS ?? 0));
  }

  /** A stream went at `now`: intent and warmth at once. */
  used(now) {
    this.lastIntent = Math.max(this.lastIntent ?? now, now);
    this.warmed(now);
  }

  /** When the next keep-warm is due, or null: hidden, no intent yet, or idle past idleS. */
  nextAt(now) {
    if (!this.visible || !this.#active(now)) return null;
    const due = this.lastWarm === null ? now : this.lastWarm + this.keepWarmS;
    return Math.max(due, this.quietUntil ?? due);
  }

  #active(now) {
    return this.lastIntent !== null && now - this.lastIntent < this.idleS;
  }

  #stale(now) {
    if (this.quietUntil !== null && now < this.quietUntil) return false;
    return this.lastWarm === null || now - this.lastWarm >= this.keepWarmS;
  }
}

const INTENT_EVENTS = ["focus", "keydown", "input", "pointerdown"];

/** The IO shell of a WarmSchedule for one client and one prompt element (or none). */
export class IntentWarmer {
  constructor(client, element, { keepWarmS = 20, idleS = 600, doc = globalThis.document,
                                  conversation = null } = {}) {
    this.client = client;
    this.conversation = conversation;
    this.element = element;
    this.doc = doc;
    this.schedule = new WarmSchedule({
      keepWarmS, idleS, visible: doc ? doc.visibilityState !== "hidden" : true,
    });
    this.warms = 0; // prewarms sent (on intent, on becoming visible, to keep warm)
    this.failures = 0;
    this.timer = null;
    this.onIntent = () => this.#intent();
    this.onVisibility = () => this.#visibility();
    for (const name of INTENT_EVENTS) element?.addEventListener(name, this.onIntent);
    doc?.addEventListener("visibilitychange", this.onVisibility);
    if (element && doc?.activeElement === element) this.#intent(); // focused already
  }

  /** Stop listening and warming. */
  stop() {
    for (const name of INTENT_EVENTS) this.element?.removeEventListener(name, this.onIntent);
    this.doc?.removeEventListener("visibilitychange", this.onVisibility);
    clearTimeout(this.timer);
    this.timer = null;
  }

  #now() {
    return performance.now() / 1000;
  }

  /** What the client did since: its requests keep the connection warm; only its streams
   * are the user's activity (a keep-warm counted as one would never let idleS end). */
  #sync(now) {
    const { lastUseS, lastStreamS } = this.client;
    if (lastUseS !== null && lastUseS <= now) this.schedule.warmed(lastUseS);
    if (lastStreamS !== null && lastStreamS <= now) this.schedule.used(lastStreamS);
  }

  #intent() {
    const now = this.#now();
    this.#sync(now);
    if (this.schedule.intent(now)) this.#warm(now, true);
    else this.#arm(now);
  }

  #visibility() {
    const now = this.#now();
    this.#sync(now);
    const visible = this.doc.visibilityState !== "hidden";
    if (this.schedule.visibility(visible, now)) this.#warm(now, true);
    else this.#arm(now);
  }

  #warm(now, intent) {
    this.schedule.warmed(now);
    this.warms += 1;
    const prompt = intent && this.conversation ? this.conversation() : null;
    this.client.prewarm({ intent, ...(prompt ?? {}) }).catch((err) => {
      this.failures += 1;
      // A refusal's Retry-After (the client's APIError): the next warm waits for it (the
      // armed timer's tick finds it due later, and re-arms).
      if (RETRY_STATUSES.includes(err?.status)) {
        this.schedule.refused(this.#now(), err.retryAfter ?? null);
      }
    });
    this.#arm(now);
  }

  #arm(now) {
    clearTimeout(this.timer);
    this.timer = null;
    const at = this.schedule.nextAt(now);
    if (at === null) return; // hidden or idle: nothing until the next intent or visibility
    this.timer = setTimeout(() => this.#tick(), Math.max(0, at - now) * 1000);
  }

  #tick() {
    const now = this.#now();
    this.#sync(now);
    const at = this.schedule.nextAt(now);
    if (at !== null && at <= now + 0.001) this.#warm(now, false);
    else this.#arm(now);
  }
}
