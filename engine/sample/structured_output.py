"""Structured outputs with llguidance: JSON schema, regex, choice and Lark/GBNF grammars.

Why llguidance: it computes a 49k-token mask in a few milliseconds on one CPU core
(docs/performance-history.md, 'Figures the code's comments quoted'; a Rust Earley parser
with a token trie, no per-schema precompilation), its wheel is one abi3 binary with no
dependencies (xgrammar pulls in its own torch/triton requirements, outlines-core precompiles
an index per schema that grows with the schema), and it is maintained by the guidance team
and used by vLLM as its `guidance` backend.

Each constrained sequence owns an LLMatcher. Before a step samples, the matchers of the
constrained rows (only those) write one bitmask (one bit per token, filled in parallel on
native threads). A 256-row table turns each byte of it into eight 0 / -inf biases, and
one add masks the rows' logits; after sampling, each matcher consumes its sequence's
token. llguidance's view of a tokenizer is built once per process and shared by every
engine with the same tokenizer. A matcher whose count of consumed tokens differs from its
sequence's output (a sequence it has not seen yet, such as a fork, or anything that
rewound it) is rebuilt from the output tokens.
"""

import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass

import llguidance
import llguidance.hf
import torch
from llguidance.gbnf_to_lark import any_to_lark
from llguidance.torch import fill_next_token_bitmask_par
from torch.nn.functional import embedding

