"""vLLM's FlexibleArgumentParser (`vllm.utils`), for the CLI-style vLLM programs: an ArgumentParser
that also takes underscores in long flags (--max_model_len as --max-model-len)."""

from __future__ import annotations

import argparse
from typing import Any, Optional, Sequence


class FlexibleArgumentParser(argparse.ArgumentParser):
    def parse_args(  # type: ignore[override]
        self, args: Optional[Sequence[str]] = None, namespace: Optional[argparse.Namespace] = None
    ) -> Any:
        import sys

        raw = list(sys.argv[1:] if args is None else args)
        return super().parse_args([_dashed(a) for a in raw], namespace)


def _dashed(arg: str) -> str:
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value
