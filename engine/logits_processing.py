"""Request-dependent edits of the logits before sampling, for a whole batch at once.

vLLM v1's order: the grammar bitmask, allowed_token_ids, bad_words, min_tokens (stop tokens
masked), logit_bias, then the repetition / frequency / presence penalties. Temperature,
min_p, top-k and top-p follow in the sampler.

Penalties need each sequence's output-token counts. They live on the device in one
[slots, vocab] tensor, beside a mask of the tokens seen in the prompt or the output (the
repetition penalty's set); a sequence gets a slot the first time it samples and a step
updates every slot with one scatter each, so nothing is rebuilt from Python lists per step.
"""

from dataclasses import dataclass

import torch

from engine.request import Sequence
from engine.sampling_params import SamplingParams
from engine.structured_output import GrammarCompiler, StructuredOutputs

NEG_INF = float("-inf")


@dataclass(slots=True)
class RequestConstraints:
    """What a request's params turn into once, at admission (checked against the vocab)."""

    logit_bias_ids: torch.Tensor | None = None
    logit_bias_values: torch.Tensor | None = None
    allowed_mask: torch.Tensor | None = None  # bool [vocab]: True where allowed
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    grammar: str | None = None  # llguidance grammar, compiled and validated

    @property
    def empty(self) -> bool:
        return (self.logit_bias_ids is None and self.allowed_mask is None
                and not self.bad_words_ids and self.grammar is None)


