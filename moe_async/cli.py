"""``moe-async`` command line.

    moe-async train CONFIG.yaml [key.sub=value ...]     run an experiment
    moe-async show-config CONFIG.yaml [key.sub=value ...] print the validated config
"""

from __future__ import annotations

import argparse
import sys

from moe_async.config import ConfigError, dump_config, load_config


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="moe-async", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("train", "run an experiment"), ("show-config", "print the validated config")):
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("config", help="YAML experiment file")
        sp.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"moe-async: {e}", file=sys.stderr)
        return 2
    if args.cmd == "show-config":
        print(dump_config(cfg), end="")
        return 0
    from moe_async.orchestration.driver import run_experiment

    run_experiment(cfg)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
