"""The same-step verdict inside vLLM: from the model runner's step to the scheduler's per-request error path.

The runner enqueues a verdict copy after the step's kernels and takes it after vLLM's own wait for the sampled
tokens (:meth:`tripwire.Monitor.verdicts`); the requests it names (vLLM's request ids) ride on the step's own
``ModelRunnerOutput`` to the scheduler's ``update_from_output`` of that step (in the same process, or pickled from a
worker process), which acts on them before any output of that step is built:

* ``contain``: each tainted request's tokens of the step are dropped and it is finished with
  ``RequestStatus.FINISHED_ERROR`` through the scheduler's own error set (the one it fails requests with
  ``FinishReason.ERROR`` from, in the same ``update_from_output``); a verdict that cannot attribute its rise in full
  taints every request of the step. Their blocks are evicted from the prefix cache first.
* ``mask``: the tainted requests go on (masked, wrong); their blocks are kept out of the prefix cache until they
  finish. A stop the verdict armed (a fatal site: the KV write) raises in the step that saw it.
* ``flag``: no verdict at all (counts and reports only).
"""

from __future__ import annotations

import copy
import inspect
import logging
import threading
from collections.abc import Callable
from typing import Any

from ...monitor import Monitor

__all__ = ["VerdictChannel"]

log = logging.getLogger("tripwire")

# The attribute of a ModelRunnerOutput that carries a step's tainted requests (request id -> why) to the scheduler;
# vLLM pickles the output from a worker process (MultiprocExecutor, which its CPU build uses with the engine core in a
# process of its own), and pickling keeps an instance's attributes.
ATTR = "_tripwire_tainted"
# Verdict copies in flight per runner: one per step; vLLM keeps at most two steps in flight (async scheduling).
DEPTH = 4
# The scheduler's per-request error set that update_from_output drains into FINISHED_ERROR in the same call (its
# structured-output grammar failures), in every supported release: a set of request ids in 0.26-0.32, a dict of
# request id -> vllm.outputs.RequestError from 0.33.
ERRORS = "grammar_compile_error_reqs"


class Taints(dict):  # type: ignore[type-arg]
    """What a step's ``ModelRunnerOutput`` carries at :data:`ATTR` (request id -> why). Made, and rebuilt where it is
    unpickled (the engine core's process, when the runner is in a worker process), through :func:`arrived`, which
    arms the scheduler's side of that process before the scheduler can see the output: a clean step's output
    carries none, so the scheduler runs vLLM's own ``update_from_output``, unwrapped."""

    def __reduce__(self) -> tuple[Any, tuple[dict[str, str]]]:
        return arrived, (dict(self),)


# The scheduler side's arming of this process (set while the plugin is installed with a verdict; None otherwise).
ON_TAINT: Callable[[], None] | None = None


def arrived(named: dict[str, str]) -> Taints:
    """A step's taints, in the process that holds them now: the scheduler's wrapper armed here first."""
    arm = ON_TAINT
    if arm is not None:
        arm()
    return Taints(named)


class SchedulerSide:
    """The scheduler's ``update_from_output`` wrapper, on the class only while containment has something to do:
    armed by each step output that carries taints (:func:`arrived`), and taken off again after an update once no
    armed output is still to come and no masked request runs on. A clean step passes through vLLM's own method."""

    def __init__(self, cls: type, name: str, wrapper: Any) -> None:
        self.cls, self.name, self.wrapper = cls, name, wrapper
        self.original = cls.__dict__[name]
        # Outputs armed in this process and not yet seen by the wrapper (outputs unpickled ahead of their update,
        # under async scheduling, keep the wrapper on for theirs).
        self.pending = 0
        self.lock = threading.Lock()

    def arm(self) -> None:
        with self.lock:
            self.pending += 1
            if self.cls.__dict__[self.name] is not self.wrapper:
                setattr(self.cls, self.name, self.wrapper)

    def settle(self, consumed: bool, masked: dict[str, str]) -> None:
        """After a wrapped update: ``consumed`` (it carried taints) counts one armed output off; the wrapper comes
        off once none is pending and no masked request runs on."""
        with self.lock:
            if consumed and self.pending > 0:
                self.pending -= 1
            if self.pending == 0 and not masked and self.cls.__dict__[self.name] is self.wrapper:
                setattr(self.cls, self.name, self.original)

    def remove(self) -> None:
        with self.lock:
            self.pending = 0
            if self.cls.__dict__[self.name] is self.wrapper:
                setattr(self.cls, self.name, self.original)


