"""The front door's entry to the cluster: launch it, submit requests, read status, shut down.

`submit` is where a request's stream is kept whole. It learns the verdict and the replica
from the controller, then reads tokens straight from that replica. If the replica dies, it
asks the controller to resume the request elsewhere from the tokens it already delivered, so
the client sees every token exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import ray
from ray import ObjectRef, ObjectRefGenerator
from ray.actor import ActorHandle
from ray.autoscaler.sdk import request_resources
from ray.exceptions import ActorDiedError, RayActorError, RayError, TaskCancelledError
from ray.util.placement_group import PlacementGroup, get_placement_group, remove_placement_group

from cluster.api import (
    ClusterStatus,
    ClusterUnavailable,
    FinalRecord,
    Placement,
    TokenChunk,
    Verdict,
    stage_verdicts,
)
from cluster.config import ClusterConfig
from cluster.control import Binding
from cluster.controller import MAX_CONCURRENCY, ClusterController, kill_for_good
from cluster.messages import StreamItem
from cluster.names import CONTROLLER_NAME, NAMESPACE, replica_name, slot_occupants
from cluster.profile import cluster_profile
from cluster.replica_launch import start_actor, start_replica
from replica.model_source import model_folder
from replica.planner.base import CacheBudget
from replica.planner.queues import peak_tokens
from replica.request import Request

log = logging.getLogger(__name__)

CONTROLLER_RETRIES = 20
"""Controller calls retried while Ray restarts it (each after RETRY_DELAY_S)."""
RETRY_DELAY_S = 0.5
SHUTDOWN_TIMEOUT_S = 10.0
STALL_CHECK_S = 3.0
"""How long a stream waits for its replica's next item before it asks the controller whether
to move (`ClusterHandle._next_ref`)."""
STALLED_MOVE_CHECKS = 2
"""Answers in a row that say move before a stalled stream does."""
MOVE_ANSWER_S = STALL_CHECK_S / 2
"""How long the controller's answer about a replica serves every stream stalled there: shorter
than STALL_CHECK_S, so a stream's answers in a row are never the same one."""
DEAD_RENEWALS = 3
"""Renewals in a row that find the controller dead for good (`ActorDiedError`; a restarting
one holds the call) before the door takes its cluster for stopped."""
DOORS_POLL_S = 0.5
"""How often a launch asks whether the doors of a cluster it replaces have left."""
GPU_POLL_S = 2.0
"""How often a launch waiting for GPU nodes (`ClusterConfig.resource_wait_s`) looks again."""


@dataclass
class _Progress:
    """What the client has received so far: the source of truth for a resume."""

    tokens: list[int]
    times: list[float]
    migrations: int = 0
    cached_tokens: int = 0
    """Prompt tokens the first replica found cached (a resumed request's prompt is longer)."""


