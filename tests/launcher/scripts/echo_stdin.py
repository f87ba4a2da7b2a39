"""Echo every stdin line back, tagged, until EOF."""
import sys

for line in sys.stdin:
    print("got " + line.strip(), flush=True)
print("eof", flush=True)
