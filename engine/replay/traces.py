"""Public trace formats as workloads: Mooncake (JSONL), Azure LLM inference (CSV), ShareGPT
(JSON). Each file is read whole and checked before anything is returned, so a bad line
raises a ValueError naming the line and the field and nothing is half-built."""

import csv
import json
import math
import random
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

from kvscope.engine.core.scheduling_policy import PRIORITY_MIN
from kvscope.engine.orchestrator.chat import render_chat
from kvscope.engine.replay.workload import ReplayRequest, Workload

# Mooncake's hash ids each name one block of this many prompt tokens.
MOONCAKE_BLOCK_TOKENS = 512
FORMATS = ("mooncake", "azure", "sharegpt")
SUFFIX_FORMATS = {".jsonl": "mooncake", ".csv": "azure", ".json": "sharegpt"}


class TraceError(ValueError):
    """A bad record: names the file, the line (or entry) and the field."""

    def __init__(self, path: Path, line: int, field: str, problem: str) -> None:
        super().__init__(f"{path}: line {line}: field {field!r} {problem}")


def trace_format(path: Path, fmt: str | None = None) -> str:
    if fmt is not None:
        if fmt not in FORMATS:
            raise ValueError(f"format={fmt!r} must be one of {list(FORMATS)}")
        return fmt
    try:
        return SUFFIX_FORMATS[path.suffix.lower()]
    except KeyError:
        raise ValueError(f"{path}: cannot tell the trace format from the suffix "
                         f"{path.suffix!r}; give format= one of {list(FORMATS)}") from None


def load_trace(path: str | Path, tokenizer, fmt: str | None = None, rate: float | None = None,
               seed: int = 0) -> Workload:
    """The trace at `path` as a workload. Synthetic prompts draw token ids from the
    tokenizer's ordinary vocabulary; `rate` (requests/s, Poisson) times ShareGPT's
    arrivals, which the format does not record (None: all at once, as vLLM's benchmark)."""
    path = Path(path)
    fmt = trace_format(path, fmt)
    if fmt == "sharegpt":
        return load_sharegpt(path, tokenizer, rate, seed)
    tokens = SyntheticTokens(tokenizer, seed)
    return (load_mooncake if fmt == "mooncake" else load_azure)(path, tokens)


