"""`python -m shmvllm ...` is the `shmvllm` command."""

from shmvllm.cli import main

raise SystemExit(main())
