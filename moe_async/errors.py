"""Exception types for bad user input found after the config has loaded.

:class:`moe_async.config.ConfigError` covers what the config file alone can tell. Some
input can only be judged at start-up against this host or the file system: a
``cpu_affinity`` core this machine lacks, a ``trainer.load`` path that is no checkpoint, a
``model.hf_path`` that is no HF model directory. Those checks raise :class:`UserInputError`
(its message names the field and the value), and ``moe-async train`` prints it as one line
``moe-async: <message>`` and exits with status 2, as it does for a ConfigError. Any other
exception is treated as a bug or a crash and keeps its traceback.
"""

from __future__ import annotations


class UserInputError(ValueError):
    """A value the user gave (a config field, a path) is unusable here; the message names it.

    A ``ValueError`` subclass so that callers catching ``ValueError`` keep working.
    """


class UserInputFileNotFoundError(UserInputError, FileNotFoundError):
    """A path the user gave does not exist or lacks a required file.

    Both a :class:`UserInputError` and a ``FileNotFoundError`` (callers catching either keep
    working); ``str(e)`` is the message alone.
    """


class CheckpointReadError(UserInputError, RuntimeError):
    """A checkpoint file cannot be read (truncated, corrupt, not what its name says); the
    message names the file and says whether the trainer's state is unchanged.

    Both a :class:`UserInputError` (``moe-async train`` prints one line and exits 2) and a
    ``RuntimeError`` (what torch_dist read failures were reported as before).
    """


def one_line(msg: str, limit: int = 600) -> str:
    """``msg`` on one line (its non-empty lines joined by `` | ``), cut at ``limit`` characters
    (``...`` marks a cut): for errors that carry a server's or a peer's multi-line text."""
    msg = " | ".join(x.strip() for x in msg.splitlines() if x.strip())
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."


def check_safetensors_file(path: str) -> None:
    """Read a ``.safetensors`` file's header (8-byte little-endian length + JSON) and check that
    the file holds every byte its tensors' ``data_offsets`` name, so a truncated or corrupt
    file is refused by name before any tensor is read.

    Raises:
        CheckpointReadError: naming ``path`` (short header, bad JSON, missing bytes).
    """
    import json
    import os
    import struct

    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError(f"{size} bytes, shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if 8 + n > size:
                raise ValueError(f"header of {n} bytes, file of {size} bytes")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + n + end > size:
            raise ValueError(f"truncated: {size} bytes, its tensors end at byte {8 + n + end}")
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise CheckpointReadError(f"cannot read safetensors file {path}: {e}") from e


def read_json_object(path, field: str, error: type[Exception] = UserInputError) -> dict:
    """The JSON object in file ``path`` (a ``str`` or ``pathlib.Path``), which the config field
    ``field`` (e.g. ``model.hf_path``) points at.

    Raises:
        error (default :class:`UserInputError`): ``"<field>: cannot read <path>: ..."`` when the
            file cannot be read or parsed, ``"<field>: <path> is not a JSON object"`` otherwise.
    """
    import json
    import pathlib

    try:
        d = json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError) as e:
        raise error(f"{field}: cannot read {path}: {type(e).__name__}: {e}") from e
    if not isinstance(d, dict):
        raise error(f"{field}: {path} is not a JSON object")
    return d
