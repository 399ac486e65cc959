"""Prompt-file fixtures written with ``datasets`` / pyarrow (the libraries users write them with)."""

from __future__ import annotations

from pathlib import Path

SYSTEM = "Answer with a number."


def verl_rows(n: int, source: str = "src_a") -> list[dict]:
    """verl's Parquet schema (examples/data_preprocess/gsm8k.py): data_source, prompt messages,
    ability, reward_model {style, ground_truth}, extra_info."""
    return [{"data_source": source, "prompt": [{"role": "system", "content": SYSTEM},
                                               {"role": "user", "content": f"What is {i} + {i}?"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"split": "train", "index": i}} for i in range(n)]


def slime_rows(n: int, source: str = "src_b") -> list[dict]:
    """slime's JSONL: prompt (a string here), label, metadata dict."""
    return [{"prompt": f"Compute {i} * 3.", "label": str(3 * i), "metadata": {"data_source": source, "id": i}}
            for i in range(n)]


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    import datasets

    datasets.Dataset.from_list(rows).to_json(str(path), lines=True)
    return path
