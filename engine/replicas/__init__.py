"""Engine replicas on Ray behind a KV-cache-aware router.

Ray is imported by engine.replicas.replica_set alone, so the router and the prefix index
(and a single embedded engine) never import it.
"""
