"""The `slos-serve` command.

It lives in loadgen because loadgen is the top of the dependency graph (it may use every other
package). Subcommands import their module only when chosen, so `--help` stays instant and
`version` never loads torch or Ray.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version

from replica.arguments import OptionError

COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("replica.demo", "generate with the demo pair on one local replica and print tokens/s"),
    "profile": ("replica.profiler", "profile the engine and fit a batch-time model"),
    "simulate": ("loadgen.simulate", "SLO attainment and capacity per policy, simulated"),
    "loadgen": ("loadgen.run_load", "drive a live server with a scenario; attainment, capacity"),
    "compare": ("loadgen.compare", "serve configs in turn under the same load; capacity ratio"),
    "compile": ("replica.compiled", "compile the planner with mypyc: faster planning, simulation"),
    "serve": ("router.serve_run", "serve run CONFIG, draining its streams on SIGINT or SIGTERM"),
}
BENCHES: dict[str, tuple[str, str]] = {
    "engine": ("loadgen.bench_engine", "engine vs transformers throughput, speculative speedup"),
    "planner": ("loadgen.bench_planner", "planning latency over randomized calls"),
    "controller": ("loadgen.bench_controller", "routing/admission decisions per second"),
    "frontend": ("loadgen.bench_frontend", "added latency and max req/s of HTTP and gRPC"),
    "specserve": ("loadgen.bench_specserve", "SpecServe's lengths vs slos's, draft calibration"),
    "adaserve": ("loadgen.bench_adaserve", "AdaServe's token trees vs chains, tokens per verify"),
    "prefix": (
        "loadgen.bench_prefix",
        "prefix caching: prompt tokens and TTFT saved, shared prefix",
    ),
}


def package_version() -> str:
    try:
        return version("slos-serve")
    except PackageNotFoundError:
        return "unknown"


def _load(module: str) -> object:
    return importlib.import_module(module)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slos-serve", description="Multi-SLO LLM serving cluster on Ray."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    sub.add_parser("version", help="print the version")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, add_help=False)
        p.set_defaults(module=module)
    bench = sub.add_parser("bench", help="benchmarks (JSON output)")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, (module, help_text) in BENCHES.items():
        p = bench_sub.add_parser(name, help=help_text, add_help=False)
        p.set_defaults(module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    known, rest = parser.parse_known_args(args_list)
    if known.command == "version":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        print(f"slos-serve {package_version()}")
        return 0
    module = _load(known.module)
    prog = f"slos-serve {known.command}" + (f" {known.bench}" if known.command == "bench" else "")
    sub_parser = argparse.ArgumentParser(prog=prog)
    module.add_arguments(sub_parser)  # type: ignore[attr-defined]
    sub_args = sub_parser.parse_args(rest)
    try:
        return int(module.run(sub_args))  # type: ignore[attr-defined]
    except OptionError as exc:
        raise SystemExit(f"{prog}: error: {exc}") from None
    except KeyboardInterrupt:
        # Said once, then dying of the signal, as a shell loop around the command expects.
        print(f"{prog}: interrupted", file=sys.stderr)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        raise


if __name__ == "__main__":
    sys.exit(main())
