"""The engine loop and what builds and drives it: `Engine.step` (`core`), config to engine (`builder`, with
the KV tiers' `offload` and the `_target_` plugins), the one drive loop over a workload (`runner`) and its bar
(`progress`), and the metrics each step records (`metrics`, `slo`)."""
