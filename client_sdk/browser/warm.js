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
// The cost, per page that showed intent and stays visible: one GET /v1/edge/warm every
// keepWarmS (default 20 s: 3 requests a minute, ~150 bytes each way on an open HTTP/2 or
// HTTP/3 connection), for at most idleS (default 600 s) after the user's last intent or
// stream; none while hidden (docs/browser.md, "Prewarm").
//
// WarmSchedule is the decision, sans-IO (times in seconds on one clock, passed in);
// IntentWarmer is the thin shell: DOM events and one timer.

/** When to warm: on intent, on becoming visible again, and every keepWarmS while visible. */
export class WarmSchedule {
  constructor({ keepWarmS = 20, idleS = 600, visible = true } = {}) {
    this.keepWarmS = keepWarmS;
    this.idleS = idleS;
    this.visible = visible;
    this.lastIntent = null; // the user's last focus, keystroke or stream
    this.lastWarm = null; // the last request that kept the connection open
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

  /** A stream went at `now`: intent and warmth at once. */
  used(now) {
    this.lastIntent = Math.max(this.lastIntent ?? now, now);
    this.warmed(now);
  }

  /** When the next keep-warm is due, or null: hidden, no intent yet, or idle past idleS. */
  nextAt(now) {
    if (!this.visible || !this.#active(now)) return null;
    return this.lastWarm === null ? now : this.lastWarm + this.keepWarmS;
  }

  #active(now) {
    return this.lastIntent !== null && now - this.lastIntent < this.idleS;
  }

  #stale(now) {
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

  #sync(now) {
    const used = this.client.lastUseS;
    if (used !== null && used <= now) this.schedule.used(used);
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
    this.client.prewarm({ intent, ...(prompt ?? {}) }).catch(() => { this.failures += 1; });
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
