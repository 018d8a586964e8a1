"""EngineView: the typed interface every front end (the API, /metrics, /ws/events, the
dashboard, the session recorder, app.py) uses, whether one engine serves or many."""

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from kvscope.engine.config import EngineConfig
from kvscope.engine.core.state_slots import SlotTable
from kvscope.engine.orchestrator.async_engine import EngineCounters, ReplicaStatus
from kvscope.engine.orchestrator.streams import Channel, RequestStream
from kvscope.engine.replicas.router import RoutingDecision
from kvscope.engine.replicas.router_view import RouterView
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.telemetry.records import EngineSnapshot
from kvscope.engine.worker.memory import MemoryPlan
from kvscope.engine.worker.models.moe import ExpertLayout


@runtime_checkable
class EngineView(Protocol):
    """What a front end may do with a running engine: AsyncEngine (one engine, replica 0,
    no routing) and engine.replicas.ReplicaSet (replicas behind a router) are both one.

    Nothing here exposes the scheduler or the block pool: readers get streams, records
    and snapshots taken on the engine thread. A single engine answers the replica
    questions with its trivial answer (one replica, no routing decisions), so a front end
    never asks which kind it holds.
    """

    # ---- what it serves ------------------------------------------------------------------
    @property
    def config(self) -> EngineConfig:
        """The current resolved config (a new object after each reconfigure)."""

    @property
    def memory_plan(self) -> MemoryPlan:
        """The current pool's size and what it holds."""

    @property
    def tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer."""

    @property
    def default_sampling(self) -> dict:
        """Sampling fields from the model's generation_config."""

    @property
    def model_path(self) -> str:
        """The model folder (or .gguf file) the engine runs."""

    @property
    def expert_layout(self) -> ExpertLayout | None:
        """A mixture-of-experts model's experts (layers, experts, top-k, bytes each); None
        for a dense model."""

    def resolved_identity(self) -> dict[str, str]:
        """The model, dtype and device actually running ("auto" and None resolved)."""

    # ---- health ----------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        """False once stopped (or every replica is down)."""

    @property
    def is_reconfiguring(self) -> bool:
        """True while a reconfigure rebuilds the pool (new requests wait)."""

    @property
    def num_replicas(self) -> int:
        """Engine replicas (1 for a single engine)."""

    def replica_statuses(self) -> list[ReplicaStatus]:
        """One status per replica, in replica order."""

    def counters(self) -> EngineCounters:
        """Monotonic totals over every replica."""

    # ---- requests --------------------------------------------------------------------------
    def submit(self, prompt: str | list[int], params: SamplingParams | None = None, *,
               request_id: str | None = None, source: str = "api", priority: int = 0,
               add_special_tokens: bool = True, cache_salt: str | None = None,
               ) -> RequestStream:
        """Queue a request; its outputs arrive on the returned stream."""

    def submit_chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None,
                    *, chat_template_kwargs: dict[str, Any] | None = None,
                    **kwargs: Any) -> RequestStream:
        """Queue a conversation, rendered with the model's chat template."""

    def render_chat(self, messages: list[dict[str, Any]], **template_options: Any) -> str:
        """The prompt text of a conversation, ending with the assistant's turn (options:
        engine.orchestrator.chat.render_chat's `tools`, `chat_template_kwargs`, ...)."""

    # ---- readers ---------------------------------------------------------------------------
    def snapshot(self, timeout: float | None = 10.0, replica: int | None = None) -> EngineSnapshot:
        """One replica's pool and queues at one instant between steps."""

    def state_slot_table(self, replica: int | None = None) -> SlotTable | None:
        """One replica's recurrent-layer state slots now (None: no recurrent layers)."""

    def subscribe_steps(self, maxsize: int = 1024) -> Channel:
        """Every StepRecord from now on, of every replica (a slow reader loses the oldest)."""

    def subscribe_kv_events(self, listener: Any) -> None:
        """Every KV event of the pool (engine.core.kv_events), across reconfigures; one
        engine only (a ReplicaSet refuses: its replicas' pools are in other processes)."""

    def subscribe_requests(self, maxsize: int = 10_000) -> Channel:
        """A RequestRecord for every request that ends from now on."""

    def subscribe_pool(self, maxsize: int = ..., replica: int | None = None) -> Channel:
        """One replica's block pool as a full snapshot, then one delta per step (a
        PoolMirror's input)."""

    def resync_pool(self, channel: Channel) -> None:
        """Send a pool subscriber that lost records a fresh full snapshot."""

    # ---- routing (a single engine routes nothing) ----------------------------------------
    @property
    def routing(self) -> str | None:
        """The router's policy; None for a single engine."""

    @property
    def routing_load_weight(self) -> float | None:
        """The kv-aware policy's load weight; None for a single engine."""

    @property
    def recent_decisions(self) -> Sequence[RoutingDecision]:
        """The latest routing decisions, oldest first (none for a single engine)."""

    def set_routing(self, policy: str | None = None, load_weight: float | None = None) -> None:
        """Change how later requests are routed (ValueError names a bad value, or says a
        single engine does not route)."""

    def subscribe_decisions(self, maxsize: int = 1024) -> Channel:
        """Every RoutingDecision from now on (a single engine's channel stays empty)."""

    def router_view(self, timeout: float | None = 10.0) -> RouterView | None:
        """The router's prefix index beside each live replica's prefix cache (its
        staleness too), and the routed requests' predicted prefix hits beside the hits
        their replicas had; None for a single engine."""

    # ---- control ---------------------------------------------------------------------------
    def reconfigure(self, abort_running: bool = False, timeout: float | None = None,
                    **knobs: Any) -> MemoryPlan:
        """Rebuild the pool with new knobs (ValueError names a bad one; nothing changes)."""

    def shutdown(self, abort_running: bool = True, timeout: float | None = 30.0) -> None:
        """Stop taking requests, abort (or finish) the running ones, stop."""


def resolved_config(engine: EngineView) -> dict[str, Any]:
    """The engine's knobs as it runs them, for logs and exports: what "auto" and None
    became for the model, dtype and device, not the words the config was given."""
    return {**engine.config.to_dict(), **engine.resolved_identity()}
