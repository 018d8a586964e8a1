"""Random models saved as Hugging Face folders (no download), for the benches that measure
the engine rather than a model's answers (values do not change the work): token `i` is the
word `<i>`, so prompts are token ids and any id decodes."""

import os
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp, as kvscope/__init__.py asks

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, PreTrainedTokenizerFast


def save_random_model(folder: Path, config: PretrainedConfig,
                      dtype: torch.dtype = torch.float32) -> Path:
    """transformers' random initialisation of `config`, saved in `dtype` with a word-level
    tokenizer. The config should have no BOS or EOS token: generation runs to max_tokens."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(folder)
    vocab = {f"<{i}>": i for i in range(config.vocab_size)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core).save_pretrained(folder)
    return folder


def save_random_llama(folder: Path, *, vocab_size: int, hidden_size: int,
                      intermediate_size: int, num_layers: int, num_heads: int,
                      num_kv_heads: int, max_positions: int) -> Path:
    return save_random_model(folder, LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, max_position_embeddings=max_positions,
        bos_token_id=None, eos_token_id=None, pad_token_id=None))
