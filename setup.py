"""Builds the native shared-memory engine (csrc/) at `pip install`; everything else is in
pyproject.toml. JACKLRING_NO_NATIVE=1 installs without it (same-host ranks then use sockets)."""
import os
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HOW = ("install a C compiler and Python's headers (Debian/Ubuntu: apt-get install gcc python3-dev; "
       "Fedora: dnf install gcc python3-devel), or set JACKLRING_NO_NATIVE=1 to install without the "
       "shared-memory engine (ranks on one host then talk over sockets)")


class BuildEngine(build_ext):
    """A failed build names what to install instead of a compiler's traceback."""

    def run(self) -> None:
        headers = os.path.join(sysconfig.get_paths()["include"], "Python.h")
        if not os.path.exists(headers):
            raise SystemExit(f"jacklring: {headers} is missing: {HOW}")
        try:
            super().run()
        except Exception as exc:  # CompileError, a missing compiler (DistutilsExecError, ...)
            raise SystemExit(f"jacklring: building the shared-memory engine failed ({exc}): {HOW}") from exc


def extensions() -> list:
    if os.environ.get("JACKLRING_NO_NATIVE") == "1" or not sys.platform.startswith("linux"):
        return []
    sources = [os.path.join("csrc", "shm", name) for name in ("segment.c", "step.c", "copy.c", "reduce.c", "collectives.c", "probe.c")]
    return [Extension("adapter.backends.local._engine", sources=sources + ["csrc/python/engine_module.c"],
                      depends=[os.path.join("csrc", "shm", h)
                               for h in ("engine.h", "context.h", "step.h", "copy.h", "reduce.h", "probe.h")],
                      extra_compile_args=["-std=c11", "-O3", "-Wall", "-Wextra", "-Werror"])]


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildEngine})
