"""Every path of the C++ CPU kernels runs against the reference, and a failed build fails.

The suite's own kernel tests run the native build (-march=native: on this CPU its AVX-512,
AVX512-BF16 and VNNI paths, AMX where the CPU has it). The kernels also have paths for older
CPUs (AVX2, and plain x86-64 where vec.hpp's vectors lower to scalars), which a native build
never compiles; an AVX-512 CPU runs their code too, so the same kernel tests run here again in a
child pytest over a build for each (kernels/cpu_extension.py TARGETS, cached like the native
build). The run's summary names the builds that ran (tests/conftest.py).
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CPU_PATH_PROPERTY

from kvscope.kernels import REQUIRE_CPU_KERNELS_ENV, cpu_extension, cpu_kernels_required

REPO = Path(__file__).resolve().parents[1]
# The tests of the kernels against their oracles (kernels/reference.py, kernels/torch_ops.py,
# the de-quantized weights) and of the engine on the C++ backend; the Triton ones and the real
# default model's are left to the native run.
KERNEL_TESTS = ("tests/test_kernels.py", "tests/test_forward_ops.py", "tests/test_quantization.py",
                "tests/test_gguf_blocks.py", "tests/test_engine_backends.py",
                "tests/test_recurrent_kernels.py")
# The instruction sets the summary names, as /proc/cpuinfo spells them.
NAMED_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")


def test_the_native_build_runs(cpu_kernel_ops, record_property):
    flags = cpu_extension.build_flags()
    named = [flag for flag in NAMED_FLAGS if flag in flags] or ["none of " + " ".join(NAMED_FLAGS)]
    amx = "AMX ran" if "amx_tile" in flags else "no AMX on this CPU"
    record_property(CPU_PATH_PROPERTY, f"native ({' '.join(named)}; {amx})")
    assert cpu_kernel_ops.backend == "cpu"


@pytest.mark.parametrize("target", [name for name in cpu_extension.TARGETS if name != "native"])
def test_the_kernel_tests_pass_on_a_build_for_an_older_cpu(target, record_property, tmp_path):
    record_property(CPU_PATH_PROPERTY, f"{target} (-march={cpu_extension.TARGETS[target].march})")
    if not cpu_extension.runs_here(target):
        pytest.skip(f"this CPU cannot run a {target} build")
    if not cpu_extension.compiler_available() and not cpu_kernels_required():
        pytest.skip("no C++ compiler")
    env = {**os.environ, cpu_extension.TARGET_ENV: target, REQUIRE_CPU_KERNELS_ENV: "1"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
         f"--basetemp={tmp_path}", "-m", "not slow", "-k", "not triton", *KERNEL_TESTS],
        cwd=REPO, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert re.search(r"^\d+ passed", run.stdout.splitlines()[-1]), run.stdout[-3000:]


# Run in a fresh process, as an engine's start is: the C++ kernels built from a copy of their
# sources (argv[1]) into a cache of their own (KVSCOPE_CACHE_DIR), and the backend chosen.
BUILD_FROM_COPY = """
import sys
from pathlib import Path
from kvscope.kernels import cpu_extension, select_ops
cpu_extension.CSRC = Path(sys.argv[1])
print(select_ops("cpu").backend)
"""
# A header the broken copy includes and nobody ships: the compiler stops at the include, so
# the failed build takes a second, not the minutes of a whole one.
MISSING_HEADER = "kvscope_deliberately_missing.h"


@pytest.fixture(scope="module")
def broken_sources(tmp_path_factory) -> Path:
    csrc = tmp_path_factory.mktemp("broken") / "csrc"
    shutil.copytree(cpu_extension.CSRC, csrc)
    first = csrc / cpu_extension.sources()[0].relative_to(cpu_extension.CSRC)
    first.write_text(f'#include "{MISSING_HEADER}"\n' + first.read_text())
    return csrc


def build_from(csrc: Path, cache: Path, required: bool) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != REQUIRE_CPU_KERNELS_ENV}
    env.update({"KVSCOPE_CACHE_DIR": str(cache), "MAX_JOBS": "1"})  # ninja -j1: the first error
    if required:
        env[REQUIRE_CPU_KERNELS_ENV] = "1"
    return subprocess.run([sys.executable, "-c", BUILD_FROM_COPY, str(csrc)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(not cpu_extension.compiler_available(), reason="no C++ compiler")
def test_a_failed_build_is_an_error_naming_the_compiler_error_when_required(broken_sources,
                                                                             tmp_path):
    failed = build_from(broken_sources, tmp_path, required=True)
    assert failed.returncode != 0 and failed.stdout == ""
    assert f"{REQUIRE_CPU_KERNELS_ENV} is set and the C++ CPU kernels could not be built" in (
        failed.stderr)
    assert f"{MISSING_HEADER}: No such file or directory" in failed.stderr


@pytest.mark.skipif(not cpu_extension.compiler_available(), reason="no C++ compiler")
def test_a_failed_build_falls_back_to_torch_with_a_warning_otherwise(broken_sources, tmp_path):
    fell_back = build_from(broken_sources, tmp_path, required=False)
    assert fell_back.returncode == 0, fell_back.stderr[-3000:]
    assert fell_back.stdout.strip() == "torch"
    assert "C++ CPU kernels unavailable" in fell_back.stderr and MISSING_HEADER in fell_back.stderr


def test_the_test_targets_and_ci_require_the_cpu_kernels():
    """`make test` (which .ci/run runs) sets the switch, so a failed build fails CI."""
    makefile = (REPO / "Makefile").read_text()
    assert re.search(rf"^PYTEST := {REQUIRE_CPU_KERNELS_ENV}=1 ", makefile, re.MULTILINE)
    assert f"export {REQUIRE_CPU_KERNELS_ENV}=1" in (REPO / ".ci" / "run").read_text()


def test_an_unknown_build_target_is_refused(monkeypatch):
    monkeypatch.setenv(cpu_extension.TARGET_ENV, "avx1024")
    with pytest.raises(ValueError, match=r"KVSCOPE_CPU_KERNELS_TARGET='avx1024' must be one of "
                                         r"native, avx2, portable"):
        cpu_extension.cflags()
