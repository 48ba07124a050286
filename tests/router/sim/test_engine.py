"""The sans-IO engine with an injected clock: scheduling, cost model, prefix cache, metrics."""

from __future__ import annotations

import pytest

from firstbyte.router.sim.engine import Engine, Overloaded, SeqState
from firstbyte.router.sim.profiles import PROFILES, Profile, get_profile

# A profile with round numbers: prefill 1 ms per uncached token, decode 10 ms + 1 ms per seq.
ROUND = Profile(
    name="round",
    model="m",
    prefill_a_s=1e-3,
    prefill_b_s=0.0,
    decode_base_s=10e-3,
    decode_per_seq_s=1e-3,
    max_num_seqs=4,
    prefix_cache_blocks=1000,
    description="test",
)


def run_until_idle(engine: Engine, now: float = 0.0, limit: int = 100_000) -> float:
    """Advance the engine deadline by deadline until idle; return the final time."""
    for _ in range(limit):
        deadline = engine.next_deadline()
        if deadline is None:
            return now
        now = max(now, deadline)
        engine.advance(now)
    raise AssertionError("engine did not go idle")


def test_single_request_timing_follows_the_cost_model() -> None:
    engine = Engine(ROUND)
    seq = engine.submit(list(range(100, 200)), 3, "length", now=5.0)
    # Admission step: prefill 100 tokens (100 ms) + decode of a batch of 1 (11 ms).
    assert engine.next_deadline() == pytest.approx(5.0 + 0.100 + 0.011)
    run_until_idle(engine, 5.0)
    assert seq.state is SeqState.FINISHED
    assert seq.token_times[0] - 5.0 == pytest.approx(0.111)
    gaps = [b - a for a, b in zip(seq.token_times, seq.token_times[1:], strict=False)]
    assert gaps == [pytest.approx(0.011)] * 2
    assert seq.ttft == pytest.approx(0.111)


def test_a_request_dated_back_starts_then_but_never_inside_the_last_step() -> None:
    engine = Engine(ROUND)
    early = engine.submit([100] * 10, 1, "length", now=1.0)  # one step: 1.0 .. 1.021
    engine.advance(2.0)
    assert early.finished
    # Handed over at 2.0 as of 1.5 (the frontend's modelled moment): its step starts at 1.5.
    dated = engine.submit([200] * 10, 1, "length", now=1.5)
    assert engine.next_deadline() == pytest.approx(1.5 + 0.021)
    engine.advance(2.0)
    # As of 1.51, inside the step that ran 1.5 .. 1.521: it starts when that one ended.
    inside = engine.submit([300] * 10, 1, "length", now=1.51)
    assert engine.next_deadline() == pytest.approx(1.521 + 0.021)
    run_until_idle(engine, 2.0)
    assert dated.ttft == pytest.approx(0.021)
    assert inside.token_times[0] == pytest.approx(1.542)


def test_advance_before_the_deadline_emits_nothing() -> None:
    engine = Engine(ROUND)
    seq = engine.submit([100] * 10, 2, "length", now=0.0)
    assert engine.advance(0.01) == []
    assert seq.generated == 0
    assert engine.advance(0.021) == [seq]
    assert seq.generated == 1


def test_late_advance_catches_up_without_drift() -> None:
    engine = Engine(ROUND)
    seq = engine.submit([100] * 10, 5, "length", now=0.0)
    engine.advance(10.0)  # very late: all steps complete, at their scheduled times
    assert seq.generated == 5
    assert seq.token_times[-1] == pytest.approx(0.010 + 0.011 + 4 * 0.011)


def test_batching_slows_every_sequence() -> None:
    alone = Engine(ROUND)
    a = alone.submit([100] * 16, 20, "length", now=0.0)
    run_until_idle(alone)
    together = Engine(ROUND)
    seqs = [together.submit([100 + i] * 16, 20, "length", now=0.0) for i in range(3)]
    run_until_idle(together)
    solo_itl = a.token_times[-1] - a.token_times[1]
    batch_itl = seqs[0].token_times[-1] - seqs[0].token_times[1]
    # Decode step: 11 ms alone, 13 ms for three.
    assert batch_itl / solo_itl == pytest.approx(13 / 11)


