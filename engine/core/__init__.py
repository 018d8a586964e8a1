"""What decides: the request, the scheduler, the KV-cache manager and its block pool, beam
search, and EngineCore, which runs one step of schedule -> run -> sample -> update. What
they change they report as typed events (kv_events) to whoever subscribes."""
