"""What decides: the request, the scheduler, the KV-cache manager and its block pool. What
they change they report as typed events (kv_events) to whoever subscribes. The core imports
only the config and the sampling params: the orchestrator above runs it."""
