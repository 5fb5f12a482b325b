"""The batch: every task becomes an agent; all run concurrently under one gate; each finished
agent becomes one line on disk. One agent's failure is a record, never the batch's end.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import heapq
import itertools
import json
import logging
import tempfile
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tools.core import Tool, ToolContext
from tools.gitrepo import ensure_repo
from tools.registry import DEFAULT_TOOLS, get_tools
from tools.sandbox import (
    AGENT_UID_BASE,
    CommandSandbox,
    Limits,
    Sandbox,
    UidLease,
    WorkspaceBound,
    lease_uids,
    make_workspace,
    move_tree,
    remove_tree,
    start_reaper,
)

from ..agent.agent import Agent
from ..agent.stopping import DrainingGate
from ..engines.protocol import (
    CacheStats,
    DataParallel,
    Engine,
    EngineError,
    Generation,
    SamplingParams,
    TokenLogprobs,
)
from ..gate.control import DEFAULT_CONTROL_PERIOD, Controller, MultiController
from ..gate.gate import AdmissionGate, Gate
from ..gate.ranked_gate import RankedGate
from ..policies.protocol import Policy
from ..runfolder.records import eval_field, patch_field, rollout_record, setup_field, trajectory
from ..runfolder.store import RunFolderWriteError
from ..tasks.rewards import reward_fields, sample_seed
from ..tasks.swebench import checkout
from ..tasks.tasks import Task
from .evaluation import evaluate
from .progress import ROWS_MAX, BatchStatus, Progress, TaskRow
from .workspace import populate

log = logging.getLogger("concur")
SETUP_CONCURRENCY = 4  # workspaces prepared at once: disk and process churn, not the engine
# This many agents in a row failing on the engine, with no successful request in between,
# means the engine is gone: stop the batch rather than turn every remaining task into an error.
ENGINE_FAILURE_LIMIT = 5
# A batch fed from a task source keeps this many agents beyond its window, set up and waiting:
# a freed slot is taken at once instead of after a round trip to the source.
PREFETCH = 2


class RecordSink(Protocol):
    """Where a batch's records go: the run folder (`RunStore`), or, in a worker of a batch
    over many nodes, the driver that owns the run folder (runner/scaleout/)."""

    @property
    def finished(self) -> Mapping[str, dict[str, Any]]: ...

    async def finish(self, record: dict[str, Any], extra: Mapping[str, dict[str, Any]]) -> None:
        """A finished agent: its lines of other record files (`extra`: file name -> record,
        e.g. rollouts.jsonl), then its trajectory `record`; done once this returns."""
        ...

    async def log_error(self, record: dict[str, Any]) -> None: ...

    async def log_control(self, line: dict[str, Any]) -> None: ...


class TaskSource(Protocol):
    """Tasks handed to a batch while it runs, when its gate has room (a worker of a batch over
    many nodes pulls them from the driver)."""

    def coming(self) -> int:
        """Tasks not handed over yet that this batch may still get (the window's bound)."""
        ...

    async def take(self, n: int, idle: bool) -> list[Task] | None:
        """Up to `n` more tasks; [] when there are none now; None: there will be no more.
        `idle`: the batch has no agent left, so the call may wait until there is work."""
        ...


@dataclass
class BatchConfig:
    max_steps: int = 20  # for tasks that set none
    max_steps_cap: int | None = None  # an explicit --max-steps: caps every task's own too
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tools: tuple[str, ...] = DEFAULT_TOOLS
    # name -> tool factory; None: the production tools (tools/registry.py). Simulated runs pass
    # their own (runner/sim/tools.py), so a real run never sees the simulated tool.
    tool_registry: Mapping[str, Callable[[], Tool]] | None = None
    control_period: float = DEFAULT_CONTROL_PERIOD
    pause_rule: str = "newest"
    resume_rule: str = "oldest"
    keep_workspaces: Path | None = None  # move finished workspaces here (None: delete)
    # Where live workspaces go. Per-agent uids must reach it, which a run folder under e.g.
    # /root would not allow: a 0755 dir in /tmp. A fixed path per run folder lets a rerun
    # clear what a killed run left; None: a fresh temp dir.
    workspace_root: Path | None = None
    limits: Limits = field(default_factory=Limits)
    # how limits.workspace_bytes is enforced: each workspace its own "tmpfs" or "ext4"
    # filesystem (exact), or "watch" (checked while commands run); tools/sandbox/workspaces.py
    workspace_fs: str = "tmpfs"
    eval_timeout: float = 300.0
    constrain_tool_calls: bool = False  # engines that can: every reply is one valid call
    # Commit each prepared workspace as the git base that submit diffs against (simulated
    # runs have no workspace to commit).
    git_base: bool = True
    rollouts: bool = True  # write rollouts.jsonl (token ids, mask, logprobs) per agent
    # Agent i runs as uid_base + i. A worker of a batch over many nodes gets a range of its
    # own from its run, so two workers on one host never share a uid.
    uid_base: int = AGENT_UID_BASE


@dataclass
class Totals:
    retries: int = 0  # engine requests retried after a transient failure (runner/agent/retries.py)
    prompt: int = 0
    cached: int = 0
    generated: int = 0
    requests: int = 0
    by_status: dict[str, int] = field(default_factory=dict)


async def _uninterrupted(recording: Coroutine[Any, Any, None], task_id: str) -> None:
    """Run `recording` to its end even when the caller is cancelled meanwhile (a signal's
    stop, the batch stopping on a dead engine), then let the cancellation go on: an agent
    that finished is recorded whole, as when the writes blocked the loop, never half."""
    task = asyncio.ensure_future(recording)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])
        if not task.cancelled() and task.exception() is not None:
            log.error("finished agent %s could not be recorded: %s", task_id, task.exception())
        raise


