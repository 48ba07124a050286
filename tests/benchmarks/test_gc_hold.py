"""The load generator's GC is off for a phase and as it was after."""

from __future__ import annotations

import gc

import pytest

from firstbyte.benchmarks.gc_hold import gc_held_off


def _phase_that_fails() -> None:
    with gc_held_off():
        assert not gc.isenabled()
        raise RuntimeError("a phase failed")


def test_the_gc_is_off_in_the_block_and_back_after_it_even_on_an_error() -> None:
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        _phase_that_fails()
    assert gc.isenabled()


def test_a_gc_that_was_off_stays_off() -> None:
    gc.disable()
    try:
        with gc_held_off():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
