"""SQLAlchemy tables of the session log: sessions, requests, steps, chat messages, configs."""

from sqlalchemy import JSON, Float, ForeignKey, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Bump when a table changes, and add the step from the previous version to MIGRATIONS
# in storage.schema, so files written by older versions keep opening.
# 2: per-step cache statistics; 3: the engine replica; 4: routing decisions;
# 5: what a replay needs (prompt and output token ids, sampling params, arrival offset);
# 6: each step's verified speculative proposals; 7: the pool's records (pool_records);
# 8: mixture-of-experts routing; 9: preemption causes; 10: prefix-miss causes; 11: the
# disk tier per step (the tier_* columns).
SCHEMA_VERSION = 11


class Base(DeclarativeBase):
    pass


class SchemaVersion(Base):
    __tablename__ = "schema_version"

    version: Mapped[int] = mapped_column(Integer, primary_key=True)


class SessionRow(Base):
    """One run of the app: its model and engine config (the latest, after reconfigures)."""

    __tablename__ = "sessions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model: Mapped[str] = mapped_column(String, default="")
    config: Mapped[dict] = mapped_column(JSON, default=dict)
    started_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class RequestRow(Base):
    """One finished (or aborted / failed) request with its timings."""

    __tablename__ = "requests"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    session_id: Mapped[int] = mapped_column(ForeignKey("sessions.id"), index=True)
    request_id: Mapped[str] = mapped_column(String)
    source: Mapped[str] = mapped_column(String)  # chat, api, loadgen, offline
    prompt: Mapped[str | None] = mapped_column(Text, nullable=True)
    outputs: Mapped[list] = mapped_column(JSON, default=list)  # text of each sample
    finish_reason: Mapped[str | None] = mapped_column(String, nullable=True)
    num_prompt_tokens: Mapped[int] = mapped_column(Integer)
    num_output_tokens: Mapped[int] = mapped_column(Integer)
    num_cached_tokens: Mapped[int] = mapped_column(Integer)
    num_preemptions: Mapped[int] = mapped_column(Integer, default=0)
    arrival_time: Mapped[float | None] = mapped_column(Float, nullable=True)
    first_scheduled_time: Mapped[float | None] = mapped_column(Float, nullable=True)
    first_token_time: Mapped[float | None] = mapped_column(Float, nullable=True)
    finished_time: Mapped[float | None] = mapped_column(Float, nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    replica: Mapped[int] = mapped_column(Integer, default=0)  # the engine replica that ran it
    # Added in schema version 5 (NULL in rows written before): what `kvscope replay` needs
    # to run the request again as it ran.
    prompt_token_ids: Mapped[list | None] = mapped_column(JSON, nullable=True)
    output_token_ids: Mapped[list | None] = mapped_column(JSON, nullable=True)  # per sample
    sampling_params: Mapped[dict | None] = mapped_column(JSON, nullable=True)  # every field
    arrival_offset_s: Mapped[float | None] = mapped_column(Float, nullable=True)  # from start


class StepRow(Base):
    """One EngineCore step record; the chunk list keeps enough to redraw timelines."""

    __tablename__ = "steps"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    session_id: Mapped[int] = mapped_column(ForeignKey("sessions.id"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    start_time: Mapped[float] = mapped_column(Float)
    end_time: Mapped[float] = mapped_column(Float)
    num_scheduled_tokens: Mapped[int] = mapped_column(Integer)
    token_budget: Mapped[int] = mapped_column(Integer)
    num_used_blocks: Mapped[int] = mapped_column(Integer)
    num_cached_blocks: Mapped[int] = mapped_column(Integer)
    num_free_blocks: Mapped[int] = mapped_column(Integer)
    num_running: Mapped[int] = mapped_column(Integer)
    num_waiting: Mapped[int] = mapped_column(Integer)
    num_generated_tokens: Mapped[int] = mapped_column(Integer)
    # Added in schema version 2 (0 in rows written before).
    prefix_cache_queries: Mapped[int] = mapped_column(Integer, default=0)
    prefix_cache_hits: Mapped[int] = mapped_column(Integer, default=0)
    num_blocks_swapped_out: Mapped[int] = mapped_column(Integer, default=0)
    num_blocks_swapped_in: Mapped[int] = mapped_column(Integer, default=0)
    replica: Mapped[int] = mapped_column(Integer, default=0)  # the engine replica that stepped
    chunks: Mapped[list] = mapped_column(JSON, default=list)  # [request, seq, kind, start, end]
    preempted: Mapped[list] = mapped_column(JSON, default=list)
    swapped_out: Mapped[list] = mapped_column(JSON, default=list)
    swapped_in: Mapped[list] = mapped_column(JSON, default=list)
    finished: Mapped[list] = mapped_column(JSON, default=list)
    # Added in schema version 5: speculative decoding's [seq, proposed, accepted] per
    # proposal the step verified.
    spec_drafts: Mapped[list] = mapped_column(JSON, default=list)
    # Added in schema version 8: a mixture-of-experts model's routing (empty, 0 for a
    # dense model): each MoE layer's decoder layer, its tokens per expert (a list per
    # layer), the bytes the chosen experts read and the bytes all experts hold.
    expert_layers: Mapped[list] = mapped_column(JSON, default=list)
    expert_tokens: Mapped[list] = mapped_column(JSON, default=list)
    expert_bytes_read: Mapped[int] = mapped_column(Integer, default=0)
    expert_bytes_all: Mapped[int] = mapped_column(Integer, default=0)
    # Added in schema version 9: why each of `preempted` was, [victim, reason, taker,
    # blocks freed, computed tokens lost] (engine.telemetry.records.PreemptionCause).
    preemptions: Mapped[list] = mapped_column(JSON, default=list)
    # Added in schema version 10: why admissions missed tokens the prefix cache had seen,
    # [seq_id, reason, tokens, evicted by, evicted at step]
    # (engine.telemetry.records.PrefixMissCause).
    prefix_misses: Mapped[list] = mapped_column(JSON, default=list)
    # Added in schema version 11: the disk tier at the step (NULL for a step run without
    # one, and in rows written before): held after it, and done since the previous step
    # (engine.telemetry.records.TierStep, each field as tier_<field>).
    tier_blocks_held: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tier_bytes_held: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tier_blocks_stored: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tier_blocks_removed: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tier_blocks_loaded: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tier_bytes_loaded: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tier_loads: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tier_query_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tier_hit_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)


class ChatMessageRow(Base):
    """One turn of a dashboard chat; request_id links an assistant turn to its request."""

    __tablename__ = "chat_messages"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    session_id: Mapped[int] = mapped_column(ForeignKey("sessions.id"), index=True)
    conversation_id: Mapped[str] = mapped_column(String)
    role: Mapped[str] = mapped_column(String)
    content: Mapped[str] = mapped_column(Text)
    request_id: Mapped[str | None] = mapped_column(String, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)


class ConfigRow(Base):
    """Every config a session ran with, from its start and after each reconfigure (the
    sessions row keeps only the latest). A table added after version 1: older files get
    it, empty, when opened."""

    __tablename__ = "session_configs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    session_id: Mapped[int] = mapped_column(ForeignKey("sessions.id"), index=True)
    applied_at: Mapped[float] = mapped_column(Float)
    config: Mapped[dict] = mapped_column(JSON, default=dict)


class RoutingDecisionRow(Base):
    """Where the router (engine.replicas) sent one request, and why: every candidate
    replica's matched prefix blocks, load and score. Added in schema version 4."""

    __tablename__ = "routing_decisions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    session_id: Mapped[int] = mapped_column(ForeignKey("sessions.id"), index=True)
    request_id: Mapped[str] = mapped_column(String)
    time: Mapped[float] = mapped_column(Float)
    policy: Mapped[str] = mapped_column(String)
    replica: Mapped[int] = mapped_column(Integer)  # the chosen one
    num_prompt_blocks: Mapped[int] = mapped_column(Integer)  # the prompt's full blocks
    matched_blocks: Mapped[int] = mapped_column(Integer)  # held by the chosen replica
    # [{"replica", "matched_blocks", "load", "score"}] for every live replica
    candidates: Mapped[list] = mapped_column(JSON, default=list)


class PoolRecordRow(Base):
    """One record of the pool's feed (a PoolBase, PoolSlice or PoolDelta) as a live reader
    received it, as /ws/events sends it (engine.telemetry.pool_messages): the Sessions tab
    steps through the pool with them. Added in schema version 7."""

    __tablename__ = "pool_records"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    session_id: Mapped[int] = mapped_column(ForeignKey("sessions.id"), index=True)
    replica: Mapped[int] = mapped_column(Integer, default=0)
    kind: Mapped[str] = mapped_column(String)  # pool_base, pool_slice, pool (a delta)
    payload: Mapped[dict] = mapped_column(JSON, default=dict)


SESSION_TABLES = (SessionRow, RequestRow, StepRow, ChatMessageRow, ConfigRow,
                  RoutingDecisionRow, PoolRecordRow)
