"""engine.worker.memory_bandwidth: the read bandwidths the benches hold the engines against."""

from pathlib import Path

import pytest
import torch

from kvscope.engine.worker import huge_pages
from kvscope.engine.worker.memory_bandwidth import (
    PROBE_FLOOR_BYTES,
    PROBE_LLC_MULTIPLE,
    cache_size_bytes,
    last_level_cache_bytes,
    probe_bytes,
    storage_words,
    weights_read_bandwidth,
)


def test_the_weights_read_bandwidth_reads_each_storage_once_and_whole():
    """Tensors that share a region (the engine's weights do) read the region once, all of
    it; a tensor apart adds its own storage."""
    region = torch.zeros(4096, dtype=torch.uint8)
    first, second = region[:1024].view(torch.bfloat16), region[2048:].view(torch.int32)
    apart = torch.zeros(100, dtype=torch.float32)
    words = storage_words([first, second, apart, first])
    assert sorted(word.numel() * 8 for word in words) == [400, 4096]
    assert {word.data_ptr() for word in words} == {region.data_ptr(), apart.data_ptr()}
    assert weights_read_bandwidth([first, apart], repeats=1) > 0


def write_cache(root: Path, cpu: int, index: int, level: int, kind: str, size: str,
                shared: str) -> None:
    folder = root / f"cpu{cpu}" / "cache" / f"index{index}"
    folder.mkdir(parents=True)
    for name, text in (("level", str(level)), ("type", kind), ("size", size),
                       ("shared_cpu_list", shared)):
        (folder / name).write_text(text + "\n")


def test_the_last_level_cache_counts_each_instance_of_the_highest_level_once(tmp_path):
    """Two L3s (two Zen CCDs, each listed by each of its CPUs) add up; the L2s, the L1s and
    an instruction cache do not count, nor does a CPU whose cache files cannot be read."""
    for cpu in range(4):
        ccd = "0-1" if cpu < 2 else "2-3"
        write_cache(tmp_path, cpu, 0, 1, "Data", "32K", str(cpu))
        write_cache(tmp_path, cpu, 1, 1, "Instruction", "32K", str(cpu))
        write_cache(tmp_path, cpu, 2, 2, "Unified", "1024K", str(cpu))
        write_cache(tmp_path, cpu, 3, 3, "Unified", "32768K", ccd)
    (tmp_path / "cpu4" / "cache" / "index3").mkdir(parents=True)  # no files: skipped
    assert last_level_cache_bytes(tmp_path) == 2 * (32 << 20)
    assert last_level_cache_bytes(tmp_path / "absent") == 0


def test_cache_sizes_read_as_sysfs_writes_them():
    assert cache_size_bytes("32768K\n") == 32 << 20
    assert cache_size_bytes("2M") == 2 << 20
    assert cache_size_bytes("4096") == 4096
    with pytest.raises(ValueError):
        cache_size_bytes("lots")


@pytest.mark.parametrize("llc", [0, 32 << 20, 105 << 20, 3 * (105 << 20) + 12345])
def test_the_probe_reads_at_least_four_last_level_caches_in_whole_huge_pages(llc):
    size = probe_bytes(llc)
    assert size >= PROBE_LLC_MULTIPLE * llc and size >= PROBE_FLOOR_BYTES
    assert size % huge_pages.HUGE_PAGE_BYTES == 0
    assert size - huge_pages.HUGE_PAGE_BYTES < max(PROBE_LLC_MULTIPLE * llc, PROBE_FLOOR_BYTES)
