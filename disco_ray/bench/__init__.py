"""Benchmarking and what-if analysis: execution modes for the ablations, device profiles, the
discrete-event simulator, and the pure report of `disco-ray bench` (checks, bound, table, plots)."""
