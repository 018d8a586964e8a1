"""What a step leaves for readers, beside the core: immutable step records and pool records
(records), the StepRecord built from a step (step_records), the recorder that turns the
core's typed events into pool deltas (pool_recorder), and the reader-side mirror of the pool
(pool_mirror). Telemetry names what it reads of an engine as a protocol (RecordedEngine):
the orchestrator above hands the engine in."""
