"""Run logging: wandb (offline by default: a run directory you can ``wandb sync`` later),
a ``metrics.jsonl`` file (one JSON object per step: ``step`` and every metric), and one
console line per step.

Metric names (per step): ``rollout/reward_mean``, ``rollout/accuracy``,
``buffer/staleness_mean``, ``buffer/staleness_max``, ``sync/seconds``,
``perf/tokens_per_s``, ``perf/trainer_idle_frac``, ``train/loss``, ``train/grad_norm`` ...;
docs/observability.md (the metrics catalogue) lists them all with units and sources.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Mapping

from moe_async.logging.config import LoggingConfig
from moe_async.types import JsonDict


def make_run_dir(cfg: LoggingConfig, name: str, path: Path | None = None) -> Path:
    """Create ``<output_dir>/<name>-<YYYYmmdd-HHMMSS>[-n]`` and return it (absolute); with
    ``path`` (a run id's fixed directory under ``output_dir``) create or reuse that one.

    Raises:
        UserInputError naming ``logging.output_dir`` when it cannot be created or written
        (a file in its place, no permission, a read-only file system).
    """
    from moe_async.errors import UserInputError

    base = Path(cfg.output_dir).expanduser().resolve()
    try:
        base.mkdir(parents=True, exist_ok=True)
        if not os.access(base, os.W_OK | os.X_OK):
            raise PermissionError(f"{base} is not writable")
    except OSError as e:  # FileExistsError/NotADirectoryError (a file there), PermissionError, EROFS
        raise UserInputError(f"logging.output_dir={cfg.output_dir!r}: cannot create a run directory "
                             f"there ({type(e).__name__}: {e})") from e
    if path is not None:
        path.mkdir(exist_ok=True)
        return path
    stamp = time.strftime("%Y%m%d-%H%M%S")
    d = base / f"{name}-{stamp}"
    n = 1
    while d.exists():
        d = base / f"{name}-{stamp}-{n}"
        n += 1
    d.mkdir()
    return d


class RunLogger:
    """Writes metrics to wandb, ``metrics.jsonl``, TensorBoard (``logging.tensorboard``) and
    the console.

    Args:
        cfg: logging config (``wandb_mode`` offline|online|disabled).
        run_dir: the run's directory (wandb writes under ``run_dir/wandb``).
        config: the experiment config as a dict, stored with the wandb run.
    """

    def __init__(self, cfg: LoggingConfig, run_dir: Path, name: str, config: JsonDict):
        self.run_dir = run_dir
        self.quiet = cfg.quiet
        self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        self._wandb = None
        self._tb = None
        if cfg.tensorboard:  # the same names as metrics.jsonl and wandb, step = the run's step
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(logdir=str(run_dir / "tensorboard"))
        if cfg.wandb_mode != "disabled":
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb

            self._wandb = wandb.init(
                project=cfg.project, name=name, dir=str(run_dir), mode=cfg.wandb_mode, config=config
            )

    @property
    def wandb_dir(self) -> str | None:
        return self._wandb.dir if self._wandb is not None else None

    def log(self, metrics: Mapping[str, object], step: int) -> None:
        """Record ``metrics`` (floats/ints; other values only go to the jsonl file)."""
        rec = {"step": step, **metrics}
        self._jsonl.write(json.dumps(rec, default=float) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, global_step=step)

    def console_step(self, step: int, total: int, m: Mapping[str, float]) -> str:
        """Format the one-line step summary, print it (unless ``logging.quiet``); return it.

        ``reward`` is the trained batch's mean; ``gen reward`` (when known) the mean over every
        sample generated since the previous step, including groups that dynamic filtering or
        the staleness bound dropped: the policy's own reward, which filtering does not bias.
        ``wait`` is the trainer's wait for the batch (``straggler`` its part spent on groups at
        the staleness limit), ``train`` the train step, ``sync`` the weight sync."""
        gen = m.get("rollout/reward_mean_generated_step")
        strag = m.get("perf/wait_straggler_seconds", 0.0)
        line = (
            f"step {step:>3}/{total} | reward {m.get('rollout/reward_mean', 0):.3f}"
            f" acc {m.get('rollout/accuracy', 0):.3f}"
            + (f" gen reward {gen:.3f}" if gen is not None else "")
            + f" | staleness {m.get('buffer/staleness_mean', 0):.2f} max {m.get('buffer/staleness_max', 0):.0f}"
            f" | loss {m.get('train/loss', 0):+.4f} aux {m.get('train/moe_aux_loss', 0):.3f}"
            f" | wait {m.get('perf/wait_seconds', 0):.1f}s" + (f" (straggler {strag:.1f}s)" if strag >= 0.05 else "")
            + f" train {m.get('train/step_time_s', 0):.1f}s sync {m.get('sync/seconds', 0):.2f}s"
            f" | {m.get('perf/tokens_per_s', 0):.0f} tok/s, trainer idle {m.get('perf/trainer_idle_frac', 0):.0%}"
            f" | dropped {m.get('buffer/samples_dropped', 0):.0f}"
        )
        if not self.quiet:
            print(line, flush=True)
        return line

    def summary(self, values: Mapping[str, object]) -> None:
        """Write final values to ``summary.json`` and the wandb summary."""
        (self.run_dir / "summary.json").write_text(json.dumps(values, indent=2, default=float))
        if self._wandb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float, str)):
                    self._wandb.summary[k] = v

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
