"""``chunk_instructions`` reads the cyclic GC's share of a pass from callgrind's annotation,
and runs its bare ASGI relay (the reference beside the router) end to end."""

import json

import pytest

from firstbyte.benchmarks.chunk_instructions import _CHUNK, gc_instructions, main

# Lines of `callgrind_annotate --inclusive=yes` of a measured pass of the router (2026-12-07):
# the collection's own line has its object file in brackets; lines of inlined headers do not.
_ANNOTATION = """\
43,133,702 (100.0%)  PROGRAM TOTALS
 1,688,732 ( 4.34%)  /tmp/python-build/Python-3.11.7/Modules/gcmodule.c:gc_collect_main [/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0]
   208,117 ( 0.54%)  /tmp/python-build/Python-3.11.7/Modules/gcmodule.c:gc_collect_main'2 [/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0]
     2,364 ( 0.01%)  /tmp/python-build/Python-3.11.7/./Include/object.h:gc_collect_main
    11,868 ( 0.03%)  /tmp/python-build/Python-3.11.7/Modules/gcmodule.c:gc_collect_with_callback [/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0]
"""


def test_the_collections_inclusive_count_is_read() -> None:
    assert gc_instructions(_ANNOTATION) == 1_688_732  # the outer call holds the recursive one


def test_a_pass_without_a_collection_reads_zero() -> None:
    assert gc_instructions(_ANNOTATION.splitlines()[0] + "\n") == 0


def test_the_bare_relay_relays_every_chunk_of_every_stream(capsys: pytest.CaptureFixture[str]) -> None:
    # The reference is measured as the router is: its clients finish only on each answer's
    # [DONE] and last chunk, so a pass that returns had every chunk relayed.
    main(["--target", "bare", "--no-valgrind", "--streams", "3", "--chunks", "4",
          "--passes", "2", "--interval-ms", "2", "--idle-s", "0"])
    result = json.loads(capsys.readouterr().out)
    assert result["target"] == "bare"
    assert result["chunks"] == 2 * 3 * (4 + 2)
    # every content chunk's payload (its JSON line) reached a client, in the relay's framing
    assert result["bytes_received"] >= 2 * 3 * 4 * len(_CHUNK)
    assert result["cpu_us_per_chunk"] >= 0
