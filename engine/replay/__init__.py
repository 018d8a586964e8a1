"""What-if replay: a recorded session or a public trace, run again through the real scheduler
under other engine knobs, live (the real engine) or simulated (the same scheduler, KV-cache
manager and block pool, with the forward replaced by a step-cost model).

workload.py        the workload record every source becomes (ReplayRequest, Workload); the
                   SessionLogReader protocol kvscope.storage.replay_source fills
traces.py          importers: Mooncake JSONL, Azure CSV, ShareGPT JSON
cost_model.py      the step-cost model fitted from step records, and where it came from
calibration.py     a step-cost model made by a short live profile on this machine
calibration_cache.py its cache on disk, keyed by the model, the machine and the build
simulated_runner.py the executor that stands in for ModelRunner: no weights, no KV tensors
runner.py          one replay loop for both modes; a run per config
metrics.py         a run's timings and series, summarized (the --json keys)
divergence.py      where a simulated run's pool parts from a live run's, step by step, and why
report.py          JSON, CSV and a self-contained HTML report of runs side by side
cli.py             `kvscope replay` (kvscope/cli.py dispatches to it)
"""
