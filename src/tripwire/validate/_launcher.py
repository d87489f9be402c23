"""The validator's bound launch: one :class:`Launcher` per validator plan calls the compiled kernel of
:mod:`tripwire.validate._triton` through its own launcher, with everything that does not change between calls
computed once.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton

from . import _triton
from ._rules import BLOCK, Rules

__all__ = ["Launcher"]


class Launcher:
    """One validator's launch with everything that does not change between its calls computed once: the tensor
    selections, the constexprs, and, per key (below), the compiled kernel, bound and called directly.

    Why: a JITFunction launch re-binds and re-specialises every argument on each call (the rules are many tuple
    arguments), tens of microseconds of host time per call, a real share of a CPU-bound engine's step. Bound, a call
    is the host checks, the sizes and one call into the compiled kernel's launcher. The first call for a key (below)
    goes through the JITFunction (which compiles or loads the kernel) and binds what it returns; so does every call
    under Triton's interpreter and while a launch hook (a profiler) is installed.

    What the compiled kernel is specialised on is the key it is bound under. Triton specialises each element of a
    tuple argument with its defaults, whatever ``do_not_specialize`` and ``do_not_specialize_on_alignment`` say
    (they apply to a parameter as a whole): an integer equal to 1 becomes a constant, one divisible by 16 is
    compiled as such, a tensor whose address is a multiple of 16 is compiled as aligned. The rules' tensors and
    sizes are tuple elements, so a kernel bound at one call could be wrong for the next: bound at a one-entry slot
    mapping (a one-token step), it would check one entry at every later call; bound at aligned tensors, it would
    issue vector loads a misaligned view cannot take. So the key is the tensors' dtypes and, for every size and
    every tensor, what Triton specialises it on (:func:`tripwire.validate._triton.spec_key`); the arena is one
    fixed tensor, the rest are the rules' constexprs. Same preconditions as :func:`tripwire.validate._triton.launch`.
    """

    __slots__ = (
        "_bound", "_builds", "_consts", "_dev", "_direct", "_n_aux", "_pick", "_stream", "arena", "mask", "rules"
    )  # fmt: skip

    def __init__(self, arena: torch.Tensor, rules: Rules, *, mask: bool, fault_calls: bool | None = None) -> None:
        self.arena = arena
        self.rules = rules
        self.mask = mask
        # The builds the register budget is offered (Validator's fault_calls: both, or the one forced).
        self._builds = _triton.BUILDS[fault_calls]
        # In the kernel's parameter order (after its ten runtime arguments): what the compiled launcher is given.
        self._consts = _triton._constexprs(arena, rules, mask)
        # One operator.itemgetter per group: a call selects its tuples in C, not in generator expressions.
        self._pick = tuple(_getter(ix) for ix in (rules.tensor, rules.aux, rules.requests, rules.segments))
        self._n_aux = sum(rules.own_aux)
        self._bound: dict[tuple, Any] = {}
        self._dev = arena.device.index if arena.is_cuda else -1
        # Decided at the first eager call, not here: a plan built while torch.compile traces (its op never calls
        # this launcher) must not touch the JITFunction, which the tracer cannot follow.
        self._direct: bool | None = None
        self._stream: Any = None  # Triton's get_current_stream(device), set with _direct

    def _args(self, tensors: Sequence[torch.Tensor], numels: list[int], widths: list[int]) -> tuple:
        # Every tensor's numel read once (by the caller) and picked with the tensors (a tensor can serve several
        # rules); itemgetters and list comprehensions, not generator expressions: this is the eager call's host time.
        pm, pa, pr, ps = self._pick
        return (self.arena, pm(tensors), pa(tensors), pr(tensors), ps(tensors), pm(numels), tuple(widths), pa(numels),
                pr(numels), ps(numels))  # fmt: skip

    def __call__(self, tensors: Sequence[torch.Tensor]) -> None:
        if not self.rules.kind:
            return
        pm = self._pick[0]
        numels = [t.numel() for t in tensors]
        total = self._n_aux
        for x in pm(numels):
            total += -(-x // BLOCK)
        if total == 0:
            return
        widths = [t.shape[1] if t.dim() == 2 else 1 for t in pm(tensors)]
        if self._direct is None:
            # Direct calls need a compiled kernel on a GPU: under the interpreter _validate is an
            # InterpretedFunction.
            self._direct = self.arena.is_cuda and hasattr(_triton._validate, "device_caches")
            if self._direct:
                self._stream = triton.runtime.driver.active.get_current_stream
        # The bound kernel's key: what Triton specialises the call's kernel on (_triton.spec_key says what and why).
        key = _triton.spec_key(tensors, numels, widths)
        if not self._direct or _hooked():
            args = self._args(tensors, numels, widths)
            _triton._validate[(total,)](
                *args, **_triton._with_cap(self.arena, self._consts, key, total, args, self._builds)
            )
            return
        bound = self._bound.get(key)
        if bound is None:
            args = self._args(tensors, numels, widths)
            kw = _triton._with_cap(self.arena, self._consts, key, total, args, self._builds)
            k = _triton._validate[(total,)](*args, **kw)
            # Bind what the JITFunction compiled (None or not a compiled kernel under the interpreter), with the
            # constexprs it was compiled with: the rules' and the CALLS the register budget chose for this key.
            if hasattr(k, "packed_metadata"):
                self._bound[key] = (k, (*self._consts, kw["CALLS"]))
            return
        k, consts = bound
        # The current stream as Triton's own launch asks for it (its driver's get_current_stream, bound once), on
        # the arena's device; no launch metadata and no hooks (_hooked() said none is set). The compiled kernel's
        # ``run`` is the launcher every Triton release gives a CompiledKernel (no release-specific C entry: a path
        # CI cannot run would be one no test keeps honest).
        stream = self._stream(self._dev)
        args = self._args(tensors, numels, widths)
        k.run(total, 1, 1, stream, k.function, k.packed_metadata, None, None, None, *args, *consts)

    @property
    def path(self) -> str:
        """How the next call launches (Validator.launch_path): ``"triton"`` (a bound compiled kernel's launcher) or
        ``"jit"`` (nothing bound yet, no compiled kernel under the interpreter, or a launch hook installed)."""
        return "triton" if self._bound and not _hooked() else "jit"

    @property
    def kernels(self) -> tuple[Any, ...]:
        """The bound compiled kernels, in binding order (Validator.kernels)."""
        return tuple(k for k, _ in self._bound.values())


def _getter(ix: tuple[int, ...]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """``seq -> tuple(seq[i] for i in ix)``, always a tuple (itemgetter of one index returns the item)."""
    if not ix:
        return lambda ts: ()
    if len(ix) == 1:
        one = ix[0]
        return lambda ts: (ts[one],)
    return operator.itemgetter(*ix)  # type: ignore[return-value]


def _hooked() -> bool:
    """Whether a Triton launch hook (a profiler) is installed: then every launch goes through the JITFunction, which
    hands the hook its metadata. Triton's hooks are HookChains (never None; empty when nothing is installed) or, on
    older releases, None or a callable."""
    rt = triton.knobs.runtime
    for h in (rt.launch_enter_hook, rt.launch_exit_hook):
        if h is not None and getattr(h, "calls", True):
            return True
    return False
