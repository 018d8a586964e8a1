"""The CPU runtime around the kernels: big tensors on huge pages, activations kept in glibc's
heap, passive OpenMP workers."""

import platform
from pathlib import Path

import pytest
import torch

from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.engine_core import EngineCore
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.worker import huge_pages

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def mapping_field_bytes(address: int, field: str = "AnonHugePages:") -> int:
    """A /proc/self/smaps field (in kB there) of the mapping that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:
            start, end = (int(part, 16) for part in fields[0].split("-"))
            inside = start <= address < end
        elif inside and fields[0] == field:
            return int(fields[1]) * 1024
    return 0


def test_tensors_are_zeroed_and_big_ones_aligned():
    big = huge_pages.empty((3, 1 << 20), torch.bfloat16)  # 6 MiB
    assert big.shape == (3, 1 << 20) and big.dtype == torch.bfloat16
    assert big.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    assert big.is_contiguous() and not big.any()
    small = huge_pages.empty((10,), torch.float32)
    assert small.shape == (10,) and not small.any()


def test_their_pages_are_resident_before_the_first_write():
    """A KV cache's first writes must not fault its pages in one by one mid-serving."""
    tensor = huge_pages.empty((8 << 20,), torch.uint8)
    assert mapping_field_bytes(tensor.data_ptr(), "Rss:") >= tensor.numel()


def test_a_pool_populated_in_the_background_is_resident_once_waited_for():
    """A KV pool's pages are faulted in by a thread, so start-up does not wait for them;
    wait_resident() returns once they are resident, the zeros kept."""
    tensor = huge_pages.empty((8 << 20,), torch.uint8, background=True)
    huge_pages.wait_resident()
    assert mapping_field_bytes(tensor.data_ptr(), "Rss:") >= tensor.numel()
    assert not tensor.any()


def test_the_engine_starts_before_its_pool_is_resident_and_steps_after(tiny_model):
    """EngineCore returns with its pool still being populated in the background, and its
    first step waits for it, so no forward pays the pool's page faults."""
    huge_pages.wait_resident()
    engine = EngineCore(EngineConfig(model=str(tiny_model("llama").path), device="cpu",
                                     dtype="float32", device_memory_gb=0.05))
    assert engine.runner.kv_cache.numel() * engine.runner.kv_cache.element_size() >= (
        huge_pages.HUGE_PAGE_BYTES)
    assert len(huge_pages._populating) == 1
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=2))
    engine.step()
    assert not huge_pages._populating
    cache = engine.runner.kv_cache
    assert mapping_field_bytes(cache.data_ptr(), "Rss:") >= cache.numel() * cache.element_size()


@pytest.mark.skipif(not THP_SETTING.exists() or "[never]" in THP_SETTING.read_text(),
                    reason="transparent huge pages are off on this machine")
def test_the_kernel_backs_them_with_huge_pages():
    tensor = huge_pages.empty((8 << 20,), torch.uint8)
    assert mapping_field_bytes(tensor.data_ptr()) >= huge_pages.HUGE_PAGE_BYTES


def test_moving_a_module_keeps_values_and_ties():
    embedding = torch.nn.Embedding(4096, 256)  # 4 MiB
    head = torch.nn.Linear(256, 4096, bias=False)
    head.weight = embedding.weight
    model = torch.nn.ModuleDict({"embed": embedding, "head": head, "norm": torch.nn.LayerNorm(256)})
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    huge_pages.move_module(model)
    assert embedding.weight.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    assert head.weight is embedding.weight
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name])


def test_small_tensors_share_one_huge_page_region():
    layers = torch.nn.Sequential(*[torch.nn.Linear(256, 512) for _ in range(8)])  # 512 KiB each
    before = [p.detach().clone() for p in layers.parameters()]
    huge_pages.move_module(layers)
    weights = [layer.weight for layer in layers]
    assert weights[0].data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0  # the region's start
    storage = weights[0].untyped_storage().data_ptr()
    assert all(w.untyped_storage().data_ptr() == storage for w in weights)
    assert all(p.data_ptr() % 64 == 0 for p in layers.parameters())
    for p, value in zip(layers.parameters(), before):
        assert torch.equal(p, value)


def test_engine_asks_for_passive_openmp_workers_before_torch_loads():
    """kvscope/__init__.py: spinning OpenMP workers take the cores the kernels' pool needs."""
    import os
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
    first = subprocess.run([sys.executable, "-c",
                            "import kvscope, os; print(os.environ['OMP_WAIT_POLICY'])"],
                           env=env, capture_output=True, text=True, check=True)
    assert first.stdout.strip() == "PASSIVE" and "OMP_WAIT_POLICY" not in first.stderr
    late = subprocess.run([sys.executable, "-c", "import torch, kvscope"],
                          env=env, capture_output=True, text=True, check=True)
    assert "OMP_WAIT_POLICY=PASSIVE" in late.stderr
    chosen = subprocess.run([sys.executable, "-c", "import torch, kvscope, os; "
                             "print(os.environ['OMP_WAIT_POLICY'])"],
                            env={**env, "OMP_WAIT_POLICY": "ACTIVE"}, capture_output=True,
                            text=True, check=True)
    assert chosen.stdout.strip() == "ACTIVE" and "OMP_WAIT_POLICY" not in chosen.stderr


