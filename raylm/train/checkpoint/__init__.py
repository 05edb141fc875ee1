"""Checkpoints: `format` (sharded DCP state, the manifest, discovery, verification), `policy`
(when to save, and saving safely, sync or async), `resume` (which checkpoint to resume from and
what may change on resume), `metadata` (DCP's index, read without running code from storage,
and without torch where only its files are wanted), `safe_load` (reading DCP state safely)."""
