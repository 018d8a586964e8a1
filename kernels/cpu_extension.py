"""Builds and loads the C++ CPU kernels (kernels/csrc) on first use.

The build is cached under <kvscope cache dir (cache.py)>/cpu_kernels/<key>, the key hashing
the source, the torch version, the compiler, its flags and the CPU's instruction-set flags:
the code is compiled with -march=native, so a cached build must never run on a CPU it was
not built for (an AVX2-only machine gets its own AVX2 build). Loading registers
the torch.ops.kvscope ops (attention, KV store and the fused forward ops).

KVSCOPE_CPU_KERNELS_TARGET builds for an older class of CPU instead of this one (TARGETS):
an AVX-512 CPU runs AVX2 and plain x86-64 code too, so the tests build those beside the
native build and run the kernels' other paths here (tests/test_cpu_paths.py).
"""

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import threading
import time
from pathlib import Path

import torch

from kvscope.kernels.cache import cache_dir

logger = logging.getLogger(__name__)
CSRC = Path(__file__).resolve().parent / "csrc"
NAME = "kvscope_cpu_kernels"
TARGET_ENV = "KVSCOPE_CPU_KERNELS_TARGET"


@dataclasses.dataclass(frozen=True)
class Target:
    """A class of CPU the kernels have paths for: the -march a build for it takes, and the
    /proc/cpuinfo flags of the instruction sets that build uses (a CPU needs them all)."""

    march: str
    flags: frozenset[str]


# native: this CPU's every instruction (AVX-512, its BF16 and VNNI, AMX where present).
# avx2: the AVX2 + FMA paths (Zen 2/3, Haswell on; the k-quants' AVX2 int8 dots).
# portable: x86-64's SSE2 baseline, where vec.hpp's vectors lower to scalars.
TARGETS = {
    "native": Target("native", frozenset()),
    "avx2": Target("haswell", frozenset({"sse2", "avx", "avx2", "fma", "f16c", "bmi2"})),
    "portable": Target("x86-64", frozenset({"sse2"})),
}
# A first build takes minutes and cpp_extension is silent meanwhile (its verbose mode prints
# every compiler command instead), so the build says how far it is this often.
PROGRESS_EVERY_S = 10.0


def cpu_flags() -> str:
    """The instruction-set flags of this CPU (/proc/cpuinfo), or the machine name."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.machine()


def target_name() -> str:
    """The build's target, from KVSCOPE_CPU_KERNELS_TARGET (unset: native).

    Raises ValueError for a name TARGETS lacks."""
    name = os.environ.get(TARGET_ENV, "").strip().lower() or "native"
    if name not in TARGETS:
        raise ValueError(f"{TARGET_ENV}={name!r} must be one of {', '.join(TARGETS)}")
    return name


def build_flags() -> frozenset[str]:
    """The /proc/cpuinfo flags of the instruction sets the build uses: this CPU's for a
    native build, the target's for another."""
    name = target_name()
    return frozenset(cpu_flags().split()) if name == "native" else TARGETS[name].flags


def runs_here(name: str) -> bool:
    """Whether this CPU runs a build for the target (it has every flag the target uses)."""
    return name == "native" or (platform.machine() in ("x86_64", "AMD64")
                                and TARGETS[name].flags <= set(cpu_flags().split()))


def cflags() -> list[str]:
    return ["-O3", f"-march={TARGETS[target_name()].march}", "-fopenmp"]


def sources() -> list[Path]:
    """The files the build compiles (under CSRC)."""
    return sorted(CSRC.rglob("*.cpp"))


def inputs() -> list[Path]:
    """Every file the build reads (the sources and the headers they include)."""
    return sorted(path for path in CSRC.rglob("*") if path.suffix in {".cpp", ".h", ".hpp"})


def build_key() -> str:
    digest = hashlib.sha256()
    # Each file's path inside csrc as well as its text: moving a file changes the build.
    parts = [part for path in inputs()
             for part in (str(path.relative_to(CSRC)).encode(), path.read_bytes())]
    # The folder too: ninja's build file names the sources by absolute path, so two
    # checkouts sharing one build folder would each rebuild it whole for the other.
    for part in (*parts, str(CSRC).encode(), torch.__version__.encode(), " ".join(cflags()).encode(),
                 cpu_flags().encode(), (shutil.which("c++") or "").encode()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def ninja_on_path() -> bool:
    """cpp_extension runs `ninja` from PATH; the ninja wheel's copy counts too."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return False
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    return shutil.which("ninja") is not None


def compiler_available() -> bool:
    return shutil.which(os.environ.get("CXX", "c++")) is not None and ninja_on_path()


@contextlib.contextmanager
def build_lock(build_dir: Path):
    """Holds an OS lock on the build folder while this process builds or loads from it.

    torch's own lock is a file that exists while a build runs: a process killed mid-build
    (Ctrl-C during the first start's compile) leaves it behind, and every later start then
    waited for it forever. An OS lock ends with its process, so its holder knows that any
    such file left over is stale and removes it.
    """
    with open(build_dir / "kvscope.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        yield


@contextlib.contextmanager
def progress_reports(build_dir: Path):
    """Logs, every PROGRESS_EVERY_S until the block ends, how many sources have been
    compiled into build_dir (one object file each; an interrupted build's objects count,
    as ninja keeps them)."""
    started = time.perf_counter()
    finished = threading.Event()

    def report() -> None:
        while not finished.wait(PROGRESS_EVERY_S):
            compiled = len(list(build_dir.glob("*.o")))
            logger.info("C++ CPU kernels: %.0f s, %d of %d sources compiled",
                        time.perf_counter() - started, compiled, len(sources()))

    reporter = threading.Thread(target=report, name="kvscope-kernel-build-progress", daemon=True)
    reporter.start()
    try:
        yield
    finally:
        finished.set()
        reporter.join()


@functools.cache
def load() -> None:
    """Compile (first use on this CPU) or load the cached build; registers the ops.

    Raises RuntimeError when no compiler is available or the build fails, and ValueError for
    a KVSCOPE_CPU_KERNELS_TARGET this CPU cannot run.
    """
    target = target_name()
    if not runs_here(target):
        raise ValueError(f"{TARGET_ENV}={target}: this CPU lacks "
                         f"{' '.join(sorted(TARGETS[target].flags - set(cpu_flags().split())))}")
    if not compiler_available():
        raise RuntimeError("the CPU attention kernels need a C++ compiler (c++) and ninja")
    from torch.utils import cpp_extension

    build_dir = cache_dir() / "cpu_kernels" / build_key()
    build_dir.mkdir(parents=True, exist_ok=True)
    compiling = not (build_dir / f"{NAME}.so").is_file()
    if compiling:
        logger.info("compiling the C++ CPU kernels for %s (once; a few minutes) in %s",
                    "this CPU" if target == "native" else f"-march={TARGETS[target].march}",
                    build_dir)
    started = time.perf_counter()
    reports = progress_reports(build_dir) if compiling else contextlib.nullcontext()
    with reports, build_lock(build_dir):
        cpp_extension.load(
            name=NAME, sources=[str(source) for source in sources()],
            build_directory=str(build_dir), extra_include_paths=[str(CSRC)],
            extra_cflags=cflags(),
            extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    logger.info("CPU attention kernels ready in %.1f s (%s)", time.perf_counter() - started,
                build_dir)


if __name__ == "__main__":  # `make install` builds the kernels ahead of the first start
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    load()
