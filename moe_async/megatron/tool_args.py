"""The converter CLIs' torch-free part (``tools/convert_*.py``), so that a refused argument
costs no torch or Megatron import: :func:`run_tool` (a refusal as one ``<prog>: error: ...``
line, exit status 2), :func:`parse_size` ("5GB" -> bytes) and :func:`check_out_dir`
(``FileExistsError`` naming the flag)."""

from __future__ import annotations

import os


def run_tool(main, prog: str, argv: list[str] | None = None) -> int:
    """Run a converter's ``main(argv)`` with a refused input (bad layout, config, keys, files)
    reported as one ``<prog>: error: ...`` line on stderr and exit status 2 instead of a
    traceback; other exceptions propagate with theirs."""
    import sys

    try:
        return main(argv)
    except (ValueError, KeyError, FileNotFoundError, FileExistsError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"{prog}: error: {msg}", file=sys.stderr)
        return 2


def parse_size(text: str | int) -> int:
    """``"5GB"`` / ``"500MB"`` / ``"10KB"`` / ``"123"`` -> bytes (powers of 1000, as
    transformers' ``max_shard_size``; ``GiB``/``MiB``/``KiB`` are powers of 1024)."""
    if isinstance(text, int):
        return text
    t = text.strip().upper()
    units = {"GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1}
    for u, m in units.items():
        if t.endswith(u):
            return int(float(t[: -len(u)]) * m)
    return int(t)


def check_out_dir(out_dir: str, flag: str = "--out") -> None:
    """Refuse an output dir that cannot take a conversion: FileExistsError naming ``flag`` and
    the path when it is an existing file, a non-empty directory, or lies under a file."""
    if os.path.exists(out_dir):
        if not os.path.isdir(out_dir):
            raise FileExistsError(f"{flag} {out_dir} is an existing file, not a directory")
        if os.listdir(out_dir):
            raise FileExistsError(f"{flag} {out_dir} exists and is not empty")
        return
    up = os.path.dirname(os.path.abspath(out_dir))
    while not os.path.exists(up):
        up = os.path.dirname(up)
    if not os.path.isdir(up):
        raise FileExistsError(f"{flag} {out_dir} cannot be created: {up} is a file, not a directory")
