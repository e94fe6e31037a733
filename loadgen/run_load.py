"""`slos-serve loadgen`: drive a live server with a paper scenario (or a mix file of your own
application classes, loadgen.mixes) and judge what it delivered.

Open loop: every request is sent at its arrival time whatever happened to earlier ones
(follow-up rounds of tool-calling sessions go out `delay_s` after the round they continue,
with that round's prompt and the output it got, then fresh text for the tool's response, as
an agent sends its history back). Each request becomes a RequestRecord (loadgen.clients),
written to JSONL as it finishes, and the run is judged by loadgen.metrics: attainment under
deadline semantics and in the paper's form, goodput, p50/p99 TTFT and TPOT per SLO class.
slos-serve announces each request's verdict, replica and hops with its first token (headers /
gRPC initial metadata), so records carry them even for streams the client closes at the output
length (other servers leave those `unknown`); slos-serve's own
counts for the run (admitted, best_effort, rejected, from /v1/cluster/status before and after)
are in the summary as `server_counters`, and from its replicas' step time (`busy_us`)
`busy_ms_per_request` and `replica_busy_fraction`: how loaded the replicas were. `--rate` is
requests per second sent to the target (the whole cluster); capacity per replica divides by the
replica count (`--replicas`, else the server's /v1/cluster/status).

SLOs come from a perf profile (default deploy/profiles/cpu-demo.json, the CPU demo pair): TTFT =
3x (tight) or 5x (loose) the profile's zero-load TTFT of the prompt; TPOT = 3.3x (tight) or 6.6x
(loose) the profile's zero-load decode step at the ChatBot mean prompt (763 tokens x
--length-scale). 3.3 and 6.6 are the paper's 50/100 ms over the 15.1 ms step the A100 OPT-7B
profile predicts for that context (loadgen.workloads.SLOTargets.for_decode_step). With a GPU
profile, pass --gpu-slos for the paper's fixed 50/100 ms. The profile knows a replica's steps
only; `--zero-load probe` instead measures the zero-load TTFT and decode step on the target
itself (front door, Ray hops, planning tick included; loadgen.zero_load) and the same factors
apply; `--zero-load FILE` reuses a probed run's numbers, so runs against other servers (baseline
policies) are held to the same SLOs.

Capacity mode (`--capacity --rates LO,HI`) searches the highest rate in [LO, HI] with >= 90%
attainment (loadgen.capacity); every point is a fresh run against the same server, after
`--cooldown` seconds for it to drain, of the same requests compressed or stretched in time:
their count is fixed so the run at the search's start (`--rate`, else LO) lasts `--duration`.
With --records, each point's records go to <stem>.rate<R><suffix>.

`--endpoint chat` sends chats to /v1/chat/completions (gRPC: chat messages) instead of text to
/v1/completions, each rendered by the --tokenizer folder's chat template to exactly its
planned length (loadgen.prompts.ChatPromptSource): a class's system prompt is the system
message, and a session's follow-up is the chat so far, the output as the assistant's message,
then the tool's response as a user message.

Trace arrivals replay the scenario's Azure LLM inference trace 2023 (CC-BY 4.0; see
loadgen.traces.AZURE_ATTRIBUTION, which the JSON output carries).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
from tokenizers import Tokenizer
from tqdm import tqdm

from loadgen.arrivals import ArrivalKind, ArrivalProcess
from loadgen.capacity import DEFAULT_TARGET, CapacityResult, check_rel_tol, find_capacity
from loadgen.clients import GrpcClient, HttpClient, LoadClient, Reply
from loadgen.metrics import GroupReport, RunReport, report
from loadgen.mixes import parse_workload
from loadgen.prompts import ChatPromptSource, Prompt, Prompts, PromptSource, heldout_texts
from loadgen.records import RecordWriter, RequestRecord, Verdict
from loadgen.simulate import ROOT, TRACE_DIR
from loadgen.traces import read_trace
from loadgen.workloads import (
    TABLE4,
    Scenario,
    SLOTargets,
    Workload,
    WorkloadConfig,
    WorkloadRequest,
    ZeroLoadTTFT,
    generate_workload,
    grow_rounds,
    shared_prompts,
    trace_file,
    zero_load_decode_step_s,
    zero_load_ttft_from,
)
from loadgen.zero_load import PROBE_OUTPUT_LEN, PROBE_PROMPT_LENS, ZeroLoad, probe
from replica.arguments import (
    OptionError,
    model_length,
    non_negative_float,
    non_negative_int,
    output_file,
    positive_float,
    positive_int,
)
from replica.model_source import has_tokenizer, model_folder
from replica.perf_model import PerfModel
from replica.profiles import CPU_PROFILE, load_profile
from router.client import AsyncClient, Client, ClientError
from router.tokenizer import TextCodec

DEFAULT_TOKENIZER = ROOT / "deploy" / "models" / "demo-target"
DECODE_CONTEXT_KEY = "chatbot.prompt"
"""The TPOT levels scale from the decode step at this Table 4 entry's mean prompt length."""


