"""tandem's hottest Python compiled to C by mypyc, as an option: the same source, run faster.

`TANDEM_COMPILED=on` makes a process import the modules `PACKAGES` names (the scheduler's core,
fair queue, registry, indexes and placements; the simulator's event loop and workers) as C
extensions that mypyc built from this very source; `off` (the default) imports the Python. It
acts when a package is first imported (its `__init__.py` calls `activate`), so it is an
environment variable, not a flag: the scheduler service, `tandem plan`'s simulator and the
benches all follow it.

The build is cached under the cache directory by a hash of every source it reads (the packages,
`shared` and `kernels` for their types, this recipe), mypy's version and the Python ABI: an edit
of any of them builds afresh, a stale build is never loaded. mypy reads copies of them in a
scratch folder (it refuses site-packages on its path, where an installed tandem lives). It takes
a minute or two (mypy type-checks, then the C compiler); `python -m services.compiled` builds
ahead of time. Without mypy (`pip install 'tandem-serve[compiled]'`) or a C compiler the build
fails with the reason, and `on` fails the import: an operator who asked for it hears why.

Compiled code checks the annotated types at run time, so the compiled modules keep their
annotations true (the C indexes, duck-typed twins of the Python ones, are typed
`NativeOrPython`), and a generator expression there is a list to mypyc: lazy walks are written
as generator functions. The tests run the simulator's scenarios and the policy's tests against
both and require the same results (`tests/unit/test_compiled.py`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import MutableSequence
from pathlib import Path
from types import ModuleType

from kernels import native_build
from shared.config import cache_dir

ENV = "TANDEM_COMPILED"
CHOICES = ("off", "on")
SERVICES = Path(__file__).parent
ROOT = SERVICES.parent  # the repository (or site-packages) holding `services`, `shared`
SCHEDULER = (
    "adopted",
    "cache_holders",
    "cache_placement",
    "cache_routing",
    "candidates",
    "core",
    "decode_fit",
    "fair_share",
    "lazy_heap",
    "prefix_index",
    "queue_index",
    "queued",
    "registry",
    "wait_forecast",
    "worker_index",
    "worker_state",
)
# The simulator that drives the scheduler's core (`tandem plan`): its event loop and workers.
PLANNER = ("caches", "events", "profile", "simulator", "slo_watch", "workers", "workload")
# The packages compiled, by name under `services`, and their modules; one build holds all.
PACKAGES = {"scheduler": SCHEDULER, "planner": PLANNER}
# Read for their types, not compiled.
TYPED_TREES = ("shared", "kernels")
BUILD_TIMEOUT_S = 1200
BUILDING = "building-"  # a build's scratch folder, beside the builds
# mypy follows the compiled modules into the trees whose types they use, and no further: every
# other import (torch, numpy, transformers, ...) is skipped, as Any. Following them, as mypy
# does by default, made no difference to the C it generated (byte for byte) and took two thirds
# of the build (4.9 of 7.4 minutes on a 2-core EPYC); none of their types reaches the compiled
# modules' annotations.
MYPY_CONFIG = """\
[mypy]
follow_imports = skip
ignore_missing_imports = True

