"""Launch-time checks shared by the reference kernels' launchers.

Every check here reads host attributes only (dtype, device, shape, strides): no device sync, no allocation, no
``.item()``. They run before any launch, so a wrong argument raises a clear error naming it instead of becoming an
illegal memory access (or, worse, a silently wrong read) inside the kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton

from .._default import default_monitor
from .._runtime.arena import normalize_device
from ..layout import SLOTS
from ..monitor import Monitor
from ..sites import Site
from ..triton import _callee

# Metadata (ids, rows, columns, positions) may be int32 (what engines store) or int64 (what torch indexing makes).
INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(
    name: str,
    t: object,
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    ndim: int | None = None,
    min_ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
) -> torch.Tensor:
    """Refuse anything but a contiguous tensor of the expected dtype and rank (``None`` in ``shape`` = any size)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype {want}, got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimensions, got shape {tuple(t.shape)}")
    if shape is not None:
        if len(shape) != t.dim() or any(s is not None and s != a for s, a in zip(shape, t.shape, strict=True)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    # Kernels compute flat offsets from the shape, so a strided view would be read at the wrong addresses.
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {t.stride()} for shape {tuple(t.shape)})")
    return t


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one device (CUDA, or CPU under the Triton interpreter); returns it."""
    items = list(tensors.items())
    first_name, first = items[0]
    dev = first.device
    for name, t in items[1:]:
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {dev}; all arguments must share a device")
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"tripwire kernels run on CUDA (or on the CPU under TRITON_INTERPRET=1), got {dev}")
    # _callee's function looked up at the call, not bound at import: a stand-in a test sets on _callee is seen while
    # it is set and gone after, whichever module was imported first.
    if dev.type == "cpu" and not _callee.interpreting() and not _callee.recording():
        # Else Triton's own error, "0 active drivers", says neither what is wrong nor what to do.
        raise RuntimeError(
            f"{first_name} is on the CPU, but tripwire's reference kernels are Triton kernels and Triton compiles "
            f"them for a GPU in this process: without a GPU, set TRITON_INTERPRET=1 before triton is first imported "
            f"(Triton's interpreter then runs them on the CPU, slowly: for tests and demos; `tripwire demo` does "
            f"it itself), or pass CUDA tensors"
        )
    return dev


def check_ctr(name: str, ctr: object, device: torch.device, n_sites: int = 1) -> torch.Tensor:
    """A counter block: int64 ``[n_sites, 8]`` (``[8]`` accepted for one site), contiguous, on the kernel's device."""
    if n_sites == 1 and isinstance(ctr, torch.Tensor) and ctr.dim() == 1:
        check_tensor(name, ctr, dtypes=(torch.int64,), shape=(SLOTS,))
    else:
        check_tensor(name, ctr, dtypes=(torch.int64,), shape=(n_sites, SLOTS))
    assert isinstance(ctr, torch.Tensor)
    if ctr.device != device:
        raise ValueError(
            f"{name} (the counter rows) is on {ctr.device} but the kernel's tensors are on {device}; use "
            f"tripwire.kernels.counters(SITES, {str(device)!r})"
        )
    return ctr


# (id(sites), raw device argument) -> (monitor, view): the default path of a launcher is one dict lookup.
_DEFAULT_VIEWS: dict[tuple[int, object], tuple[Monitor, tuple[Site, ...], torch.Tensor]] = {}