class LogitsProcessor:
    """Owns the per-sequence device state and applies every request's edits per step."""

    def __init__(self, vocab_size: int, tokenizer, eos_token_ids: set[int],
                 device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.eos_token_ids = sorted(eos_token_ids)
        self.device = device
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.seen_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.slots: dict[Sequence, int] = {}
        self.free_slots: list[int] = []
        self.structured = StructuredOutputs(GrammarCompiler(tokenizer, vocab_size,
                                                            eos_token_ids))

    # ---- admission ---------------------------------------------------------------------
    def prepare(self, params: SamplingParams) -> RequestConstraints | None:
        """Check params against the vocabulary and compile them; ValueError names the field."""
        constraints = RequestConstraints()
        if params.logit_bias:
            ids = self._token_ids("logit_bias", list(params.logit_bias))
            constraints.logit_bias_ids = ids
            constraints.logit_bias_values = torch.tensor(
                list(params.logit_bias.values()), dtype=torch.float32, device=self.device)
        if params.allowed_token_ids is not None:
            mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            mask[self._token_ids("allowed_token_ids", params.allowed_token_ids)] = True
            constraints.allowed_mask = mask
        if params.bad_words:
            constraints.bad_words_ids = self._bad_words_ids(params.bad_words)
        for token in params.stop_token_ids:
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"stop_token_ids: token id {token} is outside the "
                                 f"vocabulary [0, {self.vocab_size})")
        if params.structured_outputs is not None:
            constraints.grammar = self.structured.compiler.compile(params.structured_outputs)
        return None if constraints.empty else constraints

    def _token_ids(self, name: str, ids: list[int]) -> torch.Tensor:
        outside = [t for t in ids if not 0 <= t < self.vocab_size]
        if outside:
            raise ValueError(f"{name}: token id {outside[0]} is outside the vocabulary "
                             f"[0, {self.vocab_size})")
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    def _bad_words_ids(self, words: list[str]) -> tuple[tuple[int, ...], ...]:
        """Each word's tokens at the start of the text and, when the tokenizer gives a
        different first token after a space, in the middle of it (vLLM's rule)."""
        sequences: list[tuple[int, ...]] = []
        for word in words:
            plain = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            sequences.append(plain)
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                sequences.append(spaced)
        return tuple(s for s in sequences if s)

    # ---- one step ----------------------------------------------------------------------
    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The processed logits of rows `seqs` (a new tensor if anything applies)."""
        self._release_finished()
        params = [seq.request.params for seq in seqs]
        edited = [i for i, (seq, p) in enumerate(zip(seqs, params, strict=True))
                  if seq.request.constraints is not None or p.has_penalties
                  or seq.num_output_tokens < p.min_tokens]
        if not edited:
            return logits
        logits = logits.clone()
        self.structured.apply_bitmask(logits, seqs)
        self._mask_disallowed(logits, seqs)
        banned = self._banned_tokens(seqs)
        if banned:
            rows, tokens = zip(*banned)
            logits[list(rows), list(tokens)] = NEG_INF
        self._add_logit_bias(logits, seqs)
        self._apply_penalties(logits, seqs)
        return logits

    def accept(self, seqs: list[Sequence], token_ids: list[int]) -> None:
        """Count the sampled tokens and advance the grammars (before the tokens are appended)."""
        rows = [i for i, seq in enumerate(seqs) if seq in self.slots]
        if rows:
            slots = torch.tensor([self.slots[seqs[i]] for i in rows], device=self.device)
            tokens = torch.tensor([token_ids[i] for i in rows], device=self.device)
            self.output_counts.index_put_((slots, tokens), torch.ones_like(
                tokens, dtype=torch.int32), accumulate=True)
            self.seen_mask[slots, tokens] = True
        self.structured.accept(seqs, token_ids)

    def grammar_finished(self, seq: Sequence) -> bool:
        return self.structured.finished(seq)

    # ---- the edits -----------------------------------------------------------------------
    def _mask_disallowed(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        rows = [i for i, seq in enumerate(seqs) if seq.request.constraints is not None
                and seq.request.constraints.allowed_mask is not None]
        if rows:
            allowed = torch.stack([seqs[i].request.constraints.allowed_mask for i in rows])
            logits[rows] = logits[rows].masked_fill(~allowed, NEG_INF)

    def _banned_tokens(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """(row, token) pairs: stop tokens before min_tokens, and bad words' last tokens."""
        banned = []
        for row, seq in enumerate(seqs):
            params = seq.request.params
            if seq.num_output_tokens < params.min_tokens:
                stops = params.stop_token_ids + ([] if params.ignore_eos else self.eos_token_ids)
                banned.extend((row, token) for token in stops)
            constraints = seq.request.constraints
            if constraints is None or not constraints.bad_words_ids:
                continue
            output = seq.output_token_ids
            for word in constraints.bad_words_ids:
                prefix = list(word[:-1])
                if not prefix or output[len(output) - len(prefix):] == prefix:
                    banned.append((row, word[-1]))
        return banned

    def _add_logit_bias(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        rows, ids, values = [], [], []
        for row, seq in enumerate(seqs):
            constraints = seq.request.constraints
            if constraints is not None and constraints.logit_bias_ids is not None:
                rows.append(torch.full_like(constraints.logit_bias_ids, row))
                ids.append(constraints.logit_bias_ids)
                values.append(constraints.logit_bias_values)
        if rows:
            logits.index_put_((torch.cat(rows), torch.cat(ids)), torch.cat(values),
                              accumulate=True)

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """vLLM's formulas: repetition divides positive logits (multiplies negative ones) of
        every token seen in the prompt or output; frequency subtracts penalty x count,
        presence subtracts the penalty once for each token in the output. A penalty no row
        asks for costs nothing."""
        rows = [i for i, seq in enumerate(seqs) if seq.request.params.has_penalties]
        if not rows:
            return
        slots = torch.tensor([self._slot(seqs[i]) for i in rows], device=self.device)
        params = [seqs[i].request.params for i in rows]
        whole = len(rows) == logits.shape[0]  # the common case: no gather, no scatter
        penalised = logits if whole else logits[rows]

        def column(name: str, neutral: float) -> torch.Tensor | None:
            values = [getattr(p, name) for p in params]
            if all(value == neutral for value in values):
                return None
            return torch.tensor(values, dtype=logits.dtype, device=self.device).unsqueeze(1)

        repetition = column("repetition_penalty", 1.0)
        if repetition is not None:
            factor = torch.where(self.seen_mask[slots], repetition, 1.0)
            penalised = torch.where(penalised > 0, penalised / factor, penalised * factor)
        frequency, presence = column("frequency_penalty", 0.0), column("presence_penalty", 0.0)
        if frequency is not None or presence is not None:
            counts = self.output_counts[slots]
            if frequency is not None:
                penalised = penalised - frequency * counts
            if presence is not None:
                penalised = penalised - presence * (counts > 0)
        if whole:
            logits.copy_(penalised)
        else:
            logits[rows] = penalised

    # ---- per-sequence state ----------------------------------------------------------------
    def _slot(self, seq: Sequence) -> int:
        """The sequence's row of counts, made on its first use from the tokens it holds (a
        forked sample starts from its parent's prompt)."""
        slot = self.slots.get(seq)
        if slot is not None:
            return slot
        if not self.free_slots:
            self._grow()
        slot = self.free_slots.pop()
        self.slots[seq] = slot
        output = torch.tensor(seq.output_token_ids, dtype=torch.long, device=self.device)
        self.output_counts[slot] = torch.bincount(output, minlength=self.vocab_size)
        self.seen_mask[slot] = False
        self.seen_mask[slot, torch.tensor(seq.token_ids, device=self.device)] = True
        return slot

    def _grow(self) -> None:
        old = self.output_counts.shape[0]
        new = max(8, 2 * old)
        self.output_counts = torch.cat([self.output_counts, self.output_counts.new_zeros(
            new - old, self.vocab_size)])
        self.seen_mask = torch.cat([self.seen_mask, self.seen_mask.new_zeros(
            new - old, self.vocab_size)])
        self.free_slots.extend(range(new - 1, old - 1, -1))

    def _release_finished(self) -> None:
        for seq in [seq for seq in self.slots if seq.is_finished]:
            self.free_slots.append(self.slots.pop(seq))
        self.structured.release_finished()
