"""A tiny model that answers in gpt-oss's harmony format, for the server's harmony parsers.

Its tokenizer holds harmony's special tokens and one token per printable character; its
chat template renders conversations as gpt-oss's does (the system and developer headers,
tools as a `functions` namespace, calls and results on the commentary channel, the prompt
ending in `<|start|>assistant`). Its weights spell given answers: an OPT model whose layers
add nothing, so each next token is read from the learned position embedding alone, which
points at the answer's token for that position. An answer `ANSWER` to a prompt of L tokens
is written into positions L - 1 onwards, so the same model answers each scripted prompt
with its own script, greedily, through the real engine.
"""

import string
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    OPTConfig,
    OPTForCausalLM,
    PreTrainedTokenizerFast,
)

HARMONY_SPECIALS = ["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                    "<|constrain|>", "<|return|>", "<|call|>"]

HARMONY_TEMPLATE = (
    "{%- set last_call = namespace(name=none) -%}"
    "<|start|>system<|message|>You are a tiny test model.\nReasoning: "
    "{{ reasoning_effort | default('medium') }}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every "
    "message.{% if tools %}\nCalls to these tools must go to the commentary channel: "
    "'functions'.{% endif %}<|end|>"
    "{%- set instructions = messages[0].content if messages[0].role in ('system', "
    "'developer') else none -%}"
    "{%- if instructions or tools -%}<|start|>developer<|message|>"
    "{%- if instructions %}# Instructions\n\n{{ instructions }}\n\n{% endif -%}"
    "{%- if tools %}# Tools\n\n## functions\n\nnamespace functions {\n\n"
    "{%- for tool in tools %}\n// {{ tool.function.description }}\n"
    "type {{ tool.function.name }} = (_: {{ tool.function.parameters | tojson }}) => any;\n"
    "{% endfor %}\n} // namespace functions{% endif %}<|end|>{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' -%}<|start|>user<|message|>{{ message.content }}<|end|>"
    "{%- elif message.role == 'assistant' and message.tool_calls -%}"
    "{%- set call = message.tool_calls[0].function -%}"
    "<|start|>assistant to=functions.{{ call.name }}<|channel|>commentary json<|message|>"
    "{{ call.arguments | tojson }}<|call|>{%- set last_call.name = call.name -%}"
    "{%- elif message.role == 'assistant' -%}"
    "<|start|>assistant<|channel|>final<|message|>{{ message.content }}<|end|>"
    "{%- elif message.role == 'tool' -%}"
    "<|start|>functions.{{ last_call.name }} to=assistant<|channel|>commentary<|message|>"
    "{{ message.content | tojson }}<|end|>"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt %}<|start|>assistant{% endif -%}"
)

# Larger than the vocabulary: every token's embedding is orthogonal to every other's.
HIDDEN_SIZE = 128
MAX_POSITIONS = 2048
POSITION_OFFSET = 2  # OPT's learned positions start at index 2
# How far a position's embedding outweighs the token's own: the answer's token always wins.
POSITION_WEIGHT = 30.0


def save_harmony_tokenizer(folder: Path):
    """The tokenizer (saved into `folder`, loaded back as the engine loads it)."""
    characters = sorted(set(string.printable) - set("\r\x0b\x0c"))
    vocab = {token: index for index, token in enumerate(HARMONY_SPECIALS + characters)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|endoftext|>"))
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|return|>", pad_token="<|endoftext|>",
        unk_token="<|endoftext|>", additional_special_tokens=HARMONY_SPECIALS[1:])
    tokenizer.chat_template = HARMONY_TEMPLATE
    tokenizer.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def save_scripted_model(folder: Path, tokenizer, scripts: list[tuple[str, str]]) -> Path:
    """Beside the tokenizer: a model whose greedy answer to each scripted prompt (the
    rendered text) is its harmony text, which ends in `<|return|>` or `<|call|>` (both EOS)."""
    vocab_size = len(tokenizer)
    assert vocab_size <= HIDDEN_SIZE
    torch.manual_seed(0)
    config = OPTConfig(
        vocab_size=vocab_size, hidden_size=HIDDEN_SIZE, word_embed_proj_dim=HIDDEN_SIZE,
        ffn_dim=2 * HIDDEN_SIZE, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=MAX_POSITIONS, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model = OPTForCausalLM(config).eval()
    decoder = model.model.decoder
    with torch.no_grad():
        token_rows = torch.linalg.qr(torch.randn(HIDDEN_SIZE, HIDDEN_SIZE))[0][:vocab_size]
        decoder.embed_tokens.weight.copy_(token_rows)  # tied: the output projection too
        decoder.embed_positions.weight.zero_()
        for layer in decoder.layers:  # each layer adds nothing to the residual stream
            for linear in (layer.self_attn.out_proj, layer.fc2):
                linear.weight.zero_()
                linear.bias.zero_()
        written: set[int] = set()
        for prompt, answer in scripts:
            prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
            answer_ids = tokenizer.encode(answer, add_special_tokens=False)
            positions = range(prompt_len - 1, prompt_len - 1 + len(answer_ids))
            assert written.isdisjoint(positions), "two scripts share positions"
            written.update(positions)
            for position, token in zip(positions, answer_ids, strict=True):
                decoder.embed_positions.weight[position + POSITION_OFFSET] = (
                    POSITION_WEIGHT * token_rows[token])
    model.save_pretrained(folder)
    stops = [tokenizer.convert_tokens_to_ids(token) for token in ("<|return|>", "<|call|>")]
    GenerationConfig(eos_token_id=stops, pad_token_id=tokenizer.pad_token_id).save_pretrained(
        folder)
    return folder
