"""The engine loop and what builds and drives it: `Engine.step` (`engine`), config to engine (`builder`, with
the KV tiers' `offload`), the one drive loop over a workload (`runner`) and its bar
(`progress`), and the metrics each step records (`metrics`, `slo`)."""
