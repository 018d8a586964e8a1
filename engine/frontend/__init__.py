"""Between callers and the engine thread: the thread that steps the engine, the streams and
channels that carry its outputs, and chat templates."""
