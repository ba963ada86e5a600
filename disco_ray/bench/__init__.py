"""Benchmarking and what-if analysis: execution modes for the ablations, device profiles, the
discrete-event simulator, the pure report of `disco-ray bench` (checks, bound, table, plots), and
the bench itself, callable from Python (`run.bench(workload, run.BenchSettings(...))`)."""
