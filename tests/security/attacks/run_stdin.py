"""Run the Python source given on stdin (a one-off attack a test writes, e.g. creating a name
in a shared directory first), as the outsider."""
import sys

exec(compile(sys.stdin.read(), "<attack>", "exec"))
