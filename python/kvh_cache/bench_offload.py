"""``python -m kvh_cache.bench_offload``, the command the documentation gave before
the benchmark moved to :mod:`kvh_cache.demo.bench_offload` (also ``kvh bench
offload``); it runs that module's ``main``."""

from __future__ import annotations

import sys

from .demo.bench_offload import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
