"""What a run tells: per-step metrics and the progress line (`metrics`), the run's JSON-lines
records (`records`), MLflow and W&B (`trackers`), activation and parameter norms (`norms`)."""
