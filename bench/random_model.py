"""A random Llama saved as a Hugging Face folder (no download), for the benches that measure
the engine's machinery rather than a model: token `i` is the word `<i>`, so prompts are
token ids and any id decodes."""

import os
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp, as kvscope/__init__.py asks

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast


def save_random_llama(folder: Path, *, vocab_size: int, hidden_size: int,
                      intermediate_size: int, num_layers: int, num_heads: int,
                      num_kv_heads: int, max_positions: int) -> Path:
    """No BOS or EOS token: generation runs to max_tokens."""
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, max_position_embeddings=max_positions,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)).save_pretrained(folder)
    core = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab_size)}, unk_token="<0>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core).save_pretrained(folder)
    return folder
