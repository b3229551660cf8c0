"""What every ``tierserve bench-engine`` mode shares: its log line and its JSON report."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def log(message: str) -> None:
    print(f"[bench-engine {time.strftime('%H:%M:%S')}] {message}", flush=True)


def write_report(report: dict[str, Any], path: Path | None,
                 say: Callable[[str], None] = log) -> None:
    """Print the report as JSON and write it to ``path`` (when given)."""
    text = json.dumps(report, indent=2)
    print(text)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
        say(f"report written to {path}")
