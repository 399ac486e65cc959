"""Re-export of :mod:`moe_async.affinity` (CPU core pinning; it lives below orchestration so
that the config and engine layers use it without importing orchestration)."""

from moe_async.affinity import check_cpu_affinity, check_run_placement, pin_this_process, validate_core_list

__all__ = ["check_cpu_affinity", "check_run_placement", "pin_this_process", "validate_core_list"]
