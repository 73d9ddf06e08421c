"""The round loop the interleaved benchmark scripts share (sdk-bench.py, shm-bench.py):
runs the rounds, prints each as a JSON line as soon as it ends (a long run shows its
progress, and a killed one keeps what it measured), appends it to an output file if
asked, and returns them all for the summary."""

from __future__ import annotations

import json
from typing import Any, Callable, Dict, List, Optional


def run_rounds(
    rounds: int, one_round: Callable[[int], Dict[str, Any]], out: Optional[str]
) -> List[Dict[str, Any]]:
    rows = []
    for i in range(rounds):
        row = one_round(i)
        rows.append(row)
        line = json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
        print(line, flush=True)
        if out:
            with open(out, "a") as f:
                f.write(line + "\n")
    return rows
