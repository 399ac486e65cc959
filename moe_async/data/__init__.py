"""Train and eval prompts from the user's own files (JSONL, Parquet, ``datasets`` folders)."""
