"""The `tierserve` command line: one subcommand per capability.

Each subcommand lives in the package that owns it, as a module exposing
``add_arguments(parser)`` and ``run(args) -> int``; this file only maps names
to modules and imports them lazily, so `tierserve simulate` never pays for
torch or Ray. The benches, drills and calibration live in ``bench/``, the floor
above this one: the table names them as strings, the one place a lower floor
refers to ``bench`` (the entry-point table knows every command, as
``[project.scripts]`` does); no module of a lower floor imports it.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("cluster.serve_cli", "run the cluster and its OpenAI-compatible HTTP endpoint"),
    "prepare-model": ("engine.prepare_model", "build the embedded default model checkpoint"),
    "simulate": ("scheduler.sim.cli", "replay a trace through the simulator against peer policies"),
    "check": ("scheduler.verify.cli", "model-check the scheduling kernel's invariants"),
    "bench-scheduler": ("bench.scheduler_latency",
                        "measure per-step and per-placement decision latency"),
    "bench-engine": ("bench.engine_suite",
                     "measure engine equivalence, throughput, prefill and memory"),
    "calibrate": ("bench.calibrate", "fit the simulator's cpu-smollm2 cost model to this machine"),
    "bench-transfer": ("bench.transfer", "measure KV block transfer bandwidth and latency"),
    "bench": ("bench.endpoint", "replay a trace through a running endpoint over HTTP"),
    "bench-clients": ("bench.clients",
                      "guidellm, aiperf and vllm bench serve against a running endpoint"),
    "bench-control": ("bench.control",
                      "requests per second through router and scheduler (stub engines)"),
    "bench-pressure": ("bench.pressure",
                       "KV memory pressure on a real cluster: preemption modes, restore "
                       "times, swap, tier attainment per policy"),
    "bench-scale": ("bench.scale",
                    "a load step up and down against the SLO planner (paced stub engines)"),
    "why": ("cluster.why_cli", "explain why a request was late"),
    "drill": ("bench.drill_cli", "kill parts of a running cluster mid-stream and check it heals"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        # Arguments are added lazily (below) so unrelated imports stay cold.
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # Find the subcommand first, then let its module add its own arguments.
    if argv and argv[0] in SUBCOMMANDS:
        name = argv[0]
        module = importlib.import_module(SUBCOMMANDS[name][0])
        p = argparse.ArgumentParser(prog=f"tierserve {name}", description=SUBCOMMANDS[name][1])
        module.add_arguments(p)
        args = p.parse_args(argv[1:])
        return int(module.run(args) or 0)
    parser.parse_args(argv)  # prints usage / errors for unknown commands
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