def test_queue_is_fifo_and_waits_for_a_free_slot() -> None:
    engine = Engine(ROUND, max_num_seqs=2)
    first = engine.submit([100] * 16, 10, "length", now=0.0)
    second = engine.submit([101] * 16, 10, "length", now=0.0)
    third = engine.submit([102] * 16, 10, "length", now=0.0)
    fourth = engine.submit([103] * 16, 10, "length", now=0.0)
    # The first starts a step alone at once; the second waits for that step to end.
    assert [s.state for s in (first, second, third, fourth)] == [
        SeqState.RUNNING,
        SeqState.WAITING,
        SeqState.WAITING,
        SeqState.WAITING,
    ]
    engine.advance(engine.next_deadline() or 0.0)
    assert second.state is SeqState.RUNNING
    assert [s.id for s in engine.waiting] == [third.id, fourth.id]
    run_until_idle(engine)
    assert third.admitted_at is not None
    assert fourth.admitted_at is not None
    assert first.admitted_at is not None
    assert second.admitted_at is not None
    # The third takes the first slot to free up; the fourth the next one.
    assert third.admitted_at == pytest.approx(first.token_times[-1])
    assert fourth.admitted_at == pytest.approx(second.token_times[-1])
    assert third.admitted_at <= fourth.admitted_at
    # The queued request's TTFT includes its wait: about one request's duration more.
    assert third.ttft is not None
    assert first.ttft is not None
    assert third.ttft > first.ttft + (first.token_times[-1] - first.token_times[0])


def test_token_budget_starts_a_burst_over_several_steps() -> None:
    # 100 tokens a step: one per running sequence plus the prompts started. Six 40-token
    # prompts arrive together; the first starts alone (an idle engine starts at once).
    engine = Engine(ROUND, max_num_seqs=16, max_num_batched_tokens=100)
    seqs = [engine.submit([200 + i] * 40, 50, "length", now=0.0) for i in range(6)]
    assert [s.state for s in seqs].count(SeqState.RUNNING) == 1
    engine.advance(engine.next_deadline() or 0.0)
    # 100 - 1 running = 99 of room: two 40-token prompts, not a third.
    assert [s.state for s in seqs].count(SeqState.RUNNING) == 3
    engine.advance(engine.next_deadline() or 0.0)
    assert [s.state for s in seqs].count(SeqState.RUNNING) == 5  # 97 of room: two more
    engine.advance(engine.next_deadline() or 0.0)
    assert len(engine.waiting) == 0
    # A prompt over the whole budget still starts, the first of its step (vLLM would split
    # its prefill over steps), and the one after it waits for the next step.
    big = Engine(ROUND, max_num_batched_tokens=10)
    busy = big.submit([300] * 8, 5, "length", now=0.0)
    lone, after = (big.submit([301 + i] * 64, 2, "length", now=0.0) for i in range(2))
    big.advance(big.next_deadline() or 0.0)
    assert (busy.state, lone.state, after.state) == (
        SeqState.RUNNING, SeqState.RUNNING, SeqState.WAITING
    )
    run_until_idle(big)
    assert after.state is SeqState.FINISHED
    # Without a budget all six start at the first step boundary.
    free = Engine(ROUND, max_num_seqs=16)
    rest = [free.submit([400 + i] * 40, 50, "length", now=0.0) for i in range(6)]
    free.advance(free.next_deadline() or 0.0)
    assert all(s.state is SeqState.RUNNING for s in rest)


def test_overload_past_queue_limit() -> None:
    engine = Engine(ROUND, max_num_seqs=2, queue_limit=1)
    for i in range(3):
        engine.submit([100 + i] * 4, 5, "length", now=0.0)
    with pytest.raises(Overloaded):
        engine.submit([200] * 4, 5, "length", now=0.0)
    run_until_idle(engine)
    engine.submit([201] * 4, 5, "length", now=1.0)  # room again


def test_cancel_frees_the_slot_and_counts_abort() -> None:
    engine = Engine(ROUND, max_num_seqs=1)
    running = engine.submit([100] * 4, 100, "length", now=0.0)
    queued = engine.submit([101] * 4, 3, "length", now=0.0)
    engine.advance(engine.next_deadline() or 0.0)
    engine.cancel(running)
    engine.cancel(running)  # idempotent
    assert running.state is SeqState.CANCELLED
    end = run_until_idle(engine, engine.next_deadline() or 0.0)
    assert queued.finished
    assert end < 1.0
    assert engine.finished_by_reason["abort"] == 1
    assert engine.finished_by_reason["length"] == 1