class EngineDead(RuntimeError):
    """The engine failed for several agents in a row: the batch stops (resumable)."""


class Batch:
    def __init__(
        self,
        tasks: list[Task],
        engine: Engine,
        sandbox: CommandSandbox,
        policy: Policy,
        store: RecordSink,
        config: BatchConfig,
        progress: Progress | None = None,
        source: TaskSource | None = None,
    ) -> None:
        self.tasks = tasks
        self.engine, self.sandbox, self.policy, self.store = engine, sandbox, policy, store
        self.config = config
        self.source = source
        self.todo = [t for t in tasks if t.id not in store.finished]
        self.gate: AdmissionGate
        self.controller: Controller | MultiController
        if isinstance(engine, DataParallel) and engine.dp_size > 1:
            self.gate, self.controller = self._ranked(engine, policy, store)
        else:
            gate = self._gate(policy, len(self.todo) + (source.coming() if source else 0))
            self.gate = gate
            self.controller = Controller(
                gate,
                policy,
                engine.cache_stats,
                config.control_period,
                on_line=store.log_control,
            )
        self._room = asyncio.Event()  # source mode: an agent ended, the gate may have room
        self._free_slots: list[int] = []  # source mode: uid offsets of ended agents
        self._next_slot = itertools.count()
        self.totals = Totals()
        self.progress = progress
        self._step_budget = sum(self._max_steps(t) for t in self.todo)
        self._agent_gate = DrainingGate(self.gate)  # what agents see: can stop admitting
        self._agent_tasks: dict[str, asyncio.Task[None]] = {}
        self._uids: UidLease | None = None
        self._engine_failures = 0  # consecutive agents that failed on the engine
        # for the progress rows: the agents so far, when each started, how each ended. Agents
        # are kept (their whole context) only where rows are shown, i.e. for small batches.
        self._rows_shown = len(self.todo) <= ROWS_MAX
        self._agents: dict[str, Agent] = {}
        self._started: dict[str, float] = {}
        self._ended: dict[str, tuple[str, float]] = {}
        self._setup_sem = asyncio.Semaphore(SETUP_CONCURRENCY)
        self.workspace_bounds: dict[WorkspaceBound, int] = {}  # how many workspaces got each
        self._ws_root: Path  # made in run, once the reaper watches it

    def _ranked(
        self, engine: DataParallel, policy: Policy, store: RecordSink
    ) -> tuple[RankedGate, MultiController]:
        """Data parallel: one window per rank, each agent sticks to its rank."""
        ranks = engine.dp_size
        per_rank = -(-len(self.todo) // ranks)
        ranked = RankedGate(
            [self._gate(policy, per_rank) for _ in range(ranks)], bind=engine.assign_rank
        )

        def stats(r: int) -> Callable[[], CacheStats]:
            return lambda: engine.rank_stats(r)

        period = self.config.control_period
        controllers = [
            Controller(ranked.view(r), policy, stats(r), period, rank=r, on_line=store.log_control)
            for r in range(ranks)
        ]
        return ranked, MultiController(ranked, controllers)

    def _gate(self, policy: Policy, n_agents: int) -> Gate:
        return Gate(
            policy.initial_window(n_agents),
            unit=policy.unit,
            pause_rule=self.config.pause_rule,
            resume_rule=self.config.resume_rule,
            coming=self.source.coming if self.source else None,
            track_tools=policy.wants_tools,
        )

    async def run(self) -> Totals:
        for t in self.todo:
            self.gate.register(t.id)
        # Uids no other batch on this host uses while this one runs (tools/sandbox/uids.py);
        # a worker of a scaled-out run has its range from its run instead (uid_base); a
        # sandbox that starts no process as a uid (the simulator's) needs none
        if self.config.uid_base == AGENT_UID_BASE and isinstance(self.sandbox, Sandbox):
            self._uids = lease_uids(len(self.todo))
        self._ws_root = self.config.workspace_root or Path(tempfile.mkdtemp(prefix="concur-ws-"))
        # cleans up if we are killed; the workspaces' folder is emptied and made only after
        # it has started, so that a kill at any moment leaves no workspace (an empty
        # temporary folder at worst)
        reaper = start_reaper(self._uids, self._ws_root)
        try:
            remove_tree(self._ws_root)  # left by a killed run
            self._ws_root.mkdir(parents=True)
            self._ws_root.chmod(0o755)
            await self._run_all()
        except* (EngineDead, RunFolderWriteError) as group:
            raise _first_leaf(group) from None  # stops the batch; the rest runs on resume
        finally:
            await self.sandbox.aclose()  # no tool process outlives the batch
            remove_tree(self._ws_root)
            reaper.close()
            if self._uids is not None:
                self._uids.close()
        await self.controller.tick()  # a last control line with the final counts
        return self.totals

    async def _run_all(self) -> None:
        async with asyncio.TaskGroup() as tg:
            control = tg.create_task(self.controller.run())
            ui = tg.create_task(self.progress.run(self.status)) if self.progress else None
            async with asyncio.TaskGroup() as agents:
                for i, task in enumerate(self.todo):
                    self._agent_tasks[task.id] = agents.create_task(self._run_one(i, task))
                if self.source is not None:
                    agents.create_task(self._pull(self.source, agents))
            control.cancel()
            if ui:
                ui.cancel()

    def stop_admitting(self) -> int:
        """Drain (on a signal): cancel every agent that holds no slot (not recorded: it runs
        again on resume); the admitted ones go on. -> how many go on."""
        going_on = self._agent_gate.stop_admitting()
        running = [k for k, t in self._agent_tasks.items() if not t.done()]
        for key in running:
            if key not in going_on:
                self._agent_tasks[key].cancel()
        return sum(1 for k in running if k in going_on)

    async def _pull(self, source: TaskSource, agents: asyncio.TaskGroup) -> None:
        """Source mode: take tasks while the gate has room (its window, plus PREFETCH agents
        ready to take a freed slot), until the source has no more. Agents in a tool call
        between requests (request-unit policies) hold no claim, as in one process."""
        while not self._agent_gate.draining:  # a signal stops the pulling too
            c = self.gate.counts()
            room = self.gate.window + PREFETCH - (c["active"] + c["paused"] + c["pending"])
            if room > 0:
                tasks = await source.take(room, idle=c["unfinished"] == 0)
                if tasks is None:
                    return
                for task in tasks:
                    self.todo.append(task)
                    self.gate.register(task.id)  # in arrival order, which is task order
                    self._agent_tasks[task.id] = agents.create_task(self._run_sourced(task))
                if tasks:
                    continue
            self._room.clear()
            with contextlib.suppress(TimeoutError):  # the window may grow at each period
                await asyncio.wait_for(self._room.wait(), self.config.control_period)

    async def _run_sourced(self, task: Task) -> None:
        """One agent of a sourced batch: its uid offset is the lowest free one, so uids stay
        within the worker's range however many tasks it runs."""
        slot = heapq.heappop(self._free_slots) if self._free_slots else next(self._next_slot)
        try:
            await self._run_one(slot, task)
        finally:
            heapq.heappush(self._free_slots, slot)
            self._room.set()

    def status(self) -> BatchStatus:
        """Where the batch stands (for the progress display)."""
        t = self.totals
        c = self.gate.counts()
        last = self.controller.stats.last
        return BatchStatus(
            done=sum(t.by_status.values()),
            total=len(self.todo),
            active=c["active"],
            paused=c["paused"],
            pending=c["pending"],
            window=self.gate.window,
            steps=t.requests,
            generated_tokens=t.generated,
            hit=t.cached / t.prompt if t.prompt else None,
            u=last.get("u"),
            h=last.get("h"),
            step_budget=self._step_budget,
            rows=self._rows() if self._rows_shown else (),
        )

    def _rows(self) -> tuple[TaskRow, ...]:
        try:  # loop time: virtual in simulations
            now = asyncio.get_running_loop().time()
        except RuntimeError:  # asked after the batch (no loop): unfinished agents show 0 s
            now = None
        rows = []
        for task in self.todo:
            agent = self._agents.get(task.id)
            steps = agent.steps if agent else []
            if task.id in self._ended:
                status, seconds = self._ended[task.id]
                state = f"done {status}"
            else:
                start = self._started.get(task.id)
                seconds = 0.0 if now is None or start is None else now - start
                if agent is None:
                    state = "setup" if task.id in self._started else "pending"
                else:
                    state = "in tool" if agent.in_tool else self.gate.state(task.id)
            rows.append(
                TaskRow(
                    task_id=task.id,
                    state=state,
                    step=len(steps),
                    max_steps=self._max_steps(task),
                    context_tokens=len(agent.ids) if agent else 0,
                    generated_tokens=sum(s.completion_tokens for s in steps),
                    last_tool=next((s.tool for s in reversed(steps) if s.tool), None),
                    seconds=seconds,
                )
            )
        return tuple(rows)

    def _new_record(self, task: Task, sampling: SamplingParams) -> dict[str, Any]:
        """A trajectory record with every key (runner/runfolder/records.py), as far as known now."""
        return trajectory(
            task_id=task.id,
            task=task.dataset_id or task.id,
            sample=task.sample,
            seed=sampling.seed,
            engine=self.engine.name,
            model=self.engine.model,
        )

    async def _run_one(self, index: int, task: Task) -> None:
        """Everything about one agent, end to end. Never raises (except cancellation)."""
        t0 = self._started[task.id] = asyncio.get_running_loop().time()
        uid = self._uids.uid(index) if self._uids else self.config.uid_base + index
        ws = self._ws_root / task.id
        ctx = ToolContext(ws, uid, self.sandbox, self.config.limits)
        sampling = self._sampling(task)
        record = self._new_record(task, sampling)
        record["metadata"] = json.dumps(task.metadata, ensure_ascii=False, default=str)
        agent: Agent | None = None
        try:
            names = tuple(task.tools) if task.tools else self.config.tools
            tools = get_tools(names, self.config.tool_registry)
            async with self._setup_sem:
                setup = await self._prepare(task, ctx)
            record["setup"] = setup_field(setup)
            if setup and setup.get("failed"):
                raise _SetupFailed(setup["failed"])
            agent = Agent(
                key=task.id,
                task=task,
                engine=self.engine,
                gate=self._agent_gate,
                tools=tools,
                tool_ctx=ctx,
                sampling=sampling,
                max_steps=self._max_steps(task),
                on_request=functools.partial(self._on_request, task.id),
                on_retry=self._on_retry,
                constrain_tool_calls=self.config.constrain_tool_calls,
            )
            if self._rows_shown:
                self._agents[task.id] = agent
            status, reason, answer = await agent.run()
        except asyncio.CancelledError:
            raise  # interrupted: not recorded, so it runs again on resume
        except EngineError as e:
            self._engine_failures += 1
            if self._engine_failures >= ENGINE_FAILURE_LIMIT:  # `finally` frees the slot
                raise EngineDead(
                    f"{self._engine_failures} agents in a row failed on the engine, the last "
                    f"({task.id}) with: {e}"
                ) from e
            status, reason, answer = "error", f"{type(e).__name__}: {e}", None
        except (_SetupFailed, ValueError) as e:
            status, reason, answer = "error", f"{type(e).__name__}: {e}", None
        except Exception as e:  # a bug in one agent must not end the batch
            log.exception("agent %s crashed", task.id)
            status, reason, answer = "error", f"{type(e).__name__}: {e}", None
        finally:
            self._agent_gate.finish(task.id)
        try:
            await self.engine.end_agent(task.id)
        except Exception as e:  # releasing engine state must not lose the record
            log.warning("engine could not release agent %s: %s", task.id, e)
        error = (
            {"kind": "agent", "task_id": task.id, "reason": reason} if status == "error" else None
        )
        # Recording must never end the batch: what fails keeps a minimal record. The agent's
        # error line goes with it unless `_record` wrote it before failing.
        try:
            rollout = await self._complete_record(
                task, ctx, agent, record, status, reason, answer, t0
            )
        except (asyncio.CancelledError, RunFolderWriteError):
            raise  # a run folder that cannot be written stops the batch (not one agent)
        except Exception as e:
            await self._record_minimal(task, sampling, status, t0, e, error)
            return
        try:
            await _uninterrupted(self._record(task, record, rollout, error), task.id)
        except (asyncio.CancelledError, RunFolderWriteError):
            raise
        except Exception as e:
            await self._record_minimal(task, sampling, status, t0, e, None)

    async def _record_minimal(
        self,
        task: Task,
        sampling: SamplingParams,
        status: str,
        t0: float,
        e: Exception,
        error: dict[str, Any] | None,
    ) -> None:
        log.exception("could not record agent %s in full", task.id, exc_info=e)
        minimal = self._new_record(task, sampling)
        minimal["reason"] = f"recording failed: {type(e).__name__}: {e} (agent: {status})"
        minimal["seconds"] = round(asyncio.get_running_loop().time() - t0, 3)
        await _uninterrupted(self._record(task, minimal, None, error), task.id)

    def _sampling(self, task: Task) -> SamplingParams:
        """The run's sampling with the task's overrides, the seed of this sample, and
        logprobs where rollouts are written and the engine gives them."""
        sp = sampling_for(self.config.sampling, task)
        logprobs = (
            self.config.rollouts
            and isinstance(self.engine, TokenLogprobs)
            and self.engine.gives_logprobs
        )
        return dataclasses.replace(sp, seed=sample_seed(sp.seed, task.sample), logprobs=logprobs)

    def _max_steps(self, task: Task) -> int:
        steps = task.max_steps or self.config.max_steps
        cap = self.config.max_steps_cap
        return steps if cap is None else min(steps, cap)

    async def _complete_record(
        self,
        task: Task,
        ctx: ToolContext,
        agent: Agent | None,
        record: dict[str, Any],
        status: str,
        reason: str,
        answer: str | None,
        t0: float,
    ) -> dict[str, Any] | None:
        """Fill in `record` (eval, reward, patch, the agent's fields) and put the workspace
        away; returns the rollout to write with it. Writes nothing to the run folder."""
        ev = eval_field(await self._evaluate(task, ctx) if agent is not None else None)
        record.update(status=status, reason=reason, answer=answer, eval=ev)
        if agent is not None:
            timeout = self.config.eval_timeout
            record.update(await reward_fields(self.sandbox, task, ctx, ev, timeout))
        record["patch"] = patch_field(ctx.state.get("patch"))  # submit in a git workspace
        if agent is not None:
            record.update(self._agent_fields(agent))
        record["seconds"] = round(asyncio.get_running_loop().time() - t0, 3)
        rollout = None
        if agent is not None and agent.ids and self.config.rollouts:
            rollout = rollout_record(
                record, agent.ids, agent.prompt_len, agent.spans, agent.logprobs
            )
        # The workspace is put away BEFORE the record says the task is done: a kill in
        # between re-runs the task rather than losing a kept workspace.
        try:
            self._dispose(ctx.workspace)
        except OSError as e:
            log.warning("could not clean up workspace %s: %s", ctx.workspace, e)
        return rollout

    async def _record(
        self,
        task: Task,
        record: dict[str, Any],
        rollout: dict[str, Any] | None,
        error: dict[str, Any] | None,
    ) -> None:
        """Write a finished agent's lines (its error, its rollout, then the trajectory line
        that marks it done) and count it."""
        if error is not None:
            await self.store.log_error(error)
        await self.store.finish(record, {} if rollout is None else {"rollouts.jsonl": rollout})
        self._count(record)
        self._ended[task.id] = (record["status"], record["seconds"])
        # the budget it left unused is no longer ahead of the batch (the progress ETA)
        self._step_budget -= max(0, self._max_steps(task) - record.get("steps", 0))

    def _dispose(self, ws: Path) -> None:
        if not ws.exists():  # never created (the task failed before its workspace)
            return
        keep = self.config.keep_workspaces
        if keep is None:
            remove_tree(ws)
            return
        keep.mkdir(parents=True, exist_ok=True)
        move_tree(ws, keep / ws.name)

    async def _prepare(self, task: Task, ctx: ToolContext) -> dict[str, Any] | None:
        """The workspace: the task's `workspace` source and `files` (host side, never
        following links), then, in the sandbox as the agent's uid, the `setup` commands and a
        git base commit (so that submit can capture the patch)."""
        ws = ctx.workspace
        remove_tree(ws)  # left by an interrupted run: start clean
        await self._make_workspace(ws)
        source = Path(task.workspace) if task.workspace else None
        if task.swe is not None:  # a clone of the task's repository at its base commit
            await asyncio.to_thread(checkout, ws, task.swe, self.config.limits.workspace_bytes)
        if source is not None or task.files:  # off the loop: copies can be large
            await asyncio.to_thread(
                populate, ws, source, task.files, self.config.limits.workspace_bytes
            )
        self.sandbox.prepare_workspace(ws, ctx.uid)
        rec: dict[str, Any] = {}
        if task.setup:
            out = rec["commands"] = []
            for cmd in task.setup:
                r = await self.sandbox.run(cmd, ws, ctx.uid, self.config.limits)
                out.append({"command": cmd, "exit_code": r.exit_code, "output": r.output[-2000:]})
                if r.timed_out or r.exit_code != 0:
                    why = "timed out" if r.timed_out else f"exit code {r.exit_code}"
                    rec["failed"] = f"setup command {cmd!r} {why}"
                    return rec
        if self.config.git_base:
            rec["git"] = await ensure_repo(ctx)
            if "error" in rec["git"]:
                log.warning("task %s: no patch will be captured: %s", task.id, rec["git"]["error"])
        return rec or None

    async def _make_workspace(self, ws: Path) -> None:
        """An empty workspace on its own size-limited filesystem (a plain directory for a
        sandbox that runs no commands, the simulator's). An ext4 image takes three
        subprocesses: off the loop; the rest is a mount(2) or a mkdir, kept on it (a thread
        would let a simulated run's virtual clock jump while it waits)."""
        fs = self.workspace_fs_asked
        limit = self.config.limits.workspace_bytes
        if fs == "ext4":
            bound = await asyncio.to_thread(make_workspace, ws, limit, fs)
        else:
            bound = make_workspace(ws, limit, fs)
        self.workspace_bounds[bound] = self.workspace_bounds.get(bound, 0) + 1

    @property
    def workspace_fs_asked(self) -> str:
        """The workspaces' filesystem kind asked for: "watch" for a sandbox that runs no
        commands (the simulator's), whose workspaces are plain directories."""
        return self.config.workspace_fs if isinstance(self.sandbox, Sandbox) else "watch"

    def workspace_bound(self) -> dict[str, Any]:
        """For summary.json: how the workspace size was bounded, exact only if every
        workspace was on its own filesystem (None: this session made none)."""
        made = self.workspace_bounds
        counts: dict[str, int] = {}
        for bound, n in made.items():
            counts[bound.fs] = counts.get(bound.fs, 0) + n
        return {
            "limit_bytes": self.config.limits.workspace_bytes,
            "asked": self.workspace_fs_asked,
            "workspaces": counts,
            "exact": all(b.exact for b in made) if made else None,
            "why_not_exact": sorted({b.why for b in made if b.why}),
        }

    async def _evaluate(self, task: Task, ctx: ToolContext) -> dict[str, Any] | None:
        return await evaluate(
            self.sandbox, task, ctx.workspace, ctx.uid, self.config.limits, self.config.eval_timeout
        )

    def _on_retry(self) -> None:
        self.totals.retries += 1

    def _on_request(self, key: str, gen: Generation, fresh: int) -> None:
        self._engine_failures = 0  # the engine works
        self.controller.record(gen.prompt_tokens, gen.cached_tokens, fresh, agent=key)
        t = self.totals
        t.requests += 1
        t.prompt += gen.prompt_tokens
        t.cached += gen.cached_tokens
        t.generated += gen.completion_tokens

    @staticmethod
    def _agent_fields(agent: Agent) -> dict[str, Any]:
        steps = [asdict(s) for s in agent.steps]
        for s in steps:
            for k in ("gen_seconds", "tool_seconds", "wait_seconds"):
                s[k] = round(float(s[k]), 4)
            if s["arguments"] is not None:  # JSON text: one type whatever the tool
                s["arguments"] = json.dumps(s["arguments"], ensure_ascii=False)
        return {
            "steps": len(agent.steps),
            "messages": agent.messages,
            "tools": json.dumps(agent.tool_schemas, ensure_ascii=False),
            "step_log": steps,
            "context_tokens": len(agent.ids),
            "prompt_tokens": sum(s.prompt_tokens for s in agent.steps),
            "cached_tokens": sum(s.cached_tokens for s in agent.steps),
            "completion_tokens": sum(s.completion_tokens for s in agent.steps),
            "gen_seconds": round(float(sum(s.gen_seconds for s in agent.steps)), 3),
            "tool_seconds": round(float(sum(s.tool_seconds for s in agent.steps)), 3),
            "wait_seconds": round(float(sum(s.wait_seconds for s in agent.steps)), 3),
        }

    def _count(self, rec: dict[str, Any]) -> None:
        t = self.totals
        t.by_status[rec["status"]] = t.by_status.get(rec["status"], 0) + 1


def sampling_for(base: SamplingParams, task: Task) -> SamplingParams:
    """The run's sampling parameters with the task's own `sampling` overrides."""
    if not task.sampling:
        return base
    over = dict(task.sampling)
    for k in ("max_new_tokens", "seed"):
        if k in over:
            over[k] = int(over[k])
    if "stop" in over:  # added to the run's stops (the agent adds the tool-call stop itself)
        over["stop"] = tuple(dict.fromkeys([*base.stop, *over["stop"]]))
    return dataclasses.replace(base, **over)


def _first_leaf(group: BaseExceptionGroup) -> BaseException:
    e: BaseException = group
    while isinstance(e, BaseExceptionGroup):
        e = e.exceptions[0]
    return e


class _SetupFailed(Exception):
    pass
