"""engine.worker.memory_bandwidth: the read bandwidths the benches hold the engines against."""

import torch

from kvscope.engine.worker.memory_bandwidth import storage_words, weights_read_bandwidth


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
