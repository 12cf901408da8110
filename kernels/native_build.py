"""C sources compiled on first use with the system's C compiler, cached by what they are.

tandem ships C as source (the CPU decode kernel, the scheduler's native queue index) and compiles
it on the machine that runs it, with `$CC`, else `cc`: no wheel per platform, no build step at
install. A library is written into a cache directory under a name that hashes the source, the
compiler, its flags and `key_extra` (the CPU's feature flags for `-march=native` code; the
Python ABI for an extension module), so a cache shared between machines or Pythons never hands
one another's build, and a changed source builds afresh. A compile takes about a second; later
calls load the cached file. Processes starting together may compile at once: each builds in a
temporary directory of its own and renames the library into place (atomic), so none loads a
half-written one. A library ends with a digest of its own bytes (`_seal`), checked before a cached
one is handed out: one cut short on disk (a copy of the cache interrupted, a crash before the
build's data reached the disk) is built again, where loading it crashed the process with SIGBUS
inside dlopen, past every fallback.

Without a compiler, when it fails, or where the cache directory cannot be written,
`compile_cached` raises `NativeUnavailable` with the reason (the compiler's last lines), and
leaves nothing behind; the caller keeps its Python path.

`TANDEM_NATIVE_CFLAGS` adds flags to every compile and link (part of the hash): the tests build
the scheduler's C with AddressSanitizer and UBSan through it.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

COMPILE_TIMEOUT_S = 120
DIAGNOSTIC_LINES = 5  # of a failed build's output, in its error


class NativeUnavailable(RuntimeError):
    """The native code cannot be built or loaded here (no compiler, a failed compile, ...)."""


def compiler() -> list[str]:
    """The compiler's command: `$CC` split as a shell would (it may name a wrapper or carry
    flags, `ccache gcc`, as make takes it), else `cc`."""
    try:
        return shlex.split(os.environ.get("CC", "")) or ["cc"]
    except ValueError as error:  # an unclosed quote: a failed build, not a failed start
        raise NativeUnavailable(f"cannot read $CC: {error}") from None


def compile_cached(
    source: Path,
    build_dir: Path,
    compile_flags: tuple[str, ...],
    link_flags: tuple[str, ...],
    libraries: tuple[str, ...] = (),
    key_extra: bytes = b"",
    headers: tuple[Path, ...] = (),
) -> Path:
    """The shared library built from `source` into `build_dir` (compiled once: later calls find
    it), named `<source stem>-<hash>.so`. `headers`: the files `source` includes (beside it),
    hashed with it, so an edit of one builds afresh too."""
    command = compiler()
    if shutil.which(command[0]) is None:
        raise NativeUnavailable(f"no C compiler ({command[0]!r} not found)")
    extra = tuple(os.environ.get("TANDEM_NATIVE_CFLAGS", "").split())
    compile_flags, link_flags = (*compile_flags, *extra), (*link_flags, *extra)
    flags = " ".join((*command, *compile_flags, *link_flags, *libraries)).encode()
    texts = [source.read_bytes(), *(header.read_bytes() for header in headers)]
    key = hashlib.sha256(b"\0".join([*texts, flags, key_extra])).hexdigest()[:16]
    library = build_dir / f"{source.stem}-{key}.so"
    if not _is_sealed(library):
        _compile(command, source, library, compile_flags, link_flags, libraries)
    return library


# What `_seal` appends: this tag, then the SHA-256 of every byte before it. The dynamic loader maps
# a library by its headers' offsets and never reads bytes past them, so the seal changes nothing.
_SEAL_TAG = b"tandem-native-build-sha256:"
_SEAL_LENGTH = len(_SEAL_TAG) + hashlib.sha256().digest_size


def _seal(library: Path) -> None:
    body = library.read_bytes()
    with library.open("ab") as file:
        file.write(_SEAL_TAG + hashlib.sha256(body).digest())


def _is_sealed(library: Path) -> bool:
    """Whether `library` is a whole build: present, readable, and ending with its seal."""
    try:
        data = library.read_bytes()
    except OSError:
        return False
    body, seal = data[:-_SEAL_LENGTH], data[-_SEAL_LENGTH:]
    return len(data) > _SEAL_LENGTH and seal == _SEAL_TAG + hashlib.sha256(body).digest()


def _compile(
    command: list[str],
    source: Path,
    library: Path,
    compile_flags: tuple[str, ...],
    link_flags: tuple[str, ...],
    libraries: tuple[str, ...],
) -> None:
    # A directory of its own per build, not names made of the process id: the compose file's
    # containers all run tandem as process 1 and share the cache volume. A cache directory that
    # cannot be written is a failed build like any other: the callers keep their Python path.
    try:
        library.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{library.stem}-", dir=library.parent))
    except OSError as error:
        raise NativeUnavailable(f"cannot write the build into {library.parent}: {error}") from None
    partial, obj = staging / library.name, staging / f"{source.stem}.o"
    try:
        _run([*command, *compile_flags, "-c", str(source), "-o", str(obj)])
        _run([*command, *link_flags, str(obj), "-o", str(partial), *libraries])
        try:
            _seal(partial)
            os.replace(partial, library)
        except OSError as error:
            raise NativeUnavailable(f"cannot write {library}: {error}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _run(command: list[str]) -> None:
    run_build_tool(
        command, label=" ".join(command), error=NativeUnavailable, timeout_s=COMPILE_TIMEOUT_S
    )


def run_build_tool(
    command: list[str],
    *,
    label: str,
    error: type[Exception],
    timeout_s: float,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> None:
    """Runs a build tool (a C compiler, mypyc) to its end. A failure to start, a timeout or a
    non-zero exit raises `error` naming the tool (`label`) and what went wrong: the last
    `file:line: error:` lines (what compilers and mypy print), else the output's last lines."""
    try:
        result = subprocess.run(
            command,
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as failure:
        raise error(f"{label} failed: {failure}") from None
    if result.returncode != 0:
        lines = (result.stdout + result.stderr).strip().splitlines()
        errors = [line for line in lines if ": error:" in line] or lines
        raise error(f"{label} failed: {' / '.join(errors[-DIAGNOSTIC_LINES:])}")


CPUINFO = Path("/proc/cpuinfo")
# The fields of the first CPU in /proc/cpuinfo that say what `-march=native` compiles for: x86's
# `flags`; ARM's `Features` and its core (`CPU implementer`, `CPU part`), from which GCC picks
# the architecture (ARM has no `flags`: every ARM CPU shared one key).
_CPU_FEATURE_FIELDS = ("flags", "Features", "CPU implementer", "CPU part")


def cpu_flags(cpuinfo: Path = CPUINFO) -> bytes:
    """The CPU's feature flags (what `-march=native` compiles for), as Linux reports them."""
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return b"unknown"
    found: dict[str, str] = {}
    for line in lines:
        field = line.split(":", 1)[0].strip()
        if field in _CPU_FEATURE_FIELDS:
            found.setdefault(field, line)
    return "\n".join(found.values()).encode() or b"unknown"


def load_extension(
    source: Path, module_name: str, build_dir: Path, headers: tuple[Path, ...] = ()
) -> ModuleType:
    """A CPython extension module (its `PyInit_<module_name>`) built from `source` (which
    includes `headers`) for the running Python, loaded (not imported into `sys.modules`: each
    caller holds its module)."""
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        raise NativeUnavailable(f"no Python headers ({include}/Python.h not found)")
    abi = f"{sysconfig.get_config_var('EXT_SUFFIX')} {include}".encode()
    library = compile_cached(
        source,
        build_dir,
        compile_flags=("-O2", "-fPIC", "-Wall", "-Werror", f"-I{include}"),
        link_flags=("-shared",),
        key_extra=abi,
        headers=headers,
    )
    loader = importlib.machinery.ExtensionFileLoader(module_name, str(library))
    spec = importlib.util.spec_from_file_location(module_name, library, loader=loader)
    if spec is None:
        raise NativeUnavailable(f"cannot load {library}")
    try:
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except ImportError as error:
        raise NativeUnavailable(f"cannot load {library}: {error}") from None
    return module