[mypy-services.*,shared.*,kernels.*]
follow_imports = silent
"""


class CompiledUnavailable(RuntimeError):
    """The compiled modules cannot be built here (no mypy, no compiler, a failed build)."""


def choice() -> str:
    value = os.environ.get(ENV, "off").strip().lower() or "off"
    if value not in CHOICES:
        raise ValueError(f"{ENV} must be one of {', '.join(CHOICES)}, got {value!r}")
    return value


def activate(package: str, package_path: MutableSequence[str]) -> bool:
    """Puts the compiled modules ahead of the sources in `services.<package>`'s path, if the
    environment asks for them (building them first if needed); whether it did."""
    if choice() == "off":
        return False
    build = build_dir()
    if not build.exists():
        build_modules(build)
    lib = str(build / "lib")  # the modules' shared runtime (one per build)
    if lib not in sys.path:
        sys.path.insert(0, lib)
    package_path.insert(0, str(build / package))
    return True


def kind(module: ModuleType) -> str:
    """How `module` runs: `compiled` (an extension built here) or `python`."""
    return "python" if (module.__file__ or "").endswith(".py") else "compiled"


def build_dir() -> Path:
    return cache_dir() / "compiled" / _key()


def _key() -> str:
    digest = hashlib.sha256()
    for path, source in _typed_sources():
        digest.update(path.encode() + b"\0" + source.read_bytes() + b"\0")
    abi = f"{sysconfig.get_config_var('EXT_SUFFIX')} {sys.version} {_mypy_version()}"
    digest.update(abi.encode())
    return digest.hexdigest()[:16]


def _typed_sources() -> list[tuple[str, Path]]:
    """Every source the build reads, by its path in the build: the packages' modules (the
    compiled ones, and their siblings for their types), `shared`'s and `kernels`' (the compiled
    code expects what their annotations say: an edit there may change what it must check), and
    this module (the recipe)."""
    sources = [(f"services/{p.name}", p) for p in (SERVICES / "__init__.py", Path(__file__))]
    for package in PACKAGES:
        sources += [(f"services/{package}/{p.name}", p) for p in (SERVICES / package).glob("*.py")]
    for tree in TYPED_TREES:
        sources += [(str(p.relative_to(ROOT)), p) for p in (ROOT / tree).rglob("*.py")]
    return sorted(sources)


def _mypy_version() -> str:
    try:
        return importlib.metadata.version("mypy")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def build_modules(build: Path) -> None:
    """Compiles `PACKAGES` with mypyc into `build` (a folder of modules per package, `lib/` their
    shared runtime), staged beside it and renamed into place, so processes building at once
    never load a half-written build."""
    if _mypy_version() == "none":
        raise CompiledUnavailable(f"{ENV}=on needs mypy: pip install 'tandem-serve[compiled]'")
    build.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned_builds(build.parent)
    with tempfile.TemporaryDirectory(dir=build.parent, prefix=BUILDING) as work:
        work_dir = Path(work)
        for path, source in _typed_sources():  # mypy reads them here, never in site-packages
            (work_dir / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source, work_dir / path)
        files = [f"services/{p}/{name}.py" for p, modules in PACKAGES.items() for name in modules]
        _run_mypyc(work_dir, files)
        staged = work_dir / "staged"
        (staged / "lib").mkdir(parents=True)
        for package in PACKAGES:
            (staged / package).mkdir()
            for library in (work_dir / "services" / package).glob("*.so"):
                shutil.move(library, staged / package)
        for library in work_dir.glob("*.so"):
            shutil.move(library, staged / "lib")
        try:
            os.replace(staged, build)
        except OSError:
            if not build.exists():  # (else another process built it first: theirs stands)
                raise


def remove_abandoned_builds(parent: Path, now: float | None = None) -> None:
    """Removes the scratch folders of builds whose process was killed (a temporary folder
    outlives a SIGKILL; each holds about 120 MB). A folder made longer ago than twice the
    build's time limit belongs to no live build: that build would have been stopped."""
    now = time.time() if now is None else now
    for folder in parent.glob(BUILDING + "*"):
        try:
            if now - folder.stat().st_mtime > 2 * BUILD_TIMEOUT_S:
                shutil.rmtree(folder, ignore_errors=True)
        except FileNotFoundError:  # (another process removed it first)
            continue


def _run_mypyc(work_dir: Path, files: list[str]) -> None:
    (work_dir / "mypy.ini").write_text(MYPY_CONFIG)
    command = [sys.executable, "-m", "mypyc", "--config-file", "mypy.ini", *files]
    env = {k: v for k, v in os.environ.items() if k != "MYPYPATH"}  # all it reads is here
    native_build.run_build_tool(
        command,
        label="mypyc",
        error=CompiledUnavailable,
        timeout_s=BUILD_TIMEOUT_S,
        cwd=work_dir,
        env=env,
    )


def main() -> None:
    """Builds the compiled modules (if not built yet) and prints where they lie."""
    build = build_dir()
    if not build.exists():
        print(f"building {build} (minutes) ...", flush=True)
        build_modules(build)
    print(build)


if __name__ == "__main__":
    main()
