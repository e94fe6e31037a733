"""`slos-serve compare`: the live capacity comparison, one Ray Serve config after another.

Each config (a `serve run` YAML of slos-serve with its scheduler: slos, or a baseline's, vllm
or sarathi) is started fresh (loadgen.serve_process), driven by `slos-serve loadgen` with the
same options (a point at `--rate`, or a capacity search with `--capacity --rates LO,HI`),
stopped, and the next one started. The summary gives each config's capacity per replica and
slos over the best baseline. Why one command: a live capacity moves with what else the machine
runs (loadgen/RESULTS.md), so the comparison only means something side by side, on the same
requests and SLOs, one right after the other; `--rounds N` repeats the whole sequence
(A B C A B C ...) so that drift over the run hits every config alike, and summarizes each
config by its median with every round's ratio beside it.

Every config is held to the same SLOs: `--zero-load probe` measures on the first config's
server and reuses those numbers for the rest (written to `<--json stem>.zero-load.json`).
Sarathi sizes its token budget from the tightest TPOT among its config's tiers, while the load
generator's requests carry their own SLOs; so that the budget fits the tightest TPOT the
workload asks for (the baseline's definition), a sarathi config runs as a copy whose tier TPOTs
are lowered to it (the JSON records the value). Configs are read relative to the working
directory, where `serve run` starts and resolves the model paths (the repo root for the shipped
ones). The JSON is rewritten after every config, so a config that fails to start keeps the
results of the ones before it; each server's log is kept beside it.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from cluster.config import ClusterConfig, SchedulerKind
from cluster.simulator import tightest_tpot_s
from loadgen import run_load
from loadgen.plots import Curve, Panel, plot_attainment
from loadgen.serve_process import ServeCommand, ServeError, local_address, served
from loadgen.simulate import sim_requests
from loadgen.zero_load import ZeroLoad
from replica.arguments import OptionError, plot_file, positive_int
from replica.profiles import load_profile


@dataclass(frozen=True)
class ServeConfig:
    """One `serve run` YAML: where its front doors listen and which scheduler it runs."""

    path: Path
    data: dict[str, Any]
    cluster: ClusterConfig
    http: tuple[str, int]
    grpc_port: int | None

    @property
    def label(self) -> str:
        return self.path.stem

    @classmethod
    def load(cls, path: Path) -> ServeConfig:
        """Parse and check `path`; errors name the file and the field."""
        where = f"--configs: {str(path)!r}"
        try:
            data = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"--configs: cannot read {str(path)!r}: {exc}") from None
        if data is None:
            raise ValueError(f"{where} is empty")
        data = _mapping(data, "the file", where)
        apps = data.get("applications")
        if not isinstance(apps, list) or len(apps) != 1:
            found = len(apps) if isinstance(apps, list) else "none"
            raise ValueError(f"{where} must hold one application in applications, got {found}")
        app = _mapping(apps[0], "applications[0]", where)
        args = _mapping(app.get("args"), "applications[0].args", where)
        cluster_args = _mapping(args.get("cluster"), "applications[0].args.cluster", where)
        http = _mapping(data.get("http_options"), "http_options", where)
        grpc = _mapping(data.get("grpc_options") or {}, "grpc_options", where)
        try:
            cluster = ClusterConfig.from_dict(cluster_args)
            host, port = str(http.get("host", "127.0.0.1")), _port(http, "http_options")
            grpc_port = _port(grpc, "grpc_options") if "port" in grpc else None
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        return cls(path, data, cluster, (host, port), grpc_port)

    def target(self, protocol: str) -> str:
        host, port = self.http
        address = local_address(host)
        if protocol == "grpc":
            if self.grpc_port is None:
                raise ValueError(f"--protocol grpc: {self.path} has no grpc_options.port")
            return f"{address}:{self.grpc_port}"
        return f"http://{address}:{port}"

    def ports(self) -> tuple[tuple[str, int], ...]:
        grpc = () if self.grpc_port is None else ((self.http[0], self.grpc_port),)
        return (self.http, *grpc)

    def with_tpot_cap(self, tpot_ms: float) -> dict[str, Any]:
        """The config with every tier's TPOT lowered to at most `tpot_ms`."""
        data = copy.deepcopy(self.data)
        tiers = data["applications"][0]["args"]["cluster"]["tiers"]
        for tier in tiers:
            tier["tpot_ms"] = min(float(tier["tpot_ms"]), tpot_ms)
        return data


def _mapping(value: object, name: str, where: str) -> dict[str, Any]:
    """`value` if it is a mapping; else an error naming the file and `name`."""
    if value is None:
        raise ValueError(f"{where} has no {name}")
    if not isinstance(value, dict):
        raise ValueError(f"{where}: {name} must be a mapping, got {type(value).__name__}")
    return value


