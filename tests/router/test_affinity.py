from __future__ import annotations

from collections import Counter

from firstbyte.protocol.openai import ChatCompletionRequest, Message
from firstbyte.router.pipeline.affinity import (
    AffinityPolicy,
    affinity_key,
    opens_conversation,
    rendezvous_rank,
)

SYSTEM = "You are a careful assistant. " * 300
BACKENDS = ["b0", "b1", "b2", "b3"]


def conversation(user: int, turns: int) -> ChatCompletionRequest:
    messages = [Message(role="system", content=SYSTEM)]
    for t in range(turns):
        messages.append(Message(role="user", content=f"user {user} question {t}"))
        messages.append(Message(role="assistant", content=f"answer {t} for {user}"))
    messages.append(Message(role="user", content=f"user {user} question {turns}"))
    return ChatCompletionRequest(model="m", messages=messages)


def test_key_skips_shared_system_prompt_and_is_stable_across_turns() -> None:
    k1 = affinity_key(conversation(7, 0))
    k2 = affinity_key(conversation(7, 5))
    assert SYSTEM[:50] not in k1
    assert k1 == k2
    assert affinity_key(conversation(7, 0)) != affinity_key(conversation(8, 0))


def test_key_strips_warm_prefix_inside_first_message() -> None:
    warm = "Shared preamble. " * 50
    a = ChatCompletionRequest(model="m", messages=[Message(role="user", content=warm + "alpha")])
    b = ChatCompletionRequest(model="m", messages=[Message(role="user", content=warm + "beta")])
    assert affinity_key(a, [warm]) != affinity_key(b, [warm])
    assert affinity_key(a, [warm], chars=32).endswith("alpha")


def test_key_only_system_message_uses_it() -> None:
    req = ChatCompletionRequest(model="m", messages=[Message(role="system", content="x")])
    assert affinity_key(req) == "m\x00system:x"


def test_rendezvous_stable_when_backend_removed() -> None:
    weights = dict.fromkeys(BACKENDS, 1.0)
    keys = [f"k{i}" for i in range(200)]
    before = {k: rendezvous_rank(k, weights)[0] for k in keys}
    del weights["b2"]
    after = {k: rendezvous_rank(k, weights)[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == "b2" for k in moved)


def test_fifty_users_spread_and_sticky() -> None:
    policy = AffinityPolicy(dict.fromkeys(BACKENDS, 1.0))
    loads = dict.fromkeys(BACKENDS, 0)
    placed: dict[int, str] = {}
    requests: Counter[str] = Counter()
    for turn in range(4):
        for user in range(50):
            key = affinity_key(conversation(user, turn))
            choice = policy.choose(key, BACKENDS, loads, now=float(turn))
            assert choice is not None
            requests[choice.backend] += 1
            if user in placed:
                assert choice.backend == placed[user]
                assert choice.reason == "affinity"
            placed[user] = choice.backend
    total = sum(requests.values())
    assert max(requests.values()) / total <= 0.40
    assert max(requests.values()) / min(requests.values()) <= 1.5


def test_imbalance_rule_overrides_affinity() -> None:
    policy = AffinityPolicy(dict.fromkeys(BACKENDS, 1.0), abs_threshold=4, rel_threshold=1.5)
    key = "m\x00user:hello"
    first = policy.choose(key, BACKENDS, dict.fromkeys(BACKENDS, 0), 0.0)
    assert first is not None
    loads = dict.fromkeys(BACKENDS, 2)
    loads[first.backend] = 10  # 10 - 2 > 4 and 10 > 1.5 * 2
    second = policy.choose(key, BACKENDS, loads, 1.0)
    assert second is not None
    assert second.reason == "balance"
    assert second.backend != first.backend
    # Absolute gap large but relative small: affinity holds.
    loads = dict.fromkeys(BACKENDS, 20)
    loads[first.backend] = 26
    third = policy.choose(key, BACKENDS, loads, 2.0)
    assert third is not None
    assert third.backend == first.backend


def test_least_loaded_tie_break_and_unavailable() -> None:
    policy = AffinityPolicy(dict.fromkeys(BACKENDS, 1.0), policy="least_loaded")
    choice = policy.choose("k", BACKENDS, {"b0": 3, "b1": 1, "b2": 1, "b3": 2}, 0.0)
    assert choice is not None
    assert choice.backend in {"b1", "b2"}
    assert policy.choose("k", [], {}, 0.0) is None


def test_sticky_key_moves_when_backend_unavailable_and_expires() -> None:
    policy = AffinityPolicy(dict.fromkeys(BACKENDS, 1.0), ttl_s=10.0)
    first = policy.choose("k", BACKENDS, {}, 0.0)
    assert first is not None
    others = [b for b in BACKENDS if b != first.backend]
    moved = policy.choose("k", others, {}, 1.0)
    assert moved is not None
    assert moved.backend in others
    assert sum(policy.key_counts().values()) == 1
    policy.choose("other", BACKENDS, {}, 100.0)  # "k" idle for 99 s > ttl: forgotten
    assert sum(policy.key_counts().values()) == 1


def test_round_robin_cycles() -> None:
    policy = AffinityPolicy(dict.fromkeys(BACKENDS, 1.0), policy="round_robin")
    got = [policy.choose("same", BACKENDS, {}, 0.0) for _ in range(8)]
    assert Counter(c.backend for c in got if c is not None) == Counter(dict.fromkeys(BACKENDS, 2))


def test_a_conversation_opens_until_something_answered_it() -> None:
    """A first message (a shared system prompt before it or not) opens a conversation: no
    other router process can have placed its affinity key. Once an answer, a tool's result or
    a function's is in it, it is a later turn, whose key may live elsewhere."""

    def request(*roles: str) -> ChatCompletionRequest:
        return ChatCompletionRequest(model="m", messages=[
            Message(role=role, content=f"{role} {i}") for i, role in enumerate(roles)])  # type: ignore[arg-type]

    assert opens_conversation(request("user"))
    assert opens_conversation(request("system", "user"))
    assert opens_conversation(request("developer", "user", "user"))
    assert not opens_conversation(request("user", "assistant", "user"))
    assert not opens_conversation(request("system", "user", "tool"))
    assert not opens_conversation(request("user", "function"))
    # the key is the first message's either way: a later turn names the conversation's key
    assert affinity_key(request("user", "assistant", "user")) == affinity_key(request("user"))


def test_a_lone_candidate_is_chosen_whatever_its_load() -> None:
    # RouteChooser.backend asks no load for a lone candidate (abs_threshold >= 0): under every
    # policy the choice and its reason are the same without it.
    for name in ("prefix", "least_loaded", "round_robin"):
        answers = []
        for loads in ({}, {"b": 0}, {"b": 50}):
            policy = AffinityPolicy({"a": 1.0, "b": 1.0}, policy=name)
            answers.append([policy.choose(f"k{i % 3}", ["b"], loads, float(i)) for i in range(6)])
        assert answers[0] == answers[1] == answers[2], name
