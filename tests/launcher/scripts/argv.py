"""Print this rank's arguments as one JSON line."""
import json
import sys

print("ARGV " + json.dumps(sys.argv[1:]), flush=True)
