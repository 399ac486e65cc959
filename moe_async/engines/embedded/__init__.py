"""The embedded engine: a CPU inference server (transformers-backed) that speaks SGLang's
HTTP protocol. Run it with ``python -m moe_async.engines.embedded.server``."""
