"""Replicas of the whole engine behind a router: one seam for the simulator and the real engine.

A `Fleet` looks to its driver (`paged.engine.runner.drive`) like one engine: requests go in, steps come out.
Inside, a `Router` (a plugin of the `router` config group) picks the replica of each request from
what every replica reports through `ReplicaView` (queue, KV usage, prefix cache), and the fleet steps
its replicas: under `executor=sim` on one virtual clock in this process, the earliest replica first;
real engines in turn, or as Ray actors (`paged.cluster.ray_fleet`).
"""