def test_prefix_cache_hit_makes_prefill_cheap() -> None:
    engine = Engine(get_profile("h100-7b"))
    system = list(range(1000, 5000))  # 4,000 tokens
    first = engine.submit([*system, 7, 8, 9], 1, "length", now=0.0)
    t = run_until_idle(engine)
    second = engine.submit([*system, 10, 11], 1, "length", now=t + 1)
    run_until_idle(engine, t + 1)
    assert first.cached_tokens == 0
    assert second.cached_tokens == 4000  # 250 full blocks; the tail block differs
    assert first.ttft is not None
    assert second.ttft is not None
    assert 0.050 <= first.ttft <= 0.090  # "4K tokens in 50-80 ms" + one decode step
    assert second.ttft < first.ttft / 4
    assert engine.cache.hits_tokens == 4000
    assert engine.cache.queries_tokens == 4003 + 4002


def test_metrics_use_vllm_names() -> None:
    engine = Engine(ROUND, max_num_seqs=1)
    engine.submit([100] * 40, 3, "length", now=0.0)
    engine.submit([101] * 40, 3, "stop", now=0.0)
    text = engine.render_metrics()
    assert 'vllm:num_requests_running{model_name="m"} 1' in text
    assert 'vllm:num_requests_waiting{model_name="m"} 1' in text
    usage_line = next(ln for ln in text.splitlines() if ln.startswith("vllm:gpu_cache_usage_perc"))
    assert float(usage_line.split()[-1]) == pytest.approx(3 / 1000)  # 40 tokens = 3 blocks
    run_until_idle(engine)
    text = engine.render_metrics()
    for name in (
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_count",
        "vllm:kv_cache_usage_perc",
    ):
        assert name in text
    assert 'vllm:time_to_first_token_seconds_count{model_name="m"} 2' in text
    assert 'vllm:inter_token_latency_seconds_count{model_name="m"} 4' in text
    assert 'vllm:request_success_total{model_name="m",finished_reason="stop"} 1.0' in text
    assert "# TYPE vllm:prefix_cache_hits_total counter" in text


def test_instant_profile_takes_zero_time_but_interleaves() -> None:
    engine = Engine(PROFILES["instant"])
    a = engine.submit([100] * 20, 5, "length", now=0.0)
    b = engine.submit([101] * 20, 5, "length", now=0.0)
    touched = engine.advance(0.0)
    assert touched == [a]  # b is admitted at the next step boundary
    touched = engine.advance(0.0)
    assert touched == [a, b]  # one zero-length step per call
    run_until_idle(engine)
    assert a.token_times[-1] == 0.0
    assert b.finished


def test_invalid_settings() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        Engine(ROUND, max_num_seqs=0)
    with pytest.raises(ValueError, match="queue_limit"):
        Engine(ROUND, queue_limit=-1)
    with pytest.raises(KeyError, match="h100-7b"):
        get_profile("nope")


def test_a_pooling_request_costs_its_prefill_and_leaves_the_decode_batch_alone() -> None:
    engine = Engine(ROUND)
    embed = engine.submit(list(range(100, 150)), 0, "stop", now=0.0)
    # Alone: its step is its prefill (50 tokens, 50 ms) and no decode.
    assert engine.next_deadline() == pytest.approx(0.050)
    assert engine.advance(0.050) == [embed]
    assert embed.state is SeqState.FINISHED
    assert (embed.generated, embed.token_times) == (0, [])
    assert engine.next_deadline() is None
    # Beside a decoding sequence: the step is that sequence's decode (batch of 1) plus the
    # embedding's prefill; the embedding does not count in the batch.
    chat = engine.submit(list(range(300, 310)), 2, "length", now=1.0)  # starts a step at once
    other = engine.submit(list(range(400, 420)), 0, "stop", now=1.0)  # waits for the next
    assert engine.next_deadline() == pytest.approx(1.0 + 0.010 + 0.011)
    assert engine.advance(1.021) == [chat]
    assert engine.next_deadline() == pytest.approx(1.021 + 0.011 + 0.020)
    assert set(engine.advance(1.052)) == {chat, other}
    assert other.state is SeqState.FINISHED
    assert (chat.state, chat.generated) == (SeqState.FINISHED, 2)
    assert engine.next_deadline() is None
    text = engine.render_metrics()
    assert 'vllm:generation_tokens_total{model_name="m"} 2.0' in text
    assert 'vllm:request_success_total{model_name="m",finished_reason="stop"} 2.0' in text
