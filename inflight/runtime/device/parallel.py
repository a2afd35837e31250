"""The worker ranks of a tensor-parallel runtime.

Rank 0 is the runtime's own process: it schedules, plans each step and samples. Ranks 1..N-1
are worker processes it spawns (a fresh interpreter each; on CUDA rank r runs on GPU r), each
holding its shard of the model (`model/layers/parallel.py`) and its share of every KV block.

Start-up: each worker opens the checkpoint and loads its shard while rank 0 loads its own. Once
every rank reports its weights loaded, they join one process group (gloo on the CPU, NCCL on
CUDA) and capture their decode graphs. A worker that fails first fails the runtime's
construction, naming its rank and error.

Serving: rank 0 sends each step's `StepPlan` down a pipe to every worker, then runs the same
forward pass; the collectives keep the ranks in step.

Failure: a worker that raises reports its error and exits, and a watchdog thread on rank 0 sees
any worker's process end. Either way the runtime records its `fault`, aborts the group (a
collective waiting on the lost rank raises instead of hanging), stops the other workers and
refuses every later step. A step that fails on rank 0 after its plan went out leaves the ranks
out of step, and is a fault too.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import threading
import weakref
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from inflight.model.checkpoints.loader import Checkpoint, open_checkpoint
from inflight.model.layers.parallel import TensorParallel
from inflight.runtime.deployment import DeploymentPlan
from inflight.runtime.device.batch_builder import RaggedBatch, RowInput
from inflight.runtime.device.executor import Executor, LaunchedStep
from inflight.runtime.device.model_runner import HeadRows, StepPlan, build_model_runner
from inflight.runtime.host.rows import ScheduledRow, ScheduledStep

log = logging.getLogger(__name__)

# How long ranks wait for one another to load, connect, and in a collective.
_TIMEOUT = timedelta(minutes=10)
# How long `close` waits for a worker to leave before it is killed.
_STOP_WAIT_S = 10.0
# How long a failed step waits for a worker to end before it blames rank 0.
_LOST_WAIT_S = 5.0


def process_group(rank: int, size: int, store: dist.Store, device: torch.device) -> Any:
    """This rank's process group over the `size` ranks that meet at `store`."""
    if device.type == "cuda":
        return dist.ProcessGroupNCCL(store, rank, size)
    return dist.ProcessGroupGloo(store, rank, size, _TIMEOUT)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: GPU r on CUDA."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


class Workers:
    """Ranks 1..size-1 of a runtime being built on rank 0 (`device`), started at once:
    `wait_loaded`, then `connect` and `wait_ready`, as rank 0 builds its own shard."""

    def __init__(
        self,
        size: int,
        checkpoint: Checkpoint,
        plan: DeploymentPlan,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.size = size
        self.device = device
        self.fault: str | None = None
        self._failed = threading.Event()  # set with the fault
        self._closing = threading.Event()
        # A worker opens the checkpoint's files itself; one without files (a benchmark's random
        # weights, made from a seed) is sent whole.
        source = checkpoint.path if checkpoint.path.exists() else checkpoint
        context = multiprocessing.get_context("spawn")
        self._pipes: list[Connection] = []
        self._processes: list[multiprocessing.process.BaseProcess] = []
        for rank in range(1, size):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=_worker_main,
                args=(rank, size, source, plan, dtype, device),
                kwargs={"pipe": theirs},
                name=f"inflight-tp-rank-{rank}",
                daemon=True,
            )
            process.start()
            theirs.close()
            self._pipes.append(ours)
            self._processes.append(process)
        self.group: Any = None
        self._store: dist.Store | None = None
        self._watchdog: threading.Thread | None = None
        # A runtime dropped without close() still stops its workers.
        self._finalizer = weakref.finalize(self, _stop, self._pipes, self._processes)

    def wait_loaded(self) -> None:
        """Wait until every worker has loaded its shard (RuntimeError naming a rank that
        failed or exited first)."""
        self._expect("loaded")

    def connect(self, parallel: TensorParallel) -> None:
        """Join rank 0 and the workers in one group (given to `parallel`)."""
        self._store = dist.TCPStore(
            "127.0.0.1", 0, self.size, is_master=True, timeout=_TIMEOUT, wait_for_workers=False
        )
        for pipe in self._pipes:
            pipe.send(("connect", self._store.port))
        self.group = parallel.group = process_group(0, self.size, self._store, self.device)

    def wait_ready(self) -> None:
        """Wait until every worker has captured its graphs and serves steps; then watch them."""
        self._expect("ready")
        self._watchdog = threading.Thread(target=self._watch, name="inflight-tp-watchdog")
        self._watchdog.daemon = True
        self._watchdog.start()

    def _expect(self, stage: str) -> None:
        waiting = dict(enumerate(self._processes, start=1))
        while waiting:
            pipes = {self._pipes[rank - 1]: rank for rank in waiting}
            sentinels = {p.sentinel: rank for rank, p in waiting.items()}
            ready = wait([*pipes, *sentinels], timeout=_TIMEOUT.total_seconds())
            if not ready:
                self.close()
                raise RuntimeError(
                    f"tensor-parallel ranks {sorted(waiting)} did not reach {stage!r} in {_TIMEOUT}"
                )
            for each in ready:
                rank = pipes.get(each) or sentinels[each]
                if rank not in waiting:  # its pipe, read first, said it reached the stage
                    continue
                message = _receive(self._pipes[rank - 1])
                if message is not None and message[0] == stage:
                    del waiting[rank]
                    continue
                process = waiting[rank]
                process.join(timeout=1.0)
                error = message[1] if message is not None else f"exited ({process.exitcode})"
                self.close()
                raise RuntimeError(f"tensor-parallel rank {rank} could not start: {error}")

    def send(self, plan: StepPlan) -> None:
        """Give every worker the step's plan (RuntimeError once a rank is lost)."""
        if self.fault is not None:
            raise RuntimeError(self.fault)
        try:
            for pipe in self._pipes:
                pipe.send(plan)
        except OSError as exc:
            self.fail(f"a tensor-parallel rank's pipe broke ({exc})")
            raise RuntimeError(self.fault) from exc

    def lost(self) -> str | None:
        """Why the ranks stopped serving, once a worker has ended: a step's collective that
        raised may have lost a worker, which ends moments later (on a loaded machine, a few
        seconds: a failed step that waits names the rank rather than rank 0's collective).
        The watchdog, which reaps the workers, records it; this waits for that rather than
        reaping too: of two threads waiting on one child, the one that loses finds no exit
        status yet and would have blamed rank 0's collective (a killed worker's test, 1 in 13)."""
        self._failed.wait(timeout=_LOST_WAIT_S)
        return self.fault

    def fail(self, reason: str) -> None:
        """Stop serving: record why (the first reason stands), abort the group, stop the
        workers."""
        if self.fault is None:
            self.fault = reason
            self._failed.set()
            log.error("tensor parallelism stopped: %s", reason)
        if self.group is not None:
            self.group.abort()
        # Killed, not told: the step thread may be writing to their pipes.
        for process in self._processes:
            process.kill()

    def close(self) -> None:
        """Stop the workers (they finish the step they run) and leave the group."""
        self._closing.set()
        self._finalizer()

    def _watch(self) -> None:
        while not self._closing.is_set():
            self._reap(timeout=1.0)
            if self._watch_once():
                return

    def _reap(self, timeout: float) -> None:
        """Wait up to `timeout` for any worker to end, then for the exit status of those that
        have: a process's sentinel is ready as its files close, its exit status a moment
        later."""
        sentinels = {p.sentinel: p for p in self._processes}
        for ended in wait(list(sentinels), timeout=timeout):
            sentinels[ended].join(timeout=1.0)

    def _watch_once(self) -> bool:
        """Whether a worker has ended (and the ranks failed)."""
        for rank, (process, pipe) in enumerate(
            zip(self._processes, self._pipes, strict=True), start=1
        ):
            if process.exitcode is None or self._closing.is_set():
                continue
            message = _receive(pipe)
            error = f": {message[1]}" if message is not None and message[0] == "error" else ""
            self.fail(f"tensor-parallel rank {rank} exited with code {process.exitcode}{error}")
            return True
        return False


