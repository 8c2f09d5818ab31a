"""``python -m probe.reader PID|core:PATH [--native] [--executable EXE]``: the stacks as JSON rows of
python.backtrace, for a helper on a rank's host or a script."""

import argparse
import json
import sys

from probe.errors import ProbeError
from probe.tables.python_backtrace import COLUMNS


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m probe.reader", description=__doc__)
    parser.add_argument("target", help="a pid, or core:PATH")
    parser.add_argument("--native", action="store_true", help="C frames too (stops a live process briefly)")
    parser.add_argument("--executable", help="the Python executable that made the core file")
    args = parser.parse_args()
    from probe.reader import live, pystack_source

    try:
        if args.target.startswith("core:"):
            stacks = pystack_source.read_core(args.target[5:], args.executable, args.native)
        elif args.target.isdigit():
            stacks = live.read_live(int(args.target), args.native)
        else:
            parser.error("give a pid or core:PATH")
    except ProbeError as exc:
        print(json.dumps({"error": {"code": exc.code, "message": exc.message, "hint": exc.hint}}))
        return exc.exit_code
    names = [c.name for c in COLUMNS]
    holder = stacks.gil_holder()
    print(json.dumps({"pid": stacks.pid, "source": stacks.source, "python": stacks.python_version,
                      "gil_holder": holder.native_id if holder else None, "facts": dict(stacks.facts),
                      "rows": [dict(zip(names, row)) for row in stacks.rows()]}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
