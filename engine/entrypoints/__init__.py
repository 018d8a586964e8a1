"""What callers hold: LLM, the offline API (llm.py), and EngineView, the one interface the
front ends read whether one engine or replicas serve (view.py)."""
