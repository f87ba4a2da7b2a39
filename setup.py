"""Builds the native shared-memory engine (csrc/) at `pip install`; everything else is in
pyproject.toml. JACKLRING_NO_NATIVE=1 installs without it (same-host ranks then use sockets)."""
import glob
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
    # Every C file of the engine and of its binding: a new unit is picked up without editing this.
    folders = [os.path.join("csrc", "shm"), os.path.join("csrc", "python")]
    sources = sorted(glob.glob(os.path.join(folders[0], "*.c"))) + sorted(glob.glob(os.path.join(folders[1], "*.c")))
    headers = sorted(h for folder in folders for h in glob.glob(os.path.join(folder, "*.h")))
    # numpy's headers (pyproject.toml's build requirements): the fast path reads arrays through its C API;
    # built against numpy 2, the module runs with numpy 1.x too (numpy's default target version).
    import numpy

    return [Extension("adapter.backends.local._engine", sources=sources, depends=headers,
                      include_dirs=[numpy.get_include()],
                      extra_compile_args=["-std=c11", "-O3", "-Wall", "-Wextra", "-Werror"])]


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildEngine})
