"""What a step leaves for readers: immutable step records and pool deltas, the pool's
block events, and the reader-side mirror of the pool."""
