"""Print this rank's launcher environment (and the files it points at) as one JSON line."""
import json
import os

out = {"env": dict(os.environ), "cwd": os.getcwd(), "files": {}}
for name in ("MLX_HOSTFILE", "MLX_IBV_DEVICES"):
    if name in os.environ:
        with open(os.environ[name]) as f:
            out["files"][name] = json.load(f)
print("ENV " + json.dumps(out), flush=True)