class ClusterHandle:
    """A running cluster: its controller and replica actors."""

    def __init__(
        self,
        config: ClusterConfig,
        controller: ActorHandle,
        replicas: Sequence[ActorHandle | None],
        max_model_len: int,
        vocab_size: int,
        namespace: str | None = None,
    ) -> None:
        """`replicas`: per slot, its replica (None: off, with autoscaling); `namespace`: the
        Ray namespace their names (and their placement groups') are in (None: this job's)."""
        self.config = config
        self._controller = controller
        self._replicas = list(replicas)
        self._namespace = namespace
        self._max_model_len = max_model_len
        self._vocab_size = vocab_size
        self._active: set[str] = set()
        """Request ids being streamed by this handle (an id streams to one client only)."""
        self.door_id = uuid.uuid4().hex
        """This handle's lease on the cluster: its requests end when the lease does."""
        self._leaving = threading.Event()
        """Set when the handle leaves: its lease is no longer renewed."""
        self.lease_refused = False
        """The cluster is being stopped and refused this handle's lease: nothing it sends
        will be served (Serve's health check restarts such a door)."""
        self._move_answers: dict[int | None, tuple[float, asyncio.Future[bool]]] = {}
        """Per replica, the last `moves_from` asked and when (`_moves`)."""

    @property
    def model_name(self) -> str:
        return self.config.model_name

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def controller(self) -> ActorHandle:
        return self._controller

    @property
    def replicas(self) -> list[ActorHandle]:
        """The replicas this handle knew of at launch or attach (the controller may start
        others since: each binding names its own)."""
        return [r for r in self._replicas if r is not None]

    def validate(self, request: Request) -> None:
        """The checks a replica would make, made here so bad input fails before routing."""
        if request.model and request.model != self.model_name:
            raise ValueError(
                f"unknown model {request.model!r}; this cluster serves {self.model_name!r}"
            )
        request.check_fits(self.max_model_len, self.vocab_size)
        blocks = CacheBudget(self.config.num_kv_blocks).blocks_for(peak_tokens(request))
        if blocks > self.config.num_kv_blocks:
            raise ValueError(
                f"prompt + max_tokens need {blocks} KV blocks; a replica has "
                f"{self.config.num_kv_blocks}"
            )

    async def submit(self, request: Request) -> AsyncIterator[TokenChunk | FinalRecord]:
        """Token chunks as produced, then exactly one FinalRecord.

        The verdict the first chunk from a replica announces is the one the request runs
        with then, and the record's the one it ended with: best-effort at its bind, it is
        admitted once its replica's planner guaranteed it (mostly before its first token).
        A guarantee given up later is not taken back; the record shows the SLO missed.

        Raises ValueError for invalid requests, and ClusterUnavailable when no replica is up
        (before anything is yielded) or when a request that lost its replica cannot be resumed
        (possibly mid-stream). Closing the iterator early aborts the request. Request ids must
        be unique (the front doors make them so): the controller takes an id it still holds
        for a retry of that request, and it may hold one for a moment after its end."""
        self.validate(request)
        rid = request.request_id
        if rid in self._active:
            raise ValueError(f"request {rid!r} is already in flight")
        if request.arrival_time <= 0:
            request = replace(request, arrival_time=time.time())
        self._active.add(rid)
        progress = _Progress([], [])
        finished = False
        try:
            binding = await self._call("submit", request, self.door_id)
            if binding.verdict is None:
                finished = True
                raise ClusterUnavailable(binding.reason, binding.retry_after_s or None)
            if binding.verdict is Verdict.REJECTED:
                finished = True
                yield self._final(request, binding, None, progress)
                return
            while True:
                assert binding.replica is not None and binding.verdict is not None
                placed = False
                end = None
                why = ""
                try:
                    async for item in self._stream(binding, rid):
                        if item.promoted:
                            binding = replace(binding, verdict=Verdict.ADMITTED)
                        if item.token_ids:
                            if not progress.tokens:
                                progress.cached_tokens = item.cached_tokens
                            progress.tokens.extend(item.token_ids)
                            progress.times.extend(item.times)
                            yield TokenChunk(
                                rid,
                                item.token_ids,
                                item.times,
                                None if placed else self._placement(binding),
                                item.logprobs,
                                item.prompt_logprobs,
                            )
                            placed = True
                        if item.lost:
                            raise _Lost
                        if item.finish_reason is not None:
                            end, why = item.finish_reason, item.abort_reason
                            break
                except (RayActorError, _Lost):
                    if len(progress.tokens) < request.sampling.max_tokens:
                        moved = await self._resume(request, binding, progress)
                        if moved.verdict not in (Verdict.ADMITTED, Verdict.BEST_EFFORT):
                            # No output to report as served: the client learns it was cut off.
                            raise ClusterUnavailable(moved.reason or "no replica is up") from None
                        binding = replace(moved, hops=binding.hops)
                        continue
                    end = "length"  # the replica failed after delivering every token
                finished = True
                yield self._final(request, binding, end, progress, why)
                return
        finally:
            self._active.discard(rid)
            if not finished:
                self.abort(rid)

    @staticmethod
    def _placement(binding: Binding) -> Placement:
        """Where the request runs and its verdict, as its first chunk from there announces."""
        assert binding.verdict is not None and binding.replica is not None
        return Placement(binding.verdict, binding.replica, binding.hops)

    async def _stream(self, binding: Binding, request_id: str) -> AsyncIterator[StreamItem]:
        """The replica's items (a cancelled task: see `_call`)."""
        gen = self._open_stream(binding, request_id)
        try:
            while (ref := await self._next_ref(gen, binding, request_id)) is not None:
                yield await ref
        except TaskCancelledError:
            raise asyncio.CancelledError from None

    async def _next_ref(
        self, gen: ObjectRefGenerator, binding: Binding, request_id: str
    ) -> ObjectRef[StreamItem] | None:
        """The stream's next item (None: its end). A replica that hangs (a wedged device, a
        stopped process) holds its streams for as long as it hangs, while the controller
        takes it for down and routes around it: a stream that waits STALL_CHECK_S for an
        item asks whether it should move (`ClusterController.moves_from`), and once told so
        twice in a row aborts it there (the replica gets the abort when it wakes) and
        resumes elsewhere. Twice, as a replica the health loop took for down on a loaded
        machine is back within seconds."""
        step = asyncio.ensure_future(anext(gen, None))
        told = 0
        try:
            while not (await asyncio.wait({step}, timeout=STALL_CHECK_S))[0]:
                check = asyncio.ensure_future(self._moves(binding))
                await asyncio.wait({step, check}, return_when=asyncio.FIRST_COMPLETED)
                if not check.done():  # the item came first (a restarting controller is slow)
                    check.cancel()
                    continue
                told = told + 1 if check.result() else 0
                if told == STALLED_MOVE_CHECKS:
                    actor: Any = binding.actor
                    actor.abort.remote(request_id)
                    raise _Lost
            ref: ObjectRef[StreamItem] | None = step.result()
            return ref
        finally:
            step.cancel()

    async def _moves(self, binding: Binding) -> bool:
        """Whether the controller says the stream should leave the binding's replica. One
        question per replica, its answer shared for MOVE_ANSWER_S with every stream stalled
        there: a queue of best-effort streams waiting minutes for their first token, or a
        burst on a hung replica, asked once each per STALL_CHECK_S."""
        now = time.monotonic()
        asked = self._move_answers.get(binding.replica)
        if asked is None or now - asked[0] >= MOVE_ANSWER_S:
            asked = now, asyncio.ensure_future(self._ask_moves(binding.replica))
            self._move_answers[binding.replica] = asked
        return await asyncio.shield(asked[1])  # a stream whose item came leaves it to others

    async def _ask_moves(self, replica: int | None) -> bool:
        """No when the controller cannot say: the stream waits on, as it did before it asked."""
        try:
            moves: bool = await self._controller.moves_from.remote(replica)
        except RayError:
            return False
        return moves

    @staticmethod
    def _open_stream(binding: Binding, request_id: str) -> ObjectRefGenerator:
        actor: Any = binding.actor
        assert actor is not None
        gen: ObjectRefGenerator = actor.stream.options(num_returns="streaming").remote(request_id)
        return gen

    async def _resume(self, request: Request, binding: Binding, progress: _Progress) -> Binding:
        """Continue elsewhere after the delivered tokens (the controller waits for a replica
        when none is up)."""
        progress.migrations += 1
        assert binding.replica is not None
        result: Binding = await self._call(
            "resume", request, list(progress.tokens), binding.replica, self.door_id
        )
        return result

    def _final(
        self,
        request: Request,
        binding: Binding,
        end: str | None,
        progress: _Progress,
        why: str = "",
    ) -> FinalRecord:
        times = progress.times
        return FinalRecord(
            request_id=request.request_id,
            verdict=binding.verdict or Verdict.REJECTED,
            replica=binding.replica,
            hops=binding.hops,
            finish_reason=end,
            reason=why or binding.reason,
            retry_after_s=binding.retry_after_s,
            arrival_time=request.arrival_time,
            first_token_time=times[0] if times else None,
            finish_time=time.time() if end is not None else None,
            num_prompt_tokens=request.prompt_len,
            num_cached_tokens=progress.cached_tokens,
            num_output_tokens=len(progress.tokens),
            migrations=progress.migrations,
            stages=stage_verdicts(request, progress.tokens, times) if end is not None else (),
        )

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV (fire-and-forget; unknown ids are ignored)."""
        self._controller.abort.remote(request_id)

    async def status(self) -> ClusterStatus:
        status: ClusterStatus = await self._call("status")
        return status

    async def metrics_snapshot(self) -> dict[str, object]:
        """The controller's counters and histograms (the front door counts what clients saw)."""
        snapshot: dict[str, object] = await self._call("metrics")
        return snapshot

    async def _call(self, method: str, *args: object) -> Any:
        """A controller call that rides out a controller restart. The Ray tasks a request
        awaits are cancelled only with it (Ray Serve cancels them when its client leaves):
        that reaches the caller as the cancellation it is, not as a fault."""
        for _ in range(CONTROLLER_RETRIES):
            try:
                return await getattr(self._controller, method).remote(*args)
            except RayActorError:
                await asyncio.sleep(RETRY_DELAY_S)
            except TaskCancelledError:
                raise asyncio.CancelledError from None
        raise ClusterUnavailable("the cluster controller does not answer")

    async def attach(self) -> bool:
        """Take a lease on the cluster and keep renewing it; False when it is being stopped."""
        if not await self._call("attach", self.door_id):
            return False
        threading.Thread(target=self._renew, name="door-lease", daemon=True).start()
        return True

    def _renew(self) -> None:
        """Renews from a thread of its own: the lease says the door's process lives, and a
        door whose event loop is held up for a while (a burst of large bodies to parse) must
        not have every client's request ended for it. A hung loop is Serve's health check's
        to find, which restarts the door; so is a controller dead for good (stopped by a door
        that replaced the cluster), which leaves this door nothing to serve with."""
        lease_s = self.config.door_lease_s
        died = 0
        while not self._leaving.wait(lease_s / 4) and not self.lease_refused:
            try:
                # A copy made in one C call, under the GIL, of the set the loop adds to.
                ref: ObjectRef[bool] = self._controller.attach.remote(
                    self.door_id, list(self._active)
                )
                renewed = bool(ref.future().result(timeout=lease_s))
            except ActorDiedError:
                died += 1
                renewed = died < DEAD_RENEWALS
            except (RayActorError, TimeoutError):  # it restarts, or answers late
                continue
            except Exception:  # a dead thread would end every request this door serves
                log.exception("renewing the door's lease failed")
                continue
            else:
                died = 0
            if not renewed and not self._leaving.is_set():  # not the door's own release
                log.warning("the cluster is stopped or gone; this front door cannot serve")
                self.lease_refused = True

    async def shutdown(self, handover: bool = False) -> None:
        """Leave the cluster, ending this handle's requests. The last handle to leave stops
        it: the controller, then the replicas (open streams end); returns once their names
        are free of them, so a new cluster can launch on the same Ray instance. The replicas
        and their groups are found by their slots' names, as each is created: the controller
        may have started some since launch (the autoscaler's, those in place of replicas dead
        for good), and stopped the starts in flight when the last door left. A controller
        gone for good was stopped by whoever replaced it, with its replicas. `handover`: a
        Serve update replaces this door; the cluster is left running for the next one (it
        stops itself if none comes, `Leases.abandoned`)."""
        self._leaving.set()
        try:
            last: bool = await asyncio.wait_for(
                self._controller.release.remote(self.door_id, handover), SHUTDOWN_TIMEOUT_S
            )
        except RayActorError:
            return
        except TimeoutError:
            # A controller that does not answer cannot be left running, unless a door takes
            # it over (a cluster no door comes to stops itself, `Leases.abandoned`).
            last = not handover
        if last:
            actors = {CONTROLLER_NAME: self._controller}
            groups = []
            grouped = self.config.num_gpus_per_replica > 0
            for i in range(self.config.slots):
                actor, group = slot_occupants(i, self._namespace, grouped)
                groups.append(group)
                if actor is not None:
                    actors[replica_name(i)] = actor
            await _stop(actors, groups, self._namespace)


