"""The driver side of a run: `Program` (plan once, run many times), the `ray` and `local`
engines, where the actors are placed, connecting to a cluster, and run traces."""
