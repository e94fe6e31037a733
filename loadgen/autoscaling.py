"""`simulate --size-for R --autoscale SIGNALS`: the GPUs a fixed deployment and an autoscaled
one spend on the same requests.

Sizing finds the fewest replicas that serve a total rate at 90% attainment for the whole run;
traffic that rises and falls leaves most of them idle outside its peaks. Each autoscaled run
replays the sizing's requests, starting at that fixed count, with the replica count left to
the autoscaler between 1 and twice it, and says what it attained and how many replicas it ran
on average (GPU seconds over the run's length).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from cluster.autoscale import AutoscaleConfig, ScaleSignal
from cluster.simulator import Policy, SimResult
from loadgen.sizing import rate_key
from replica.arguments import OptionError
from replica.planner.config import check_positive


@dataclass(frozen=True)
class ScaleChoice:
    """One --autoscale item: a signal, and for `ongoing` its target per replica."""

    signal: ScaleSignal
    target_ongoing: float | None = None

    @property
    def label(self) -> str:
        if self.target_ongoing is None:
            return self.signal.value
        return f"{self.signal.value}:{self.target_ongoing:g}"

    def applies_to(self, policy: Policy) -> bool:
        """`slo` follows admission's declines, which only slos policies make."""
        if self.signal is ScaleSignal.ONGOING:
            return True
        return policy.is_slos and policy is not Policy.SLOS_NOADMIT

    def config(self, fixed: int) -> AutoscaleConfig:
        bounds = AutoscaleConfig(min_replicas=1, max_replicas=max(2 * fixed, fixed + 1))
        if self.target_ongoing is None:
            return replace(bounds, signal=self.signal)
        return replace(bounds, signal=self.signal, target_ongoing_requests=self.target_ongoing)


def parse_choices(text: str) -> list[ScaleChoice]:
    """`slo,ongoing:8,...`; errors name --autoscale and the item at fault."""
    choices: list[ScaleChoice] = []
    for item in (part.strip() for part in text.split(",")):
        name, _, target = item.partition(":")
        if name == ScaleSignal.SLO.value and not target:
            choice = ScaleChoice(ScaleSignal.SLO)
        elif name == ScaleSignal.ONGOING.value and target:
            try:
                value = float(target)
                check_positive("target", value)
            except ValueError:
                raise OptionError(
                    f"--autoscale: {item!r}: the target must be a finite number > 0"
                ) from None
            choice = ScaleChoice(ScaleSignal.ONGOING, value)
        else:
            raise OptionError(
                f"--autoscale: {item!r} is not slo or ongoing:TARGET (requests per replica)"
            )
        if choice in choices:
            raise OptionError(f"--autoscale: {item!r} repeats an earlier item")
        choices.append(choice)
    return choices


def scaled_run(
    run: dict[str, Any], choice: ScaleChoice, fixed: int, result: SimResult
) -> dict[str, Any]:
    """The JSON of one autoscaled run: `run` (what ran, its attainment), its GPU time and
    timeline, and the fixed count it is compared to."""
    return {
        "signal": choice.label,
        "fixed_replicas": fixed,
        "mean_replicas": result.mean_replicas,
        "gpu_share_of_fixed": result.mean_replicas / fixed,
        **run,
        "replica_s": result.replica_s,
        "demoted": result.demoted,
        "promoted": result.promoted,
        "simulated_s": result.end_s,
        "wall_s": result.wall_s,
        "scaling": [list(point) for point in result.scaling],
    }


def autoscale_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """{scenario: {total rate: {policy: {signal: attainment, mean and fixed replicas}}}}."""
    out: dict[str, Any] = {}
    for run in runs:
        by_policy = out.setdefault(run["scenario"], {}).setdefault(rate_key(run["total_rate"]), {})
        by_policy.setdefault(run["policy"], {})[run["signal"]] = {
            key: run[key]
            for key in ("attainment", "mean_replicas", "fixed_replicas", "gpu_share_of_fixed")
        }
    return out


def autoscale_table(runs: list[dict[str, Any]]) -> str:
    """The autoscaled runs beside the fixed counts, one line each."""
    lines = [
        "| scenario | req/s | policy | autoscaler | attainment | mean replicas | fixed | share |",
        "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {r['scenario']} | {r['total_rate']:g} | {r['policy']} | {r['signal']} | "
        f"{r['attainment']:.3f} | {r['mean_replicas']:.2f} | {r['fixed_replicas']} | "
        f"{r['gpu_share_of_fixed']:.2f} |"
        for r in runs
    ]
    return "\n".join(lines)