def _receive(pipe: Connection) -> tuple[str, Any] | None:
    """A worker's message, if one is waiting (None when its pipe closed or is empty)."""
    try:
        return pipe.recv() if pipe.poll() else None
    except (EOFError, OSError):
        return None


def _stop(pipes: list[Connection], processes: list[multiprocessing.process.BaseProcess]) -> None:
    for pipe in pipes:
        with contextlib.suppress(OSError):
            pipe.send(None)
    for process in processes:
        process.join(timeout=_STOP_WAIT_S)
        if process.is_alive():
            process.kill()
            process.join()


def _worker_main(
    rank: int,
    size: int,
    checkpoint: Path | Checkpoint,
    plan: DeploymentPlan,
    dtype: torch.dtype,
    device: torch.device,
    *,
    pipe: Connection,
) -> None:
    """A worker rank: load its shard, join the group, then run each step rank 0 sends until
    told to stop (None) or rank 0 is gone. Any error is reported to rank 0 before exiting."""
    try:
        device = rank_device(device, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        parallel = TensorParallel(rank, size)

        def join() -> None:
            pipe.send(("loaded", None))
            message = pipe.recv()
            if message is None:
                raise SystemExit(0)
            store = dist.TCPStore("127.0.0.1", message[1], size, is_master=False, timeout=_TIMEOUT)
            parallel.group = process_group(rank, size, store, device)

        runner = build_model_runner(
            open_checkpoint(checkpoint), plan, dtype, device, parallel=parallel, connect=join
        )
        pipe.send(("ready", None))
        while (step := pipe.recv()) is not None:
            runner.follow(step)
    except (EOFError, SystemExit):
        os._exit(0)  # rank 0 is gone or stopped us before the group formed
    except BaseException as exc:
        try:
            pipe.send(("error", f"{type(exc).__name__}: {exc}"))
        finally:
            os._exit(1)
    os._exit(0)


class ParallelExecutor(Executor):
    """Rank 0's executor of a tensor-parallel runtime: each step's plan goes to the worker
    ranks, which run the same forward pass and LM-head calls; decode rows whose input token
    rank 0 sampled on its device get it by a broadcast. Once a rank is lost (or rank 0 fails
    after a plan went out, leaving the ranks out of step), every later step fails."""

    def __init__(self, *args: Any, workers: Workers, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.workers = workers

    @property
    def fault(self) -> str | None:
        return self.workers.fault

    def launch(self, step: ScheduledStep) -> LaunchedStep:
        try:
            return super().launch(step)
        except Exception as exc:
            self.workers.fail(self.workers.lost() or f"a step failed on rank 0 ({exc})")
            raise RuntimeError(self.workers.fault) from exc

    def _forward(
        self, rows: list[ScheduledRow], batch: RaggedBatch, unfold: bool, heads: list[HeadRows]
    ) -> torch.Tensor:
        inputs = [
            RowInput(r.token_ids, r.past_len, r.block_table, r.samples, r.scores, r.drafts)
            for r in rows
        ]
        share_ids = any(row.device_token for row in rows)
        self.workers.send(StepPlan(inputs, unfold, share_ids, heads))
        if share_ids:
            self.runner.share_ids(batch)
        return self.runner.execute(batch)