class SyntheticTokens:
    """Deterministic token blocks for traces that record lengths, not text: the same key
    always gives the same tokens, so prompts that share a key share those tokens."""

    def __init__(self, tokenizer, seed: int) -> None:
        special = set(tokenizer.all_special_ids)
        size = len(tokenizer)
        # Skip the low ids where tokenizers keep their special and byte tokens.
        self.vocab = [t for t in range(size // 16, size) if t not in special]
        self.seed = seed
        self._blocks: dict[object, list[int]] = {}

    def block(self, key: object, length: int) -> list[int]:
        tokens = self._blocks.get(key)
        if tokens is None or len(tokens) < length:
            rng = random.Random(f"{self.seed}:{key}")
            tokens = self._blocks[key] = rng.choices(self.vocab, k=length)
        return tokens[:length]


def _field(path: Path, line: int, record: dict, name: str, kind: type, minimum: float):
    if name not in record:
        raise TraceError(path, line, name, "is missing")
    value = record[name]
    if isinstance(value, str) and kind is not str:
        try:
            value = kind(value)
        except ValueError:
            raise TraceError(path, line, name, f"must be a number (got {value!r})") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            kind is int and value != int(value)) or not math.isfinite(value):
        raise TraceError(path, line, name, f"must be {'an integer' if kind is int else 'a number'}"
                         f" (got {value!r})")
    if value < minimum:
        raise TraceError(path, line, name, f"must be >= {minimum} (got {value!r})")
    return kind(value)


# ---- Mooncake ------------------------------------------------------------------------------
def load_mooncake(path: Path, tokens: SyntheticTokens) -> Workload:
    """JSONL, one request per line: timestamp (ms), input_length, output_length, hash_ids,
    and kvscope's optional priority (an integer, lower first; 0 if absent). Requests
    sharing a hash id share that 512-token block of prompt, so prefix hits fall where the
    trace puts them."""
    requests = []
    for line, record in _json_lines(path):
        timestamp = _field(path, line, record, "timestamp", float, 0)
        input_length = _field(path, line, record, "input_length", int, 1)
        output_length = _field(path, line, record, "output_length", int, 1)
        hash_ids = record.get("hash_ids")
        needed = -(-input_length // MOONCAKE_BLOCK_TOKENS)
        if not isinstance(hash_ids, list) or any(
                isinstance(h, bool) or not isinstance(h, int) for h in hash_ids):
            raise TraceError(path, line, "hash_ids", "must be a list of integers"
                             if "hash_ids" in record else "is missing")
        if len(hash_ids) < needed:
            raise TraceError(path, line, "hash_ids", f"has {len(hash_ids)} ids; input_length="
                             f"{input_length} needs {needed} blocks of {MOONCAKE_BLOCK_TOKENS}")
        prompt: list[int] = []
        for hash_id in hash_ids[:needed]:
            prompt += tokens.block(("mooncake", hash_id), MOONCAKE_BLOCK_TOKENS)
        priority = (_field(path, line, record, "priority", int, PRIORITY_MIN)
                    if "priority" in record else 0)
        requests.append(ReplayRequest(f"mooncake-{line}", timestamp / 1000.0,
                                      prompt[:input_length], output_length,
                                      priority=priority))
    return Workload(path.name, requests)


def _json_lines(path: Path) -> Iterator[tuple[int, dict]]:
    with path.open() as lines:
        for line, text in enumerate(lines, start=1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}: line {line}: not JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}: line {line}: expected a JSON object")
            yield line, record


# ---- Azure ---------------------------------------------------------------------------------
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def load_azure(path: Path, tokens: SyntheticTokens) -> Workload:
    """Azure's LLM inference trace: CSV with TIMESTAMP (a date and time, or seconds),
    ContextTokens and GeneratedTokens. Its prompts share nothing, so each is its own."""
    requests = []
    with path.open(newline="") as file:
        reader = csv.DictReader(file)
        missing = [c for c in AZURE_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise TraceError(path, 1, missing[0], "is missing from the header")
        for line, record in enumerate(reader, start=2):
            arrival = _azure_time(path, line, record["TIMESTAMP"])
            context = _field(path, line, record, "ContextTokens", int, 1)
            generated = _field(path, line, record, "GeneratedTokens", int, 1)
            requests.append(ReplayRequest(f"azure-{line}", arrival,
                                          tokens.block(("azure", line), context), generated))
    return Workload(path.name, requests)


def _azure_time(path: Path, line: int, text: str | None) -> float:
    if not text:
        raise TraceError(path, line, "TIMESTAMP", "is missing")
    try:
        return float(text)
    except ValueError:
        pass
    # The published files write 7 fractional digits; datetime reads at most 6.
    head, dot, fraction = text.strip().partition(".")
    try:
        moment = datetime.fromisoformat(head + (dot + fraction[:6] if dot else ""))
    except ValueError:
        raise TraceError(path, line, "TIMESTAMP", f"is not a date and time or seconds "
                         f"(got {text!r})") from None
    return moment.timestamp()


# ---- ShareGPT ------------------------------------------------------------------------------
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "system": "system"}


def load_sharegpt(path: Path, tokenizer, rate: float | None, seed: int) -> Workload:
    """A JSON list of {"id", "conversations": [{"from": "human" | "gpt" | "system",
    "value": text}, ...]}. Every human turn answered by a gpt turn is a request: the
    conversation so far through the model's chat template, its output as long as the
    recorded answer (in this tokenizer's tokens). Later turns of a conversation repeat
    its earlier turns, which the prefix cache can reuse."""
    try:
        entries = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON ({error.msg}, line {error.lineno})") from None
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    arrivals = _poisson_arrivals(rate, seed)
    requests = []
    for line, entry in enumerate(entries, start=1):
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list):
            raise TraceError(path, line, "conversations", "is missing (entry "
                             f"{line} of the list)")
        messages: list[dict] = []
        for index, turn in enumerate(turns):
            role, text = _sharegpt_turn(path, line, index, turn)
            if role == "assistant" and messages and messages[-1]["role"] == "user":
                prompt = tokenizer(render_chat(tokenizer, messages),
                                   add_special_tokens=False).input_ids
                output = len(tokenizer(text, add_special_tokens=False).input_ids)
                if output:
                    requests.append(ReplayRequest(
                        f"sharegpt-{line}-{index}", next(arrivals), prompt, output))
            messages.append({"role": role, "content": text})
    return Workload(path.name, requests)


def _sharegpt_turn(path: Path, line: int, index: int, turn) -> tuple[str, str]:
    where = f"conversations[{index}]."
    if not isinstance(turn, dict) or turn.get("from") not in SHAREGPT_ROLES:
        raise TraceError(path, line, where + "from", f"must be one of {sorted(SHAREGPT_ROLES)}")
    if not isinstance(turn.get("value"), str):
        raise TraceError(path, line, where + "value", "must be text")
    return SHAREGPT_ROLES[turn["from"]], turn["value"]


def _poisson_arrivals(rate: float | None, seed: int) -> Iterator[float]:
    if rate is not None and not (isinstance(rate, (int, float)) and rate > 0):
        raise ValueError(f"rate={rate!r} must be > 0 requests/s (or None: all at once)")
    rng = random.Random(seed)
    now = 0.0
    while True:
        yield now
        if rate is not None:
            now += rng.expovariate(rate)

