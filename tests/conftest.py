import compileall
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# tests import their helpers (ranks.py, sshd.py) as top-level modules
sys.path.insert(0, HERE)

# Every rank process a test spawns inherits this: a rank that crashes (SIGSEGV, SIGABRT) prints
# the Python stack of each of its threads, so a rare crash in CI says where it happened.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")


def _compile_the_repository() -> None:
    """Byte-compile the repository's modules into their __pycache__ folders (gitignored) once per
    session. Under PYTHONDONTWRITEBYTECODE=1 no process writes them, so each of the thousands of
    rank processes the suite starts compiled every module it imported from source again: about a
    third of the CPU of a small launch (a 2-rank all_sum under the launcher: 1.5 -> 1.0 CPU-s).
    Reading cached bytecode is still allowed; stale files are never used (Python checks each
    source's size and mtime)."""
    if not sys.flags.dont_write_bytecode:
        return  # the processes cache what they compile themselves
    for folder in ("adapter", "launcher", "jacklring_shared", "tests", "examples"):
        compileall.compile_dir(os.path.join(ROOT, folder), quiet=2, workers=1)


_compile_the_repository()
