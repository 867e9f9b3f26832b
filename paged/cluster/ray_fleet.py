"""`cluster.backend=ray`: each replica a Ray actor holding a full engine, the router in this process.

The replicas step at the same time: `RayFleet.step` keeps one step in flight on every replica that
holds work and returns what the first to finish ended, so the runner's loop (`paged.engine.runner.drive`)
submits arrivals and collects steps while the others run.

A replica whose actor dies (killed, its node lost, its process crashed) is marked dead and the
router forgets it; the requests it held start afresh on the live replicas, routed as new ones (their
arrival times stay, so their latencies count the time lost), or, with none left alive, end aborted
with a reason that names the dead replica. The run goes on; its summary row says `alive: false`.
"""

from __future__ import annotations

import logging
from typing import Any

import ray
from omegaconf import OmegaConf
from ray.exceptions import RayActorError, RayTaskError

from paged.cluster.engine_actor import EngineActor
from paged.cluster.fleet import Fleet
from paged.cluster.ray_replica import RayReplica
from paged.cluster.ray_session import Placement, connect
from paged.cluster.router import Router
from paged.engine.metrics import MetricsRecorder
from paged.request import Request

log = logging.getLogger(__name__)


class RayFleet(Fleet):
    """A fleet of `RayReplica`s. `started_ray`: this fleet started (or connected) the Ray session, and
    `shutdown` ends it."""

    replicas: list[RayReplica]

    def __init__(
        self, replicas: list[RayReplica], router: Router, metrics: MetricsRecorder, *, started_ray: bool
    ) -> None:
        super().__init__(replicas, router, metrics)
        self.started_ray = started_ray
        self._shut_down = False

    def add_request(self, request: Request) -> None:
        # recorded once here: a request re-routed off a dead replica is not a new one
        self.metrics.on_add(request)
        if self.live:
            super().add_request(request)
        else:  # nothing to run it: it ends at once, as an engine's intake ends a request it cannot take
            dead = ", ".join(str(r.index) for r in self.replicas)
            request.abort_reason = f"every replica died ({dead}); none was left to take it"

    def step(self, until: float | None = None, releases: bool = False) -> list[Request]:
        """Send a step to every busy replica without one in flight, then collect the first to finish;
        returns the requests it ended (or those a dead replica's loss aborted). `until` (the next
        arrival) and `releases` are not used: real replicas run every step."""
        busy = [r for r in self.live if r.has_unfinished]
        for replica in busy:
            replica.launch()
        by_ref = {r.in_flight: r for r in busy}
        ready, _ = ray.wait(list(by_ref), num_returns=1)
        replica = by_ref[ready[0]]
        try:
            return replica.step()
        except RayActorError as e:
            return self._lose(replica, e)

    def abort_all(self, reason: str) -> list[Request]:
        done: list[Request] = []
        for replica in self.live:
            try:
                if replica.in_flight is not None:
                    done += replica.step()
                done += replica.abort_all(reason)
            except RayActorError as e:
                orphans = replica.lose(_death(e))
                self.router.forget(replica)
                done += self._abort(replica, orphans, reason)
        return done

    def _lose(self, replica: RayReplica, error: RayActorError) -> list[Request]:
        """`replica`'s actor died: re-route what it held, or abort it if no replica is left."""
        why = _death(error)
        orphans = replica.lose(why)
        self.router.forget(replica)
        if not self.live:
            log.error("replica %d died (%s) and no replica is left: %d request(s) aborted", replica.index, why,
                      len(orphans))
            reason = f"replica {replica.index} died ({why}) and no replica was left to take it"
            return self._abort(replica, orphans, reason)
        log.warning("replica %d died (%s): its %d unfinished request(s) start again on the %d live replica(s)",
                    replica.index, why, len(orphans), len(self.live))
        replica.num_rerouted += len(orphans)
        for request in orphans:
            super().add_request(request)
        return []

    def _abort(self, replica: RayReplica, orphans: list[Request], reason: str) -> list[Request]:
        for request in orphans:
            request.abort_reason = reason
        replica.num_aborted += len(orphans)
        return orphans

    def shutdown(self) -> None:
        """Stop every replica's actor, and the Ray session if this fleet started it (once: a second
        call does nothing)."""
        if self._shut_down:
            return
        self._shut_down = True
        for replica in self.replicas:
            ray.kill(replica.actor)
        if self.started_ray:
            ray.shutdown()


def _death(error: RayActorError) -> str:
    """Why the actor died, in one line: the last line of Ray's account that is not one of its
    tab-indented fields (class, id, pid, ip), e.g. `The actor is dead because it was killed by ray.kill.`"""
    lines = [line.strip() for line in str(error).splitlines() if line.strip() and not line.startswith("\t")]
    return lines[-1] if lines else type(error).__name__


def _placement(cfg: Any) -> Placement:
    """One actor per replica, with `cluster.num_cpus_per_replica` CPUs, and a GPU per tensor-parallel
    rank where the model runs on CUDA (model.device=cuda, or auto on a driver that has CUDA)."""
    import torch

    device = cfg.model.device
    on_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    ranks = int(cfg.executor.get("tensor_parallel_size") or 1)
    c = cfg.cluster
    return Placement(c.num_replicas, float(c.num_cpus_per_replica), float(ranks) if on_cuda else 0.0)


def engine_config(cfg: Any) -> dict[str, Any]:
    """The plain config every replica builds its engine from: `cfg`, with the model's CPU threads set
    to the replica's CPUs where the config leaves them to the machine (each replica would otherwise
    take every core of its node)."""
    container = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(container, dict)
    if container["model"].get("num_threads") is None:
        container["model"]["num_threads"] = max(1, int(cfg.cluster.num_cpus_per_replica))
    return container


def build_ray_fleet(cfg: Any, router: Router) -> RayFleet:
    """The replicas of `cfg` (checked by `paged.cluster.fleet_builder.check_fleet`) on Ray: join or start
    the session and check that it can place them, then start their actors, which load their models
    side by side."""
    placement = _placement(cfg)
    started = connect(cfg.cluster.address, placement)
    remote = ray.remote(EngineActor).options(
        num_cpus=placement.cpus, num_gpus=placement.gpus, max_restarts=0, max_task_retries=0,
    )
    actors = [remote.remote() for _ in range(placement.num_replicas)]
    config = engine_config(cfg)
    try:
        infos = ray.get([actor.build.remote(config) for actor in actors])
    except BaseException as e:
        for actor in actors:
            ray.kill(actor)
        if started:
            ray.shutdown()
        if isinstance(e, RayTaskError) and isinstance(e.cause, Exception):
            raise e.cause from None  # the replica's own error (a config or checkpoint error), as it is
        raise
    metrics = MetricsRecorder()
    replicas = [RayReplica(i, actor, info, metrics) for i, (actor, info) in enumerate(zip(actors, infos))]
    log.info("fleet: %d replicas on Ray (%s), router %s", len(replicas),
             ", ".join(sorted({info.node for info in infos})), cfg.router.name)
    return RayFleet(replicas, router, metrics, started_ray=started)
