"""``python -m kvcompose.bench`` = ``kvcompose bench``."""

from kvcompose.cli.bench_cmd import main

raise SystemExit(main())
