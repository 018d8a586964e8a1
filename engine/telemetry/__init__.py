"""What a step leaves for readers, beside the core: immutable step records and pool records
(records), the recorder that turns the core's typed events into pool deltas
(pool_recorder), and the reader-side mirror of the pool (pool_mirror)."""
