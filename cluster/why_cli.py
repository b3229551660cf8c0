"""`tierserve why REQ_ID`: ask a running endpoint why a request was late.

Data flow: ``GET {url}/v1/requests/{REQ_ID}/why`` on the router (the JSON of
:meth:`cluster.why.WhyReport.to_dict`) -> :class:`~cluster.why.WhyReport` -> the causal
chain printed as one sentence and then one numbered line per step (``--json`` prints the
answer as it came). Exit codes: 0 answered, 1 the endpoint does not know the request
(404) or refused it (other 4xx/5xx), 2 the endpoint could not be reached or answered
something that is not a report.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from cluster.why import WhyReport

DEFAULT_URL = "http://127.0.0.1:8000"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("req_id", metavar="REQ_ID", help="the request id (the response's `id`)")
    parser.add_argument("--url", default=DEFAULT_URL, help=f"the endpoint (default {DEFAULT_URL})")
    parser.add_argument("--api-key", default=None, help="API key, when the endpoint needs one")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait (default 10)")
    parser.add_argument("--json", action="store_true", help="print the JSON answer as is")


def why_url(base: str, req_id: str) -> str:
    return f"{base.rstrip('/')}/v1/requests/{urllib.parse.quote(req_id, safe='')}/why"


def fetch(base: str, req_id: str, *, api_key: str | None = None,
          timeout: float = 10.0) -> tuple[int, dict[str, Any] | None, str]:
    """(HTTP status, parsed JSON body or None, raw body text); status 0: not reached."""
    req = urllib.request.Request(why_url(base, req_id), headers={"Accept": "application/json"})
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        return 0, None, str(reason)
    try:
        body = json.loads(raw)
    except json.JSONDecodeError:
        return status, None, raw
    return status, body if isinstance(body, dict) else None, raw


def format_report(report: WhyReport) -> str:
    lines = [report.text]
    for i, step in enumerate(report.steps, 1):
        lines.append(f"  {i}. [{step.kind.value}] {step.text}")
    return "\n".join(lines)


def _error_message(body: dict[str, Any] | None, raw: str) -> str:
    if body and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", raw))
    if body and "detail" in body:
        return str(body["detail"])
    return raw.strip()[:500]


def run(args: argparse.Namespace) -> int:
    status, body, raw = fetch(args.url, args.req_id, api_key=args.api_key, timeout=args.timeout)
    if status == 0:
        print(f"tierserve why: cannot reach {args.url}: {raw}", file=sys.stderr)
        return 2
    if status != 200:
        print(f"tierserve why: {args.url} answered {status}: {_error_message(body, raw)}",
              file=sys.stderr)
        return 1
    if body is None:
        print(f"tierserve why: {args.url} answered something that is not JSON", file=sys.stderr)
        return 2
    try:
        report = WhyReport.from_dict(body)
    except (KeyError, TypeError, ValueError) as e:
        print(f"tierserve why: the answer is not a why-report ({e!r})", file=sys.stderr)
        return 2
    print(json.dumps(body, indent=2) if args.json else format_report(report))
    return 0
