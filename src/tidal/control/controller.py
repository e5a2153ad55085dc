"""The reconcile loop, as a controller that steps: ``decisions = controller.step(now_s)``.

One step, in order:

1. **Observe** every job the executor runs: exit codes, progress, heartbeats (progress stored in one
   transaction). The active jobs are read whole once, then only those written since (``Store.take_changed``);
   the scheduler's views and queues likewise (:class:`~tidal.control.job_views.SchedulerView`).
2. **Reconcile** each job holding GPUs or backing off, and each pending job written since
   (:meth:`Controller._reconcile`): ranks up -> ``running``; every rank exited -> classify the attempt and
   move on (``succeeded``; ``pending`` after a preemption; relaunch after a resize; ``backoff`` then
   ``pending`` up to ``max_restarts``; ``failed``); a rank failed or the job hung -> kill it; a grace run out
   -> SIGKILL; a cancel request -> notice.
3. **Lend and reclaim** (:class:`tidal.control.loans.LiveLoans`), or with a serving side that only advises,
   let the :class:`tidal.serving.watch.Advisor` plan and lend nothing.
4. **Decide**: the pure scheduler (:func:`tidal.policy.scheduler.schedule`, the simulator's) on a
   :class:`~tidal.model.Snapshot` built from the store, with the serving loans and reclaims in it.
5. **Act**: each decision to the store (a checked transition, an event) and the executor (``Admit`` ->
   launch; ``Preempt``/``Shrink``/``Grow`` -> notice, the job checkpoints and exits 75; ``ReturnGpus`` ->
   ledger and adapter). The loan state is stored after every step, so a restarted plane continues it.

The controller reads no clock: ``now_s`` (Unix seconds, the clock heartbeats use) is an argument. Not
thread-safe: one loop calls ``step``; the API only writes requests to the store.
"""

from __future__ import annotations

import logging
import operator
from collections import Counter
from pathlib import Path
from typing import Any

from tidal.contract import DEFAULT_GRACE_S, EXIT_FENCED
from tidal.control import locations, node_memory
from tidal.control.accounting import account, describe_rank, rank_code
from tidal.control.config import ControlConfig
from tidal.control.job_views import SchedulerView, job_env, own_dirs, taken_over
from tidal.control.loans import DOC_KEY as LOANS_DOC
from tidal.control.loans import LiveLoans
from tidal.control.node_watch import NodeWatch
from tidal.control.read_view import (
    QUEUE_SHOWN,
    PlaneView,
    Published,
    QueuedJob,
    held_job,
    told,
    waiting_head,
    with_progress,
)
from tidal.control.serving_nodes import lent_before
from tidal.control.states import ACTIVE, HELD, STOPPING, TERMINAL, State
from tidal.control.store import HeldJob, JobRow, Store, loaded, written
from tidal.exec.progress import Progress
from tidal.exec.protocol import EXIT_PREEMPTED, AgentMemory, Executor, LaunchRequest, NodeMemory, Observation
from tidal.model import (
    Admit,
    Decision,
    Grow,
    Job,
    Node,
    Preempt,
    QueueKey,
    ReturnGpus,
    SetCkptInterval,
    Shrink,
    Snapshot,
    Tenant,
    Waiting,
)
from tidal.policy import apply
from tidal.policy.ckpt_interval import plan_ckpt_intervals
from tidal.policy.scheduler import RunningIndex, schedule
from tidal.serving.watch import Advisor

log = logging.getLogger(__name__)

S = State
SHM_SWEEP_S = 5.0  # how often ended jobs' shared-memory directories are looked at
RETENTION_CHECK_S = 60.0  # how often ended jobs and events older than ``retention_s`` are dropped
ANNOUNCE_INTERVAL_S = 600.0  # a job's checkpoint-interval changes are announced (events) at most this often
_IDLE = frozenset({S.PENDING.value, S.BACKOFF.value})  # (job states holding nothing, as stored)
_PROGRESS_FIELDS = ("id", "state", "progress", "last_ckpt_s", "ckpt_stall_s", "ckpt_step")  # (its progress)
_STEADY_FIELDS = ("state", "cancel_requested", "killed", "stop_reason")  # (a running job with nothing to do)
RESUMABLE_CODES = frozenset({0, EXIT_PREEMPTED, -15, 128 + 15})  # -15/143: SIGTERM before the session existed