# In a fresh process (glibc's thresholds are process-wide): the page faults of making and
# filling a 48 MiB tensor, on average over four once twelve were made and freed, before and
# after the call. The heap needs several to settle: torch asks posix_memalign, whose request
# is a few bytes more than the block a freed tensor leaves, so until freed blocks merge each
# tensor extends the heap (nine tensors on an EPYC host, three on a Xeon); a prefill makes
# one per layer, so the engine is past that within its first step.
REFAULTS = """
import resource, torch
from kvscope.engine.worker import cpu_allocator

def refaults():
    for _ in range(12):
        torch.empty(48 << 20, dtype=torch.uint8).fill_(1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        torch.empty(48 << 20, dtype=torch.uint8).fill_(1)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 4

# The fewest of three rounds: under a busy full suite one round of reused blocks once
# faulted a quarter of their pages in again (cause not found: no swap, no NUMA balancing),
# while an allocator that maps each block afresh faults all of them in every round.
default = min(refaults() for _ in range(3))
print(default, cpu_allocator.reuse_large_blocks(), min(refaults() for _ in range(3)))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_large_activations_reuse_the_heap_after_the_engine_asks():
    """engine/worker/cpu_allocator.py: by default glibc maps (and the kernel faults in and
    zeroes) a fresh 48 MiB block each time; asked, it reuses the freed one."""
    import subprocess
    import sys

    default, reused, after = subprocess.run([sys.executable, "-c", REFAULTS], capture_output=True,
                                            text=True, check=True).stdout.split()
    pages = (48 << 20) // 4096
    # Fresh small pages, unless the kernel backs every mapping with huge ones.
    always_huge = THP_SETTING.exists() and "[always]" in THP_SETTING.read_text()
    assert always_huge or int(default) > pages // 2
    assert reused == "True" and int(after) < pages // 20


# Run before a bench script: at the moment torch is first imported (and loads libgomp, which
# reads its wait policy then), print the policy and stop, so the rest of the script's imports
# are not paid for.
STOP_AT_TORCH = """
import importlib.abc, os, sys
class StopAtTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            print("torch loads with OMP_WAIT_POLICY=" + os.environ.get("OMP_WAIT_POLICY", "unset"))
            sys.stdout.flush()
            os._exit(0)
sys.meta_path.insert(0, StopAtTorch())
"""


def test_the_benches_load_torch_with_passive_openmp_workers():
    """A bench run as documented (`python bench/throughput.py ...`, no OMP_WAIT_POLICY set)
    must not load torch before the policy is set, or it measures spinning workers."""
    import os
    import subprocess
    import sys

    env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
    bench = Path(__file__).resolve().parent.parent / "bench"
    scripts = [path for path in sorted(bench.glob("*.py"))
               if "import torch" in path.read_text() and "kvscope" in path.read_text()]
    assert any(path.name == "throughput.py" for path in scripts)
    for path in scripts:
        loaded = subprocess.run(
            [sys.executable, "-c", STOP_AT_TORCH + f"sys.path.insert(0, {str(bench)!r})\n"
             f"import runpy; runpy.run_path({str(path)!r})"],
            env=env, capture_output=True, text=True, cwd=bench.parent)
        assert loaded.returncode == 0, (path.name, loaded.stderr)
        # A script whose top level does not import torch never reaches the line.
        assert loaded.stdout in ("", "torch loads with OMP_WAIT_POLICY=PASSIVE\n"), path.name


# The CPU classes the kernels have a path for that the tests do not build and run here
# (tests/test_cpu_paths.py runs the AVX2 and plain x86-64 builds): AVX-512 with VNNI and
# without bf16 (Ice Lake), AVX512-BF16 with AMX (Sapphire Rapids). The build is
# -march=native, so a machine compiles only its own class's branches; a branch broken for
# another class would show only on such a machine.
@pytest.mark.parametrize("march", ["icelake-server", "sapphirerapids"])
def test_the_cpu_kernels_compile_for_every_cpu_class(march):
    import shutil
    import subprocess
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    from kvscope.kernels import cpu_extension

    compiler = shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    includes = [f"-I{path}" for path in (*include_paths(), sysconfig.get_paths()["include"],
                                         str(cpu_extension.CSRC))]
    # The standard torch's extension builds use (torch.utils.cpp_extension).
    compiled = subprocess.run(
        [compiler, "-std=c++20", f"-march={march}", "-fopenmp", "-fsyntax-only", *includes,
         *map(str, cpu_extension.sources())], capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stderr[-3000:]
