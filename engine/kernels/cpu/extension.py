"""Build-once-per-machine for this package's C++ kernels (paged_attention.cpp, quant_gemm.cpp).

`torch.utils.cpp_extension.load` compiles a source into a directory under the cache dir named
by the caller (the kernel, the instruction set and a hash of the source), so each machine pays
the compile once (tens of seconds of CPU; minutes of wall time on a loaded 2-core VM) and every
later start imports the cached library in about a second; a changed source or another CPU gets
its own directory. The source is compiled from a copy inside that directory, so checkouts at
different paths holding the same source share one build instead of rebuilding it in turn.

A source may include headers of its own folder by quotes (`#include "gemv_prefetch.h"`): they
are staged beside the copy and hashed with it, so a changed header builds again too.

A build leaves a stamp beside its library (`built.json`: the library, the flags, torch's and
Python's versions); a later start whose source and stamp match imports the library directly.
torch's builder is imported only to build: with it come setuptools and distutils, 4.3 MiB of
every engine process's RSS (and a fraction of a second at start) for a check that the stamp
makes. No C++ compiler, or a build that fails, gives None with one warning: callers
fall back to their torch path, the engine never fails for want of a compiler. Where a compiler
is present, the test suite sets MINI_INFER_KERNEL_BUILD_STRICT=1 (tests/conftest.py): a kernel that
fails to compile there raises instead of falling back, so its tests fail rather than skip.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import structlog

log = structlog.get_logger(__name__)

STRICT_ENV = "MINI_INFER_KERNEL_BUILD_STRICT"
STAMP = "built.json"  # beside a built library: what it was built from


def compiler() -> str | None:
    """The C++ compiler torch's extension builder would use, if it is installed."""
    return shutil.which(os.environ.get("CXX", "c++"))


_LOCAL_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]+"([^"/\\]+)"', re.MULTILINE)


def build_inputs(source: Path) -> list[Path]:
    """`source` and the headers it includes by quotes from its own folder (one level: headers
    include none of their own)."""
    source = Path(source)
    names = _LOCAL_INCLUDE.findall(source.read_bytes())
    return [source, *(source.with_name(name.decode()) for name in dict.fromkeys(names))]


def source_digest(source: Path) -> str:
    """A hash of `source` and its headers (a source without headers keeps the digest, so the
    build, it had before headers were hashed)."""
    source, *headers = build_inputs(source)
    digest = hashlib.sha256(source.read_bytes())
    for header in headers:
        digest.update(header.name.encode() + header.read_bytes())
    return digest.hexdigest()[:10]


def build(
    name: str,
    source: Path,
    cflags: Sequence[str],
    build_root: Path | None = None,
    event: str = "extension",
    fallback: str = "torch",
) -> ModuleType | None:
    """Compile (or reuse) `source` as the extension `name` and import it; None, with a warning
    logged as `{event}.no_compiler` / `{event}.build_failed`, if that is impossible."""
    if build_root is None:
        from engine.loader import cache_dir  # the loader pulls in safetensors etc.: import late

        build_root = cache_dir() / "torch_extensions"
    directory = Path(build_root) / name
    flags = ["-O3", "-fopenmp", *cflags]
    # Built before, from this very source and these flags (a container image builds its
    # kernels at image build time, `prebuild`, and ships no compiler): imported as it is.
    module = _import_prebuilt(name, source, directory, flags)
    has_compiler = compiler() is not None
    if module is not None:
        if not has_compiler:  # what an image's operator looks for at start
            log.info(f"{event}.prebuilt", path=str(directory))
        return module
    if not has_compiler:
        log.warning(
            f"{event}.no_compiler", fallback=fallback, lost=name,
            detail="no C++ compiler (set CXX or install g++) and no prebuilt library",
        )  # fmt: skip
        return None
    directory.mkdir(parents=True, exist_ok=True)
    wait_for_build_lock(directory)
    from torch.utils import cpp_extension

    try:
        module = cpp_extension.load(
            name=name,
            sources=[str(_staged(source, directory))],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            verbose=False,
        )
    except Exception as error:  # a compiler that fails is the same as none: fall back
        if os.environ.get(STRICT_ENV) == "1":  # the test suite: a broken kernel is a failure
            raise
        log.warning(f"{event}.build_failed", fallback=fallback, error=str(error)[-2000:])
        return None
    _write_stamp(directory, Path(module.__file__), flags)
    return module