async def _stop(
    actors: dict[str, ActorHandle],
    groups: Sequence[PlacementGroup | None],
    namespace: str | None,
) -> None:
    """Kill these named actors for good and free their placement groups; returns once no
    name is held by one of them any more (or after a timeout)."""
    kill_for_good(list(actors.values()), groups)
    deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
    while time.monotonic() < deadline and any(
        _holds(name, actor, namespace) for name, actor in actors.items()
    ):
        await asyncio.sleep(0.1)


def _holds(name: str, actor: ActorHandle, namespace: str | None) -> bool:
    try:
        return bool(ray.get_actor(name, namespace=namespace) == actor)
    except ValueError:
        return False


class _Lost(Exception):
    """The replica no longer holds the request (it restarted, or let it go), or hangs."""


def check_launch(config: ClusterConfig) -> None:
    """What a launch reads from disk before the replicas load the target: the profile, and the
    draft when the replicas load one; and, on a running Ray cluster, the GPUs a replica needs
    when the launch would not wait for them (Ray Serve builds an application, and so calls
    this, before it stops the running version's door)."""
    cluster_profile(config)
    if config.loads_draft:
        assert config.draft is not None  # ClusterConfig requires one
        model_folder("draft", config.draft)
    if ray.is_initialized():
        _refuse_short_of_gpus(config)