class Controller:
    """Drives the pure scheduler and an executor from the store. See the module docstring."""

    def __init__(self, store: Store, executor: Executor, config: ControlConfig | None = None, *,
                 ckpt_root: str | Path | None = None, loans: LiveLoans | None = None,
                 advisor: Advisor | None = None, publish: bool = False) -> None:
        if loans is not None and advisor is not None:
            raise ValueError("a serving side either lends (loans) or advises (advisor), not both")
        self.store, self.executor, self.loans, self.advisor = store, executor, loans, advisor
        self.config = config or ControlConfig()
        self.ckpt_root = Path(ckpt_root) if ckpt_root is not None else None
        self.nodes: list[Node] = executor.nodes()
        self._events: list[tuple[str, str, dict | None]] = []  # this step's loan events
        self._to_start: dict[str, tuple[JobRow, LaunchRequest]] = {}  # attempts recorded, ranks not started
        self._to_release: list[tuple[str, int]] = []  # (job, attempt) ended, its end not yet committed
        self.watch = NodeWatch(store, executor, self.nodes)  # nodes joining and leaving; jobs losing one
        self._shm_swept_s = float("-inf")
        self._quota_checked_s = float("-inf")
        self._retained_s = float("-inf")
        self._active: dict[str, JobRow] | None = None  # job id -> row, in submission order (_refresh)
        self._state: dict[str, str] = {}  # the same ids -> state (a plain dict: read for every job each step)
        self._busy: dict[str, int] = {}  # the ids of those not pending -> their seq (what a step reconciles)
        self._reread: set[str] = set()  # ids re-read since the last reconcile (a pending one: reconciled)
        self.view = SchedulerView()  # what the scheduler sees, kept between steps
        self._tenants: tuple[int, tuple[Tenant, ...]] = (-1, ())  # (the store's tenant_rev, the tenants)
        self._node_t: tuple[Node, ...] = ()
        self._index = RunningIndex()  # the scheduler's sums over running jobs, kept across steps
        self._over_quota: set[str] = set()
        self._announced: dict[str, tuple[float, int]] = {}  # job -> (last ckpt_interval event, changes since)
        self._own_cadence: set[str] = set()  # jobs told that their own step cadence wins
        # ``publish``: the pool as each step leaves it, for the API's reads (tidal.control.read_view); the
        # copies of the jobs holding GPUs in the newest view, made again for the jobs written since
        self.published: Published | None = Published() if publish else None
        self._copies: dict[str, HeldJob] = {}
        self._unpublished: set[str] = set()  # jobs written since the newest view
        self._progressed: set[str] = set()  # jobs whose progress alone the loop wrote since
        self.steps = 0
        # ended jobs per state for the view: counted in the store (a scan of the jobs' history) at first and
        # after retention dropped jobs; an active job seen ended adds one (_forget)
        self._ended: dict[str, int] | None = None
        # job id -> why it waited or did not grow at the newest step (the scheduler's reasons, published with
        # the view: made afresh at every step, so not stored)
        self._waiting: dict[str, Waiting] = {}
        self._queued: frozenset[QueueKey] = frozenset()  # the queues with jobs still waiting after the step
        if loans is not None:
            serving = {n.name: n.gpus for n in self.nodes if n.pool == "serving"}
            doc = store.get_doc(LOANS_DOC)
            lost_ok = lent_before(doc, loans.nodes)  # nodes lost (or back) since: the loan step's to handle
            if {n: g for n, g in serving.items() if n not in lost_ok} != {
                    n: g for n, g in loans.nodes.items() if n not in lost_ok}:
                raise ValueError(f"the executor's serving nodes {serving} are not the serving adapter's "
                                 f"{loans.nodes}")
            if doc is not None:
                loans.load(doc)

    def recover(self, now_s: float) -> None:
        """After a (re)start: re-adopt the workers of every job that holds GPUs, or requeue it (not a
        failure); ranks that ended meanwhile are handled by the next step. What the executor still holds of
        any other attempt is released (a plane killed after storing an end, before releasing it)."""
        held = self.store.jobs(states=HELD)
        adopted = {j.id for j in held if j.attempt > 0 and self.executor.adopt(j.id, j.attempt, now_s)}
        observed = self.executor.observe(now_s)  # once: every job's
        for job in held:
            found = job.id in adopted
            ob = observed.get(job.id) if found else None
            if ob is not None and ob.alive:
                pids = [r.pid for r in ob.alive]
                self.store.record("adopted", f"control plane restarted: re-adopted attempt {job.attempt}, "
                                  f"{len(pids)} of {_n(len(ob.ranks), 'rank')} running (pids {pids})", now_s,
                                  job=job, data={"attempt": job.attempt, "pids": pids})
            elif ob is not None and not all(r.vanished for r in ob.ranks):
                self.store.record("adopted", f"control plane restarted: attempt {job.attempt} ended "
                                  "meanwhile; its recorded exit codes decide what follows", now_s, job=job)
            else:
                if found:
                    self.executor.release(job.id)
                why = "its ranks are gone" if found else "its launch was never recorded, so no rank ran"
                self.store.transition(job, S.PENDING, now_s,
                                      f"control plane restarted: attempt {job.attempt} {why}; requeued to "
                                      f"resume from checkpoint step {job.ckpt_step or 0}",
                                      **_requeue_fields(), data={"recovered": True, "launched": found})
        try:  # (ends stored by a plane killed before it released them)
            self.executor.release_unadopted()
        except Exception:  # (a clean-up: the plane starts anyway, and the next start tries again)
            log.exception("releasing what is left of attempts not adopted failed")
        self.sweep_shm(now_s, force=True)  # orphans: ended jobs' shm dirs, or unknown ones

    def step(self, now_s: float) -> list[Decision]:
        """One reconcile step (see the module docstring); returns the scheduler's decisions. A step that
        raises withdraws the published view (the reads query the store until a step completes)."""
        try:
            return self._step(now_s)
        except BaseException:
            if self.published is not None:
                self.published.view = None
            self._release_stored()
            self._active = None  # (rows a rolled-back write changed in place: the next step reads all again)
            raise

    def _step(self, now_s: float) -> list[Decision]:
        observed = self.executor.observe(now_s)  # 1. observe
        self._refresh()
        rows, changed, self._reread = self._active or {}, self._reread, set()
        order = self._busy | {i: rows[i].seq for i in changed if i in rows and i not in self._busy}
        active = [rows[i] for i in sorted(order, key=order.__getitem__)]  # (in submission order)
        self._record_progress(active, observed)
        with self.store.batch():  # (a step's writes: a transaction per many, not one each)
            for job in active:  # 2. reconcile
                self._reconcile(job, observed.get(job.id), now_s)
            self._release()
        self.watch.refresh(now_s)  # after reconcile: a lost node stays only while jobs still hold it
        if self.loans is not None:  # 3. lend and reclaim (serving nodes lost or back first)
            used, wants, on = self._holdings(wants=True)
            present = {n.name: n.gpus for n in self.nodes
                       if n.pool == "serving" and n.name not in self.watch.departed}
            self._events = self._events + self.loans.tick(now_s, used, wants, present=present, jobs_on=on)
        elif self.advisor is not None:  # 3. advice only: the plan, lending nothing
            try:
                self.advisor.advance(now_s)
            except Exception:  # a demand source failing must not stop the jobs' loop
                log.exception("serving plan step failed")
        snap = self.snapshot(now_s)  # 4. decide
        why: dict[str, Waiting] | None = {} if self.published is not None else None  # (only to publish)
        decisions: list[Decision] = list(schedule(snap, self.config.scheduler, self._index, why=why))
        decisions += self._intervals(snap, now_s)
        jobs = dict(self.view.jobs)
        with self.store.batch():
            try:
                for d in decisions:  # 5. act
                    self._apply(d, now_s, jobs)
                self._start_recorded(now_s)
            finally:
                self._to_start = {}  # (raised: the batch's rollback took the attempts not yet started)
        admitted = {d.job for d in decisions if isinstance(d, Admit)}
        self._waiting = why or {}
        self._queued = frozenset(k for k, q in snap.queues.items() if any(j.id not in admitted for j in q))
        self._save_loans(now_s)
        self.sweep_shm(now_s)
        self._check_ckpt_quota(now_s)
        self._retain(now_s)
        self.steps += 1
        if self.published is not None:
            self._publish(now_s)
        return decisions

    def _publish(self, now_s: float) -> None:
        """The pool as this step leaves it (every write of it committed), for the API's pool reads and
        ``/metrics`` (:class:`~tidal.control.read_view.PlaneView`): from the rows in memory, the jobs written
        since read first (submissions: counted by the readers until read here); ended jobs counted in the
        store after a job ended or retention dropped jobs, not at every step."""
        self._refresh()
        rows, state, old = self._active or {}, self._state, self._copies
        written, progressed = self._unpublished, self._progressed
        self._unpublished, self._progressed = set(), set()
        held: dict[str, HeldJob] = {}  # (in submission order, as the store reads them)
        backoff: list[JobRow] = []
        for jid in sorted(self._busy, key=self._busy.__getitem__):
            if state[jid] == S.BACKOFF:
                backoff.append(rows[jid])
            elif jid not in old or jid in written:  # (held: the copy in the view before, unless written)
                held[jid] = held_job(rows[jid])
            else:
                held[jid] = with_progress(old[jid], rows[jid]) if jid in progressed else old[jid]
        self._copies = held
        counted = Counter((h.tenant, h.kind, h.state) for h in held.values())
        counted.update((j.tenant, j.kind, S.BACKOFF.value) for j in backoff)
        for (tenant, kind, _), n in self.view.pending_counts().items():  # (the pending: by their queues)
            counted[tenant, kind, S.PENDING.value] += n
        head = waiting_head(self.view.queues().values(), backoff, QUEUE_SHOWN)
        assert self.published is not None
        self.published.view = PlaneView(
            step=self.steps, as_of_s=now_s, nodes=tuple(self.nodes), held=tuple(held.values()),
            jobs=dict(counted),
            ended=self._ended_counts(),
            head=tuple(QueuedJob.of(rows[jid], told(self._waiting, self._queued, rows[jid]))
                       for _, jid in head),
            submitted=self.store.taken_submits, loans=self.loans.view() if self.loans is not None else None,
            waiting=self._waiting, queued=self._queued, wanted=self.published.wanted)

    def _ended_counts(self) -> dict[str, int]:
        if self._ended is None:
            self._ended = self.store.count_by_state(states=TERMINAL)
        return self._ended

    def _refresh(self) -> None:
        """Bring the active rows and their scheduler views to the store: read whole at the first call, then
        only the rows written since (the store's marks), so that a step's reads follow what changed, not how
        many jobs wait."""
        changed = self.store.take_changed()
        if self.published is not None:
            self._unpublished |= changed.keys()
        if self._active is None:  # (first, or after a step that raised: what was kept is made afresh)
            self.view, self._index, self._copies, self._ended = SchedulerView(), RunningIndex(), {}, None
            self._active = {j.id: j for j in self.store.active_jobs()}
            self._state = {i: j.state for i, j in self._active.items()}
            self._busy = {i: j.seq for i, j in self._active.items() if j.state != S.PENDING}
            for j in self._active.values():
                self.view.put(j)
            self._reread = set(self._active)
            return
        self._reread |= changed.keys()
        if changed:  # rows this loop wrote in place are as stored, so are submitted ones: the others are read
            held = {i: r for i, r in changed.items()
                    if r is not None and (self._active.get(i) is r or i not in self._active)}
            rows = {j.id: j for j in self.store.jobs_by_id(changed.keys() - held.keys())} | held
            for jid in changed.keys() - rows.keys():  # (dropped)
                self._forget(jid)
            for j in sorted(rows.values(), key=lambda r: r.seq):
                if j.state in ACTIVE:
                    self._active[j.id], self._state[j.id] = j, j.state
                    if j.state == S.PENDING:
                        self._busy.pop(j.id, None)
                    else:
                        self._busy[j.id] = j.seq
                    self.view.put(j)
                else:
                    self._forget(j.id, ended=j.state)

    def _forget(self, job_id: str, ended: str | None = None) -> None:
        """``job_id`` left the active set: it ``ended`` in that state, or (None) it is gone from the store."""
        if ended is not None and self._ended is not None and job_id in (self._active or {}):
            self._ended = {**self._ended, ended: self._ended.get(ended, 0) + 1}  # (a view holds the old)
        else:  # (dropped, or not seen active: counted again)
            self._ended = None
        (self._active or {}).pop(job_id, None)
        self._state.pop(job_id, None)
        self._busy.pop(job_id, None)
        self.view.drop(job_id)

    def _retain(self, now_s: float) -> None:
        """Every ``RETENTION_CHECK_S``: drop ended jobs and events older than ``retention_s`` (0: keep all);
        a job whose directory the executor still keeps stays."""
        keep_s = self.config.retention_s
        if not keep_s or now_s - self._retained_s < RETENTION_CHECK_S:
            return
        self._retained_s = now_s
        job_dir = getattr(self.executor, "job_dir", None)
        kept = (lambda j: Path(job_dir(j)).exists()) if job_dir else None
        self.store.drop_before(now_s - keep_s, keep=kept)

    def _check_ckpt_quota(self, now_s: float) -> None:
        """Every ``locations.QUOTA_CHECK_S``: an event for each tenant with running jobs whose checkpoints
        went over its ``checkpoint_quota_bytes`` since the last look (its new jobs are refused at
        submission)."""
        quota = self.config.checkpoint_quota_bytes
        if not quota or now_s - self._quota_checked_s < locations.QUOTA_CHECK_S:
            return
        self._quota_checked_s = now_s
        running = {j.tenant for j in self.store.active_jobs()}
        jobs = [j for j in self.store.jobs() if j.tenant in running]
        use = locations.quota_use(locations.homes(jobs, self.ckpt_root),
                                  lambda t: locations.quota_of(quota, t))
        over = {t for t, (used, q) in use.items() if used > q}
        for t in sorted(over - self._over_quota):
            used, q = use[t]
            self.store.record("ckpt_quota", f"tenant {t}'s checkpoints hold {used} bytes, over its quota of "
                              f"{q} (checkpoint_quota_bytes): its new jobs are refused until old checkpoints "
                              "are removed", now_s, tenant=t, data={"used_bytes": used, "quota_bytes": q})
        self._over_quota = over

    def _holdings(self, wants: bool = False) -> tuple[dict[str, int], int, dict[str, list[str]]]:
        """(node -> GPUs jobs hold, serving GPUs spot jobs could use now, node -> jobs holding GPUs there)
        from one read of the store. What spot jobs could use (only with ``wants``): what pending and running
        spot jobs could grow by, less the training GPUs nobody holds."""
        used: dict[str, int] = {}
        on: dict[str, list[str]] = {}
        want = 0
        self._refresh()
        rows, views = self._active or {}, self.view.jobs
        for jid, st in self._state.items():
            if st == S.PENDING:  # (holds nothing)
                want += views[jid].max_gpus if wants and views[jid].kind == "spot" else 0
                continue
            if st not in HELD:
                continue
            j = rows[jid]
            for n, g in (j.placement or {}).items():
                used[n] = used.get(n, 0) + g
                on.setdefault(n, []).append(j.id)
            if wants and j.kind == "spot" and st in (S.ADMITTED, S.RUNNING):
                want += j.max_gpus - j.gpus
        if wants:
            free_training = sum(n.gpus - used.get(n.name, 0) for n in self.nodes if n.pool == "training")
            want = max(0, want - max(0, free_training))
        return used, want, on

    def _save_loans(self, now_s: float) -> None:
        """The loan document and the step's loan events, in one transaction."""
        if self.loans is None:
            return
        events, self._events = self._events, []
        held, _, on = self._holdings()
        devices = getattr(self.executor, "used", None)  # what the executor's ranks hold, where it knows
        running = devices() if callable(devices) else {}
        over = {
            n: (max(held.get(n, 0), running.get(n, 0)), self.loans.lent_on(n))
            for n in self.loans.nodes
            if n not in self.loans.gone  # a lost node's jobs hold GPUs there until their ranks are gone
            and max(held.get(n, 0), running.get(n, 0)) > self.loans.lent_on(n)
        }
        if over:  # never expected: the scheduler places only on lent GPUs and returns only free ones
            self.loans.stats["double_counted_steps"] = self.loans.stats.get("double_counted_steps", 0) + 1
            log.error("serving GPUs held by jobs beyond what is lent: %s", over)
            events.append(("invariant", f"jobs hold serving GPUs beyond what is lent: {over}",
                           {"over": over}))
        self.loans.refresh(now_s, held, on)
        self.store.put_doc(LOANS_DOC, self.loans.dump(), now_s, events)

    def _intervals(self, snap: Snapshot, now_s: float) -> list[SetCkptInterval]:
        """Checkpoint intervals for running jobs with ``interval_s: auto``, unless the job's session reports
        its own step cadence (``ckpt_every_steps``): that wins, said once in its events."""
        out = []
        for d in plan_ckpt_intervals(snap, self.config.ckpt_interval):  # pure; usually empty
            job = self.store.job(d.job)
            if (job.spec.get("checkpoint") or {}).get("interval_s", "auto") != "auto":
                continue
            own = (job.progress or {}).get("ckpt_every_steps")
            if own:
                if job.id not in self._own_cadence:
                    self._own_cadence.add(job.id)
                    cap = job.ckpt_interval_s or self.config.ckpt_interval.max_interval_s
                    msg = (f"checkpoint cadence: every {own} steps, the job's own (TIDAL_CKPT_INTERVAL_STEPS "
                           "or its code); the platform's interval is not applied (its timer stays at "
                           f"{cap:.0f} s)")
                    self.store.record("ckpt_interval", msg, now_s, job=job,
                                      data={"own_steps": own, "interval_s": cap})
                continue
            out.append(d)
        return out

    def _reconcile(self, job: JobRow, ob: Observation | None, now_s: float) -> None:
        state, cancel, killed, stop_reason = loaded(job, _STEADY_FIELDS)
        if (state == S.RUNNING and ob is not None and ob.all_alive and not cancel and not killed
                and stop_reason != "failure" and job.id not in self.watch.lost):
            # Training, every rank alive, nothing asked of it (the usual case, thousands a step): what follows
            # would find nothing to do but the hang check.
            hung = self._hang(job, ob, now_s)
            if hung:
                self._kill_for_failure(job, hung, now_s, kind="hang")
            return
        st = S(state)
        if st == S.PENDING:
            if job.cancel_requested:
                self.store.transition(job, S.CANCELLED, now_s, "cancelled while pending", finished_s=now_s)
            return
        if st == S.BACKOFF:
            if job.cancel_requested:
                self.store.transition(job, S.CANCELLED, now_s, "cancelled while waiting to restart",
                                      finished_s=now_s)
            elif now_s >= (job.retry_at_s or 0.0):
                self.store.transition(job, S.PENDING, now_s, f"restart {job.restarts}/{job.max_restarts}: "
                                      f"queued to resume from checkpoint step {job.ckpt_step or 0}",
                                      retry_at_s=None)
            return
        if ob is None:  # held, but the executor has no trace of it
            self.store.transition(job, S.PENDING, now_s,
                                  f"attempt {job.attempt} is unknown to the executor; requeued",
                                  **_requeue_fields())
            return
        self.watch.recovered(job, ob, now_s)
        lost = [r for r in ob.ranks if r.lost]
        if lost and job.stop_reason != "node_lost" and st != S.CANCELLING:
            job = self.watch.node_lost(job, ob, lost, now_s)
        if job.cancel_requested and st != S.CANCELLING:
            job = self._stop(job, S.CANCELLING, "cancel requested", now_s,
                             job.spec.get("grace_s", DEFAULT_GRACE_S), reason="cancel")
            st = S.CANCELLING
        if ob.done:
            self._finish(job, ob, now_s)
            return
        if job.stop_reason != "failure" and not job.killed:
            bad = [r for r in ob.ranks if not r.alive and (r.vanished or rank_code(r) not in RESUMABLE_CODES)]
            if bad:
                self._kill_for_failure(job, describe_rank(bad[0]), now_s)
                return
            hung = self._hang(job, ob, now_s) if st == S.RUNNING else None
            if hung:
                self._kill_for_failure(job, hung, now_s, kind="hang")
                return
        if st == S.ADMITTED:
            pids = [r.pid for r in ob.alive]
            self.store.transition(job, S.RUNNING, now_s, f"{_n(len(pids), 'rank')} running (pids {pids})")
        elif (st in STOPPING and not job.killed and job.stop_deadline_s is not None
              and now_s >= job.stop_deadline_s):
            self.executor.kill(job.id)
            self.store.update(job, killed=True)
            self.store.record("kill", f"grace expired while {st}: SIGKILL to {_n(len(ob.alive), 'rank')}",
                              now_s, job=job)
            self.store.commit()

    def _hang(self, job: JobRow, ob: Observation, now_s: float) -> str | None:
        cfg, p = self.config, ob.progress
        if p.heartbeats < len(ob.ranks):
            idle = now_s - ob.launched_s
            if idle > cfg.startup_timeout_s:
                return (f"hung: {len(ob.ranks) - p.heartbeats} of {len(ob.ranks)} ranks wrote no heartbeat "
                        f"within {cfg.startup_timeout_s:.0f} s of launch")
            return None
        limit = max(cfg.hang_timeout_s, cfg.hang_step_times * (p.step_time_s or 0.0))
        # Phases that beat once and may last: building the model and joining the rendezvous, reading a
        # checkpoint back (from S3, say), a final save persisting to slow tiers.
        if p.phase in ("starting", "restoring", "checkpointing", "stopped"):
            limit = max(limit, cfg.startup_timeout_s)
        idle = now_s - (p.heartbeat_s or ob.launched_s)
        if idle > limit:
            return (f"hung: no heartbeat for {idle:.0f} s (limit {limit:.0f} s) "
                    f"at step {p.step}, phase {p.phase}")
        return None

    def _kill_for_failure(self, job: JobRow, why: str, now_s: float, kind: str = "failure") -> None:
        self.executor.kill(job.id)
        self.store.update(job, stop_reason="failure", killed=True, message=why)
        self.store.record(kind, f"{why}: killing the other ranks", now_s, job=job)
        self.store.commit()

    def _record_progress(self, jobs: list[JobRow], observed: dict[str, Observation]) -> None:
        """The progress of every observed job holding GPUs, where it changed, in one transaction (and into
        the rows, which the reconcile goes on with)."""
        changes: dict[str, dict[str, Any]] = {}
        for job in jobs:
            jid, state, progress, last_ckpt_s, ckpt_stall_s, ckpt_step = loaded(job, _PROGRESS_FIELDS)
            ob = observed.get(jid)
            if ob is None or state in _IDLE:
                continue
            p = ob.progress
            doc = p.to_dict()
            fields: dict[str, Any] = {}
            if doc != progress:
                fields["progress"] = doc
            if p.durable_ckpt_s is not None and p.durable_ckpt_s != last_ckpt_s:
                fields["last_ckpt_s"] = p.durable_ckpt_s
            if p.ckpt_stall_s is not None and p.ckpt_stall_s != ckpt_stall_s:
                fields["ckpt_stall_s"] = p.ckpt_stall_s
            if p.ckpt_step is not None and (ckpt_step is None or p.ckpt_step > ckpt_step):
                fields["ckpt_step"] = p.ckpt_step
            if fields:
                changes[jid] = fields
                if self.published is not None and "progress" in fields:
                    self._progressed.add(jid)
                written(job, fields)
                if "last_ckpt_s" in fields or "ckpt_stall_s" in fields:
                    self.view.checkpointed(job)  # (fields the scheduler reads)
        self.store.update_many(changes, mark=False, observed=True)  # (the rows hold them already)

    def _finish(self, job: JobRow, ob: Observation, now_s: float) -> None:
        """Every rank of the attempt has exited: account for it, then the next state."""
        outcome, why = self._classify(job, ob)
        if outcome in ("success", "cancelled", "fenced") or (outcome == "failure"
                                                            and job.restarts >= job.max_restarts):
            self.watch.forget(job.id, now_s)  # over: it will not train again
        acct = account(job, ob, now_s, outcome == "success")
        self._to_release.append((job.id, job.attempt))  # (released once this is stored: _release)
        self._shm_swept_s = float("-inf")  # the end of this step looks at its shared memory
        base = {"stop_reason": None, "stop_deadline_s": None, "killed": False, **acct}
        end = {"finished_s": now_s, "placement": {}, "releasing": {}, **base}  # the job is over
        codes = [r.exit_code for r in ob.ranks]
        p = ob.progress
        reached = p.step if p.step is not None else p.start_step
        data = {"attempt": job.attempt, "exit_codes": codes, "step": reached, "ckpt_step": p.ckpt_step}
        if outcome == "success":
            at = f" at step {reached}" if reached is not None else ""
            torn = [r.rank for r in ob.ranks if r.ended]
            how = (f"finished{at} (exit codes {codes}: ranks {torn} died in the interpreter's teardown after "
                   "closing cleanly, counted as 0)") if torn else f"exited 0{at}"
            who = "its only rank " if len(codes) == 1 else f"all {len(codes)} ranks "
            self.store.transition(job, S.SUCCEEDED, now_s, who + how, data=data, **end)
        elif outcome == "cancelled":
            self.store.transition(job, S.CANCELLED, now_s, f"cancelled; exit codes {codes}", data=data,
                                  **end)
        elif outcome == "lost":
            self.store.transition(job, S.PENDING, now_s, f"{why}; requeued to resume from checkpoint step "
                                  f"{_resume_step(p, job)} on the remaining GPUs",
                                  data={**data, "node_lost": True}, **_requeue_fields(), **base)
        elif outcome == "stopped" and S(job.state) == S.RESIZING:
            left = {n: g - job.releasing.get(n, 0) for n, g in job.placement.items()
                    if g - job.releasing.get(n, 0) > 0}
            why = (f"resized: relaunching on {sum(left.values())} GPUs from checkpoint step "
                   f"{_resume_step(p, job)}")
            self._release()  # (the attempt that ended gives its GPUs back before the next starts)
            self._launch(self.store.update(job, **base), left, now_s, why, data=data)
        elif outcome == "stopped":
            by_us = S(job.state) == S.PREEMPTING
            self.store.transition(job, S.PENDING, now_s, f"preempted: stopped at step {reached} "
                                  f"with checkpoint step {p.ckpt_step} (exit codes {codes}); requeued"
                                  + ("" if by_us else " (the notice came from outside Tidal)"), data=data,
                                  preemptions=job.preemptions + 1, **_requeue_fields(),
                                  **({} if by_us else {"last_preempted_s": now_s}), **base)
        elif outcome == "fenced":  # another attempt owns the checkpoints: a restart would fence it out
            self.store.transition(job, S.FAILED, now_s, f"failed: {why}; not restarted: a new attempt "
                                  "would fence the other one out in turn (does another job, or a second "
                                  "control plane, use this job's checkpoint directory?)",
                                  data={**data, "fenced": True}, **end)
        elif job.restarts < job.max_restarts:
            n = job.restarts + 1
            wait_s = self.config.backoff_s(n)
            self.store.transition(job, S.BACKOFF, now_s,
                                  f"failed: {why}; restart {n}/{job.max_restarts} in "
                                  f"{wait_s:g} s from checkpoint step {job.ckpt_step or 0}", data=data,
                                  restarts=n, retry_at_s=now_s + wait_s, **_requeue_fields(), **base)
        else:
            self.store.transition(job, S.FAILED, now_s, f"failed: {why}; no restarts left "
                                  f"(max_restarts={job.max_restarts})", data=data, **end)

    def _release(self) -> None:
        """Release the attempts that ended (:meth:`_finish`) once their ends are committed, all of a step's
        reconcile with one commit: a plane killed in between restarts with each end stored, so it neither
        loses one nor runs a finished job again."""
        if self._to_release:
            self.store.commit()
            todo, self._to_release = self._to_release, []
            for k, (jid, _) in enumerate(todo):
                try:
                    self.executor.release(jid)
                except BaseException:
                    self._to_release = todo[k:]  # (not released yet: the failed step's release looks at them)
                    raise

    def _release_stored(self) -> None:
        """After a step raised: release the ended attempts whose ends were committed before (the store holds
        them no longer, or holds a later attempt); the others were rolled back, and the next step sees them
        end again."""
        todo, self._to_release = self._to_release, []
        if not todo:
            return
        try:
            stored = {j.id: j for j in self.store.jobs_by_id([jid for jid, _ in todo])}
        except Exception:
            log.exception("reading the jobs that ended in a failed step")
            return
        for jid, attempt in todo:
            j = stored.get(jid)
            if j is None or j.state not in HELD or j.attempt != attempt:
                try:
                    self.executor.release(jid)
                except Exception:  # (the others are still released)
                    log.exception("releasing the ended attempt of %s failed", jid)

    def _classify(self, job: JobRow, ob: Observation) -> tuple[str, str]:
        codes = [rank_code(r) for r in ob.ranks]
        bad = [r for r in ob.ranks if r.vanished or rank_code(r) not in RESUMABLE_CODES]
        if S(job.state) == S.CANCELLING:
            return ("success" if codes and all(c == 0 for c in codes) else "cancelled"), ""
        fenced = [r for r in ob.ranks if rank_code(r) == EXIT_FENCED]
        if fenced:
            return "fenced", (f"rank {fenced[0].rank} was fenced out of its checkpoint location (exit "
                              f"{EXIT_FENCED}): another job, or a newer attempt of this one, owns it now")
        if job.stop_reason == "failure":
            return "failure", job.message or "a rank failed"
        if job.stop_reason == "node_lost":
            return "lost", job.message or "a node was lost"
        if codes and all(c == 0 for c in codes):
            return "success", ""
        if job.stop_reason in ("preempt", "resize") and all(
                rank_code(r) in RESUMABLE_CODES or (job.killed and (r.vanished or (r.exit_code or 0) < 0))
                for r in ob.ranks):  # SIGKILLed by us after the grace: stopped, not failed
            return "stopped", ""
        if not bad and EXIT_PREEMPTED in codes:
            return "stopped", ""  # preempted by a notice from outside (exit 75 is never a failure)
        return "failure", describe_rank(bad[0]) if bad else f"exit codes {codes}"

    def _apply(self, d: Decision, now_s: float, jobs: dict[str, Job]) -> None:
        """Carry out one decision: the job's change is :mod:`tidal.policy.apply`'s (updating ``jobs``), stored
        with a checked transition; what it asks of the workers goes to the executor."""
        if isinstance(d, ReturnGpus):
            if self.loans is None:
                self.store.record("decision", f"ignored {d}: no serving side", now_s)
            else:
                self._events = [*self._events, *self.loans.returned(d.node, d.gpus, now_s)]
            return
        for_job = d.for_job if isinstance(d, Shrink | Preempt) else None
        if d.job in self._to_start or for_job in self._to_start:
            self._start_recorded(now_s)  # (a job's attempt starts before anything else is asked of it)
        try:
            new = apply.after(jobs[d.job], d, now_s)
            nominee = apply.nominated(jobs[for_job], now_s) if for_job is not None else None
        except (KeyError, apply.IllegalDecision) as e:  # never expected: the scheduler read this snapshot
            log.error("decision %s not carried out: %s", d, e)
            self.store.record("invariant", f"decision {d} not carried out: {e}", now_s)
            return
        jobs[d.job] = new
        job = (self._active or {}).get(d.job) or self.store.job(d.job)
        grace = float(job.spec.get("grace_s", DEFAULT_GRACE_S))
        if isinstance(d, SetCkptInterval):
            self._set_interval(job, new.ckpt_interval_s or d.interval_s, now_s)
        elif isinstance(d, Admit):
            g = sum(new.placement.values())
            where = ", ".join(f"{n}: {k}" for n, k in new.placement.items())
            why = f"admitted on {g} GPUs ({where})"
            self._to_start[job.id] = self._record_attempt(job, dict(new.placement), now_s, why,
                                                          started_s=new.started_s)
        elif isinstance(d, Preempt):
            why = f"preempted ({d.reason}" + (f", for {d.for_job})" if d.for_job else ")")
            self._stop(job, S.PREEMPTING, why, now_s, min(grace, max(0.0, d.by_s - now_s)), reason="preempt",
                       releasing=dict(new.releasing), last_preempted_s=new.last_preempted_s)
        elif isinstance(d, Shrink):
            why = f"shrink to {d.to_gpus} GPUs ({d.reason}" + (f", for {d.for_job})" if d.for_job else ")")
            self._stop(job, S.RESIZING, why, now_s, min(grace, max(0.0, d.by_s - now_s)), reason="resize",
                       releasing=dict(new.releasing), last_shrunk_s=new.last_shrunk_s)
        elif isinstance(d, Grow):
            self._stop(job, S.RESIZING, f"grow to {d.to_gpus} GPUs", now_s, grace, reason="resize",
                       placement=dict(new.placement), last_grown_s=new.last_grown_s)
        if nominee is not None and for_job is not None:
            # others were told to give GPUs back for pending ``for_job``: it goes first while they drain
            jobs[for_job] = nominee
            if nominee.nominated_s is not None:
                waiting = (self._active or {}).get(for_job) or for_job
                self.store.update(waiting, nominated_s=nominee.nominated_s)

    def _set_interval(self, job: JobRow, interval_s: float, now_s: float) -> None:
        """A new checkpoint interval to the store and the ranks; announced at most every
        ``ANNOUNCE_INTERVAL_S``."""
        was = job.ckpt_interval_s
        self.store.update(job, ckpt_interval_s=interval_s)
        self.executor.configure(job.id, {"ckpt_interval_s": interval_s})
        stall = f"{job.ckpt_stall_s:.3g} s" if job.ckpt_stall_s is not None else "unmeasured"
        last_s, quiet = self._announced.get(job.id, (float("-inf"), 0))
        if now_s - last_s < ANNOUNCE_INTERVAL_S:  # applied, announced with the next change worth one
            self._announced[job.id] = (last_s, quiet + 1)
            return
        more = f"; {quiet} more change(s) since the last announcement" if quiet else ""
        self._announced[job.id] = (now_s, 0)
        before = f"{was:.0f} s" if was else "the default"
        self.store.record("ckpt_interval", f"checkpoint every {interval_s:.0f} s (was {before}; "
                          f"measured stall {stall}{more})", now_s, job=job,
                          data={"interval_s": interval_s, "was": was, "unannounced": quiet})

    def _stop(self, job: JobRow, to: State, why: str, now_s: float, grace_s: float, *, reason: str,
              **fields: Any) -> JobRow:
        """Tell the job to stop (SIGTERM, unless it was already told); SIGKILL after the grace."""
        already = S(job.state) in STOPPING
        deadline = now_s + grace_s + self.config.kill_slack_s
        if already and job.stop_deadline_s is not None:
            deadline = min(deadline, job.stop_deadline_s)
        if reason == "cancel" or job.stop_reason != "failure":
            fields["stop_reason"] = reason
        if S(job.state) == to:  # told again the same way (a job growing is shrunk): a new target, one notice
            row = self.store.update(job, stop_deadline_s=deadline, **fields)
            self.store.record("decision", f"{why} (already {to})", now_s, job=row)
            return row
        row = self.store.transition(job, to, now_s,
                                    why + ("" if already else f": notice sent, grace {grace_s:g} s"),
                                    stop_deadline_s=deadline, **fields)
        if not already:
            self.store.commit()  # (told in the store before the ranks are)
            self.executor.signal_stop(job.id)
        return row

    def _launch(self, job: JobRow, placement: dict[str, int], now_s: float, why: str, *,
                data: dict | None = None, **fields: Any) -> None:
        """Record the attempt (``admitted``) first, then start it: a crash in between leaves a recorded
        attempt with no ranks, which ``recover`` requeues; never ranks without a record."""
        self._to_start[job.id] = self._record_attempt(job, placement, now_s, why, data=data, **fields)
        self._start_recorded(now_s)

    def _record_attempt(self, job: JobRow, placement: dict[str, int], now_s: float, why: str, *,
                        data: dict | None = None, **fields: Any) -> tuple[JobRow, LaunchRequest]:
        """The job's next attempt stored as ``admitted`` (not yet committed); what starts its ranks."""
        attempt = job.attempt + 1
        self.store.transition(job, S.ADMITTED, now_s, f"{why}; launching attempt {attempt}", data=data,
                              placement=placement, releasing={}, attempt=attempt, attempt_launched_s=now_s,
                              stop_reason=None, stop_deadline_s=None, killed=False, handle=None, progress={},
                              nominated_s=None, **fields)
        env = job_env(job, self.ckpt_root, self.config.ckpt_interval.max_interval_s)
        take_over, take_over_from = taken_over(job, self.store)
        spec = job.spec
        return job, LaunchRequest(job.id, attempt, tuple(spec["command"]), placement, spec.get("workdir"),
                                  env, tenant=job.tenant, own_dirs=own_dirs(job, self.ckpt_root),
                                  take_over=take_over, take_over_from=take_over_from)

    def _start_recorded(self, now_s: float) -> None:
        """Start the ranks of every attempt recorded by :meth:`_record_attempt`, once all are committed (one
        commit for a step's admissions); their handles stored together."""
        todo, self._to_start = self._to_start, {}
        if not todo:
            return
        self.store.commit()  # (every attempt is recorded before any rank starts)
        handles: dict[str, dict[str, Any]] = {}
        started: dict[str, JobRow] = {}
        for job, req in todo.values():
            try:
                handle = self.executor.launch(req, now_s)
            except Exception as e:  # a launch that fails is a failed attempt (restarts apply)
                log.warning("launch of %s failed: %s", job.id, e)
                failed = self.store.update(job, stop_reason="failure", message=f"launch failed: {e}")
                self._finish(failed, Observation(job.id, req.attempt, now_s, ()), now_s)
                continue
            handles[job.id], started[job.id] = {"handle": handle}, job
            self.store.record("launch", f"attempt {req.attempt}: {_n(req.world_size, 'rank')} started", now_s,
                              job=job, data=handle)
        self.store.update_many(handles, held=started)
        self._release()

    def sweep_shm(self, now_s: float, *, force: bool = False) -> list[str]:
        """Free ended jobs' node memory and agents' steps (:mod:`tidal.control.node_memory`), every
        ``SHM_SWEEP_S`` at most unless ``force``; returns the jobs freed."""
        ex = self.executor
        soon = not force and now_s - self._shm_swept_s < SHM_SWEEP_S
        if not isinstance(ex, NodeMemory | AgentMemory) or soon:
            return []
        self._shm_swept_s = now_s
        retention_s = self.config.isolation.shm_retention_s
        if isinstance(ex, AgentMemory):  # the steps the checkpoint agents keep of ended jobs: the same rule
            node_memory.sweep_agents(self.store, ex, retention_s, now_s)
        return node_memory.sweep(self.store, ex, retention_s, now_s) if isinstance(ex, NodeMemory) else []

    def snapshot(self, now_s: float) -> Snapshot:
        """The scheduler's view: pending jobs queue, held jobs run (stopping ones release everything)."""
        loans, reclaims = (self.loans.loans, self.loans.reclaims) if self.loans is not None else ((), ())
        self._refresh()
        if self._tenants[0] != self.store.tenant_rev:
            rev = self.store.tenant_rev
            self._tenants = (rev, tuple(Tenant(t.name, t.quota_gpus, t.weight) for t in self.store.tenants()))
        nodes = self.nodes
        if len(self._node_t) != len(nodes) or any(map(operator.is_not, self._node_t, nodes)):
            self._node_t = tuple(nodes)  # (the same tuple while the nodes stay: the index keeps its sums)
        return self.view.snapshot(now_s, self._node_t, self._tenants[1], tuple(loans), tuple(reclaims))


def _requeue_fields() -> dict[str, Any]:
    return {"placement": {}, "releasing": {}, "started_s": None, "handle": None}


def _resume_step(p: Progress, job: JobRow) -> int:
    """The checkpoint step the next attempt resumes from: the ended attempt's newest, else the job's."""
    return p.ckpt_step if p.ckpt_step is not None else job.ckpt_step or 0


def _n(n: int, word: str) -> str:
    """``1 rank``, ``2 ranks``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
