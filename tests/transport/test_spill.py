"""The spill buffer that the ring's point-to-point streams and the TCP mesh share: bytes come out
in the order they went in, across chunk boundaries, and the cap is what a full-buffer note names."""
from __future__ import annotations

from adapter.backends.transport import spill as spill_module
from adapter.backends.transport.spill import Spill


def test_bytes_come_out_in_order_across_chunks_and_partial_takes() -> None:
    spill = Spill(limit=100)
    for text in (b"abcdef", b"gh", b"ijklmnop"):
        chunk = spill.new_chunk()
        chunk[:len(text)] = text
        spill.keep(chunk, len(text))
    assert spill.bytes == 16
    out = bytearray(5)
    assert spill.take(memoryview(out)) == 5 and bytes(out) == b"abcde"
    out = bytearray(4)
    assert spill.take(memoryview(out)) == 4 and bytes(out) == b"fghi"
    out = bytearray(20)
    assert spill.take(memoryview(out)) == 7 and bytes(out[:7]) == b"jklmnop"
    assert spill.bytes == 0 and not spill.chunks


def test_the_cap_bounds_each_chunk_and_the_note_names_it() -> None:
    spill = Spill(limit=10)
    assert len(spill.new_chunk()) == 10 and spill.full_note("rank 1") == ""
    spill.keep(bytearray(b"x" * 7), 7)
    assert len(spill.new_chunk()) == 3 and not spill.full()
    spill.keep(bytearray(b"yyy"), 3)
    assert spill.full()
    assert spill.full_note("rank 1") == ("; 10 bytes from rank 1 wait in this rank's spill buffer, which is full "
                                         "(JACKLRING_P2P_SPILL_BYTES=10)")
    assert len(Spill(limit=1 << 30).new_chunk()) == spill_module.CHUNK
