"""Request-dependent edits of the logits before sampling, for a whole batch at once.

vLLM v1's order: the grammar bitmask, allowed_token_ids, bad_words, min_tokens (stop tokens
masked), logit_bias, then the repetition / frequency / presence penalties. Temperature,
min_p, top-k and top-p follow in the sampler.

Penalties touch only the tokens a sequence holds, never the whole vocabulary: each
penalised sequence keeps a row of its token ids (prompt, then output) on the device, padded
with repeats of its first token, and a flag on each output token that occurs there for the
first time. A step gathers the batch's logits at those ids, applies the repetition penalty
and scatters them back (a repeated id writes the same value twice), then adds the frequency
and presence terms with one accumulating scatter. Sampled tokens are appended on the device,
so nothing is rebuilt from Python lists per step.
"""

from dataclasses import dataclass

import torch

from kvscope.engine.core.request import Sequence
from kvscope.engine.sample.structured_output import GrammarCompiler, StructuredOutputs
from kvscope.engine.sampling_params import SamplingParams

NEG_INF = float("-inf")


@dataclass(slots=True)
class RequestConstraints:
    """What a request's params turn into once, at admission (checked against the vocab)."""

    logit_bias_ids: torch.Tensor | None = None
    logit_bias_values: torch.Tensor | None = None
    allowed_mask: torch.Tensor | None = None  # bool [vocab]: True where allowed
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    grammar: str | None = None  # llguidance grammar, compiled and validated
    # The tokens after which the grammar starts (StructuredOutputsParams.start_after).
    grammar_start_after: tuple[int, ...] = ()

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
        # Per slot: token ids (prompt then output, padded with the first token), which output
        # positions hold a token's first occurrence, and the prompt and total lengths.
        self.token_ids = torch.zeros(0, 0, dtype=torch.long, device=device)
        self.first_in_output = torch.zeros(0, 0, dtype=torch.bool, device=device)
        self.num_prompt_tokens: list[int] = []
        self.num_tokens: list[int] = []
        self.slots: dict[Sequence, int] = {}
        self.free_slots: list[int] = []
        # The edited copy of a step's logits. A fresh tensor per step (12 MB at 64 rows of a
        # 49k vocabulary) cost more in page faults on a CPU than all the edits together.
        self.buffer = torch.empty(0, vocab_size, device=device)
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
            if params.structured_outputs.start_after is not None:
                constraints.grammar_start_after = tuple(self.tokenizer.encode(
                    params.structured_outputs.start_after, add_special_tokens=False))
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
        """The processed logits of rows `seqs`; `logits` itself is left alone. When anything
        applies they are written to a buffer this processor reuses: valid until its next
        call."""
        self._release_finished()
        params = [seq.request.params for seq in seqs]
        edited = [i for i, (seq, p) in enumerate(zip(seqs, params, strict=True))
                  if seq.request.constraints is not None or p.has_penalties
                  or seq.num_output_tokens < p.min_tokens]
        if not edited:
            return logits
        logits = self._copy_to_buffer(logits)
        self.structured.apply_bitmask(logits, seqs)
        self._mask_disallowed(logits, seqs)
        banned = self._banned_tokens(seqs)
        if banned:
            rows, tokens = zip(*banned)
            logits[list(rows), list(tokens)] = NEG_INF
        self._add_logit_bias(logits, seqs)
        self._apply_penalties(logits, seqs)
        return logits

    def _copy_to_buffer(self, logits: torch.Tensor) -> torch.Tensor:
        rows = logits.shape[0]
        if self.buffer.shape[0] < rows or self.buffer.dtype != logits.dtype:
            self.buffer = logits.new_empty(rows, logits.shape[1])
        return self.buffer[:rows].copy_(logits)

    def accept(self, seqs: list[Sequence], token_ids: list[int]) -> None:
        """Record the sampled tokens and advance the grammars (before the tokens are appended)."""
        rows = [i for i, seq in enumerate(seqs) if seq in self.slots]
        if rows:
            slot_list = [self.slots[seqs[i]] for i in rows]
            positions = [self.num_tokens[slot] for slot in slot_list]
            self._widen(max(positions) + 1)
            slots = torch.tensor(slot_list, device=self.device)
            tokens = torch.tensor([token_ids[i] for i in rows], device=self.device)
            held = self.token_ids[slots] == tokens.unsqueeze(1)
            held &= self._output_positions(slot_list, self.token_ids.shape[1])
            where = torch.tensor(positions, device=self.device)
            self.token_ids[slots, where] = tokens
            self.first_in_output[slots, where] = ~held.any(dim=1)
            for slot in slot_list:
                self.num_tokens[slot] += 1
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
        slot_list = [self._slot(seqs[i]) for i in rows]
        width = max(self.num_tokens[slot] for slot in slot_list)
        slots = torch.tensor(slot_list, device=self.device)
        ids = self.token_ids[slots, :width]
        at = (torch.tensor(rows, device=self.device).unsqueeze(1).expand_as(ids), ids)
        params = [seqs[i].request.params for i in rows]

        def column(name: str, neutral: float) -> torch.Tensor | None:
            values = [getattr(p, name) for p in params]
            if all(value == neutral for value in values):
                return None
            return torch.tensor(values, dtype=logits.dtype, device=self.device).unsqueeze(1)

        repetition = column("repetition_penalty", 1.0)
        if repetition is not None:
            seen = logits[at]
            logits[at] = torch.where(seen > 0, seen / repetition, seen * repetition)
        frequency, presence = column("frequency_penalty", 0.0), column("presence_penalty", 0.0)
        if frequency is None and presence is None:
            return
        change = torch.zeros_like(ids, dtype=logits.dtype)
        if frequency is not None:  # once per occurrence: the accumulation counts them
            change -= frequency * self._output_positions(slot_list, width)
        if presence is not None:
            change -= presence * self.first_in_output[slots, :width]
        logits.index_put_(at, change, accumulate=True)

    def _output_positions(self, slot_list: list[int], width: int) -> torch.Tensor:
        """bool [len(slot_list), width]: True where a slot's row holds an output token."""
        columns = torch.arange(width, device=self.device)
        bounds = torch.tensor([[self.num_prompt_tokens[slot], self.num_tokens[slot]]
                               for slot in slot_list], device=self.device)
        return (columns >= bounds[:, :1]) & (columns < bounds[:, 1:])

    # ---- per-sequence state ----------------------------------------------------------------
    def _slot(self, seq: Sequence) -> int:
        """The sequence's row of token ids, written from the tokens it holds on first use
        (a forked sample starts from its parent's) and again if they ever disagree."""
        slot = self.slots.get(seq)
        if slot is not None and self.num_tokens[slot] == seq.num_tokens:
            return slot
        if slot is None:
            if not self.free_slots:
                self._grow()
            slot = self.slots[seq] = self.free_slots.pop()
        tokens = seq.token_ids
        self._widen(len(tokens))
        self.token_ids[slot] = tokens[0]
        self.token_ids[slot, :len(tokens)] = torch.tensor(tokens, device=self.device)
        first, seen = [], set()
        for token in seq.output_token_ids:
            first.append(token not in seen)
            seen.add(token)
        self.first_in_output[slot] = False
        self.first_in_output[slot, seq.num_prompt_tokens:len(tokens)] = torch.tensor(
            first, dtype=torch.bool, device=self.device)
        self.num_prompt_tokens[slot], self.num_tokens[slot] = seq.num_prompt_tokens, len(tokens)
        return slot

    def _grow(self) -> None:
        """Twice the slots (at least 8)."""
        old = self.token_ids.shape[0]
        new = max(8, 2 * old)
        self.token_ids = torch.cat([self.token_ids, self.token_ids.new_zeros(
            new - old, self.token_ids.shape[1])])
        self.first_in_output = torch.cat([self.first_in_output, self.first_in_output.new_zeros(
            new - old, self.first_in_output.shape[1])])
        self.num_prompt_tokens += [0] * (new - old)
        self.num_tokens += [0] * (new - old)
        self.free_slots.extend(range(new - 1, old - 1, -1))

    def _widen(self, width: int) -> None:
        """Room for `width` tokens per slot; new columns repeat each row's first token."""
        old = self.token_ids.shape[1]
        if width <= old:
            return
        new = max(width, 2 * old, 64)
        first = self.token_ids[:, :1] if old else self.token_ids.new_zeros(
            self.token_ids.shape[0], 1)
        self.token_ids = torch.cat([self.token_ids, first.expand(-1, new - old)], dim=1)
        self.first_in_output = torch.cat([self.first_in_output, self.first_in_output.new_zeros(
            self.first_in_output.shape[0], new - old)], dim=1)

    def _release_finished(self) -> None:
        for seq in [seq for seq in self.slots if seq.is_finished]:
            self.free_slots.append(self.slots.pop(seq))
        self.structured.release_finished()