async def launch(
    config: ClusterConfig, *, detached: bool = False, drain_s: float = 0.0
) -> ClusterHandle:
    """Start the replicas and the controller on the current Ray cluster (a local one is
    started when Ray is not initialized); returns once every replica has loaded its model.

    `detached`: the actors outlive this process (Ray Serve's front door, which Serve restarts
    when it crashes). A running cluster launched so with the same config is then attached
    instead, without reloading a model; one with another config, or being stopped, is
    stopped first, once no door holds a live lease on it or after `drain_s` plus its lease
    (a Serve update's old door finishing its streams).

    `check_launch` runs first: a bad file stops the launch before Ray starts, not after
    every replica loaded its target."""
    check_launch(config)
    if not ray.is_initialized():
        ray.init()
    namespace = NAMESPACE if detached else None
    if detached:
        handle = await _reattach(config)
        if handle is not None:
            return handle
    # Before a running cluster of another config is stopped: a config this Ray cluster
    # cannot place must leave it serving.
    asked = await _wait_for_gpus(config)
    try:
        if detached:
            await _stop_running(config, drain_s)
        started = [
            await start_replica(config, i, namespace, detached) for i in range(config.replicas)
        ]
    finally:
        if asked:  # the replicas' actors hold (or wait for) their GPUs now
            _forget_gpu_request()
    replicas = [actor for actor, _ in started]
    groups = [group for _, group in started]
    infos: list[tuple[int, int]] = await asyncio.gather(*(r.info.remote() for r in replicas))
    max_model_len, vocab_size = infos[0]
    controller = start_actor(
        ClusterController,
        config,
        replicas,
        groups,
        detached,
        name=CONTROLLER_NAME,
        namespace=namespace,
        max_restarts=-1,
        max_task_retries=-1,
        max_concurrency=MAX_CONCURRENCY,
        num_cpus=0,
        **({"lifetime": "detached"} if detached else {}),
    )
    await controller.ready.remote()
    handle = ClusterHandle(config, controller, replicas, max_model_len, vocab_size, namespace)
    await handle.attach()
    return handle


