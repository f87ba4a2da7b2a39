import os
import sys

# tests import their helpers (ranks.py, sshd.py) as top-level modules
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Every rank process a test spawns inherits this: a rank that crashes (SIGSEGV, SIGABRT) prints
# the Python stack of each of its threads, so a rare crash in CI says where it happened.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")