class VerdictChannel:
    """The verdict channel of one process (see the module docstring). ``contained``: (request id, reason) of every
    request failed so far, newest last (tools and tests read it)."""

    def __init__(self, mode: str, monitor: Monitor) -> None:
        self.mode = mode
        self.monitor = monitor
        # request id -> reason, while it runs on (mask); never rebound: the scheduler's wrapper holds this dict
        self.masked: dict[str, str] = {}
        self.contained: list[tuple[str, str]] = []
        self._rings: dict[Any, Any] = {}

    def check_scheduler(self, sched_cls: type, version: str) -> None:
        """Refuse a scheduler whose ``update_from_output`` does not fail requests from the error set used here."""
        if self.mode != "contain":
            return
        try:
            src = inspect.getsource(sched_cls.update_from_output)  # type: ignore[attr-defined]
            init = inspect.getsource(sched_cls.__init__)  # type: ignore[misc]
        except (OSError, TypeError) as e:
            raise RuntimeError(
                f"tripwire: vLLM {version}'s scheduler source cannot be read ({e}), so tripwire cannot check the "
                f"per-request error set its containment uses; TRIPWIRE_VLLM=contain is not available (mask is)"
            ) from e
        if ERRORS not in src or ERRORS not in init or "FINISHED_ERROR" not in src:
            raise RuntimeError(
                f"tripwire: vLLM {version}'s scheduler does not fail requests through the per-request error set "
                f"tripwire's containment uses ({ERRORS}); TRIPWIRE_VLLM=contain is not available on this version "
                f"(mask is)"
            )

    def ring(self, device: Any, sites: list[Any]) -> Any:
        """The verdict ring over a runner's sites on its device (allocated at the first call: before any capture); a
        runner built again (a new KV cache) reuses it, as one (device, site) takes one ring."""
        ring = self._rings.get(device)
        if ring is None:
            ring = self._rings[device] = self.monitor.verdicts(device, sites, depth=DEPTH)
        return ring

    # ------------------------------------------------------------------ the runner's side
    def after_step(self, ring: Any, ticket: Any, scheduler_output: Any, output: Any, *, wait: bool = False) -> Any:
        """Take the step's verdict (its copy landed with the sampled tokens; ``wait``: a step whose output carries
        none, a bounded wait on that one copy) and attach what it names to the step's ``ModelRunnerOutput``
        (returned: a copy when it is vLLM's shared empty output), which carries it to the scheduler, in this process
        or, pickled, from a worker process. The verdict's events reached every sink before this returns
        (:meth:`tripwire.verdict.Verdicts.take`), so no request fails unexplained."""
        verdict = ring.take(ticket, wait=wait)
        if verdict.stop is not None:
            raise verdict.stop  # a fatal site without containment: this step fails, through vLLM's error path
        if verdict.clean or output is None:
            return output  # None: the step failed before sampling, and vLLM hands nothing of it back
        if verdict.fail_all:
            ids = list(scheduler_output.num_scheduled_tokens)
            log.warning(
                "a masked fault in this step could not be attributed in full (%s); %s all %d requests of the step",
                _reason(verdict),
                "failing" if self.mode == "contain" else "keeping out of the prefix cache",
                len(ids),
            )
        else:
            ids = [str(r) for r in verdict.tainted]
        if not ids:
            return output
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

        if output is EMPTY_MODEL_RUNNER_OUTPUT:
            output = copy.copy(output)
        # Through arrived(): this process's scheduler side armed (the in-process engine core's), and again, on
        # unpickling, in the engine core's process.
        setattr(output, ATTR, arrived({r: _message(verdict, r) for r in ids}))
        return output

    # ------------------------------------------------------------------ the scheduler's side
    def before_update(self, sched: Any, model_runner_output: Any) -> None:
        named: dict[str, str] | None = getattr(model_runner_output, ATTR, None)
        if not named:
            return
        live = [r for r in named if r in sched.requests and not sched.requests[r].is_finished()]
        _evict(sched, live)
        if self.mode != "contain":
            for r in live:
                self.masked.setdefault(r, named[r])
            return
        index = model_runner_output.req_id_to_index
        tokens = model_runner_output.sampled_token_ids
        for r in live:
            i = index.get(r)
            if i is not None and i < len(tokens):
                tokens[i] = []  # nothing of this step's masked computation reaches the request or its client
            log.warning("request %s ends with vLLM's error finish reason: %s", r, named[r])
            self.contained.append((r, named[r]))
        # The scheduler's own per-request error path: update_from_output finishes these with FINISHED_ERROR and
        # emits their error outputs in this same call. vLLM 0.26-0.32 keep a set of ids there; 0.33 and later a
        # dict of RequestError, whose message reaches the API client.
        errors = getattr(sched, ERRORS)
        if isinstance(errors, dict):
            from vllm.outputs import RequestError

            for r in live:
                errors[r] = RequestError(code="tripwire_contained", message=named[r])
        else:
            errors.update(live)

    def after_update(self, sched: Any) -> None:
        if not self.masked:
            return
        gone = [r for r in self.masked if r not in sched.requests or sched.requests[r].is_finished()]
        for r in gone:
            del self.masked[r]
        _evict(sched, list(self.masked))  # blocks the step filled and cached: out of the prefix cache again


def _evict(sched: Any, request_ids: list[str]) -> None:
    """Keep these requests' blocks out of the prefix cache (their KV came from a masked computation)."""
    mgr = sched.kv_cache_manager
    blocks: set[int] = set()
    for r in request_ids:
        for group in mgr.get_block_ids(r):
            blocks.update(group)
    blocks.discard(0)  # the null block is never cached
    if blocks:
        mgr.block_pool.evict_blocks(blocks)


def _message(verdict: Any, request: str) -> str:
    """Why ``request`` fails: its own taint's message (site and entry), or the unattributed hit's under fail_all."""
    taint = verdict.failure(request)
    return taint.message() if taint is not None else _reason(verdict)


def _reason(verdict: Any) -> str:
    """What the verdict saw, for the log: each site with its delta and offenders."""
    parts = []
    for hit in verdict.hits:
        offenders = ", ".join(
            f"row {o.row} value {o.value}" + (f" (request {o.request})" if o.request is not None else "")
            for o in hit.offenders
        )
        parts.append(f"{hit.delta} masked at {hit.site}" + (f": {offenders}" if offenders else ""))
    return "; ".join(parts) or "a masked fault"