async def _wait_for_gpus(config: ClusterConfig) -> bool:
    """Returns once the Ray cluster holds the GPUs of a replica, asking its autoscaler for
    every replica's (a group scaled to zero gets no other demand before the replicas ask);
    a ValueError after `resource_wait_s` (at once when it is 0). True: it asked, and the
    caller is to `_forget_gpu_request` once the replicas are started."""
    _refuse_short_of_gpus(config)
    short, wait_s = _gpus_short(config), config.resource_wait_s
    if not short:
        return False
    log.warning("%s: waiting up to %g s for GPU nodes", short, wait_s)
    request_resources(bundles=[{"GPU": config.num_gpus_per_replica}] * config.replicas)
    deadline = time.monotonic() + wait_s
    while short and time.monotonic() < deadline:
        await asyncio.sleep(min(GPU_POLL_S, max(0.0, deadline - time.monotonic())))
        short = _gpus_short(config)
    if short:
        _forget_gpu_request()
        raise ValueError(f"{short} after {wait_s:g} s")
    return True


def _forget_gpu_request() -> None:
    """The autoscaler keeps a request until another replaces it: left, it would hold the GPU
    nodes after the replicas stopped (or never started), whatever the load."""
    request_resources(bundles=[])


def _refuse_short_of_gpus(config: ClusterConfig) -> None:
    """A ValueError when the Ray cluster lacks a replica's GPUs and the launch is not to wait."""
    short = _gpus_short(config)
    if short and config.resource_wait_s == 0:
        raise ValueError(short + " (resource_wait_s waits for GPU nodes)")


