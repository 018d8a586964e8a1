"""EngineCore.step(): schedule -> run -> sample -> update -> outputs and one StepRecord."""

import itertools
import logging
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from kvscope.engine.config import EngineConfig
from kvscope.engine.core.kv_cache_manager import KVCacheManager
from kvscope.engine.core.kv_events import EventBus
from kvscope.engine.core.kv_offload.tier import KVTier
from kvscope.engine.core.request import FinishReason, Request, Sequence, SequenceStatus
from kvscope.engine.core.scheduler import Scheduler
from kvscope.engine.core.scheduler_output import ScheduledSequence, SchedulerOutput
from kvscope.engine.core.scheduling_policy import check_priority
from kvscope.engine.core.state_slots import recurrent_model_config
from kvscope.engine.orchestrator.beam_search import BeamSearchCoordinator, BeamSearchParams, BeamState
from kvscope.engine.orchestrator.detokenizer import detokenize_incrementally
from kvscope.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvscope.engine.sample.logits_processing import LogitsProcessor
from kvscope.engine.sample.sampler import sample, token_logprobs
from kvscope.engine.sampling_params import SamplingParams, model_sampling_defaults
from kvscope.engine.spec_decode.drafting_executor import with_draft_model
from kvscope.engine.spec_decode.metrics import SpecDraft
from kvscope.engine.spec_decode.proposer import Speculator
from kvscope.engine.telemetry.kv_cost import KVCostMeter
from kvscope.engine.telemetry.records import StepRecord
from kvscope.engine.telemetry.step_records import record_step
from kvscope.engine.worker.executor import StepExecutor, StepLogits
from kvscope.engine.worker.kv_tier import open_kv_tier
from kvscope.engine.worker.memory import GiB
from kvscope.engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StepResult:
    outputs: list[RequestOutput]
    record: StepRecord


@dataclass(slots=True)
class InFlightStep:
    """A launched step: its plan, the chunks that sample, and its forward's result."""

    plan: SchedulerOutput
    sampling: list[ScheduledSequence]
    start_time: float
    forward: Future  # of (logits or tokens, prompt logits by scheduled index)


