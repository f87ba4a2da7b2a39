"""Run the Python source given as the first argument (keeps small test programs inline)."""
import sys

exec(compile(sys.argv[1], "<test program>", "exec"))