def _port(section: dict[str, Any], name: str) -> int:
    port = section.get("port")
    if isinstance(port, bool) or not isinstance(port, int):
        raise ValueError(f"{name}.port must be an integer, got {port!r}")
    return port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    run_load.add_arguments(parser, target=False)
    parser.description = __doc__
    parser.set_defaults(target=None)
    parser.add_argument(
        "--configs",
        required=True,
        help="comma list of Ray Serve YAMLs run in turn (e.g. deploy/serve-cpu.yaml,"
        "deploy/serve-cpu-vllm.yaml,deploy/serve-cpu-sarathi.yaml)",
    )
    parser.add_argument(
        "--startup-timeout", type=float, default=300.0, help="seconds for a config to come up"
    )
    parser.add_argument(
        "--settle", type=float, default=5.0, help="seconds between coming up and the first point"
    )
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="run the configs in turn this many times (A B C A B C ...); the summary takes "
        "each config's median and gives every round's ratio",
    )
    parser.add_argument(
        "--plot",
        type=plot_file,
        help="image path (its suffix picks the format: .png, .svg, .pdf, .jpg; none: .png): "
        "attainment vs rate per config",
    )


def load_configs(args: argparse.Namespace) -> list[ServeConfig]:
    """The configs, checked against each other and the options."""
    if not math.isfinite(args.startup_timeout) or args.startup_timeout <= 0:
        raise ValueError(f"--startup-timeout must be finite and > 0, got {args.startup_timeout!r}")
    if not math.isfinite(args.settle) or args.settle < 0:
        raise ValueError(f"--settle must be finite and >= 0, got {args.settle!r}")
    paths = [Path(p.strip()) for p in args.configs.split(",") if p.strip()]
    if len(paths) < 2:
        raise ValueError(f"--configs needs two or more configs to compare, got {args.configs!r}")
    configs = [ServeConfig.load(p) for p in paths]
    labels = [c.label for c in configs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--configs: file names must differ (they label results): {labels}")
    run_load.check_args(_per_config(args, configs[0], args.zero_load, configs[0].label))
    first = configs[0].cluster.scheduler
    if args.zero_load == "probe" and first is SchedulerKind.SARATHI:
        raise ValueError(
            "--zero-load probe measures on the first config's server, and a sarathi config "
            "needs the SLOs before it starts: list another config first"
        )
    return configs


def workload_tightest_tpot_ms(args: argparse.Namespace, zero_load: ZeroLoad | None) -> float:
    """The tightest TPOT the workload's requests ask for (stages included)."""
    perf = load_profile("--profile", args.profile)
    rate = args.rate or 1.0
    spec = run_load.load_spec(args, perf, zero_load, None, rate)
    return tightest_tpot_s([r.request for r in sim_requests(spec.workload(rate))]) * 1e3


def _per_config(
    args: argparse.Namespace, config: ServeConfig, zero_load: str, tag: str
) -> argparse.Namespace:
    """`args` for one config's loadgen run; records get `tag` (the label, and the round)."""
    records = args.records
    if records is not None:
        records = records.with_name(f"{records.stem}.{tag}{records.suffix}")
    return argparse.Namespace(
        **{
            **vars(args),
            "target": config.target(args.protocol),
            "records": records,
            "json": None,
            "zero_load": zero_load,
        }
    )


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _ratio(values: dict[str, float | None], schedulers: dict[str, str]) -> float | None:
    """The best slos-scheduler config's value over the best other one's."""
    slos = SchedulerKind.SLOS.value
    ours = [v for k, v in values.items() if v is not None and schedulers[k] == slos]
    baselines = [v for k, v in values.items() if v is not None and schedulers[k] != slos]
    best = max(baselines, default=0.0)
    return max(ours) / best if ours and best > 0 else None


def summarize(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Capacity per replica (or attainment at the one rate) per config, the median over
    rounds, and slos over the best baseline: the best slos-scheduler config's over the best
    other one's; with several rounds also each round's values and ratio. A capacity at the
    search's ceiling or floor (`bound`) is listed (`capacity_bounds`) and left out of the
    ratios: a ratio to it would compare the searches' limits, not the schedulers."""
    schedulers = {r["label"]: r["scheduler"] for r in results}
    capacity: dict[str, list[float | None]] = {}
    bounds: dict[str, list[dict[str, float] | None]] = {}
    attainment: dict[str, list[float | None]] = {}
    for r in results:
        summary = r["summary"]
        if "capacity_rps" in summary:
            capacity.setdefault(r["label"], []).append(summary["capacity_per_replica"])
            bounds.setdefault(r["label"], []).append(summary.get("bound"))
        else:
            attainment.setdefault(r["label"], []).append(summary["attainment"])
    measured = {  # the capacities a ratio may use: none that is a search's limit
        label: [
            None if bound else value for value, bound in zip(values, bounds[label], strict=True)
        ]
        for label, values in capacity.items()
    }
    out: dict[str, Any] = {}
    for key, by_label in (("capacity_per_replica", capacity), ("attainment", attainment)):
        if not by_label:
            continue
        out[key] = {label: _median(values) for label, values in by_label.items()}
        if key == "capacity_per_replica":
            medians = {label: _median(values) for label, values in measured.items()}
            out["capacity_ratio"] = _ratio(medians, schedulers)
            if any(any(b) for b in bounds.values()):
                out["capacity_bounds"] = bounds
        rounds = max(len(values) for values in by_label.values())
        if rounds > 1:
            out[f"{key}_by_round"] = by_label
            if key == "capacity_per_replica":
                out["capacity_ratio_by_round"] = [
                    _ratio({k: v[i] for k, v in measured.items() if i < len(v)}, schedulers)
                    for i in range(rounds)
                ]
    return out


def _name(result: dict[str, Any], rounds: int) -> str:
    return result["label"] if rounds == 1 else f"{result['label']} #{result['round']}"


def _plot(results: Sequence[dict[str, Any]], path: Path, rounds: int) -> None:
    curves = []
    for r in results:
        replicas = r["replicas"] or 1
        by_rate = {p["rate"] / replicas: p["report"]["overall"]["attainment"] for p in r["points"]}
        capacity = r["summary"].get("capacity_per_replica")
        rates = tuple(sorted(by_rate))
        curves.append(Curve(_name(r, rounds), rates, tuple(by_rate[x] for x in rates), capacity))
    replicas = int(results[0]["replicas"] or 1)
    plot_attainment([Panel(results[0]["scenario"], replicas, tuple(curves))], path)


def _table(results: Sequence[dict[str, Any]], rounds: int) -> str:
    rows = ["| config | scheduler | rate (req/s) | attainment |", "|---|---|---:|---:|"]
    for r in results:
        for p in r["points"]:
            rows.append(
                f"| {_name(r, rounds)} | {r['scheduler']} | {p['rate']:g} | "
                f"{p['report']['overall']['attainment']:.3f} |"
            )
    return "\n".join(rows)


def run(args: argparse.Namespace) -> int:
    try:
        configs = load_configs(args)
        with tempfile.TemporaryDirectory(prefix="slos-compare-") as tmp:
            results = _run_all(args, configs, Path(tmp))
    except (argparse.ArgumentTypeError, ValueError, ServeError) as exc:
        raise OptionError(str(exc)) from None
    print("\n" + _table(results, args.rounds))
    print(f"\nsummary: {json.dumps(summarize(results))}")
    if args.plot is not None:
        _plot(results, args.plot, args.rounds)
    return 0


def _run_all(
    args: argparse.Namespace, configs: Sequence[ServeConfig], tmp: Path
) -> list[dict[str, Any]]:
    """Each config started, measured and stopped in turn, `--rounds` times over."""
    out_dir, stem = (args.json.parent, args.json.stem) if args.json else (tmp, "compare")
    zero_load = args.zero_load
    results: list[dict[str, Any]] = []
    for round_ in range(1, args.rounds + 1):
        for config in configs:
            tag = config.label if args.rounds == 1 else f"{config.label}.round{round_}"
            path, extra = config.path, {}
            if config.cluster.scheduler is SchedulerKind.SARATHI:
                known = (
                    None if zero_load in ("profile", "probe") else ZeroLoad.load(Path(zero_load))
                )
                cap = workload_tightest_tpot_ms(args, known)
                path = tmp / config.path.name
                path.write_text(yaml.safe_dump(config.with_tpot_cap(cap)))
                extra["sarathi_tpot_ms"] = cap
            command = ServeCommand(
                config=path.resolve(),
                health_url=config.target("http") + "/health",
                ports=config.ports(),
                log=out_dir / f"{stem}.{tag}.serve.log",
                cwd=Path.cwd(),
                startup_timeout_s=args.startup_timeout,
            )
            print(f"\n== {tag}: serve run {config.path} (log {command.log})", flush=True)
            with served(command):
                time.sleep(args.settle)
                out = run_load.measure(_per_config(args, config, zero_load, tag))
            if zero_load == "probe":
                zero_load = str(out_dir / f"{stem}.zero-load.json")
                Path(zero_load).write_text(json.dumps({"zero_load": out["zero_load"]}, indent=2))
            results.append(
                {
                    "label": config.label,
                    "round": round_,
                    "config": str(config.path),
                    "scheduler": config.cluster.scheduler.value,
                    **extra,
                    **out,
                }
            )
            if args.json is not None:
                document = {"summary": summarize(results), "configs": results}
                args.json.write_text(json.dumps(document, indent=2) + "\n")
    return results