def _gpus_short(config: ClusterConfig) -> str:
    """Why the Ray cluster cannot hold a replica's GPUs ("": it can)."""
    gpus = ray.cluster_resources().get("GPU", 0)
    need = config.num_gpus_per_replica
    return (
        f"num_gpus_per_replica={need:g} but the Ray cluster has {gpus:g} GPU(s)"
        if gpus < need
        else ""
    )


async def _reattach(config: ClusterConfig) -> ClusterHandle | None:
    """A handle on the detached cluster running, if it was launched with `config` and is
    not being stopped (the requests of a front door that died end when its lease runs out)."""
    try:
        controller = ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
        if await controller.cluster_config.remote() != config:
            log.info("a cluster with another config is running: it is to be replaced")
            return None
        replicas = await controller.replica_handles.remote()
    except (ValueError, RayActorError):
        return None
    info = await _model_info(replicas)
    if info is None:
        return None
    handle = ClusterHandle(config, controller, replicas, *info, NAMESPACE)
    if not await handle.attach():
        return None
    log.info("attached to the running cluster (%d replicas)", sum(r is not None for r in replicas))
    return handle


async def _model_info(replicas: Sequence[ActorHandle | None]) -> tuple[int, int] | None:
    """(max_model_len, vocab_size) from the first replica that answers: one dying at that
    moment (a restart, an autoscaler's stop) must not make the door stop a running cluster."""
    for replica in replicas:
        if replica is None:
            continue
        with contextlib.suppress(RayActorError):
            info: tuple[int, int] = await replica.info.remote()
            return info
    return None


async def _stop_running(config: ClusterConfig, drain_s: float = 0.0) -> None:
    """Stop the detached cluster running under our names (another config's, or one being
    stopped), and any group left by a launcher that died before starting its replica. Its
    doors may be draining their streams: it is stopped once none holds a live lease, or
    after `drain_s` plus its lease."""
    groups: list[PlacementGroup | None] = []
    slots = config.slots
    with contextlib.suppress(ValueError, RayActorError, TimeoutError):
        controller = ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
        running: ClusterConfig = await asyncio.wait_for(
            controller.cluster_config.remote(), SHUTDOWN_TIMEOUT_S
        )
        slots = max(slots, running.slots)
        await _until_no_door(controller, drain_s + running.door_lease_s)
        groups = await asyncio.wait_for(controller.placement_groups.remote(), SHUTDOWN_TIMEOUT_S)
    actors = {}  # named once the doors left: the controller may start or stop some meanwhile
    for name in _cluster_names():
        with contextlib.suppress(ValueError):
            actors[name] = ray.get_actor(name, namespace=NAMESPACE)
    await _stop(actors, groups, NAMESPACE)
    for i in range(slots):
        with contextlib.suppress(ValueError):
            remove_placement_group(get_placement_group(replica_name(i)))


async def _until_no_door(controller: ActorHandle, timeout_s: float) -> None:
    """Returns once no door holds a live lease on the cluster, or after `timeout_s` (the
    drain and a lease: a door that died stops renewing). A poll the controller answers late
    counts as a door still there."""
    deadline = time.monotonic() + timeout_s
    waited = False
    while time.monotonic() < deadline:
        try:
            doors: int = await asyncio.wait_for(controller.live_doors.remote(), SHUTDOWN_TIMEOUT_S)
        except TimeoutError:
            doors = 1
        if not doors:
            return
        if not waited:
            log.info(
                "waiting up to %.0f s for the door(s) of the running cluster to finish their "
                "streams before stopping it",
                timeout_s,
            )
            waited = True
        await asyncio.sleep(DOORS_POLL_S)
    log.warning("door(s) still hold the running cluster after %.0f s", timeout_s)


def _cluster_names() -> list[str]:
    """The names of the detached cluster's actors, whatever its size."""
    prefix = replica_name(0).removesuffix("0")
    named = ray.util.list_named_actors(all_namespaces=True)
    names = [a["name"] for a in named if a["namespace"] == NAMESPACE]
    return [n for n in names if n == CONTROLLER_NAME or n.startswith(prefix)]
