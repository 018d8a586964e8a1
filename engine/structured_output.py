"""Structured outputs with llguidance: JSON schema, regex, choice and Lark/GBNF grammars.

Why llguidance: it computes a 49k-token mask in ~1-2 ms on one CPU core (a Rust
Earley parser with a token trie, no per-schema precompilation), its wheel is one abi3
binary with no dependencies (xgrammar pulls in its own torch/triton requirements,
outlines-core precompiles an index per schema that grows with the schema), and it is
maintained by the guidance team and used by vLLM as its `guidance` backend.

Each constrained sequence owns an LLMatcher. Before a step samples, the matchers of all
constrained rows write one bitmask (one bit per token, filled in parallel on native
threads) that masks the batch's logits in a single op; after it, each matcher consumes
its sequence's token. A matcher whose count of consumed tokens differs from its
sequence's output (a sequence it has not seen yet, such as a fork, or anything that
rewound it) is rebuilt from the output tokens.
"""

import json
import logging
from dataclasses import dataclass

import llguidance
import llguidance.hf
import torch
from llguidance.gbnf_to_lark import any_to_lark
from llguidance.torch import fill_next_token_bitmask_par

from engine.request import Sequence
from engine.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)
# Compact JSON: small models otherwise loop on whitespace (vLLM's disable_any_whitespace).
JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarCompiler:
    """StructuredOutputsParams -> a validated llguidance grammar for this tokenizer."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]) -> None:
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use (~0.5 s for a 49k vocabulary)."""
        if self._tokenizer is None:
            if not self.eos_token_ids:
                raise ValueError("structured_outputs: the model has no EOS token to end a "
                                 "constrained output with")
            try:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
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
        return matcher.grammar_from_lark(any_to_lark(spec.grammar))


@dataclass(slots=True)
class GrammarState:
    matcher: llguidance.LLMatcher
    num_consumed: int = 0


class StructuredOutputs:
    """The matchers of the constrained sequences, and the batch's bitmask."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self.states: dict[Sequence, GrammarState] = {}
        # Fills the rows' masks on a pool of native threads, outside the GIL.
        self.executor = llguidance.LLExecutor()

    def apply_bitmask(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """-inf on every token any constrained row's grammar forbids, in one masked fill."""
        rows = [i for i, seq in enumerate(seqs) if _grammar(seq) is not None]
        if not rows:
            return
        words = (logits.shape[1] + 31) // 32
        bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
        fill_next_token_bitmask_par(self.executor, [(self._state(seqs[row]).matcher, index)
                                                    for index, row in enumerate(rows)], bitmask)
        shifts = torch.arange(32, dtype=torch.int32)
        allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)
        allowed = allowed[:, :logits.shape[1]].to(device=logits.device, dtype=torch.bool)
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))

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

    def _state(self, seq: Sequence) -> GrammarState:
        state = self.states.get(seq)
        if state is None or state.num_consumed != seq.num_output_tokens:
            matcher = llguidance.LLMatcher(self.compiler.tokenizer, _grammar(seq))
            output = seq.output_token_ids
            if output and not matcher.consume_tokens(output):
                logger.warning("%s: its output no longer fits the grammar: %s", seq.seq_id,
                               matcher.get_error())
            state = self.states[seq] = GrammarState(matcher, len(output))
        return state


def _grammar(seq: Sequence) -> str | None:
    constraints = seq.request.constraints
    return constraints.grammar if constraints is not None else None
