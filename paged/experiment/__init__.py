"""One experiment from a composed config (`run`): build, drive the workload, summarize (`summary`), write
the outputs and log to W&B (`wandb_logger`)."""
