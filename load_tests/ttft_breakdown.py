"""Where a streamed request's time to first token goes, hop by hop, from the app's own trace spans: the command line
of app/observability/ttft_hops.py (the hops: router_work, hop_to_lane, lane_wait, engine_first_token, hop_back, and
their sum ttft_at_router, per request class; its docstring says what each hop covers).

  python -m load_tests.ttft_breakdown SPANS.jsonl [--json OUT.json] [--since UNIX_S]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Re-exported: the GPU campaign, the tests and older notes import them from here.
from app.observability.ttft_hops import SEGMENTS, format_breakdown, request_segments, ttft_breakdown  # noqa: F401
from app.tools.doctor import read_span_lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m load_tests.ttft_breakdown", description=__doc__.splitlines()[0])
    parser.add_argument("spans", type=Path, help="the app's JSON-lines span file (tracing exporter 'file')")
    parser.add_argument("--json", type=Path, help="also write the breakdown here")
    parser.add_argument("--since", type=float, default=None,
                        help="only requests that began at or after this unix time (s), e.g. the measurement's start")
    args = parser.parse_args(argv)
    if not args.spans.is_file():
        print(f"no span file at {args.spans}", file=sys.stderr)
        return 2
    since_ns = None if args.since is None else int(args.since * 1e9)
    breakdown = ttft_breakdown(read_span_lines(args.spans.read_text(errors="replace")), since_ns)
    if args.json:
        args.json.write_text(json.dumps(breakdown, indent=1))
    print(format_breakdown(breakdown))
    return 0 if breakdown else 1


if __name__ == "__main__":
    sys.exit(main())