def counters(sites: Sequence[Site], device: torch.device | str | int, monitor: Monitor | None = None) -> torch.Tensor:
    """The counter rows of one kernel's ``sites`` as one tensor: ``[8]`` for one site, else an ``[n, 8]`` view of
    ``n`` adjacent arena rows (a kernel's sites are registered one after the other at import, so their rows are
    adjacent; the kernel then reaches site ``k`` at ``ctr + 8 * k``).

    ``monitor`` defaults to the default monitor. A monitor on a private registry gets the sites registered there
    (same names and attributes) if they are not yet; they must end up adjacent, or this raises. Allocates the arena
    on first use (outside a capture; inside one with no arena it raises CaptureError).
    """
    m = monitor if monitor is not None else default_monitor()
    local = [m.registry.register(s.name, description=s.description, fatal=s.fatal, kind=s.kind) for s in sites]
    for k, s in enumerate(local):
        if s.id != local[0].id + k:
            raise ValueError(
                f"the sites {[s.name for s in local]} hold rows {[s.id for s in local]} in this monitor's registry; "
                f"a kernel needs them adjacent: register them one after the other, before anything else in between"
            )
    first = m.counter(local[0], device)
    if len(local) == 1:
        return first
    arena = m.arena.get(normalize_device(device))
    assert arena is not None  # m.counter allocated it
    return arena[local[0].id : local[0].id + len(local)]


def resolve_ctr(name: str, sites: tuple[Site, ...], ctr: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """``ctr`` checked, or the default monitor's rows of ``sites`` on ``device`` (cached after the first call, so the
    hot path allocates nothing; CaptureError inside a capture when no arena was preallocated)."""
    if ctr is None:
        m = default_monitor()
        key = (id(sites), device)
        hit = _DEFAULT_VIEWS.get(key)
        if hit is not None and hit[0] is m and hit[1] is sites:
            ctr = hit[2]
        else:
            ctr = counters(sites, device, m)
            _DEFAULT_VIEWS[key] = (m, sites, ctr)
    return check_ctr(name, ctr, device, len(sites))


def check_requests(requests: object, n: int, unit: str, device: torch.device) -> torch.Tensor | None:
    """None, or a request map checked: int32/int64 ``[n]``, one request id per ``unit`` (the kernel's row unit: "batch
    entry", "token", ...), contiguous, on the kernel's ``device``. The kernel reads it only on its fault path, so an
    entry's request is kept with its offender; a map that does not fit would be read out of bounds there."""
    if requests is None:
        return None
    what = f"requests (the request map: one request id per {unit})"
    if not isinstance(requests, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor or None, got {type(requests).__name__}")
    if requests.dtype not in INDEX_DTYPES:
        raise TypeError(f"{what} must have dtype int32 or int64, got {str(requests.dtype).replace('torch.', '')}")
    if tuple(requests.shape) != (n,):
        raise ValueError(f"{what} must have shape [{n}], got {list(requests.shape)}")
    if not requests.is_contiguous():
        raise ValueError(f"{what} must be contiguous (got strides {requests.stride()})")
    if requests.device != device:
        raise ValueError(f"{what} is on {requests.device} but the kernel's tensors are on {device}")
    return requests


# The largest int a kernel argument may hold: Triton passes an int of 2**63 or more as uint64, and the kernels'
# signed compares (and their int64 counters) would read it wrong.
INT64_MAX = (1 << 63) - 1


def check_int_arg(name: str, v: object, *, lo: int = 0) -> int:
    """``v`` as a kernel's int argument: an int (not a bool) in ``[lo, 2**63 - 1]``."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    if v > INT64_MAX:
        raise ValueError(f"{name} must fit in an int64 (<= 2**63 - 1), got {v}")
    return v


def pow2(n: int, *, lo: int = 1, hi: int = 1 << 30) -> int:
    """The power of two covering ``n``, clamped into ``[lo, hi]`` (a Triton block size)."""
    return max(lo, min(hi, triton.next_power_of_2(max(int(n), 1))))


def check_fake_ctr(ctr: torch.Tensor, n_sites: int) -> None:
    """A custom op's fake implementation: ``ctr`` is the int64 counter block of ``n_sites`` sites."""
    ok = ctr.dtype == torch.int64 and (tuple(ctr.shape) == (n_sites, 8) or (n_sites == 1 and tuple(ctr.shape) == (8,)))
    if not ok:
        raise ValueError(f"ctr must be int64 [{n_sites}, 8] (or [8] for one site), got {ctr.dtype} {list(ctr.shape)}")