@dataclass(frozen=True)
class LoadSpec:
    """What a run sends, fixed across the rates of a capacity search."""

    scenario: Workload
    requests: int
    """The same at every rate: `--duration` at the reference rate (`--rate`, else LO)."""
    arrivals: ArrivalProcess
    config: WorkloadConfig
    seed: int
    round_growth: int = 1
    """The fewest tokens a session's next prompt adds (Prompts.round_growth)."""

    def workload(self, rate: float) -> list[WorkloadRequest]:
        """The same requests at every rate, only compressed or stretched in time."""
        times = self.arrivals.times(rate, self.requests, self.seed)
        generated = generate_workload(self.scenario, times, self.config, self.seed)
        return grow_rounds(generated, self.round_growth, self.config)


def prompts_for(workload: Sequence[WorkloadRequest], source: Prompts) -> dict[str, Prompt]:
    """One prompt of exactly prompt_len tokens per request that starts a session, cut before
    the run starts, sharing text as real traffic does (a class's system prompt;
    loadgen.workloads.shared_prompts). Follow-up rounds are made during the run, from the
    output the round before got (`next_round`)."""
    return shared_prompts(
        [r for r in workload if r.follows is None], source.prompt, source.prompt_after
    )


FollowUp = Callable[[WorkloadRequest, WorkloadRequest, Prompt, str], Prompt]
"""(follow-up round, the round it follows, that round's prompt, its output text) -> the
follow-up's prompt."""


def next_round(source: Prompts) -> FollowUp:
    """A follow-up's prompt as an agent sends it: the round before's prompt and output (cut at
    their planned lengths if the client got more), then the tool's response, fresh text to
    the follow-up's prompt_len."""

    def prompt(
        request: WorkloadRequest, before: WorkloadRequest, head: Prompt, output: str
    ) -> Prompt:
        history = min(before.prompt_len + before.output_len, request.prompt_len - 1)
        return source.after_output(head, output, history, request.prompt_len, request.request_id)

    return prompt


@dataclass(frozen=True)
class RunResult:
    rate: float
    records: list[RequestRecord]
    report: RunReport
    max_send_lag_s: float
    """Longest a request went out after its scheduled arrival (a late client shows here)."""
    server_counters: dict[str, int] | None
    """What slos-serve's cluster counted during the run (admitted, best_effort, rejected,
    routed, ...): the verdicts of streams closed before the server's report. None when the
    server has no /v1/cluster/status (or gRPC GetClusterStatus)."""


async def run_open_loop(
    client: LoadClient,
    workload: Sequence[WorkloadRequest],
    prompts: Mapping[str, Prompt],
    follow_up: FollowUp,
    on_record: Callable[[RequestRecord], None],
) -> tuple[list[RequestRecord], float]:
    """Send every request at its arrival time; returns the records in workload order and the
    longest send lag. `prompts` holds the sessions' first rounds; a follow-up round's prompt
    is made from the round before's output when that ends (`follow_up`), within the tool's
    delay. A follow-up round of a rejected or failed round is not sent (the session cannot go
    on): rejected like its predecessor, or unknown with the reason."""
    start = time.monotonic()

    def clock() -> float:
        return time.monotonic() - start

    loop = asyncio.get_running_loop()
    by_id = {r.request_id: r for r in workload}
    sent = dict(prompts)
    done: dict[str, asyncio.Future[Reply]] = {r.request_id: loop.create_future() for r in workload}
    lags: list[float] = []

    def not_sent(request: WorkloadRequest, verdict: Verdict, why: str) -> Reply:
        record = RequestRecord.for_request(
            request, verdict=verdict, arrival_s=clock(), error=f"not sent: {why}"
        )
        return Reply(record, "")

    async def follow(request: WorkloadRequest, follows: str) -> Reply:
        previous = await done[follows]
        if previous.record.verdict is Verdict.REJECTED:
            return not_sent(request, Verdict.REJECTED, f"{follows} was rejected")
        if not previous.record.complete:
            return not_sent(request, Verdict.UNKNOWN, f"{follows} was not completed")
        ended = clock()
        try:
            # In a thread: encoding a long history would hold up every stream being timed.
            prompt = await asyncio.to_thread(
                follow_up, request, by_id[follows], sent[follows], previous.text
            )
        except ValueError as exc:
            return not_sent(request, Verdict.UNKNOWN, f"no prompt follows {follows}'s: {exc}")
        sent[request.request_id] = prompt
        await asyncio.sleep(max(0.0, ended + request.delay_s - clock()))
        return await client.send(request, prompt, clock)

    async def one(request: WorkloadRequest) -> RequestRecord:
        if request.follows is None:
            await asyncio.sleep(max(0.0, request.arrival_s - clock()))
            lags.append(max(0.0, clock() - request.arrival_s))
            reply = await client.send(request, sent[request.request_id], clock)
        else:
            reply = await follow(request, request.follows)
        done[request.request_id].set_result(reply)
        on_record(reply.record)
        return reply.record

    records = await asyncio.gather(*(one(r) for r in workload))
    return list(records), max(lags, default=0.0)


