"""The spill budget, sans-IO: slots only from acquire, each released once."""

from __future__ import annotations

import pytest

from firstbyte.router.spill import SpillBudget


def test_spill_budget_is_twenty_percent_with_minimum() -> None:
    b = SpillBudget(ratio=0.2, min_concurrency=3)
    slots = [b.acquire(10, "saturated") for _ in range(4)]
    assert [s is not None for s in slots] == [True, True, True, False]
    first = slots[0]
    assert first is not None
    b.release(first)
    assert b.acquire(10, "saturated") is not None
    big = SpillBudget(ratio=0.2, min_concurrency=3)
    granted = [big.acquire(100, "first_token_deadline") for _ in range(30)]
    assert sum(s is not None for s in granted) == 20
    assert big.refused == {"first_token_deadline": 10}
    assert big.acquired == {"first_token_deadline": 20}


def test_a_slot_is_released_once_and_only_by_its_budget() -> None:
    b = SpillBudget(ratio=0.0, min_concurrency=2)
    one, two = b.acquire(1, "saturated"), b.acquire(1, "saturated")
    assert one is not None
    assert two is not None
    assert b.acquire(1, "saturated") is None
    b.release(one)
    b.release(one)  # a second release of the same slot gives nothing back
    assert b.spilling == 1
    other = SpillBudget(ratio=0.0, min_concurrency=1)
    with pytest.raises(ValueError, match="another spill budget"):
        other.release(two)
    b.release(two)
    assert b.spilling == 0
    assert repr(b) == "<SpillBudget [0 spilling | acquired 2, refused 1]>"


def test_one_models_spills_do_not_use_up_anothers_budget() -> None:
    b = SpillBudget(ratio=0.2, min_concurrency=3)
    held = [b.acquire(5, "saturated", "model-b") for _ in range(3)]
    assert all(s is not None for s in held)
    assert b.acquire(5, "saturated", "model-b") is None  # B's budget is used up ...
    a = [b.acquire(20, "saturated", "model-a") for _ in range(4)]
    assert all(s is not None for s in a)  # ... A's is its own: 20% of A's 20 active
    assert b.acquire(20, "saturated", "model-a") is None
    assert b.spilling == 7
    assert b.spilling_by_model == {"model-a": 4, "model-b": 3}
    for slot in (*held, *a):
        assert slot is not None
        b.release(slot)
    assert b.spilling == 0
    assert not b.spilling_by_model  # no entry kept for a model spilling nothing
