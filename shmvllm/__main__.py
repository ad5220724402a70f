"""`python -m shmvllm ...` is the `shmvllm` command."""

from shmvllm.cli import run

run()