class EngineCore:
    """One engine: a model runner (weights stay loaded), a block pool and a scheduler.

    The pool, the cache manager and the scheduler report every change as a typed event
    (engine.core.kv_events) on `events`; whoever wants them subscribes there.
    """

    def __init__(self, config: EngineConfig | None = None, runner: StepExecutor | None = None):
        config = config or EngineConfig()
        self.runner = runner or ModelRunner(config)
        self.tokenizer = self.runner.tokenizer
        self.config = config.resolved(self.runner.max_positions)
        if getattr(self.runner, "state_layers", None):
            self.config = recurrent_model_config(self.config, type(self.runner.model).__name__)
        self.runner = with_draft_model(self.runner, self.config)
        self.expert_layout = self.runner.expert_layout  # None for a dense model
        self.memory_plan = self.runner.plan_memory(self.config)
        if 0 < self.memory_plan.num_state_slots < self.config.max_num_seqs:
            # One state slot per running sequence: the plan's description says so.
            self.config = replace(self.config, max_num_seqs=self.memory_plan.num_state_slots)
        self.num_swap_blocks = 0
        if self.config.preemption_mode == "swap":
            self.num_swap_blocks = (int(self.config.swap_space * GiB)
                                    // self.memory_plan.bytes_per_block)
        self._allocate_caches()
        logger.info(self.memory_plan.describe())
        self.events = EventBus()
        self.kv_cache = KVCacheManager(self.memory_plan.num_blocks, self.config.block_size,
                                       self.config.enable_prefix_caching, self.num_swap_blocks,
                                       emit=self.events.emit,
                                       group_windows=self.runner.group_windows,
                                       num_state_slots=self.memory_plan.num_state_slots,
                                       snapshot_every_n_blocks=(
                                           self.config.state_snapshot_every_n_blocks))
        self.scheduler = Scheduler(self.config, self.kv_cache, emit=self.events.emit)
        self.requests: dict[str, Request] = {}
        self.kv_costs = KVCostMeter()
        self.eos_token_ids = _eos_token_ids(self.runner)
        self.beams = BeamSearchCoordinator(self.scheduler, self.config.max_model_len)
        self.scheduler.reclaim = self.beams.release_parked
        self.kv_tier: KVTier | None = None
        self.attach_kv_tier(open_kv_tier(self.config, self.runner, self.kv_cache,
                                         self.events.emit))
        # Sampling fields the model's generation_config sets: defaults where a request is silent.
        self.default_sampling = model_sampling_defaults(self.runner.generation_config)
        self.logits_processor = LogitsProcessor(self.runner.hf_config.vocab_size, self.tokenizer,
                                                self.eos_token_ids, self.runner.device)
        self.generator = torch.Generator(self.runner.device).manual_seed(self.config.seed)
        spec = self.config.speculative_config
        self.speculator = (None if spec is None
                           else Speculator(spec, self.config.max_model_len))
        self.step_index = 0
        self._request_counter = itertools.count()
        self._forward_thread = (ThreadPoolExecutor(1, thread_name_prefix="kvscope-forward")
                                if self.config.async_scheduling else None)
        self._in_flight: InFlightStep | None = None

    # ---- requests in -------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | BeamSearchParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        source: str = "api",
        add_special_tokens: bool = True,
        cache_salt: str | None = None,
    ) -> Request:
        """Validate and queue one request; bad input raises ValueError and changes nothing.
        `cache_salt` (vLLM's): a non-empty string; only requests of one salt (or all
        unsalted) share prefix-cache blocks."""
        params = params or SamplingParams()
        check_priority(priority, self.config.scheduling_policy)
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt={cache_salt!r} must be a non-empty string")
        beam = None
        if isinstance(params, BeamSearchParams):
            beam, params = BeamState(params), params.sampling_params()
        request_id = request_id or f"req-{next(self._request_counter)}"
        if request_id in self.requests:
            raise ValueError(f"request_id={request_id!r} is already running")
        if isinstance(prompt, str):
            prompt_text = prompt
            token_ids = self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids
        else:
            prompt_text, token_ids = None, list(prompt)
            vocab = self.runner.hf_config.vocab_size
            # In C (map, set, min, max): a replay admits thousands of long prompts.
            if token_ids and (not set(map(type, token_ids)) <= {int} or min(token_ids) < 0
                              or max(token_ids) >= vocab):
                raise ValueError(f"prompt: token ids must be integers in [0, {vocab})")
        if params.truncate_prompt_tokens is not None and \
                len(token_ids) > params.truncate_prompt_tokens:
            token_ids = token_ids[-params.truncate_prompt_tokens:]  # keep the end, as vLLM
            prompt_text = self.tokenizer.decode(token_ids)
        self._check_fits(token_ids, beam.params.beam_width if beam else params.num_sequences)
        constraints = self.logits_processor.prepare(params)
        request = Request(request_id, prompt_text, token_ids, params,
                          arrival_time=arrival_time or time.time(), priority=priority,
                          cache_salt=cache_salt, source=source, beam=beam,
                          constraints=constraints)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs, request.prompt_token_ranks = [None], [None]
        seq = Sequence(f"{request_id}", request, 0, list(token_ids), len(token_ids))
        seq.generator = self._sample_generator(params, 0)
        request.sequences.append(seq)
        self.requests[request_id] = request
        self.scheduler.add(seq)
        return request

    def _check_fits(self, token_ids: list[int], num_samples: int) -> None:
        max_len = self.config.max_model_len
        if not token_ids:
            raise ValueError("prompt: empty prompt; give at least one token")
        if len(token_ids) >= max_len:
            raise ValueError(f"prompt: {len(token_ids)} tokens, but max_model_len={max_len} "
                             "leaves no room to generate; shorten the prompt or raise "
                             "max_model_len")
        # One full sequence plus a copy-on-write block per extra sample (in each KV cache
        # group) must fit the pool.
        kv = self.kv_cache
        needed = kv.num_groups * (kv.blocks_needed(len(token_ids) + 1) + num_samples - 1)
        if needed > self.kv_cache.pool.num_blocks:
            raise ValueError(f"n={num_samples} (samples or beam_width): a {len(token_ids)}-token"
                             f" prompt needs {needed} KV blocks at least, the pool has "
                             f"{self.kv_cache.pool.num_blocks}")

    def _sample_generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        """Sample i of a seeded request draws from its own generator seeded with seed + i."""
        if params.seed is None:
            return None
        return torch.Generator(self.runner.device).manual_seed(params.seed + index)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and return its blocks; unknown or finished ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        request.aborted = True
        for seq in request.sequences:
            if not seq.is_finished:
                self.finish(seq, FinishReason.ABORT)
        self.beams.forget(request)
        output = self._make_output(request)
        self.kv_costs.forget(request_id)
        return output

    def _allocate_caches(self) -> None:
        """This engine's KV cache and swap space on its runner. A runner holds one engine's
        cache: a weak reference to the tensor lets step() tell when a later engine built on
        the same runner has replaced it (stepping on would read and write that engine's
        blocks), without keeping it alive while that engine allocates its own."""
        self.runner.allocate_kv_cache(self.config.block_size, self.memory_plan.num_blocks,
                                      self.config.kv_cache_dtype)
        self.runner.allocate_swap_space(self.num_swap_blocks)
        if self.memory_plan.num_state_slots:
            self.runner.allocate_state_slots(self.memory_plan.num_state_slots)
        tensor = getattr(self.runner, "kv_cache", None)  # a simulated runner has none
        self._kv_cache_ref = weakref.ref(tensor) if tensor is not None else lambda: None

    def reallocate_caches(self) -> None:
        """Fresh caches for this engine after another one built on its runner took them
        (a refused reconfigure): the cached-free blocks no longer hold what their hashes
        say, so the prefix cache starts over."""
        self._allocate_caches()
        self.kv_cache.pool.reset_cache()
        if self.kv_tier is not None:
            self.kv_tier.forget_pending()

    def close(self) -> None:
        """Save what the disk tier lacks of the prefix cache and stop its I/O thread (a
        no-op without a tier)."""
        if self.kv_tier is not None:
            self.kv_tier.close()

    def attach_kv_tier(self, tier: KVTier | None) -> None:
        """Put `tier` below the pool (None: none), before any request: the pool's evictions
        go to it and a waiting prompt's prefix is asked of it. The engine opens the one its
        config asks for; the replay's simulator attaches its own."""
        self.kv_tier = tier
        if tier is not None:
            self.events.subscribe(tier.observe)
            self.scheduler.fetch_prefix = tier.fetch

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or a forward still running (async scheduling): step()
        until this is False, and the engine is idle."""
        return bool(self.requests) or self._in_flight is not None

    # ---- one step ----------------------------------------------------------------------
    def live_sequences(self) -> list[Sequence]:
        """Every unfinished sequence: running, waiting, and beams parked between steps."""
        return [*self.scheduler.running, *self.scheduler.waiting, *self.beams.parked]

    def holding_sequences(self) -> list[Sequence]:
        """Sequences holding device blocks, whose tokens move from step to step: running
        ones and beams parked between steps."""
        return [*self.scheduler.running, *self.beams.parked]

    @property
    def num_running(self) -> int:
        """Sequences holding device blocks: running ones and parked beams."""
        return len(self.scheduler.running) + len(self.beams.parked)

    @property
    def num_waiting(self) -> int:
        """Sequences waiting to run, those whose prefix the disk tier is loading too."""
        loading = self.kv_tier.num_loading if self.kv_tier is not None else 0
        return len(self.scheduler.waiting) + loading

    def step(self, on_scheduled: Callable[[SchedulerOutput], None] | None = None
             ) -> StepResult:
        """One step: schedule, run the forward, sample, and the outputs and record.

        `on_scheduled` sees each plan after the scheduler admitted sequences and gave them
        blocks, before the model runs: a served engine publishes the pool then, so a long
        prefill reads as running, its blocks filling chunk by chunk, while the step
        computes (not as waiting until the step ends).

        With async scheduling (EngineConfig.async_scheduling) the forward runs on a thread
        of its own, and the step overlaps it: this step's forward was launched by the step
        before, and while it runs the next one is scheduled, assuming each sequence that
        samples gets one token (a placeholder). Once this step has sampled, the next
        forward starts without the sequences that finished, and this step's outputs are
        made while it runs."""
        self.runner.wait_until_resident()
        current = self._in_flight or self._launch(self._schedule(on_scheduled, self.step_index))
        self._in_flight = None
        ahead = (self._schedule(on_scheduled, self.step_index + 1) if self._schedules_ahead()
                 else None)
        logits, prompt_logits = self._wait(current, ahead)
        # Before sampling: a sequence that finishes now still holds the step's blocks.
        self.kv_costs.observe(current.plan, time.time() - current.start_time)
        # Read before the next forward (launched below) overwrites them.
        expert_tokens = (self.runner.expert_tokens.clone() if self.expert_layout is not None
                         and current.plan.scheduled else None)
        for index, chunk_logits in prompt_logits.items():
            _record_prompt_logprobs(current.plan.scheduled[index], chunk_logits)
        for item in current.plan.scheduled:
            if item.seq.status is SequenceStatus.RUNNING:  # not preempted since
                self.kv_cache.cache_full_blocks(item.seq)
        touched, num_generated, drafts = (self._sample_and_update(current.sampling, logits)
                                          if current.sampling else ([], 0, ()))
        if ahead is not None:
            self._in_flight = self._launch_ahead(ahead)
        finished = [r for r in touched if r.finished]
        outputs = [self._make_output(r) for r in touched]
        for request in finished:
            self.requests.pop(request.request_id, None)
            self.kv_costs.forget(request.request_id)
        record = record_step(self, current.plan, current.start_time, finished, num_generated,
                             drafts, expert_tokens)
        if self.speculator is not None:
            self.speculator.observe_step(current.plan, record.end_time - record.start_time)
        self.step_index += 1
        return StepResult(outputs, record)

    def _schedules_ahead(self) -> bool:
        """Beam search ranks and forks whole families between steps, so while a beam
        request runs, steps do not overlap."""
        return self._forward_thread is not None and not any(
            request.beam is not None for request in self.requests.values())

    def _schedule(self, on_scheduled: Callable[[SchedulerOutput], None] | None,
                  step: int) -> SchedulerOutput:
        """The plan of engine step `step`."""
        now = time.time()
        self.kv_cache.step = step
        counters = self.kv_cache.stat_totals()
        if self.kv_tier is not None:
            self._requeue_loaded()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        plan = self.scheduler.schedule()
        plan.stat_deltas = tuple(after - before for after, before
                                 in zip(self.kv_cache.stat_totals(), counters))
        if on_scheduled is not None:
            on_scheduled(plan)
        for item in plan.scheduled:
            if item.seq.first_scheduled_time is None:
                item.seq.first_scheduled_time = now
        return plan

    def _requeue_loaded(self) -> None:
        """Sequences whose prefix the disk tier loaded go back to the front of the queue
        (waiting for a load only when nothing else could run)."""
        idle = not self.scheduler.running and not self.scheduler.waiting
        for seq in reversed(self.kv_tier.receive(wait=idle)):
            self.scheduler.waiting.appendleft(seq)

    def _move_blocks(self, plan: SchedulerOutput) -> None:
        """The disk tier's copies first (evicted blocks out, loaded ones in: this plan's
        writes may reuse those blocks), then the plan's own block moves."""
        if self.kv_tier is not None:
            self.kv_tier.sync()
        self.runner.move_blocks(plan)

    def _launch(self, plan: SchedulerOutput) -> InFlightStep:
        """Move the plan's blocks and start its forward. Its tokens count as computed from
        here on (proposals only once verification accepts them); a sequence that samples
        holds a placeholder for its next token until the step has sampled."""
        if getattr(self.runner, "kv_cache", None) is not self._kv_cache_ref():
            raise RuntimeError("this engine's KV cache was replaced: another EngineCore was "
                               "built on its model runner since, and a runner holds one "
                               "engine's cache (give each engine that steps its own runner)")
        start_time = time.time()
        if self.kv_cache.state_slots is not None:
            plan.state_copies = self.kv_cache.state_slots.take_copies()
        self._move_blocks(plan)
        sampling = [item for item in plan.scheduled if item.samples]
        forward = Future()
        if plan.scheduled:
            prepared = self.runner.prepare(plan.scheduled, _prompt_logprob_items(plan))
            if self._forward_thread is not None:
                forward = self._forward_thread.submit(self.runner.execute, prepared)
            else:
                try:
                    forward.set_result(self.runner.execute(prepared))
                except Exception as error:  # noqa: BLE001 -- raised where the step waits
                    forward.set_exception(error)
        else:
            forward.set_result((None, {}))
        for item in plan.scheduled:
            item.seq.num_computed_tokens = item.start + item.num_real_tokens
        for item in sampling:
            item.seq.num_output_placeholders = 1
        return InFlightStep(plan, sampling, start_time, forward)

    def _launch_ahead(self, plan: SchedulerOutput) -> InFlightStep | None:
        """Launch a plan scheduled while the step before ran, less the sequences that step
        finished (or an abort did); None if nothing is left to do."""
        plan.scheduled = [item for item in plan.scheduled if not item.seq.is_finished]
        plan.num_scheduled_tokens = sum(item.num_tokens for item in plan.scheduled)
        if not (plan.scheduled or plan.preempted):
            return None  # its copy-on-write copies were for sequences that finished
        return self._launch(plan)

    def _wait(self, step: InFlightStep, ahead: SchedulerOutput | None
              ) -> tuple[StepLogits | None, dict[int, torch.Tensor]]:
        """The step's forward's result. If the forward failed, its sequences' tokens count
        as not computed again, and the block moves the next plan made (swaps and
        copy-on-write copies, which its block tables already point at) are done, so the
        sequences that outlive the failure hold exactly the K/V they count."""
        try:
            return step.forward.result()
        except BaseException:
            for item in step.plan.scheduled:
                item.seq.num_computed_tokens = min(item.seq.num_computed_tokens, item.start)
            if ahead is not None:
                self._move_blocks(ahead)
            raise
        finally:
            for item in step.sampling:
                item.seq.num_output_placeholders = 0

    def _sample_and_update(self, sampling: list[ScheduledSequence], logits: StepLogits
                           ) -> tuple[list[Request], int, tuple[SpecDraft, ...]]:
        """Sample a token for every sequence that reached its end (beams collect ranked
        candidates instead) and verify proposals; returns the requests touched, the tokens
        generated and the proposals verified."""
        rows: list[tuple[Sequence, int]] = []
        touched: dict[str, Request] = {}
        proposals: dict[Sequence, list[int]] = {}
        proposal_probs: dict[Sequence, torch.Tensor] = {}  # a draft model's q, where sampled
        row = 0  # a sequence with k proposals has k + 1 rows of logits
        for item in sampling:
            seq = item.seq
            if seq.is_finished:  # aborted while its forward ran (async scheduling)
                row += 1 + len(item.spec_token_ids)
                continue
            touched[seq.request.request_id] = seq.request
            if seq.request.beam is not None:
                self.beams.rank(seq, logits[row])
                row += 1
                continue
            family = [seq] + [self.fork(seq, index)
                              for index in range(1, 1 + seq.request.num_pending_forks)]
            rows.extend((member, row) for member in family)
            if item.spec_token_ids:
                proposals[seq] = item.spec_token_ids
            if item.spec_probs is not None:
                proposal_probs[seq] = item.spec_probs
            row += 1 + len(item.spec_token_ids)
        num_generated = 0
        accepted = dict.fromkeys(proposals, 0)
        # Proposal by proposal: each row is sampled (or verifies its proposal) with the
        # sequence's state after the tokens accepted before it, through the same logits
        # edits, stop checks and update path as any step; a sequence goes on to its next
        # row only while its proposals are accepted and it has not finished.
        position = 0
        while rows:
            drafts = [_proposal_at(proposals.get(seq), position) for seq, _ in rows]
            tokens = self._sample_rows(rows, logits, drafts,
                                       _probs_at(proposal_probs, rows, position))
            num_generated += len(rows)
            next_rows = []
            for (seq, row), token, draft in zip(rows, tokens, drafts):
                if token == draft:
                    accepted[seq] += 1
                    seq.num_computed_tokens += 1  # the proposal's K/V holds
                    if not seq.is_finished:
                        next_rows.append((seq, row + 1))
            rows, position = next_rows, position + 1
        for request in touched.values():
            if request.beam is not None and self.beams.ready(request):
                num_generated += self.beams.advance(request, self)
        return list(touched.values()), num_generated, self._roll_back(proposals, accepted)

    def _sample_rows(self, rows: list[tuple[Sequence, int]], logits: StepLogits,
                     drafts: list[int], draft_probs: torch.Tensor | None = None) -> list[int]:
        """One token for each (sequence, row of logits), appended through the update path;
        a draft >= 0 is verified (the token equals it exactly when accepted) against the
        distribution it was drawn from (`draft_probs` rows; None: deterministic)."""
        if isinstance(logits, list):  # an executor without a forward chose the tokens
            tokens = [logits[row] for _, row in rows]
            for (seq, _), token in zip(rows, tokens):
                self.append_token(seq, token, 0.0)
            return tokens
        seqs = [seq for seq, _ in rows]
        row_ids = [row for _, row in rows]
        # Usually every row samples once, in order: no 12 MB copy (64 rows, 49k vocab).
        raw = logits if row_ids == list(range(logits.shape[0])) else logits[row_ids]
        result = sample(self.logits_processor.apply(raw, seqs),
                        [seq.request.params for seq in seqs],
                        [seq.generator for seq in seqs], self.generator, raw_logits=raw,
                        greedy_tokens=self.runner.kernel_ops.greedy_tokens,
                        draft_token_ids=drafts if any(d >= 0 for d in drafts) else None,
                        draft_probs=draft_probs)
        self.logits_processor.accept(seqs, result.token_ids)
        for i, seq in enumerate(seqs):
            top = result.top_logprobs[i] if seq.request.params.logprobs is not None else None
            self.append_token(seq, result.token_ids[i], result.logprobs[i], top)
        return result.token_ids

    def _roll_back(self, proposals: dict[Sequence, list[int]], accepted: dict[Sequence, int]
                   ) -> tuple[SpecDraft, ...]:
        """Release the slots of rejected proposals (blocks past the accepted tokens go back
        to the pool), cache the blocks accepted tokens filled, and count what was kept."""
        drafts = []
        for seq, tokens in proposals.items():
            drafts.append((seq.seq_id, len(tokens), accepted[seq]))
            self.speculator.observe(seq, len(tokens), accepted[seq])
            if not seq.is_finished:
                self.kv_cache.truncate(seq, seq.num_computed_tokens)
                self.kv_cache.cache_full_blocks(seq)
        return tuple(drafts)

    # ---- the update path: the only code that changes sequences after a step -------------
    def append_token(self, seq: Sequence, token: int, logprob: float,
                     top_logprobs: dict[int, float] | None = None) -> None:
        seq.token_ids.append(token)
        seq.cumulative_logprob += logprob
        if top_logprobs is not None:
            seq.logprobs = (seq.logprobs or []) + [{**top_logprobs, token: logprob}]
        if seq.first_token_time is None:
            seq.first_token_time = time.time()
        if seq.request.params.detokenize:
            detokenize_incrementally(self.tokenizer, seq, seq.request.params.skip_special_tokens)
        if seq.request.beam is None:
            self._check_stop(seq, token)
            if seq.finish_reason is not None:
                self.finish(seq, seq.finish_reason)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finish_reason = reason
        seq.finished_time = time.time()
        self.scheduler.finish(seq)

    def fork(self, parent: Sequence, index: int) -> Sequence:
        """A new sequence sharing all of the parent's blocks (copy-on-write on first write):
        sample `index` of a parallel-sampling request, or a beam that branches."""
        request = parent.request
        child = Sequence(f"{request.request_id}#{index}", request, index,
                         list(parent.token_ids), parent.num_prompt_tokens,
                         generator=self._sample_generator(request.params, index),
                         cumulative_logprob=parent.cumulative_logprob, text=parent.text,
                         prefix_offset=parent.prefix_offset, read_offset=parent.read_offset,
                         first_scheduled_time=parent.first_scheduled_time,
                         first_token_time=parent.first_token_time)
        self.scheduler.fork(parent, child)
        request.sequences.append(child)
        return child

    def _check_stop(self, seq: Sequence, token: int) -> None:
        params = seq.request.params
        if seq.num_output_tokens < params.min_tokens:  # only the length limits apply
            if seq.reaches_length_limit(self.config.max_model_len):
                seq.finish_reason = FinishReason.LENGTH
        elif not params.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = FinishReason.STOP
        elif token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, token
        elif params.stop_strings and self._truncate_at_stop_string(seq):
            seq.finish_reason = FinishReason.STOP
        elif self.logits_processor.grammar_finished(seq):
            seq.finish_reason = FinishReason.STOP
        elif seq.reaches_length_limit(self.config.max_model_len):
            seq.finish_reason = FinishReason.LENGTH

    @staticmethod
    def _truncate_at_stop_string(seq: Sequence) -> bool:
        """Cut the text before the first stop string (which is not part of the output)."""
        found = [(seq.text.find(stop), stop) for stop in seq.request.params.stop_strings]
        found = [(index, stop) for index, stop in found if index >= 0]
        if not found:
            return False
        index, stop = min(found)
        seq.text = seq.text[:index]
        seq.stop_reason = stop
        return True

    # ---- outputs -----------------------------------------------------------------------
    def _make_output(self, request: Request) -> RequestOutput:
        if request.beam is not None and request.beam.done:
            return self._beam_output(request)
        completions, deltas = [], []
        stop_strings = request.params.stop_strings
        hold_back = max(map(len, stop_strings)) - 1 if stop_strings else 0
        for seq in request.sequences:
            # While running, hold back text that could still turn out to start a stop string.
            visible = len(seq.text) if seq.is_finished else max(len(seq.text) - hold_back, 0)
            deltas.append(seq.text[seq.num_emitted_chars:visible])
            seq.num_emitted_chars = max(seq.num_emitted_chars, visible)
            completions.append(CompletionOutput(
                seq.index, seq.text[:visible], seq.output_token_ids,
                seq.cumulative_logprob, seq.logprobs, seq.finish_reason, seq.stop_reason))
        first, finished = request.sequences[0], request.finished
        metrics = RequestMetrics(
            request.arrival_time, first.first_scheduled_time, first.first_token_time,
            max([s.finished_time or 0 for s in request.sequences]) or None,
            sum([s.num_preemptions for s in request.sequences]))
        if request.params.num_sequences > request.params.n:
            completions, deltas = _best_of(completions, deltas, request.params.n, finished)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                             completions, finished, request.num_cached_tokens,
                             metrics, deltas=deltas, prompt_logprobs=request.prompt_logprobs,
                             prompt_token_ranks=request.prompt_token_ranks,
                             kv=self.kv_costs.cost(request))

    def _beam_output(self, request: Request) -> RequestOutput:
        """The best beam_width hypotheses, best first."""
        completions = []
        for index, hypothesis in enumerate(request.beam.best()):
            ended_by_eos = hypothesis.token_ids[-1] in self.eos_token_ids
            completions.append(CompletionOutput(
                index, self.tokenizer.decode(hypothesis.token_ids, skip_special_tokens=True),
                hypothesis.token_ids, hypothesis.cumulative_logprob,
                finish_reason=FinishReason.STOP if ended_by_eos else FinishReason.LENGTH))
        first = request.sequences[0] if request.sequences else None
        metrics = RequestMetrics(request.arrival_time,
                                 first.first_scheduled_time if first else None,
                                 first.first_token_time if first else None, time.time())
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                             completions, True, request.num_cached_tokens, metrics,
                             deltas=[c.text for c in completions],
                             kv=self.kv_costs.cost(request))


