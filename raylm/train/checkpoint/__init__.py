"""Checkpoints: `format` (sharded DCP state, the manifest, discovery, verification), `policy`
(when to save, and saving safely, sync or async), `resume` (which checkpoint to resume from and
what may change on resume), `safe_load` (reading DCP state without running code from storage)."""
