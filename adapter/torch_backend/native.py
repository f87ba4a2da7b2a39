"""The C++ part of the torch backend (csrc/torch/): built ahead of time, loaded from a private cache.

    python -m adapter.torch_backend.native          # build it (scripts/setup.sh does)
    python -m adapter.torch_backend.native --check  # say whether this torch would load it

The build is compiled against the installed torch (torch.utils.cpp_extension, -O3) into
`~/.cache/jacklring/torch/<torch version>-<key>/`, where the key hashes torch's version, git
commit and C++ ABI, this Python and the C++ sources: a torch upgrade or an edited source finds
no build, never a stale one. The cache and every directory and file loaded from it must be the
user's own and closed to others (mode 0700 / no group or other write), so another local user
cannot plant a library that this process would load.

A training job never compiles: when no usable build is cached, load() returns None and one log
line says why and what to run; the process group then runs in Python (today's path). Any load
failure (a missing symbol after a hand-copied cache, a file someone else owns) is the same.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import stat
import sys
from pathlib import Path
from types import ModuleType

log = logging.getLogger("jacklring.torch")

SOURCE_DIR = Path(__file__).resolve().parents[2] / "csrc" / "torch"
SOURCES = ("module.cpp", "backend.cpp", "delegated_work.cpp", "floor.cpp", "native.cpp", "native_ops.cpp",
           "native_queue.cpp")
ENGINE_HEADER = SOURCE_DIR.parent / "shm" / "engine.h"  # the engine's C interface, compiled in
MODULE = "jacklring_torch"
CFLAGS = ("-O3", "-Wall", "-Wextra", "-Werror")  # at -O2 GCC 12 left the reduction loops scalar
BUILD_HINT = "python -m adapter.torch_backend.native (scripts/setup.sh runs it)"


class UnsafeCache(Exception):
    """A cache path that is not the user's own or is writable by others."""


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jacklring" / "torch"


def _torch_identity() -> str:
    import torch

    return "|".join((torch.__version__, str(getattr(torch.version, "git_version", "")),
                     str(torch._C._GLIBCXX_USE_CXX11_ABI), sys.version, platform.machine()))


def build_key(source_dir: Path = SOURCE_DIR) -> str:
    """Hash of the torch build, this Python and every source (headers included)."""
    digest = hashlib.sha256(_torch_identity().encode())
    paths = [p for p in sorted(source_dir.iterdir()) if p.suffix in (".cpp", ".h")]
    for path in paths + ([ENGINE_HEADER] if ENGINE_HEADER.exists() else []):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _version_tag() -> str:
    """torch's version as a file name (2.13.0+cpu -> 2.13.0_cpu)."""
    import torch

    return "".join(c if c.isalnum() or c == "." else "_" for c in torch.__version__)


def build_dir(key: str, root: Path | None = None) -> Path:
    return (root or cache_root()) / f"{_version_tag()}-{key}"


def module_name(key: str) -> str:
    """The library's file name (without .so) in the build's directory; the module inside is
    always MODULE (one build is loaded per process)."""
    return f"{MODULE}_{key}"


def _work_dir(root: Path) -> Path:
    """Where ninja compiles, one per torch version: an edited source recompiles only its own
    file. The finished library is copied to the build's keyed directory."""
    return root / f"{_version_tag()}-objects"


