"""Builds and loads the C++ CPU kernels (kernels/csrc) on first use.

The build is cached under <kvscope cache dir (cache.py)>/cpu_kernels/<key>, the key hashing
the source, the torch version, the compiler and the CPU's instruction-set flags: the code is
compiled with -march=native, so a cached build must never run on a CPU it was not built
for (an AVX2-only machine gets its own AVX2 build). Loading registers
the torch.ops.kvscope ops (attention, KV store and the fused forward ops).
"""

import contextlib
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
SOURCES = sorted(CSRC.rglob("*.cpp"))
# Every file the build reads (sources and the headers they include), for the build key.
INPUTS = sorted(path for path in CSRC.rglob("*") if path.suffix in {".cpp", ".h", ".hpp"})
NAME = "kvscope_cpu_kernels"
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
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


def build_key() -> str:
    digest = hashlib.sha256()
    # Each file's path inside csrc as well as its text: moving a file changes the build.
    parts = [part for path in INPUTS
             for part in (str(path.relative_to(CSRC)).encode(), path.read_bytes())]
    # The folder too: ninja's build file names the sources by absolute path, so two
    # checkouts sharing one build folder would each rebuild it whole for the other.
    for part in (*parts, str(CSRC).encode(), torch.__version__.encode(), " ".join(CFLAGS).encode(),
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
                        time.perf_counter() - started, compiled, len(SOURCES))

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

    Raises RuntimeError when no compiler is available or the build fails.
    """
    if not compiler_available():
        raise RuntimeError("the CPU attention kernels need a C++ compiler (c++) and ninja")
    from torch.utils import cpp_extension

    build_dir = cache_dir() / "cpu_kernels" / build_key()
    build_dir.mkdir(parents=True, exist_ok=True)
    compiling = not (build_dir / f"{NAME}.so").is_file()
    if compiling:
        logger.info("compiling the C++ CPU kernels for this CPU (once; a few minutes) in %s",
                    build_dir)
    started = time.perf_counter()
    reports = progress_reports(build_dir) if compiling else contextlib.nullcontext()
    with reports, build_lock(build_dir):
        cpp_extension.load(
            name=NAME, sources=[str(source) for source in SOURCES],
            build_directory=str(build_dir), extra_include_paths=[str(CSRC)],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    logger.info("CPU attention kernels ready in %.1f s (%s)", time.perf_counter() - started,
                build_dir)


if __name__ == "__main__":  # `make install` builds the kernels ahead of the first start
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    load()
