"""The soak's integrity judge, byte-exact, without sockets."""

from __future__ import annotations

from firstbyte.benchmarks.scenarios._soak_good import request_body
from firstbyte.benchmarks.scenarios._soak_integrity import Ledger, Verdict, expect


def _ledger() -> tuple[Ledger, list[str], list[str]]:
    ledger = Ledger()
    a = expect("key-a", request_body("a", 1, 48))
    b = expect("key-b", request_body("b", 1, 48))
    ledger.register(a)
    ledger.register(b)
    assert a.words != b.words  # the prompt names the key: outputs differ
    assert min(len(a.words), len(b.words)) >= 24  # room for the edits the tests make
    return ledger, list(a.words), list(b.words)


def test_expected_text_is_the_sims_output_for_that_request() -> None:
    one = expect("k", request_body("a", 7, 20))
    assert one == expect("k", request_body("a", 7, 20))
    assert len(one.words) <= 20
    assert one != expect("k", request_body("a", 8, 20))


def test_exact_and_partial_texts_are_fine() -> None:
    ledger, a, _ = _ledger()
    expected = expect("key-a", request_body("a", 1, 48))
    assert ledger.judge(expected, " ".join(a), finished=True, label="t") is Verdict.EXACT
    half = " ".join(a[: len(a) // 2])
    assert ledger.judge(expected, half, finished=False, label="t") is Verdict.PARTIAL
    assert ledger.violations == 0


def test_lost_repeated_cross_key_and_corrupt_are_told_apart() -> None:
    ledger, a, b = _ledger()
    expected = expect("key-a", request_body("a", 1, 48))
    cases = {
        Verdict.LOST: a[:5] + a[8:],                       # three tokens skipped
        Verdict.REPEATED: a[:6] + a[3:],                   # three tokens sent again
        Verdict.CROSS_KEY: a[:4] + b[10:20] + a[14:],      # key b's tokens in key a's stream
        Verdict.CORRUPT: [*a[:4], "zzz", "yyy", "xxx", *a[7:]],
    }
    for verdict, words in cases.items():
        assert ledger.judge(expected, " ".join(words), finished=True, label="t") is verdict
    # a stream that said it finished but stopped short lost its tail
    short = " ".join(a[:-2])
    assert ledger.judge(expected, short, finished=True, label="t") is Verdict.LOST
    assert ledger.judge(expected, " ".join(a + a[-3:]), finished=True, label="t") is (
        Verdict.REPEATED)
    assert ledger.violations == 6
    assert len(ledger.examples) == 6
