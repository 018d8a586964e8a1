"""EngineView: the small typed interface the dashboard (and any other front end) uses."""

from typing import Any, Protocol, runtime_checkable

from kvscope.engine.config import EngineConfig
from kvscope.engine.frontend.streams import Channel, RequestStream
from kvscope.engine.sample.sampling_params import SamplingParams
from kvscope.engine.telemetry.records import EngineSnapshot
from kvscope.engine.worker.memory import MemoryPlan


@runtime_checkable
class EngineView(Protocol):
    """What a front end may do with a running engine; AsyncEngine is one.

    Nothing here exposes the scheduler or the block pool: readers get streams, records
    and snapshots taken on the engine thread.
    """

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

    def submit(self, prompt: str | list[int], params: SamplingParams | None = None, *,
               request_id: str | None = None, source: str = "api", priority: int = 0,
               add_special_tokens: bool = True) -> RequestStream:
        """Queue a request; its outputs arrive on the returned stream."""

    def submit_chat(self, messages: list[dict[str, Any]], params: SamplingParams | None = None,
                    **kwargs: Any) -> RequestStream:
        """Queue a conversation, rendered with the model's chat template."""

    def snapshot(self, timeout: float | None = 10.0) -> EngineSnapshot:
        """The whole pool and queues at one instant between steps."""

    def subscribe_steps(self, maxsize: int = 1024) -> Channel:
        """Every StepRecord from now on (a slow reader loses the oldest)."""

    def subscribe_requests(self, maxsize: int = 10_000) -> Channel:
        """A RequestRecord for every request that ends from now on."""

    def subscribe_pool(self, maxsize: int = ...) -> Channel:
        """The block pool as a full snapshot, then one delta per step (PoolMirror's input)."""

    def resync_pool(self, channel: Channel) -> None:
        """Send a pool subscriber that lost records a fresh full snapshot."""

    def reconfigure(self, abort_running: bool = False, timeout: float | None = None,
                    **knobs: Any) -> MemoryPlan:
        """Rebuild the pool with new knobs (ValueError names a bad one; nothing changes)."""
