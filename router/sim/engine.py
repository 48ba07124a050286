"""The simulated GPU: a continuous-batching scheduler and a cost model, sans-IO.

The engine never reads a clock or touches a socket: the caller passes ``now`` (seconds, any
monotonic origin) to :meth:`Engine.submit` and :meth:`Engine.advance`, and sleeps until
:meth:`Engine.next_deadline`. The model is vLLM's step loop:

- a step runs every *running* sequence one token forward; its duration is the profile's decode
  time for that batch size plus the prefill of the sequences admitted at its start (over their
  *uncached* prompt tokens — the prefix cache is consulted on admission);
- at each step boundary, finished sequences leave and waiting ones are admitted, first come
  first served, up to ``max_num_seqs`` running and, with ``max_num_batched_tokens``, as many as
  that step's token budget holds (vLLM's): one token per running sequence plus each admitted
  one's uncached prompt (the first of a step always starts, as vLLM would split its prefill
  over steps), so a burst of new requests waits for a few steps while the batch grows;
- a new request waits for the current step to end (an idle engine starts a step at once); the
  first token of a sequence comes at the end of its admission step, so its TTFT includes its
  queueing and its prefill, and every running sequence slows down while another prefills;
- with more than ``max_num_seqs + queue_limit`` requests in the system, :meth:`submit` raises
  :class:`Overloaded` (the server answers 503);
- a pooling request (an embedding: ``max_output`` 0) is scheduled like any other but only
  prefilled: it finishes at the end of its admission step without a token, and does not count
  in a step's decode batch (a step of pooling requests alone costs their prefill only).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from firstbyte.router.hosting.prometheus import Histogram, labels, render_counter, render_gauge
from firstbyte.router.sim.metrics import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS
from firstbyte.router.sim.prefix_cache import BLOCK_SIZE, PrefixCache, block_hashes
from firstbyte.router.sim.profiles import Profile

__all__ = ["Engine", "Overloaded", "SeqState", "Sequence"]


class Overloaded(Exception):
    """The waiting queue is full; answer 503."""


class SeqState(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    CANCELLED = "cancelled"


@dataclass(eq=False, slots=True)
class Sequence:
    """One request inside the engine. Times are engine times (the ``now`` passed in)."""

    id: int
    arrival: float
    prompt_len: int
    block_keys: list[bytes]
    max_output: int
    finish_reason: str
    """``"stop"`` or ``"length"``: what ending after ``max_output`` tokens means."""
    state: SeqState = SeqState.WAITING
    cached_tokens: int = 0
    generated: int = 0
    admitted_at: float | None = None
    token_times: list[float] = field(default_factory=list)
    waiter: Any = None
    """A slot for the IO layer (e.g. a future to wake); the engine never touches it."""

    @property
    def finished(self) -> bool:
        return self.state is SeqState.FINISHED

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None


class Engine:
    """Scheduler + cost model + prefix cache + vLLM-named metrics."""

    def __init__(
        self,
        profile: Profile,
        *,
        max_num_seqs: int | None = None,
        queue_limit: int = 1024,
        prefix_cache_blocks: int | None = None,
        block_size: int = BLOCK_SIZE,
        max_num_batched_tokens: int | None = None,
        model_name: str | None = None,
    ) -> None:
        self.profile = profile
        self.model_name = model_name or profile.model
        """The ``model_name`` label of the metrics (vLLM's first served name)."""
        self.max_num_seqs = max_num_seqs if max_num_seqs is not None else profile.max_num_seqs
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if queue_limit < 0:
            raise ValueError("queue_limit must be >= 0")
        self.queue_limit = queue_limit
        if max_num_batched_tokens is not None and max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        self.max_num_batched_tokens = max_num_batched_tokens
        """Tokens one step may process (None: no budget, every waiting request fits)."""
        blocks = (
            prefix_cache_blocks
            if prefix_cache_blocks is not None
            else (profile.prefix_cache_blocks)
        )
        self.cache = PrefixCache(blocks, block_size)
        self.block_size = block_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._next_id = 0
        self._step_start = 0.0
        self._step_end: float | None = None
        self._step_batch: list[Sequence] = []
        self._free_at = float("-inf")
        """When the last step ended: an idle engine starts no step before it."""
        self.steps = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.finished_by_reason: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        self.ttft_hist = Histogram(TTFT_BUCKETS)
        self.itl_hist = Histogram(ITL_BUCKETS)
        self.e2e_hist = Histogram(E2E_BUCKETS)

    # -- input -------------------------------------------------------------------------------

    def submit(
        self,
        prompt_tokens: SequenceOf[int],
        max_output: int,
        finish_reason: str,
        now: float,
        block_keys: list[bytes] | None = None,
    ) -> Sequence:
        """Queue a request generating ``max_output`` tokens (0: a pooling request, prefill
        only); :class:`Overloaded` if full. ``block_keys``: the prompt's
        :func:`~firstbyte.router.sim.prefix_cache.block_hashes` if the caller has them."""
        if max_output < 0:
            raise ValueError("max_output must be >= 0")
        in_system = len(self.waiting) + len(self.running)
        if in_system >= self.max_num_seqs + self.queue_limit:
            raise Overloaded(
                f"{len(self.waiting)} requests waiting, {len(self.running)} running "
                f"(max_num_seqs={self.max_num_seqs}, queue_limit={self.queue_limit})"
            )
        seq = Sequence(
            id=self._next_id,
            arrival=now,
            prompt_len=len(prompt_tokens),
            block_keys=(
                block_hashes(prompt_tokens, self.block_size) if block_keys is None else block_keys
            ),
            max_output=max_output,
            finish_reason=finish_reason,
        )
        self._next_id += 1
        self.waiting.append(seq)
        if self._step_end is None:
            # ``now`` may be a little in the past (the IO layer's modelled arrival), never
            # before the step that last ran had ended.
            self._start_step(max(now, self._free_at))
        return seq

    def cancel(self, seq: Sequence) -> None:
        """Drop a sequence whose client went away; idempotent."""
        if seq.state is SeqState.WAITING:
            self.waiting.remove(seq)
        elif seq.state is SeqState.RUNNING:
            self.running.remove(seq)
        else:
            return
        seq.state = SeqState.CANCELLED
        self.finished_by_reason["abort"] += 1

    # -- time --------------------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """When the current step ends (call :meth:`advance` then), or None when idle."""
        return self._step_end

    def advance(self, now: float) -> list[Sequence]:
        """Complete every step that has ended by ``now``; return the sequences given tokens.

        Steps run back to back in engine time (a late caller catches up without drift). A
        zero-length step (the ``instant`` profile) completes at most once per call, so the
        IO layer gets to send between steps instead of receiving whole responses at once.
        """
        touched: list[Sequence] = []
        while self._step_end is not None and self._step_end <= now:
            end = self._step_end
            zero_length = end == self._step_start
            self.steps += 1
            for seq in self._step_batch:
                if seq.state is not SeqState.RUNNING:
                    continue  # cancelled during the step
                if seq.max_output == 0:
                    self._pooled(seq, end)
                else:
                    self._emit(seq, end)
                touched.append(seq)
            if any(seq.state is not SeqState.RUNNING for seq in self.running):
                self.running = [s for s in self.running if s.state is SeqState.RUNNING]
            self._step_end = None
            self._free_at = end
            self._start_step(end)
            if zero_length:
                break
        return touched

    def _emit(self, seq: Sequence, at: float) -> None:
        times = seq.token_times
        if times:
            self.itl_hist.observe(at - times[-1])
        else:
            self.ttft_hist.observe(at - seq.arrival)
        times.append(at)
        seq.generated += 1
        self.generation_tokens_total += 1
        if seq.generated >= seq.max_output:
            seq.state = SeqState.FINISHED
            self.finished_by_reason[seq.finish_reason] += 1
            self.e2e_hist.observe(at - seq.arrival)

    def _pooled(self, seq: Sequence, at: float) -> None:
        seq.state = SeqState.FINISHED
        self.finished_by_reason[seq.finish_reason] += 1
        self.e2e_hist.observe(at - seq.arrival)

    def _start_step(self, at: float) -> None:
        prefill_s = 0.0
        budget = self.max_num_batched_tokens
        room = None if budget is None else budget - len(self.running)
        started = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if room is not None:
                needed = seq.prompt_len - self.cache.cached(seq.block_keys, seq.prompt_len)
                if needed > room and started:
                    break  # the next step's budget; the first of a step always starts
                room -= needed
            started += 1
            self.waiting.popleft()
            seq.cached_tokens = self.cache.match(seq.block_keys, seq.prompt_len)
            self.cache.insert(seq.block_keys)
            prefill_s += self.profile.prefill_s(seq.prompt_len - seq.cached_tokens)
            self.prompt_tokens_total += seq.prompt_len
            seq.state = SeqState.RUNNING
            seq.admitted_at = at
            self.running.append(seq)
        if not self.running:
            return
        self._step_start = at
        decoding = sum(1 for seq in self.running if seq.max_output)
        decode_s = self.profile.decode_step_s(decoding) if decoding else 0.0
        self._step_end = at + decode_s + prefill_s
        self._step_batch = list(self.running)

    # -- observation -------------------------------------------------------------------------

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the KV-cache blocks held by running sequences (0..1)."""
        capacity = self.cache.capacity_blocks
        if capacity == 0:
            return 0.0
        size = self.block_size
        used = sum((s.prompt_len + s.generated + size - 1) // size for s in self.running)
        return min(1.0, used / capacity)

    def render_metrics(self) -> str:
        """All metrics in the Prometheus text exposition format (version 0.0.4)."""
        model = labels(model_name=self.model_name)
        usage = self.kv_cache_usage
        # prometheus_client prints counter values as floats.
        lines = [
            *render_gauge(
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                [(model, len(self.running))],
            ),
            *render_gauge(
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed.",
                [(model, len(self.waiting))],
            ),
            *render_gauge(
                "vllm:gpu_cache_usage_perc",
                "GPU KV-cache usage. 1 means 100 percent usage.",
                [(model, usage)],
            ),
            *render_gauge(
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                [(model, usage)],
            ),
            *render_counter(
                "vllm:prefix_cache_queries_total",
                "Prefix cache queries, in terms of number of queried tokens.",
                [(model, float(self.cache.queries_tokens))],
            ),
            *render_counter(
                "vllm:prefix_cache_hits_total",
                "Prefix cache hits, in terms of number of cached tokens.",
                [(model, float(self.cache.hits_tokens))],
            ),
            *render_counter(
                "vllm:prompt_tokens_total",
                "Number of prefill tokens processed.",
                [(model, float(self.prompt_tokens_total))],
            ),
            *render_counter(
                "vllm:generation_tokens_total",
                "Number of generation tokens processed.",
                [(model, float(self.generation_tokens_total))],
            ),
            *render_counter(
                "vllm:request_success_total",
                "Count of successfully processed requests.",
                [
                    (f"{model},{labels(finished_reason=reason)}", float(n))
                    for reason, n in self.finished_by_reason.items()
                ],
            ),
            *self.ttft_hist.render(
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                model,
            ),
            *self.itl_hist.render(
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                model,
            ),
            *self.itl_hist.render(
                "vllm:time_per_output_token_seconds",
                "Histogram of time per output token in seconds (older name of the above).",
                model,
            ),
            *self.e2e_hist.render(
                "vllm:e2e_request_latency_seconds",
                "Histogram of end to end request latency in seconds.",
                model,
            ),
        ]
        return "\n".join(lines) + "\n"
