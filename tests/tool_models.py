"""A tiny chat model whose template renders tools and tool results (Hermes style, as Qwen's
templates do) and a thinking switch: `enable_thinking` false closes an empty thinking block
in the prompt (as Qwen3's template does), true opens one there (as DeepSeek-R1's and
Qwen3's thinking-only templates do), unset leaves the model to choose."""

import json
from pathlib import Path

from conftest import save_tiny_byte_level_model
from transformers import AutoTokenizer

TOOLS_CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "Call a function as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n"
    "{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and tools and loop.first %}"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{{ message.content }}{% for call in message.tool_calls %}<tool_call>\n"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}\n"
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% elif enable_thinking %}<think>\n{% endif %}{% endif %}"
)

MAX_POSITIONS = 2048


def save_tiny_tools_model(folder: Path) -> Path:
    """The byte-level tiny Llama (grammars can read its vocabulary) with the tools
    template."""
    save_tiny_byte_level_model(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = TOOLS_CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    # Byte-level tokens make a tool list long: room for it (RoPE has no position table).
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = MAX_POSITIONS
    (folder / "config.json").write_text(json.dumps(config))
    return folder
