"""``moe-async`` command line.

    moe-async train [--quiet] CONFIG.yaml [key.sub=value ...]   run an experiment
    moe-async show-config CONFIG.yaml [key.sub=value ...] print the validated config
    moe-async plan CONFIG.yaml [key.sub=value ...]        check the layout, estimate per-GPU memory
    moe-async report RUN_DIR [RUN_DIR ...] [--out DIR]   plots and a summary of runs

Bad user input (a config error, a missing config file, a ``cpu_affinity`` core this host
lacks, a ``trainer.load`` that is no checkpoint, a bad ``model.hf_path``) prints one line
``moe-async: <message>`` to stderr and exits with status 2; any other exception is a bug or
a crash and keeps its traceback (exit status 1). ``plan`` prints its table and exits 0 when
every role fits, 3 when one does not fit its devices (the reason on stderr), 2 for a layout
the model or cluster cannot take (every broken rule named).
"""

from __future__ import annotations

import argparse
import sys

from moe_async.config import ConfigError, dump_config, load_config
from moe_async.errors import UserInputError


def _refuse(e: BaseException) -> int:
    """Print ``moe-async: <message>`` for a user-input error to stderr; return exit status 2.

    A :class:`UserInputError` raised inside a Ray task reaches the driver as a
    ``RayTaskError`` that is also an instance of the cause's class; its ``str`` carries the
    remote traceback, so the original exception (``.cause``) is reported instead.
    """
    cause = getattr(e, "cause", None)
    print(f"moe-async: {cause if isinstance(cause, UserInputError) else e}", file=sys.stderr)
    return 2


def _plan(cfg, config_name: str) -> int:
    """``moe-async plan``: print the table; 0 fits, 3 does not fit, 2 bad input."""
    from moe_async.plan.arch import ArchError
    from moe_async.plan.memory import PlanError
    from moe_async.plan.report import make_plan
    from moe_async.plan.table import format_plan

    try:
        plan = make_plan(cfg)
    except (ArchError, PlanError) as e:
        return _refuse(e)
    print(format_plan(plan, cfg, config_name), end="")
    for r in plan.refusals:
        print(f"moe-async: does not fit: {r}", file=sys.stderr)
    return 3 if plan.refusals else 0


def main(argv: list[str] | None = None) -> int:
    """Run ``moe-async`` with ``argv`` (default ``sys.argv[1:]``); return the exit status:
    0, or 2 for bad user input (argparse also exits with 2 on bad arguments)."""
    p = argparse.ArgumentParser(prog="moe-async", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("train", "run an experiment"), ("show-config", "print the validated config"),
                        ("plan", "check the parallel layout against the model and cluster; per-GPU memory")):
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("config", help="YAML experiment file")
        sp.add_argument("overrides", nargs="*", help="key.sub=value overrides")
        if name == "train":
            sp.add_argument("--quiet", action="store_true", help="no per-step lines or live view (logging.quiet=true)")
    rp = sub.add_parser("report", help="PNG plots and a markdown summary of run directories (overlaid)")
    rp.add_argument("run_dirs", nargs="+", help="run directories written by moe-async train")
    rp.add_argument("--out", default=None, help="output directory (default: <first run dir>/report)")
    args = p.parse_args(argv)
    if args.cmd == "report":
        return _report(args.run_dirs, args.out)
    try:
        cfg = load_config(args.config, args.overrides + (["logging.quiet=true"] if getattr(args, "quiet", False) else []))
    except ConfigError as e:
        return _refuse(e)
    if args.cmd == "show-config":
        print(dump_config(cfg), end="")
        return 0
    if args.cmd == "plan":
        return _plan(cfg, args.config)
    from moe_async.logging.console import RunConsole
    from moe_async.orchestration.driver import run_experiment

    try:
        with RunConsole(quiet=cfg.logging.quiet) as console:
            run_experiment(cfg, console)
    except (ConfigError, UserInputError) as e:
        return _refuse(e)
    return 0


def _report(run_dirs: list[str], out: str | None) -> int:
    from moe_async.report import make_report

    try:
        r = make_report(run_dirs, out)
    except UserInputError as e:
        return _refuse(e)
    for note in r["notes"]:
        print(f"[moe-async] report: {note}", file=sys.stderr)
    for d in r["damaged"]:
        print(f"[moe-async] report: {d}", file=sys.stderr)
    print(f"[moe-async] report: {r['out'] / 'summary.md'} and {len(r['plots'])} plots ({', '.join(r['plots'])})")
    return 1 if r["damaged"] else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
