"""Suite-wide: this directory is on ``sys.path`` (pytest's rootdir-relative conftest import),
so test modules in every sub-directory import the shared launch helpers as ``_launch``."""