def _build_facts(flags: Sequence[str]) -> dict:
    """What a library's build depends on besides its source: the flags it was compiled with,
    the torch it links against and the Python ABI it is a module of."""
    import torch

    return {
        "flags": list(flags), "torch": torch.__version__,
        "python": sys.implementation.cache_tag,
    }  # fmt: skip


def _write_stamp(directory: Path, library: Path, flags: Sequence[str]) -> None:
    stamp = {"library": library.name, **_build_facts(flags)}
    tmp = directory / f".{STAMP}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(stamp))
    os.replace(tmp, directory / STAMP)


def _import_prebuilt(
    name: str, source: Path, directory: Path, flags: Sequence[str]
) -> ModuleType | None:
    """The library a build left in `directory`, if it was built from `source` as it is now,
    with `flags`, for this torch and this Python (its stamp says so); else None."""
    try:
        stamp = json.loads((directory / STAMP).read_text())
        library = directory / stamp.pop("library")
        if not library.is_file() or any(
            (directory / path.name).read_bytes() != path.read_bytes()
            for path in build_inputs(source)
        ):
            return None
    except (OSError, ValueError, LookupError, TypeError, AttributeError):  # none, or of old
        return None
    if stamp != _build_facts(flags):
        return None
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, library)
    try:  # (the library links against torch's: loaded above)
        module = importlib.util.module_from_spec(spec)  # an extension is loaded here
        spec.loader.exec_module(module)
    except (ImportError, OSError) as error:  # damaged, or links what is gone: built again
        log.warning("extension.prebuilt_unloadable", path=str(library), error=str(error))
        return None
    return module


def _staged(source: Path, directory: Path) -> Path:
    """A copy of `source` (and of its headers, `build_inputs`) inside its build directory, each
    written only when missing or different; the copy of `source` is returned. ninja tracks a
    source by path and mtime: built from the checkout itself, two checkouts of the same source
    (same directory name) would each rebuild it in turn, every time."""
    for path in build_inputs(source):
        staged = directory / path.name
        text = path.read_bytes()
        if not staged.is_file() or staged.read_bytes() != text:
            tmp = staged.with_name(f".{staged.name}.tmp-{os.getpid()}")
            tmp.write_bytes(text)
            os.replace(tmp, staged)
    return directory / Path(source).name


def wait_for_build_lock(
    directory: Path,
    max_age_s: float = 900.0,
    poll_s: float = 0.5,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Wait while another process builds in `directory` (its `lock` file exists), until the
    lock goes or turns stale (`remove_stale_lock`). torch's builder waits on the lock itself,
    but forever: a lock left by a build killed a minute ago would hang every later start, since
    it was not stale yet when checked."""
    lock = Path(directory) / "lock"
    logged = False
    while True:
        try:
            age_s = clock() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age_s > max_age_s:
            remove_stale_lock(directory, max_age_s, clock)
            return
        if not logged:
            stale_in_s = round(max_age_s - age_s)
            log.info("extension.waiting_for_build", path=str(lock), stale_in_s=stale_in_s)
            logged = True
        sleep(poll_s)


def remove_stale_lock(
    directory: Path, max_age_s: float = 900.0, clock: Callable[[], float] = time.time
) -> None:
    """torch's builder serialises builds with a `lock` file and waits while one exists; a
    process killed mid-build leaves it behind, and every later start would wait forever. A
    build takes minutes at most, so a lock older than `max_age_s` is stale."""
    lock = Path(directory) / "lock"
    try:
        if clock() - lock.stat().st_mtime > max_age_s:
            lock.unlink()
            log.warning("extension.stale_lock_removed", path=str(lock))
    except FileNotFoundError:
        pass