@dataclass(frozen=True)
class Target:
    """Where and how to send: everything a client needs, so each run makes a fresh one."""

    protocol: str
    address: str
    model: str
    api_key: str | None
    tokenizer: Tokenizer
    send_slo: bool
    timeout_s: float
    temperature: float | None = None
    """What every request samples at (None: the server's default)."""

    def client(self) -> LoadClient:
        if self.protocol == "grpc":
            return GrpcClient(
                self.address,
                api_key=self.api_key,
                model=self.model,
                timeout_s=self.timeout_s,
                temperature=self.temperature,
            )
        return HttpClient(
            self.address,
            self.model,
            api_key=self.api_key,
            count_tokens=self.count_tokens,
            send_slo=self.send_slo,
            timeout_s=self.timeout_s,
            temperature=self.temperature,
        )

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    async def counters(self) -> dict[str, int] | None:
        """The cluster's decision counters since its start, if the server reports them."""
        if self.protocol == "grpc":
            sdk = AsyncClient(self.address, api_key=self.api_key, timeout_s=10.0)
            try:
                return dict((await sdk.cluster_status()).counters)
            except ClientError:
                return None
            finally:
                await sdk.close()
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        async with httpx.AsyncClient(headers=headers, timeout=10.0) as http:
            try:
                response = await http.get(self.address.rstrip("/") + "/v1/cluster/status")
            except httpx.HTTPError:
                return None
        counters = response.json().get("counters") if response.status_code == 200 else None
        return {str(k): int(v) for k, v in counters.items()} if isinstance(counters, dict) else None


def counter_changes(
    before: dict[str, int] | None, after: dict[str, int] | None
) -> dict[str, int] | None:
    if before is None or after is None:
        return None
    return {k: v - before.get(k, 0) for k, v in sorted(after.items()) if v != before.get(k, 0)}


async def run_once(
    target: Target,
    workload: Sequence[WorkloadRequest],
    prompts: Mapping[str, Prompt],
    follow_up: FollowUp,
    rate: float,
    records_path: Path | None = None,
    progress: bool = True,
) -> RunResult:
    """One open-loop run with a fresh client; records stream to `records_path` if given."""
    client = target.client()
    writer = RecordWriter(records_path) if records_path is not None else None
    bar = tqdm(total=len(workload), desc=f"rate {rate:g}/s", unit="req", disable=not progress)

    def on_record(record: RequestRecord) -> None:
        if writer is not None:
            writer.write(record)
        bar.update(1)

    before = await target.counters()
    try:
        records, lag = await run_open_loop(client, workload, prompts, follow_up, on_record)
    finally:
        bar.close()
        if writer is not None:
            writer.close()
        await client.aclose()
    changes = counter_changes(before, await target.counters())
    return RunResult(rate, records, report(records), lag, changes)


