"""The engine's big CPU tensors start on 2 MiB boundaries and, where THP is on, get huge pages."""

from pathlib import Path

import pytest
import torch

from engine import huge_pages

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_page_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping that holds `address` (from /proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:
            start, end = (int(part, 16) for part in fields[0].split("-"))
            inside = start <= address < end
        elif inside and fields[0] == "AnonHugePages:":
            return int(fields[1]) * 1024
    return 0


def test_tensors_are_zeroed_and_big_ones_aligned():
    big = huge_pages.empty((3, 1 << 20), torch.bfloat16)  # 6 MiB
    assert big.shape == (3, 1 << 20) and big.dtype == torch.bfloat16
    assert big.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    assert big.is_contiguous() and not big.any()
    small = huge_pages.empty((10,), torch.float32)
    assert small.shape == (10,) and not small.any()


@pytest.mark.skipif(not THP_SETTING.exists() or "[never]" in THP_SETTING.read_text(),
                    reason="transparent huge pages are off on this machine")
def test_the_kernel_backs_them_with_huge_pages():
    tensor = huge_pages.empty((8 << 20,), torch.uint8).fill_(1)  # pages exist once touched
    assert huge_page_bytes_at(tensor.data_ptr()) >= huge_pages.HUGE_PAGE_BYTES


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