def check_private(path: Path) -> None:
    """Raise UnsafeCache unless path is no symlink, owned by this user and not writable by
    group or others (directories: not even readable, mode 0700)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise
    if stat.S_ISLNK(info.st_mode):
        raise UnsafeCache(f"{path} is a symbolic link")
    if info.st_uid != os.getuid():
        raise UnsafeCache(f"{path} belongs to uid {info.st_uid}, not to this user (uid {os.getuid()})")
    closed = 0o077 if stat.S_ISDIR(info.st_mode) else 0o022
    if info.st_mode & closed:
        raise UnsafeCache(f"{path} has mode {stat.S_IMODE(info.st_mode):04o}: others may write to it")


def _private_dirs(target: Path, root: Path) -> None:
    """Create root .. target with mode 0700, checking each (a directory made by someone else first
    would otherwise let them swap the library)."""
    root.parent.parent.mkdir(parents=True, exist_ok=True)  # ~/.cache: the user's, as it is
    for path in [root.parent, root, *reversed([p for p in target.parents if root in p.parents]), target]:
        path.mkdir(mode=0o700, exist_ok=True)
        check_private(path)


def build(root: Path | None = None, verbose: bool = False, source_dir: Path = SOURCE_DIR) -> Path:
    """Compile the extension into its cache directory (a no-op when it is there) and return
    the library's path. Raises on a failed compile, with the compiler's output in the message."""
    from torch.utils import cpp_extension

    root = root or cache_root()
    key = build_key(source_dir)
    directory = build_dir(key, root)
    work = _work_dir(root)
    _private_dirs(directory, root)
    _private_dirs(work, root)
    library = directory / f"{module_name(key)}.so"
    if not library.exists():
        # Held from compile to copy: another checkout building other sources into the same
        # objects directory must not relink the library before it is copied under this key.
        with open(work / ".build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            cpp_extension.load(MODULE, [str(source_dir / s) for s in SOURCES], extra_cflags=list(CFLAGS),
                               extra_include_paths=[str(source_dir.parent)], build_directory=str(work),
                               verbose=verbose)
            partial = directory / f".{module_name(key)}.so.{os.getpid()}"
            shutil.copyfile(work / f"{MODULE}.so", partial)
        partial.chmod(0o700)
        os.replace(partial, library)  # whole or absent: a job never sees half a library
    check_private(library)
    return library


_loaded: dict[Path, ModuleType] = {}


def load(root: Path | None = None, source_dir: Path = SOURCE_DIR) -> tuple[ModuleType | None, str]:
    """(module, "") when a build for this torch and these sources is cached and safe to load,
    else (None, why). Never compiles."""
    try:
        root = root or cache_root()
        key = build_key(source_dir)
        directory = build_dir(key, root)
        library = directory / f"{module_name(key)}.so"
        if library in _loaded:
            return _loaded[library], ""
        if not library.exists():
            return None, _missing(root, directory)
        for path in (root.parent, root, directory, library):
            check_private(path)
        spec = importlib.util.spec_from_file_location(MODULE, library)
        if spec is None or spec.loader is None:
            return None, f"{library} is not a loadable module"
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (OSError, ImportError, UnsafeCache) as exc:
        return None, f"the C++ torch backend does not load ({exc}); rebuild with {BUILD_HINT}"
    _loaded[library] = module
    return module, ""


def _missing(root: Path, directory: Path) -> str:
    import torch

    # Finished builds (a directory with a library in it), whatever torch they were made for.
    others = sorted(p.name for p in root.iterdir() if any(p.glob("*.so"))) if root.is_dir() else []
    version = directory.name.rsplit("-", 1)[0]
    if others and not any(name.startswith(f"{version}-") for name in others):
        return (f"the C++ torch backend was built for another torch ({', '.join(others)}), torch is now "
                f"{torch.__version__}: rebuild with {BUILD_HINT}")
    return f"no C++ torch backend is built for this torch ({torch.__version__}) in {directory.parent}: build it with {BUILD_HINT}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m adapter.torch_backend.native", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say whether a usable build is cached")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's commands")
    args = parser.parse_args(argv)
    if not args.check:
        try:
            library = build(verbose=args.verbose)
        except Exception as exc:
            print(f"jacklring: the C++ torch backend did not build: {exc}", file=sys.stderr)
            return 1
        print(f"jacklring: C++ torch backend built: {library}")
    module, why = load()
    if module is None:
        print(f"jacklring: {why}", file=sys.stderr)
        return 1
    print(f"jacklring: C++ torch backend loads ({module.__file__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