def _eos_token_ids(runner: StepExecutor) -> set[int]:
    """EOS from the generation config (may be a list) and from the tokenizer."""
    ids = set()
    for source in (runner.hf_config.eos_token_id, runner.tokenizer.eos_token_id,
                   runner.generation_config.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return ids


def _proposal_at(tokens: list[int] | None, position: int) -> int:
    """The proposed token a sequence's row at `position` verifies, or -1 (none: it samples)."""
    return tokens[position] if tokens is not None and position < len(tokens) else -1


def _probs_at(probs: dict[Sequence, torch.Tensor], rows: list[tuple[Sequence, int]],
              position: int) -> torch.Tensor | None:
    """The q rows of the proposals verified at `position` ([rows, vocab]; zeros where a row
    has none: it samples, verifies greedily or verifies a deterministic proposal), or None
    when no row has one."""
    if not probs:
        return None
    first = next(iter(probs.values()))
    q = first.new_zeros((len(rows), first.shape[1]))
    for index, (seq, _) in enumerate(rows):
        if seq in probs and position < len(probs[seq]):
            q[index] = probs[seq][position]
    return q


# ---- prompt logprobs and best_of -----------------------------------------------------------
def _prompt_logprob_items(plan: SchedulerOutput) -> tuple[int, ...]:
    """Scheduled chunks whose positions score prompt tokens not scored yet (a sequence
    recomputed after preemption has some or all of them already)."""
    return tuple(index for index, item in enumerate(plan.scheduled)
                 if item.seq.request.prompt_logprobs is not None
                 and len(item.seq.request.prompt_logprobs) < _scored_end(item) + 1)


def _scored_end(item: ScheduledSequence) -> int:
    """Positions [start, end) score tokens start+1..end; the last prompt token scores nothing."""
    return min(item.end, item.seq.num_prompt_tokens - 1)


def _record_prompt_logprobs(item: ScheduledSequence, chunk_logits: torch.Tensor) -> None:
    """Position p's logits score prompt token p + 1; entries so far cover tokens < first."""
    seq, request = item.seq, item.seq.request
    first, end = len(request.prompt_logprobs), _scored_end(item)
    entries, ranks = token_logprobs(
        chunk_logits[first - 1 - item.start:end - item.start], seq.token_ids[first:end + 1],
        request.params.prompt_logprobs)
    request.prompt_logprobs.extend(entries)
    request.prompt_token_ranks.extend(ranks)


def _best_of(completions: list[CompletionOutput], deltas: list[str], n: int,
             finished: bool) -> tuple[list[CompletionOutput], list[str]]:
    """The n samples of the highest cumulative logprob, re-indexed 0..n-1 (the first n
    while they still run)."""
    order = list(range(len(completions)))
    if finished:
        order.sort(key=lambda i: -completions[i].cumulative_logprob)
    chosen = order[:n]
    for index, i in enumerate(chosen):
        completions[i].index = index
    return [completions[i] for i in chosen], [deltas[i] for i in chosen]
