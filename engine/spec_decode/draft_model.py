"""vLLM's draft_model method: a smaller model on the target's vocabulary proposes k tokens,
one forward of its own per token, and the target verifies them all in one forward.

The draft's K/V lives in a pool of its own with a block for each of the target's, named by
the same block ids (vLLM v1 likewise puts a draft's layers in the target's KV cache group):
the sequence's block tables (one per KV cache group) page both. So whatever the KV manager
does to a table, it does to the draft's K/V too: truncating rejected proposals, sharing a
cached prefix, forking and copying on write, swapping out and in, recomputing after
preemption. For that to hold, the draft writes every position the target writes, in the
same step (run() below): a block the target holds or caches is then valid in the draft's
pool as well.
"""

import logging
from dataclasses import replace

import torch

from kvscope.engine.config import EngineConfig
from kvscope.engine.core.scheduler_output import ScheduledSequence
from kvscope.engine.worker.loader import load_config, resolve_model_path
from kvscope.engine.worker.model_runner import ModelRunner
from kvscope.engine.worker.models import language_model_config

logger = logging.getLogger(__name__)


class DraftModelProposer:
    """The draft model's runner (weights and KV pool) and its proposals."""

    def __init__(self, runner: ModelRunner, seed: int) -> None:
        self.runner = runner
        self.generator = torch.Generator(runner.device).manual_seed(seed)

    @classmethod
    def load(cls, config: EngineConfig, target: ModelRunner) -> "DraftModelProposer":
        """Load speculative_config.model through the real loader, in the target's dtype and
        device (unquantized), and refuse a draft that cannot stand in for the target."""
        path = config.speculative_config.model
        name = f"speculative_config.model={path!r}"
        try:
            max_positions = language_model_config(
                load_config(resolve_model_path(path))).max_position_embeddings
        except Exception as error:  # noqa: BLE001 -- any failure to load is the user's path
            raise ValueError(f"{name} does not load: {error}") from error
        if max_positions < config.max_model_len:
            raise ValueError(f"{name}: the draft's max_position_embeddings={max_positions} is "
                             f"below max_model_len={config.max_model_len}; lower max_model_len "
                             "or choose a draft that reaches it")
        draft_config = replace(config, model=path, quantization="none", speculative_config=None)
        try:
            runner = ModelRunner(draft_config)
        except Exception as error:  # noqa: BLE001
            raise ValueError(f"{name} does not load: {error}") from error
        _check_compatible(name, runner, target)
        return cls(runner, config.seed)

    def run(self, scheduled: list[ScheduledSequence]) -> None:
        """Before the target's forward: write the draft's K/V for every position the target
        computes this step, and draw the proposals of each chunk holding placeholders
        (with their distributions, where the request samples).

        The first forward runs every chunk, a proposing one only up to its own last token,
        whose logits give the first proposal; then each forward runs the proposals just
        drawn, one per proposing chunk, and gives the next. The last proposal's forward
        only writes its K/V: if all are accepted, the target has computed it too.
        """
        proposing = [item for item in scheduled if item.spec_token_ids]
        pieces, tokens, rows, row = [], [], [], -1
        for item in scheduled:
            end = item.start + item.num_real_tokens if item.spec_token_ids else item.end
            pieces.append((item.start, end, item.seq.block_table))
            tokens.append(item.seq.token_ids[item.start:end])
            row += end - item.start
            if item.spec_token_ids:
                rows.append(row)
        logits = self.runner.forward_rows(pieces, tokens, rows)
        probs: list[list[torch.Tensor]] = [[] for _ in proposing]
        live = list(range(len(proposing)))  # the chunks whose next proposal is to draw
        position = 0
        while live:
            drawn, q = self._draw(logits, [proposing[i].seq for i in live])
            for i, token, q_row in zip(live, drawn, q):
                proposing[i].spec_token_ids[position] = token
                if q_row is not None:
                    probs[i].append(q_row)
            position += 1
            wanting = [i for i in live if len(proposing[i].spec_token_ids) > position]
            logits = self.runner.forward_rows(
                [_position_piece(proposing[i], position) for i in live],
                [[proposing[i].spec_token_ids[position - 1]] for i in live],
                [index for index, i in enumerate(live) if i in wanting])
            live = wanting
        for item, q_rows in zip(proposing, probs):
            item.spec_probs = torch.stack(q_rows) if q_rows else None

    def _draw(self, logits: torch.Tensor, seqs: list) -> tuple[list[int], list]:
        """One proposal per row: the draft's argmax for a greedy request (its q is one-hot,
        and greedy verification only asks whether it is the target's argmax), else a draw
        from the draft's distribution at the request's temperature, returned with it. Any
        q verifies exactly; the closer to the target's p, the more is accepted."""
        tokens = logits.argmax(dim=-1).tolist()
        q_rows: list[torch.Tensor | None] = [None] * len(seqs)
        for row, seq in enumerate(seqs):
            params = seq.request.params
            if params.greedy:
                continue
            q = torch.softmax(logits[row].float() / params.temperature, dim=-1)
            generator = seq.generator or self.generator
            tokens[row] = int(torch.multinomial(q, 1, generator=generator))
            q_rows[row] = q
        return tokens, q_rows


def _position_piece(item: ScheduledSequence, position: int) -> tuple[int, int, list[int]]:
    """The (start, end, table) piece of a chunk's `position`-th proposal (1: the first,
    right after the chunk's own last token)."""
    at = item.start + item.num_real_tokens - 1 + position
    return at, at + 1, item.seq.block_table


def _check_compatible(name: str, draft: ModelRunner, target: ModelRunner) -> None:
    """The draft's logits must index the target's vocabulary, token for token, and it must
    read no K/V the target's KV manager frees."""
    draft_vocab, target_vocab = draft.hf_config.vocab_size, target.hf_config.vocab_size
    if draft_vocab != target_vocab:
        raise ValueError(f"{name}: the draft's vocab_size={draft_vocab} differs from the "
                         f"target's vocab_size={target_vocab}; a draft model must share the "
                         "target's tokenizer")
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise ValueError(f"{name}: the draft's tokenizer maps tokens to other ids than the "
                         "target's; a draft model must share the target's tokenizer")
    if draft.state_layers:
        raise ValueError(f"{name}: the draft {type(draft.model).__name__} has recurrent "
                         "layers, whose state cannot be rolled back past rejected proposals; "
                         "a draft model must be attention-only")
    # Group g of the draft's layers reads group g's block table: it must attend only to
    # what that group of the target keeps (all of a full group; its window of a sliding one).
    windows, draft_windows = target.group_windows, draft.group_windows
    if len(windows) != len(draft_windows) or any(
            window is not None and (draft_window is None or draft_window > window)
            for window, draft_window in zip(windows, draft_windows)):
        raise ValueError(f"{name}: the draft's KV cache groups (windows "
                         f"{list(draft_windows)}) do not fit the target's ({list(windows)}); "
                         "the draft is paged by the target's block tables, one per group, so "
                         "each of its groups must attend within the target's group in the "
                         "same place (None: every token)")
