"""The ``tripwire`` command: ``tripwire demo`` (the README's first command), ``tripwire bench``, ``tripwire sites``.

Without a GPU, Triton kernels must run in the interpreter, and TRITON_INTERPRET has to be set before triton is
imported: so the CLI decides the device first and sets it before importing anything that imports triton.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _want_interpreter(device: str | None) -> bool:
    import torch

    if device is None:
        return not torch.cuda.is_available()
    return not device.startswith("cuda")


def _bench_dir() -> Path:
    env = os.environ.get("TRIPWIRE_BENCH_DIR")
    if env:
        return Path(env)
    # Source checkout (editable install, src layout): <repo>/src/tripwire/cli.py -> <repo>/benchmarks
    return Path(__file__).resolve().parents[2] / "benchmarks"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tripwire", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="a paged-KV decode loop with injected metadata faults", add_help=False)
    demo.add_argument("args", nargs=argparse.REMAINDER)
    bench = sub.add_parser("bench", help="run the benchmark suite (benchmarks/)", add_help=False)
    bench.add_argument("args", nargs=argparse.REMAINDER)
    sub.add_parser("sites", help="list the registered sites of the reference kernels and instruments")
    argv = list(sys.argv[1:] if argv is None else argv)
    ns, rest = parser.parse_known_args(argv)
    extra = list(getattr(ns, "args", []) or []) + rest
    if ns.cmd in ("demo", "bench"):
        # argparse's REMAINDER drops leading options into `rest` out of order ("bench --only q2 --quick" would
        # become ["q2", "--quick", "--only"]): pass everything after the subcommand through verbatim instead.
        extra = argv[argv.index(ns.cmd) + 1 :]

    if ns.cmd == "demo":
        device = None
        for i, a in enumerate(extra):
            if a == "--device" and i + 1 < len(extra):
                device = extra[i + 1]
            elif a.startswith("--device="):
                device = a.split("=", 1)[1]
        if _want_interpreter(device):
            os.environ.setdefault("TRITON_INTERPRET", "1")
        if any(a == "--engine" or a.startswith("--engine=") for a in extra):
            from .demo_transformers import main as engine_demo_main

            return engine_demo_main(extra)
        from .demo import main as demo_main

        return demo_main(extra)
    if ns.cmd == "bench":
        bdir = _bench_dir()
        if not (bdir / "run_all.py").is_file():
            print(
                f"tripwire bench: no benchmark suite at {bdir} (it runs from a source checkout; set "
                f"TRIPWIRE_BENCH_DIR to the repository's benchmarks/ folder)",
                file=sys.stderr,
            )
            return 2
        if _want_interpreter(None):
            os.environ.setdefault("TRITON_INTERPRET", "1")
        sys.path.insert(0, str(bdir))
        import run_all  # type: ignore[import-not-found]

        return int(run_all.main(extra) or 0)
    if ns.cmd == "sites":
        if _want_interpreter(None):
            os.environ.setdefault("TRITON_INTERPRET", "1")
        import tripwire

        for mod in ("tripwire.kernels", "tripwire.numerics"):
            try:
                __import__(mod)
            except ImportError:
                pass
        for s in tripwire.sites():
            print(f"{s.id:4d}  {s.kind:9s} {'FATAL' if s.fatal else '     '} {s.name}  {s.description}")
        return 0
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
