"""Sans-IO pieces: the token approximation, the prefix cache, deterministic output, faults."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from firstbyte.protocol.openai import Message, decode_request
from firstbyte.router.sim.faults import FaultKind, FaultPlan, FaultSpecError, parse_fault
from firstbyte.router.sim.output import DEFAULT_MAX_TOKENS, plan_completion
from firstbyte.router.sim.prefix_cache import BLOCK_SIZE, PrefixCache, block_hashes
from firstbyte.router.sim.tokens import IM_START, _Memo, prompt_tokens, tokenize

# -- tokens ------------------------------------------------------------------------------------


def test_tokens_are_about_four_characters_and_stable() -> None:
    text = "The quick brown fox jumps over the lazy dog, then naps under a sycamore tree. " * 20
    ids = tokenize(text)
    assert 3.0 <= len(text) / len(ids) <= 5.0
    assert ids == tokenize(text)
    assert len(tokenize("cat")) == 1
    assert len(tokenize("elephant")) == 2
    assert tokenize("hello world") != tokenize("hello  world")
    assert all(i >= 16 for i in ids)


@given(st.text(max_size=200))
def test_tokenize_never_fails_and_is_deterministic(text: str) -> None:
    assert tokenize(text) == tokenize(text)


def test_chat_template_marks_roles_and_boundaries() -> None:
    a = prompt_tokens([Message(role="system", content="ab"), Message(role="user", content="cd")])
    b = prompt_tokens([Message(role="user", content="ab"), Message(role="user", content="cd")])
    c = prompt_tokens([Message(role="system", content="abcd")])
    assert a != b != c
    assert a.count(IM_START) == 3  # two messages + the generation prompt


def test_a_long_message_remembered_gives_the_same_ids() -> None:
    history = " ".join(f"w{i:04d}" for i in range(2000))  # ~4K tokens: remembered
    messages = [Message(role="user", content=history), Message(role="user", content="next?")]
    first = prompt_tokens(messages)
    again = prompt_tokens(messages)
    assert list(first) == list(again)
    expected = [IM_START, 5, *tokenize("\n"), *tokenize(history)]
    assert list(first[: len(expected)]) == expected
    assert block_hashes(first) == block_hashes(list(first))  # an array hashes as a list


def test_the_memo_is_bounded_in_tokens_least_recent_first() -> None:
    memo = _Memo(max_tokens=40)
    a, b, c = (" ".join(f"{w}{i}" for i in range(20)) for w in ("a", "b", "c"))  # 20 each
    assert list(memo.ids(a)) == tokenize(a)
    memo.ids(b)
    memo.ids(a)  # a is now the most recent
    assert memo.tokens == 40
    memo.ids(c)  # 60 tokens: b, the least recent, goes
    assert memo.tokens == 40
    assert list(memo.ids(b)) == tokenize(b)  # split again, and a goes in turn
    assert memo.tokens == 40


# -- prefix cache ------------------------------------------------------------------------------


def test_block_hashes_are_chained_and_cover_only_full_blocks() -> None:
    tokens = list(range(100, 100 + 3 * BLOCK_SIZE + 5))
    keys = block_hashes(tokens)
    assert len(keys) == 3
    # Same block content after a different prefix: a different key (chained).
    other = block_hashes([1] * BLOCK_SIZE + tokens[BLOCK_SIZE : 2 * BLOCK_SIZE])
    assert other[1] != keys[1]
    assert block_hashes(tokens[: 2 * BLOCK_SIZE]) == keys[:2]


def test_match_counts_leading_full_blocks_and_never_the_whole_prompt() -> None:
    cache = PrefixCache(100)
    tokens = list(range(1000, 1000 + 4 * BLOCK_SIZE))
    keys = block_hashes(tokens)
    assert cache.match(keys, len(tokens)) == 0
    cache.insert(keys)
    # A fully cached prompt still computes its last token: one block fewer.
    assert cache.match(keys, len(tokens)) == 3 * BLOCK_SIZE
    longer = [*tokens, 1, 2, 3]
    assert cache.match(block_hashes(longer), len(longer)) == 4 * BLOCK_SIZE
    diverging = [*tokens[: 2 * BLOCK_SIZE], *([7] * 2 * BLOCK_SIZE), 9]
    assert cache.match(block_hashes(diverging), len(diverging)) == 2 * BLOCK_SIZE
    assert cache.hits_tokens == 3 * 16 + 4 * 16 + 2 * 16
    assert cache.queries_tokens == 64 + 64 + 67 + 65


def test_lru_eviction_under_capacity() -> None:
    cache = PrefixCache(6)
    a = block_hashes([1] * (4 * BLOCK_SIZE))
    b = block_hashes([2] * (4 * BLOCK_SIZE))
    cache.insert(a)
    assert cache.match(a, 4 * BLOCK_SIZE + 1) == 4 * BLOCK_SIZE
    cache.insert(b)  # 8 blocks into 6: a's two oldest blocks go
    assert len(cache) == 6
    assert cache.evictions == 2
    assert cache.match(a, 4 * BLOCK_SIZE + 1) == 0  # its first block is gone: no prefix hit
    assert cache.match(b, 4 * BLOCK_SIZE + 1) == 4 * BLOCK_SIZE


def test_recency_protects_a_hot_prefix() -> None:
    cache = PrefixCache(4)
    hot = block_hashes([1] * (2 * BLOCK_SIZE))
    cache.insert(hot)
    for i in range(5):
        cache.insert(block_hashes([10 + i] * BLOCK_SIZE))
        assert cache.match(hot, 2 * BLOCK_SIZE + 1) == 2 * BLOCK_SIZE  # touched: stays


def test_zero_capacity_caches_nothing() -> None:
    cache = PrefixCache(0)
    keys = block_hashes([1] * 64)
    cache.insert(keys)
    assert cache.match(keys, 65) == 0


# -- deterministic output ----------------------------------------------------------------------


def _request(extra: str = "", **fields: object) -> bytes:
    import json

    body = {"model": "m", "messages": [{"role": "user", "content": "hi" + extra}], **fields}
    return json.dumps(body).encode()


def test_same_request_and_seed_same_text() -> None:
    one = plan_completion(decode_request(_request(seed=3)), server_seed=1)
    two = plan_completion(decode_request(_request(seed=3)), server_seed=1)
    assert one == two
    assert plan_completion(decode_request(_request(seed=4)), 1).words != one.words
    assert plan_completion(decode_request(_request("!", seed=3)), 1).words != one.words
    assert plan_completion(decode_request(_request(seed=3)), 2).words != one.words


def test_length_and_stop() -> None:
    default = plan_completion(decode_request(_request()))
    assert len(default.words) <= DEFAULT_MAX_TOKENS
    short = plan_completion(decode_request(_request(max_tokens=3)))
    assert (len(short.words), short.finish_reason) == (3, "length")
    long = plan_completion(decode_request(_request(max_tokens=10_000)))
    assert long.finish_reason == "stop"
    assert 8 <= len(long.words) <= 256
    capped = plan_completion(decode_request(_request(max_completion_tokens=2, max_tokens=50)))
    assert len(capped.words) == 2
    assert long.token_text(0) == long.words[0]
    assert long.token_text(1) == " " + long.words[1]
    # vLLM's ignore_eos: past the natural end, to the limit; the same words up to that end.
    forced = plan_completion(decode_request(_request(max_tokens=1000, ignore_eos=True)))
    assert (len(forced.words), forced.finish_reason) == (1000, "length")
    assert forced.words[: len(long.words)] == long.words


# -- faults ------------------------------------------------------------------------------------


def test_parse_every_fault_kind() -> None:
    assert parse_fault("stall:after=3").after == 3
    assert parse_fault("stall:after=3").ms is None  # for good
    timed = FaultPlan([parse_fault("stall:after=9,ms=50"), parse_fault("stall:after=2,ms=1500")])
    assert (lambda f: (f.stall_after, f.stall_s))(timed.next_request()) == (2, 1.5)
    drop = parse_fault(" drop:after=0,rate=0.5 ")
    assert (drop.kind, drop.after, drop.rate) == (FaultKind.DROP, 0, 0.5)
    assert parse_fault("delay:ms=250").ms == 250
    assert parse_fault("error503:rate=0.25").rate == 0.25


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("boom", "unknown fault"),
        ("stall", "needs after"),
        ("stall:after=-1", "non-negative integer"),
        ("stall:after=1.5", "non-negative integer"),
        ("delay:ms=abc", "must be a number"),
        ("delay:ms=nan", "finite"),
        ("error503:rate=2", "between 0 and 1"),
        ("error503", "needs rate"),
        ("drop:after=1,when=now", "takes after, rate"),
        ("drop:after", "NAME=VALUE"),
    ],
)
def test_bad_fault_specs(spec: str, message: str) -> None:
    with pytest.raises(FaultSpecError, match=message):
        parse_fault(spec)


def test_fault_selection_is_deterministic_with_the_seed() -> None:
    faults = [parse_fault("error503:rate=0.3"), parse_fault("stall:after=2")]

    def pattern(seed: int) -> list[bool]:
        plan = FaultPlan(faults, seed=seed)
        return [plan.next_request().error503 for _ in range(200)]

    assert pattern(7) == pattern(7)
    assert pattern(7) != pattern(8)
    assert 30 <= sum(pattern(7)) <= 90  # about 30 %
    plan = FaultPlan(faults, seed=7)
    assert all(plan.next_request().stall_after == 2 for _ in range(10))
    assert not FaultPlan([], seed=1).next_request().any
