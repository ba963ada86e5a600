"""Memory tiers of a worker beyond its arena and host store: what it keeps across graphs and runs
(`store`), the spill file below the host store (`spill`, contract in `base`), and disk reads at
the disk's speed (`diskio`)."""