from kvscope.engine.core.request import Sequence
from kvscope.engine.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)
# Compact JSON: small models otherwise loop on whitespace (vLLM's disable_any_whitespace).
JSON_OPTIONS = {"whitespace_flexible": False}
# Row b: the bias of the 8 tokens whose bits byte b of the bitmask holds (bit j, lowest
# first, is token 8 * byte_index + j on a little-endian host): 0 if allowed, else -inf.
BYTE_BIAS = torch.where((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1 == 1, 0.0,
                        float("-inf"))
# llguidance's tokenizers by (serialized tokenizer's digest, vocab size, EOS ids): building
# one takes a good part of a second on an idle core and seconds on a busy machine
# (docs/performance-history.md, 'Figures the code's comments quoted').
_TOKENIZERS: dict[tuple[str, int, tuple[int, ...]], llguidance.LLTokenizer] = {}
_TOKENIZERS_LOCK = threading.Lock()


def llguidance_tokenizer(hf_tokenizer, vocab_size: int,
                         eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    """llguidance's view of `hf_tokenizer`, built once per process for each distinct
    tokenizer: engines created again in one process (the server's, the tests') reuse it."""
    serialized = hf_tokenizer.backend_tokenizer.to_str()  # cheap next to the build
    key = (hashlib.sha256(serialized.encode()).hexdigest(), vocab_size, tuple(eos_token_ids))
    with _TOKENIZERS_LOCK:
        if key not in _TOKENIZERS:
            started = time.perf_counter()
            _TOKENIZERS[key] = llguidance.hf.from_tokenizer(
                hf_tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids))
            logger.info("llguidance tokenizer built in %.2f s", time.perf_counter() - started)
        return _TOKENIZERS[key]


class GrammarCompiler:
    """StructuredOutputsParams -> a validated llguidance grammar for this tokenizer."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]) -> None:
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """Looked up (or built) on first use."""
        if self._tokenizer is None:
            if not self.eos_token_ids:
                raise ValueError("structured_outputs: the model has no EOS token to end a "
                                 "constrained output with")
            try:
                self._tokenizer = llguidance_tokenizer(self.hf_tokenizer, self.vocab_size,
                                                       self.eos_token_ids)
            except (ValueError, AttributeError) as error:
                raise ValueError(f"structured_outputs: llguidance cannot use this model's "
                                 f"tokenizer: {error}") from None
        return self._tokenizer

    def compile(self, spec: StructuredOutputsParams) -> str:
        field = f"structured_outputs.{spec.kind}"
        try:
            grammar = self._grammar(spec)
        except (ValueError, TypeError) as error:
            raise ValueError(f"{field}: {error}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(f"{field}: cannot compile: {error.strip()}")
        return grammar

    @staticmethod
    def _grammar(spec: StructuredOutputsParams) -> str:
        matcher = llguidance.LLMatcher
        if spec.json is not None:
            schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
            return matcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if spec.json_object:
            return matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if spec.regex is not None:
            return matcher.grammar_from_regex(spec.regex)
        if spec.choice is not None:
            alternatives = " | ".join(json.dumps(choice) for choice in spec.choice)
            return matcher.grammar_from_lark(f"start: {alternatives}")
        try:
            lark = any_to_lark(spec.grammar)
        except Exception as error:  # llguidance's GBNF reader raises bare Exceptions
            raise ValueError(f"not a Lark or GBNF grammar: {error}") from None
        return matcher.grammar_from_lark(lark)


@dataclass(slots=True)
class GrammarState:
    matcher: llguidance.LLMatcher
    num_consumed: int = 0
    start: int = 0  # the output position the grammar starts at (after start_after's tokens)


class StructuredOutputs:
    """The matchers of the constrained sequences, and the batch's bitmask."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self.states: dict[Sequence, GrammarState] = {}
        # Per sequence waiting for its start_after tokens: how much output was searched.
        self.searched: dict[Sequence, int] = {}
        # Fills the rows' masks on a pool of native threads, outside the GIL.
        self.executor = llguidance.LLExecutor()

    def apply_bitmask(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """-inf on every token a constrained row's grammar forbids (in place)."""
        starts = {i: self._start(seq) for i, seq in enumerate(seqs)
                  if _grammar(seq) is not None}
        rows = [i for i, start in starts.items() if start is not None]
        if not rows:
            return
        vocab_size = logits.shape[1]
        bitmask = torch.full((len(rows), (vocab_size + 31) // 32), -1, dtype=torch.int32)
        matchers = [(self._state(seqs[row], starts[row]).matcher, index)
                    for index, row in enumerate(rows)]
        fill_next_token_bitmask_par(self.executor, matchers, bitmask)
        byte_ids = bitmask.view(torch.uint8).to(device=logits.device, dtype=torch.long)
        bias = embedding(byte_ids, BYTE_BIAS.to(logits.device)).view(len(rows), -1)
        if len(rows) == logits.shape[0]:
            logits += bias[:, :vocab_size]
        else:
            logits[rows] += bias[:, :vocab_size]

    def accept(self, seqs: list[Sequence], token_ids: list[int]) -> None:
        for seq, token in zip(seqs, token_ids, strict=True):
            state = self.states.get(seq)
            if state is None:
                continue
            if not state.matcher.consume_token(token):
                logger.warning("%s: the grammar refused token %d: %s", seq.seq_id, token,
                               state.matcher.get_error())
            state.num_consumed += 1

    def finished(self, seq: Sequence) -> bool:
        """The grammar is complete (it consumed the EOS) or broken: the sequence must stop."""
        state = self.states.get(seq)
        return state is not None and (state.matcher.is_stopped() or state.matcher.is_error())

    def release_finished(self) -> None:
        for seq in [seq for seq in self.states if seq.is_finished]:
            del self.states[seq]
        for seq in [seq for seq in self.searched if seq.is_finished]:
            del self.searched[seq]

    def _start(self, seq: Sequence) -> int | None:
        """Where the sequence's grammar starts in its output: 0, or just after the first
        start_after tokens; None while they have not come (the output is still free)."""
        marker = seq.request.constraints.grammar_start_after
        if not marker:
            return 0
        state = self.states.get(seq)
        if state is not None:  # a sequence's output only grows: the marker stays put
            return state.start
        # Each step looks only at what it has not searched yet (a long reasoning must not
        # cost a scan of all its tokens per step).
        output, width = seq.output_token_ids, len(marker)
        searched = min(self.searched.get(seq, 0), len(output))
        found = next((end for end in range(max(width, searched + 1), len(output) + 1)
                      if tuple(output[end - width:end]) == marker), None)
        self.searched[seq] = len(output)
        return found

    def _state(self, seq: Sequence, start: int) -> GrammarState:
        state = self.states.get(seq)
        if state is None or state.start + state.num_consumed != seq.num_output_tokens:
            matcher = llguidance.LLMatcher(self.compiler.tokenizer, _grammar(seq))
            output = seq.output_token_ids[start:]
            if output and not matcher.consume_tokens(output):
                logger.warning("%s: its output no longer fits the grammar: %s", seq.seq_id,
                               matcher.get_error())
            state = self.states[seq] = GrammarState(matcher, len(output), start)
        return state


def _grammar(seq: Sequence) -> str | None:
    constraints = seq.request.constraints
    return constraints.grammar if constraints is not None else None
