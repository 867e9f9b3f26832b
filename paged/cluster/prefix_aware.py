"""`router=prefix-aware`: SGLang's cache-aware routing. A request goes to the replica whose prefix
cache holds the longest prefix of its prompt, unless that replica is overloaded; with no useful
match it goes to the least-loaded replica.

A replica's cache only holds blocks once computed, so a burst of requests sharing a new prefix
would all miss and scatter. As SGLang's router does, this one also remembers the prompt blocks it
sent to each replica (an LRU of block hashes per replica, `index_blocks` long) and counts a prefix
as held where either the replica's cache or its own record holds it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from paged.cluster.replica import ReplicaView
from paged.cluster.router import Router
from paged.memory.hashing import request_block_hashes
from paged.request import Request


class PrefixAwareRouter(Router):
    def __init__(
        self, min_match: float = 0.1, balance_abs: int = 8, balance_rel: float = 1.5, index_blocks: int = 65536
    ) -> None:
        """`min_match`: the share of the prompt a match must cover to route by it (SGLang's
        cache_threshold). The load cap: the matched replica's requests may be at most
        `balance_rel` x the least-loaded replica's plus `balance_abs`, else the least-loaded one
        takes the request. `index_blocks`: block hashes remembered per replica."""
        if not 0.0 <= min_match <= 1.0:
            raise ValueError(f"min_match={min_match} must be in [0, 1]")
        if balance_abs < 0 or balance_rel < 1.0:
            raise ValueError(f"balance_abs={balance_abs} must be >= 0 and balance_rel={balance_rel} >= 1")
        if index_blocks <= 0:
            raise ValueError(f"index_blocks={index_blocks} must be > 0")
        self.min_match, self.balance_abs, self.balance_rel = min_match, balance_abs, balance_rel
        self.index_blocks = index_blocks
        self._sent: dict[int, OrderedDict[bytes, None]] = {}
        self.num_prefix_routed = 0  # requests routed by their prefix match (the rest: by load)

    def route(self, request: Request, replicas: Sequence[ReplicaView]) -> ReplicaView:
        chain = request_block_hashes(request, replicas[0].block_size)  # the chain its replica's index reuses
        loads = {r.index: r.load_metric("num_requests") for r in replicas}
        least = min(replicas, key=lambda r: (loads[r.index], r.index))
        best, best_blocks = least, 0
        for replica in replicas:
            held = max(replica.cached_prefix_blocks(chain), self._sent_blocks(replica.index, chain))
            if held > best_blocks or (held == best_blocks and held and loads[replica.index] < loads[best.index]):
                best, best_blocks = replica, held
        covered = best_blocks * replicas[0].block_size / max(request.num_prompt_tokens, 1)
        cap = self.balance_rel * loads[least.index] + self.balance_abs
        if best_blocks and covered >= self.min_match and loads[best.index] <= cap:
            self.num_prefix_routed += 1
            chosen = best
        else:
            chosen = least
        self._remember(chosen.index, chain)
        return chosen

    def _sent_blocks(self, index: int, chain: list[bytes]) -> int:
        sent = self._sent.get(index)
        if not sent:
            return 0
        n = 0
        for h in chain:
            if h not in sent:
                break
            n += 1
        return n

    def _remember(self, index: int, chain: list[bytes]) -> None:
        sent = self._sent.setdefault(index, OrderedDict())
        for h in chain:
            sent[h] = None
            sent.move_to_end(h)
        while len(sent) > self.index_blocks:
            sent.popitem(last=False)

    def forget(self, replica: ReplicaView) -> None:
        self._sent.pop(replica.index, None)
