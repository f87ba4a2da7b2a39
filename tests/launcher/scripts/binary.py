"""Bytes that are not UTF-8, a NUL, and a last line without newline."""
import sys

sys.stdout.buffer.write(b"\xff\xfe bad \x80\n\x00zero\n")
sys.stdout.buffer.write(b"partial\xc3")
sys.stdout.flush()
