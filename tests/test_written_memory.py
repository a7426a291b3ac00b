"""The memory captured graphs write by address (:class:`WrittenMemory`), against a scan.

hypothesis is optional (a bare GPU box has none): the module skips without it.
"""

import pytest

pytest.importorskip("hypothesis")

from hypothesis import given, settings
from hypothesis import strategies as st

from fxsplit.runtime.inputs.static_buffers import WrittenMemory


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.booleans(), st.integers(0, 60), st.integers(1, 20)), min_size=1, max_size=30
    ),
    st.integers(0, 80),
    st.integers(1, 20),
)
def test_written_memory_overlaps_as_a_scan_of_every_registered_span(steps, low, length):
    """:class:`WrittenMemory` (merged, bisected ranges, counted per registration) answers as a
    scan of the spans registered and not yet removed."""
    memory, registered = WrittenMemory(), []
    for add, start, size in steps:
        span = (start, start + size)
        if add or span not in registered:
            memory.add((span,))
            registered.append(span)
        else:
            memory.remove((span,))
            registered.remove(span)
    query = (low, low + length)
    want = any(a < query[1] and query[0] < b for a, b in registered)
    assert memory.overlaps(query) == want
