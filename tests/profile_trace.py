"""The part of a ``profile`` test every job shares: run ``profile --steps N -o FILE --json`` against the job's
address, check its summary names both ranks, and return the merged trace's events (each rank a process
named ``rank N``)."""

import json
from typing import Any, Dict, List, Optional

from procs import run_cli, scaled


def profiled_events(address: str, out: str, steps: int, timeout: float = 150,
                    env: Optional[Dict[str, str]] = None) -> List[Dict[str, Any]]:
    done = run_cli(address, "profile", "--steps", str(steps), "-o", out, "--json", "--timeout", str(scaled(90)),
                   timeout=scaled(timeout), env=env)
    assert done.code == 0, (done.code, done.out, done.err)
    summary = json.loads(done.out)
    assert summary["ranks"] == [0, 1] and summary["events"] > 0, summary
    with open(out) as handle:
        events = json.load(handle)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}, names
    return events
