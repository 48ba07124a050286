"""``chunk_instructions`` reads the cyclic GC's share of a pass from callgrind's annotation."""

from firstbyte.benchmarks.chunk_instructions import gc_instructions

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
