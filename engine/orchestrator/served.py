"""What a served engine answers alike whether one engine serves (AsyncEngine) or replicas
do (replicas.ReplicaSet): the model and pool it runs, and chat on top of its own submit."""

from dataclasses import dataclass
from typing import Any

from kvscope.engine.config import EngineConfig
from kvscope.engine.orchestrator.chat import render_chat
from kvscope.engine.orchestrator.engine_core import EngineCore
from kvscope.engine.orchestrator.streams import RequestStream
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.worker.memory import MemoryPlan
from kvscope.engine.worker.models.moe import ExpertLayout


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What an engine runs: its resolved config, its pool, the model, dtype and device
    ("auto" and None resolved) and the sampling defaults of the model's generation_config.
    A replica sends it to the API process when it (re)starts."""

    config: EngineConfig
    memory_plan: MemoryPlan
    identity: dict[str, str]
    default_sampling: dict
    # A mixture-of-experts model's experts (the dashboard's Experts panel); None if dense.
    expert_layout: ExpertLayout | None = None

    @classmethod
    def of(cls, core: EngineCore) -> "ServedModel":
        runner = core.runner
        return cls(core.config, core.memory_plan,
                   {"model": str(runner.model_path),
                    "dtype": str(runner.dtype).removeprefix("torch."),
                    "device": str(runner.device)},
                   core.default_sampling, core.expert_layout)


class ServedEngine:
    """The EngineView answers both kinds of served engine give from a ServedModel, and chat
    through their own `submit` and `tokenizer`. A subclass says what it serves now."""

    @property
    def served(self) -> ServedModel:
        raise NotImplementedError

    @property
    def config(self) -> EngineConfig:
        """The current resolved config (a new object after each reconfigure)."""
        return self.served.config

    @property
    def memory_plan(self) -> MemoryPlan:
        return self.served.memory_plan

    @property
    def default_sampling(self) -> dict:
        """Sampling fields from the model's generation_config (see model_sampling_defaults)."""
        return self.served.default_sampling

    @property
    def model_path(self) -> str:
        return self.served.identity["model"]

    @property
    def expert_layout(self) -> ExpertLayout | None:
        return self.served.expert_layout

    def resolved_identity(self) -> dict[str, str]:
        """The model folder, dtype and device the engine runs, whatever the config said
        ("auto", or None for the default model)."""
        return dict(self.served.identity)

    def submit_chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None,
                    *, chat_template_kwargs: dict[str, Any] | None = None,
                    **kwargs: Any) -> RequestStream:
        """Apply the model's chat template (with `chat_template_kwargs`, e.g. Qwen3's
        `enable_thinking`), then submit (the template holds the BOS)."""
        prompt = self.render_chat(messages, chat_template_kwargs=chat_template_kwargs)
        return self.submit(prompt, params, add_special_tokens=False, **kwargs)

    def render_chat(self, messages: list[dict[str, Any]], **template_options: Any) -> str:
        """The prompt text of a conversation, ending with the assistant's turn (options:
        render_chat's `tools`, `chat_template_kwargs`, `add_generation_prompt`)."""
        return render_chat(self.tokenizer, messages, **template_options)
