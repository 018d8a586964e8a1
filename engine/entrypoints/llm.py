"""Offline API as in vLLM: LLM(...).generate(prompts, SamplingParams) and .chat(messages)."""

import logging
from collections.abc import Sequence as SequenceOf
from typing import Any

from tqdm.auto import tqdm

from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.beam_search import BeamSearchParams
from kvscope.engine.orchestrator.chat import render_chat
from kvscope.engine.orchestrator.engine_core import EngineCore
from kvscope.engine.outputs import RequestOutput
from kvscope.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
PromptType = str | list[int] | dict[str, Any]
# vLLM knobs that mean nothing for a single-device engine; accepted so its examples run.
IGNORED_VLLM_KNOBS = {"trust_remote_code", "tokenizer", "disable_log_stats"}


class LLM:
    """Load a model once, then generate for batches of prompts with continuous batching.

    With `replicas` > 1 (or a `ray_address`) the model runs in that many engine replicas on
    Ray (engine.replicas.ReplicaSet: a local cluster unless `ray_address` names one) and a
    batch's requests are routed among them by `routing`; call shutdown() when done.
    """

    def __init__(self, model: str | None = None, tensor_parallel_size: int = 1, *,
                 replicas: int = 1, ray_address: str | None = None, routing: str = "kv-aware",
                 **knobs: Any):
        if tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size}: kvscope runs on "
                             "one device; use 1")
        for name in IGNORED_VLLM_KNOBS & set(knobs):
            logger.info("ignoring vLLM knob %s=%r", name, knobs.pop(name))
        config = EngineConfig(model=model, **knobs)
        self.replicas = None
        if replicas == 1 and ray_address is None:
            self.engine = EngineCore(config)
        else:
            from kvscope.engine.replicas.replica_set import ReplicaSet  # imports Ray: only here

            self.engine = self.replicas = ReplicaSet(config, replicas, routing=routing,
                                                     ray_address=ray_address)
        self.config = self.engine.config

    def shutdown(self) -> None:
        """Stop the replicas' Ray actors, or close the in-process engine (its disk tier
        saves what it lacks of the prefix cache)."""
        if self.replicas is not None:
            self.replicas.shutdown()
        else:
            self.engine.close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config defaults (vLLM's behaviour
        when generate() or chat() get no sampling_params)."""
        return SamplingParams(**self.engine.default_sampling)

    def generate(
        self,
        prompts: PromptType | SequenceOf[PromptType],
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: int | list[int] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts` (a string, token ids, or a list of either; a
        dict {"prompt" or "prompt_token_ids": ..., "cache_salt": ...} as in vLLM: only
        prompts of one salt share prefix-cache blocks). `priority` (vLLM's argument: one
        per prompt, or one for all; lower first) needs scheduling_policy="priority"."""
        prompts = _as_prompt_list(prompts)
        return self._run([(p, False) for p in prompts], sampling_params, use_tqdm, priority)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them.
        `chat_template_kwargs` (e.g. `{"enable_thinking": False}`) and `tools` reach the
        template as variables, as in vLLM's LLM.chat."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [render_chat(self.engine.tokenizer, conversation, add_generation_prompt,
                               tools=tools, chat_template_kwargs=chat_template_kwargs)
                   for conversation in conversations]
        # The template already holds the special tokens; do not add a second BOS.
        return self._run([(p, True) for p in prompts], sampling_params, use_tqdm)

    def beam_search(
        self,
        prompts: PromptType | SequenceOf[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Beam search per prompt; each output holds the best beam_width beams, best first."""
        prompts = _as_prompt_list(prompts)
        return self._run([(p, False) for p in prompts], [params] * len(prompts), use_tqdm)

    def _run(self, prompts: list[tuple[PromptType, bool]], sampling_params,
             use_tqdm: bool, priority: int | list[int] | None = None) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params,
                                                 (SamplingParams, BeamSearchParams)):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} "
                                 "prompts; give one, or one per prompt")
        if priority is None or isinstance(priority, int):
            priorities = [priority or 0] * len(prompts)
        else:
            priorities = list(priority)
            if len(priorities) != len(prompts):
                raise ValueError(f"priority: {len(priorities)} given for {len(prompts)} "
                                 "prompts; give one, or one per prompt")
        jobs = [(prompt.get("prompt_token_ids") or prompt.get("prompt")
                 if isinstance(prompt, dict) else prompt, p, not templated, rank,
                 prompt.get("cache_salt") if isinstance(prompt, dict) else None)
                for (prompt, templated), p, rank in zip(prompts, params, priorities)]
        if self.replicas is not None:
            return self._run_on_replicas(jobs, use_tqdm)
        request_ids = []
        try:
            for prompt, p, add_special_tokens, rank, cache_salt in jobs:
                request = self.engine.add_request(prompt, p, add_special_tokens=add_special_tokens,
                                                  source="offline", priority=rank,
                                                  cache_salt=cache_salt)
                request_ids.append(request.request_id)
            return self._drain(request_ids, use_tqdm)
        except BaseException:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise

    def _run_on_replicas(self, jobs: list, use_tqdm: bool) -> list[RequestOutput]:
        """Submit every request at once (the router spreads them), then read each stream
        to its final output; a request a replica refused or lost raises its error."""
        streams = []
        try:
            for prompt, params, add_special_tokens, rank, cache_salt in jobs:
                streams.append(self.replicas.submit(prompt, params, source="offline",
                                                    priority=rank,
                                                    add_special_tokens=add_special_tokens,
                                                    cache_salt=cache_salt))
            outputs = []
            for stream in tqdm(streams, desc="Processed prompts", disable=not use_tqdm,
                               dynamic_ncols=True):
                outputs.append(list(stream)[-1])
            return outputs
        except BaseException:
            for stream in streams:
                stream.abort()
            raise

    def _drain(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm,
                  dynamic_ncols=True) as bar:
            while len(finished) < len(wanted):
                for output in self.engine.step().outputs:
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[request_id] for request_id in request_ids]


def _as_prompt_list(prompts) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):
        return [prompts]  # one prompt given as token ids
    return prompts