def _fmt(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def summary_table(result: RunResult) -> str:
    """Per SLO class and overall: verdicts, attainment (deadline and paper), TTFT, TPOT; what
    the server counted, and its replicas' step time per request."""
    run_report, server_counters = result.report, result.server_counters
    head = (
        f"{'slo class':<18}{'reqs':>7}{'adm':>7}{'be':>7}{'rej':>7}{'unk':>7}"
        f"{'attain':>8}{'paper':>7}{'TTFT p50/p99 s':>17}{'TPOT p50/p99 ms':>18}"
    )
    rows = [head, "-" * len(head)]
    groups: list[tuple[str, GroupReport]] = [*run_report.by_slo_class.items()]
    groups.append(("all", run_report.overall))
    for name, g in groups:
        ttft = f"{_fmt(g.ttft_s.p50)}/{_fmt(g.ttft_s.p99)}"
        tpot = f"{_fmt(g.mean_tpot_s.p50, 1e3, 1)}/{_fmt(g.mean_tpot_s.p99, 1e3, 1)}"
        rows.append(
            f"{name:<18}{g.requests:>7}{g.admitted:>7}{g.best_effort:>7}{g.rejected:>7}"
            f"{g.unknown:>7}{g.attainment:>8.3f}{g.paper_attainment:>7.3f}{ttft:>17}{tpot:>18}"
        )
    if server_counters is not None:
        counted = ", ".join(f"{k} {v}" for k, v in server_counters.items())
        rows.append(f"server counted: {counted or 'nothing'}")
    busy = busy_ms_per_request(result)
    if busy is not None:
        rows.append(f"replica step time: {busy:.1f} ms a request")
    hit_rate = prefix_hit_rate(result)
    if hit_rate is not None:
        rows.append(f"prefix cache: {hit_rate:.1%} of the tokens looked up were cached")
    missed = prefix_credit_missed(result)
    if missed is not None:
        rows.append(f"prefix credit: {missed:.1%} of the tokens counted cached were not")
    rows.append(
        f"goodput {run_report.goodput_rps:.3f} req/s, {run_report.goodput_tokens_per_s:.1f} "
        f"tokens/s over {run_report.duration_s:.1f} s"
    )
    return "\n".join(rows)


def _busy_s(result: RunResult) -> float | None:
    """Replica step seconds the server counted during the run (`busy_us`; None for servers
    that do not count it)."""
    counters = result.server_counters
    if counters is None or "busy_us" not in counters:
        return None
    return counters["busy_us"] / 1e6


def busy_ms_per_request(result: RunResult) -> float | None:
    """Replica step time the run's requests cost on average: at equal load, the policy that
    spends less per request has room left where the other is out of it."""
    busy = _busy_s(result)
    return None if busy is None or not result.records else 1e3 * busy / len(result.records)


def prefix_hit_rate(result: RunResult) -> float | None:
    """Of the tokens the replicas looked up in their prefix caches as prefills began, the
    share they found cached (None: the server counted no lookups)."""
    counters = result.server_counters or {}
    queries = counters.get("prefix_cache_queries", 0)
    return counters.get("prefix_cache_hits", 0) / queries if queries else None


def prefix_credit_missed(result: RunResult) -> float | None:
    """Of the prompt tokens the controller counted cached when it bound their requests
    (cluster.credit_prefixes), the share their replica did not find (None: none counted)."""
    counters = result.server_counters or {}
    credited = counters.get("prefix_credited", 0)
    return counters.get("prefix_credit_missed", 0) / credited if credited else None


def replica_busy_fraction(result: RunResult, replicas: int | None) -> float | None:
    """Replica step time over replica time from the first arrival to the last token (None
    unless the replica count is known): near 1 the replicas are out of time; well below it
    while attainment falls, time goes outside their steps."""
    busy = _busy_s(result)
    return None if busy is None or not replicas else busy / (replicas * result.report.duration_s)


def run_summary(result: RunResult, replicas: int | None = None) -> dict[str, Any]:
    r = result.report
    errors = sorted({rec.error for rec in result.records if rec.error})
    return {
        "rate": result.rate,
        "requests": r.overall.requests,
        "attainment": r.overall.attainment,
        "paper_attainment": r.overall.paper_attainment,
        "goodput_rps": r.goodput_rps,
        "goodput_tokens_per_s": r.goodput_tokens_per_s,
        "max_send_lag_s": result.max_send_lag_s,
        "verdicts": {v.value: sum(rec.verdict is v for rec in result.records) for v in Verdict},
        "server_counters": result.server_counters,
        "busy_ms_per_request": busy_ms_per_request(result),
        "replica_busy_fraction": replica_busy_fraction(result, replicas),
        "prefix_hit_rate": prefix_hit_rate(result),
        "prefix_credit_missed": prefix_credit_missed(result),
        "by_slo_class": {
            name: {
                "requests": g.requests,
                "attainment": g.attainment,
                "paper_attainment": g.paper_attainment,
                "ttft_s": {"p50": g.ttft_s.p50, "p99": g.ttft_s.p99},
                "tpot_s": {"p50": g.mean_tpot_s.p50, "p99": g.mean_tpot_s.p99},
            }
            for name, g in r.by_slo_class.items()
        },
        "errors": errors[:10],
    }


def add_arguments(parser: argparse.ArgumentParser, *, target: bool = True) -> None:
    """The load options; `target=False` for a command that starts its own servers."""
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    if target:
        parser.add_argument(
            "--target",
            default="http://127.0.0.1:8000",
            help="base URL (http) or host:port (grpc); default %(default)s",
        )
    parser.add_argument("--protocol", choices=("http", "grpc"), default="http")
    parser.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        default="completions",
        help="completions: prompts as text (/v1/completions); chat: prompts as chat messages "
        "(/v1/chat/completions; gRPC: messages), sized by the --tokenizer folder's chat "
        "template: a class's system prompt as the system message, a session's rounds as the "
        "chat so far (default %(default)s)",
    )
    parser.add_argument(
        "--scenario",
        default="mixed",
        help=f"paper scenario ({', '.join(s.value for s in Scenario)}) or a mix file "
        "(.yaml/.json: your own application classes, loadgen.mixes); default %(default)s",
    )
    parser.add_argument(
        "--rate", type=positive_float, help="requests/s to the target (capacity: start)"
    )
    parser.add_argument(
        "--duration",
        type=positive_float,
        default=60.0,
        help="seconds of arrivals at --rate (capacity: the search's start), which fix the "
        "request count of every point",
    )
    parser.add_argument(
        "--arrivals", choices=("poisson", "gamma", "trace"), default="poisson", help="arrivals"
    )
    parser.add_argument(
        "--cv", type=positive_float, help="gamma arrivals: inter-arrival CV (burstiness)"
    )
    parser.add_argument(
        "--trace", type=Path, help=f"trace CSV for --arrivals trace (default: in {TRACE_DIR})"
    )
    parser.add_argument(
        "--length-scale",
        type=positive_float,
        default=0.1,
        help="multiplies every Table 4 length (default %(default)s, for the CPU demo pair)",
    )
    parser.add_argument("--profile", default=CPU_PROFILE, help="perf profile name or path")
    parser.add_argument(
        "--zero-load",
        default="profile",
        help="what SLOs scale from: 'profile' (predicted), 'probe' (measured on the target "
        "before the run) or a JSON file (a probed run's --json output, to reuse its numbers)",
    )
    parser.add_argument(
        "--gpu-slos", action="store_true", help="fixed 50/100 ms TPOT levels (GPU profiles)"
    )
    parser.add_argument(
        "--tokenizer",
        default=DEFAULT_TOKENIZER,
        help="the served model's folder or hub repo id, for its tokenizer (prompts, HTTP token "
        "counts)",
    )
    parser.add_argument("--model", help="model name (default: the server's first /v1/models)")
    parser.add_argument(
        "--max-model-len", type=model_length, help="refuse workloads that do not fit"
    )
    parser.add_argument("--api-key", help="bearer token")
    parser.add_argument(
        "--no-slo-fields", action="store_true", help="HTTP: omit the slo body field"
    )
    parser.add_argument("--request-timeout", type=positive_float, default=120.0, help="seconds")
    parser.add_argument(
        "--temperature",
        type=non_negative_float,
        help="every request's sampling temperature, 0 for greedy (default: none sent, the "
        "server's default; the OpenAI API's is 1)",
    )
    parser.add_argument("--replicas", type=positive_int, help="for capacity per replica")
    parser.add_argument("--capacity", action="store_true", help="search the capacity")
    parser.add_argument("--rates", help="capacity: search bounds LO,HI in requests/s")
    parser.add_argument(
        "--rel-tol", type=positive_float, default=0.1, help="capacity search tolerance"
    )
    parser.add_argument(
        "--cooldown", type=non_negative_float, default=5.0, help="seconds between points"
    )
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--records", type=output_file, help="per-request JSONL")
    parser.add_argument("--json", type=output_file, help="results JSON (top-level `summary`)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _fail(message: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(message)


def check_args(args: argparse.Namespace) -> tuple[float, float] | None:
    """Validate option combinations; returns the capacity bounds. Errors name the option."""
    if args.cv is not None and args.arrivals != "gamma":
        raise _fail(f"--cv applies to --arrivals gamma only, not {args.arrivals}")
    if args.arrivals == "gamma" and args.cv is None:
        raise _fail("--arrivals gamma needs --cv")
    if args.trace is not None and args.arrivals != "trace":
        raise _fail(f"--trace applies to --arrivals trace only, not {args.arrivals}")
    if args.protocol == "http" and not args.target.startswith(("http://", "https://")):
        raise _fail(f"--target must be an http(s):// URL for --protocol http, got {args.target!r}")
    if args.protocol == "grpc" and "://" in args.target:
        raise _fail(f"--target must be host:port for --protocol grpc, got {args.target!r}")
    if args.no_slo_fields and args.protocol != "http":
        raise _fail("--no-slo-fields applies to --protocol http only")
    try:
        parse_workload(args.scenario)
    except ValueError as exc:
        raise _fail(f"--scenario: {exc}") from None
    try:
        args.tokenizer = model_folder("--tokenizer", args.tokenizer)
    except ValueError as exc:
        raise _fail(str(exc)) from None
    if not has_tokenizer(args.tokenizer):
        raise _fail(
            f"--tokenizer {str(args.tokenizer)!r} has no tokenizer.json nor tokenizer files"
        )
    if args.endpoint == "chat":
        check_chat_template(args.tokenizer)
    if args.zero_load not in ("profile", "probe"):
        if not Path(args.zero_load).is_file():
            raise _fail(
                f"--zero-load must be profile, probe or a JSON file, got {args.zero_load!r}"
            )
        try:
            ZeroLoad.load(Path(args.zero_load))
        except ValueError as exc:
            raise _fail(f"--zero-load: {exc}") from None
    if args.arrivals == "trace" and args.trace is not None:
        try:
            read_trace(args.trace)
        except ValueError as exc:
            raise _fail(f"--trace: {exc}") from None
    if not args.capacity:
        if args.rate is None:
            raise _fail("--rate is required (or --capacity with --rates)")
        if args.rates is not None:
            raise _fail("--rates applies to --capacity only")
        return None
    if args.rates is None:
        raise _fail("--capacity needs --rates LO,HI")
    check_rel_tol("--rel-tol", args.rel_tol)
    try:
        low, high = (float(x) for x in args.rates.split(","))
    except ValueError:
        raise _fail(f"--rates must be two numbers LO,HI, got {args.rates!r}") from None
    if not (math.isfinite(low) and math.isfinite(high) and 0 < low < high):
        raise _fail(f"--rates needs 0 < LO < HI, got {args.rates!r}")
    if args.rate is not None and not low <= args.rate <= high:
        raise _fail(f"--rate {args.rate} must lie within --rates {args.rates}")
    return low, high


CHAT_ROLES = ("system", "user", "assistant", "user")
"""The roles of a chat the load generator sends: a system prompt, then a session's rounds."""


def check_chat_template(tokenizer: Path) -> None:
    """The tokenizer folder's chat template renders the chats `--endpoint chat` sends."""
    codec = TextCodec.from_dir(tokenizer)
    if not codec.chat_template:
        raise _fail(
            f"--endpoint chat: --tokenizer {str(tokenizer)!r} has no chat template "
            "(chat_template.jinja, or tokenizer_config.json's chat_template)"
        )
    try:
        codec.render_chat([{"role": role, "content": "x"} for role in CHAT_ROLES])
    except ValueError as exc:
        raise _fail(
            f"--endpoint chat: the chat template of {str(tokenizer)!r} cannot render a "
            f"{', '.join(CHAT_ROLES)} chat: {exc}"
        ) from None


def probe_prompt_lens(length_scale: float, max_model_len: int | None) -> list[int]:
    """PROBE_PROMPT_LENS scaled like the workload, leaving room for the probe's output."""
    cap = None if max_model_len is None else max_model_len - PROBE_OUTPUT_LEN
    if cap is not None and cap < 1:
        raise ValueError(
            f"--zero-load probe: a {max_model_len}-token context leaves no room for a prompt "
            f"beside the probe's {PROBE_OUTPUT_LEN} output tokens; give a zero-load JSON file "
            "or 'profile'"
        )
    lens = {max(1, round(n * length_scale)) for n in PROBE_PROMPT_LENS}
    return sorted({n if cap is None else min(n, cap) for n in lens})


def zero_load_and_targets(
    args: argparse.Namespace, perf: PerfModel, measured: ZeroLoad | None
) -> tuple[ZeroLoadTTFT, SLOTargets]:
    """The zero-load TTFT per prompt length and the SLO levels, from the measured numbers
    when there are any, else from the profile."""
    if measured is not None:
        ttft: ZeroLoadTTFT = measured.ttft_s
        step = measured.decode_step_s
    else:
        ttft = zero_load_ttft_from(perf)
        context = max(1, round(TABLE4[DECODE_CONTEXT_KEY].mean * args.length_scale))
        step = zero_load_decode_step_s(perf, context)
    targets = SLOTargets() if args.gpu_slos else SLOTargets.for_decode_step(step)
    return ttft, targets


def arrival_process(args: argparse.Namespace, scenario: Workload) -> ArrivalProcess:
    if args.arrivals == "trace":
        path = args.trace or TRACE_DIR / trace_file(scenario)
        return ArrivalProcess(ArrivalKind.TRACE, trace=read_trace(path))
    if args.arrivals == "gamma":
        return ArrivalProcess(ArrivalKind.GAMMA, cv=args.cv)
    return ArrivalProcess(ArrivalKind.POISSON)


@dataclass(frozen=True)
class ServerInfo:
    model: str
    max_model_len: int | None
    replicas: int | None
    scheduler: str | None
    """slos-serve's replica scheduler (slos, vllm, sarathi), labelling the results."""


def _authorized(response: httpx.Response, api_key: str | None) -> httpx.Response:
    """`response`, unless the server refused the key (or its absence): then no request of
    the run would be served."""
    if response.status_code in (401, 403):
        raise _key_refused(f"GET {response.request.url} answered {response.status_code}", api_key)
    return response


def _key_refused(answer: str, api_key: str | None) -> ValueError:
    given = "the --api-key given" if api_key else "no --api-key"
    return ValueError(f"{answer} with {given}: the server wants a valid API key (--api-key)")


def server_info(args: argparse.Namespace) -> ServerInfo:
    """The options, else what the server says.

    Over HTTP the server's /v1/models names the model (slos-serve adds max_model_len) and
    slos-serve's /v1/cluster/status counts the replicas and names the scheduler; other servers
    leave them unknown. gRPC: the server's default model, and its GetClusterStatus."""
    model, max_len, replicas = args.model, args.max_model_len, args.replicas
    if args.protocol == "grpc":
        with Client(args.target, api_key=args.api_key) as client:
            try:
                grpc_status = client.cluster_status(timeout_s=10.0)
            except ClientError as exc:
                if exc.code is grpc.StatusCode.UNAUTHENTICATED:
                    answer = f"{args.target} answered UNAUTHENTICATED ({exc.details})"
                    raise _key_refused(answer, args.api_key) from None
                raise ValueError(f"--target: {args.target} does not answer: {exc}") from None
        return ServerInfo(model or "", max_len, replicas or len(grpc_status.replicas), None)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.target.rstrip("/")
    with httpx.Client(headers=headers, timeout=10.0) as http:
        if model is None or max_len is None:
            response = _authorized(_get(http, base + "/v1/models"), args.api_key)
            if response.status_code == 200:
                card = response.json()["data"][0]
                model = model or str(card["id"])
                if max_len is None and isinstance(card.get("max_model_len"), int):
                    max_len = card["max_model_len"]
            elif model is None:
                raise ValueError(
                    f"GET {base}/v1/models answered {response.status_code}; pass --model"
                )
        response = _authorized(_get(http, base + "/v1/cluster/status"), args.api_key)
        status = response.json() if response.status_code == 200 else {}
    replicas = replicas or len(status.get("replicas", [])) or None
    return ServerInfo(model, max_len, replicas, status.get("scheduler") or None)


async def _probe(target: Target, source: Prompts, lens: Sequence[int]) -> ZeroLoad:
    client = target.client()
    try:
        return await probe(client, source, lens, f"probe of {target.address}")
    finally:
        await client.aclose()


def _get(http: httpx.Client, url: str) -> httpx.Response:
    try:
        return http.get(url)
    except httpx.HTTPError as exc:
        raise ValueError(f"--target: cannot reach {url}: {exc}") from None


def _points_path(path: Path | None, rate: float) -> Path | None:
    return None if path is None else path.with_name(f"{path.stem}.rate{rate:g}{path.suffix}")


@dataclass
class Session:
    """One invocation: what to send, where, and every point run so far."""

    spec: LoadSpec
    target: Target
    source: Prompts
    progress: bool
    replicas: int | None = None
    points: list[dict[str, Any]] = field(default_factory=list)

    def evaluate(self, rate: float, records_path: Path | None) -> RunResult:
        """A fresh open-loop run at `rate`; prints its table and keeps its summary."""
        workload = self.spec.workload(rate)
        prompts = prompts_for(workload, self.source)
        follow_up = next_round(self.source)
        result = asyncio.run(
            run_once(self.target, workload, prompts, follow_up, rate, records_path, self.progress)
        )
        print(f"\n{self.spec.scenario.value} at {rate:g} req/s ({len(workload)} requests)")
        print(summary_table(result))
        summary = run_summary(result, self.replicas)
        self.points.append({**summary, "report": result.report.to_dict()})
        return result


def load_spec(
    args: argparse.Namespace,
    perf: PerfModel,
    measured: ZeroLoad | None,
    max_model_len: int | None,
    reference_rate: float,
    round_growth: int = 1,
) -> LoadSpec:
    """What the options send: `--duration` of requests at `reference_rate`, with SLOs from
    the measured zero load when there is one, else from the profile; a session's rounds grow
    by at least `round_growth` tokens."""
    zero_ttft, targets = zero_load_and_targets(args, perf, measured)
    config = WorkloadConfig(
        zero_ttft,
        targets=targets,
        length_scale=args.length_scale,
        max_model_len=max_model_len,
    )
    scenario = parse_workload(args.scenario)
    requests = max(1, round(reference_rate * args.duration))
    arrivals = arrival_process(args, scenario)
    return LoadSpec(scenario, requests, arrivals, config, args.seed, round_growth)


def prepare(args: argparse.Namespace, reference_rate: float) -> tuple[Session, dict[str, Any]]:
    """The session and the JSON header describing it (probing the target when asked)."""
    perf = load_profile("--profile", args.profile)
    info = server_info(args)
    measured = None
    if args.zero_load not in ("profile", "probe"):
        measured = ZeroLoad.load(Path(args.zero_load))
    codec = TextCodec.from_dir(args.tokenizer)
    text = PromptSource(codec.tokenizer, heldout_texts(), args.seed)
    source: Prompts = ChatPromptSource(text, codec.render_chat) if args.endpoint == "chat" else text
    target = Target(
        args.protocol,
        args.target,
        info.model,
        args.api_key,
        codec.tokenizer,
        not args.no_slo_fields,
        args.request_timeout,
        args.temperature,
    )
    if args.zero_load == "probe":
        try:
            lens = probe_prompt_lens(args.length_scale, info.max_model_len)
        except ValueError as exc:
            raise _fail(str(exc)) from None
        measured = asyncio.run(_probe(target, source, lens))
        print(f"zero load measured at prompts {lens}: {measured.to_dict()}")
    spec = load_spec(
        args, perf, measured, info.max_model_len, reference_rate, source.round_growth()
    )
    header: dict[str, Any] = {
        "target": args.target,
        "protocol": args.protocol,
        "endpoint": args.endpoint,
        "model": info.model,
        "scheduler": info.scheduler,
        "scenario": spec.scenario.value,
        **({} if isinstance(spec.scenario, Scenario) else {"mix": spec.scenario.to_dict()}),
        "duration_s": args.duration,
        "reference_rate": reference_rate,
        "arrivals": spec.arrivals.describe(),
        "length_scale": args.length_scale,
        "profile": str(args.profile),
        "slo_targets": asdict(spec.config.targets),
        "replicas": info.replicas,
        "seed": args.seed,
        "temperature": args.temperature,
    }
    if measured is not None:
        header["zero_load"] = measured.to_dict()
    return Session(spec, target, source, not args.no_progress, info.replicas), header


def capacity_summary(found: CapacityResult, replicas: int | None) -> dict[str, Any]:
    return {
        "capacity_rps": found.capacity,
        "capacity_per_replica": found.capacity / replicas if replicas else None,
        "lowest_failing_rps": found.lowest_failing,
        "bound": found.bound,
        "target": found.target,
        "points": [{"rate": p.rate, "attainment": p.attainment} for p in found.points],
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One invocation's results (the `--json` document): a point at `--rate`, or a capacity
    search. Bad options and unreachable targets raise OptionError naming them."""
    try:
        bounds = check_args(args)
        start = args.rate if bounds is None else args.rate or bounds[0]
        session, out = prepare(args, start)
        if bounds is None:
            out["summary"] = run_summary(
                session.evaluate(args.rate, args.records), session.replicas
            )
        else:

            def attainment_at(rate: float) -> float:
                if session.points:
                    time.sleep(args.cooldown)
                result = session.evaluate(rate, _points_path(args.records, rate))
                return result.report.overall.attainment

            low, high = bounds
            found = find_capacity(
                attainment_at,
                start,
                target=DEFAULT_TARGET,
                rel_tol=args.rel_tol,
                min_rate=low,
                max_rate=high,
            )
            out["summary"] = capacity_summary(found, out["replicas"])
            out["capacity_search"] = found.to_dict()
            print(f"\ncapacity: {json.dumps(out['summary'])}")
    except (argparse.ArgumentTypeError, ValueError) as exc:
        raise OptionError(str(exc)) from None
    out["points"] = session.points
    return out


def run(args: argparse.Namespace) -> int:
    out = measure(args)
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0
