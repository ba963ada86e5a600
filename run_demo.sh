#!/usr/bin/env bash
# The main job: set up .venv if needed, then plan, run and check a workload far larger than its
# GPU memory budget on a local Ray (cuda backend when a GPU is present, else cpu). Arguments go
# to `python -m disco_ray.cli.demo` (--workload, --backend, --engine, --out).
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup.sh
exec .venv/bin/python -m disco_ray.cli.demo "$@"
