"""Request sources: what a run serves, from `cfg.workload` (`load_workload`, by `workload.kind`).

- `synthetic` (synthetic.py): log-normal lengths fit to a dataset's mean lengths (ShareGPT, Alpaca);
- `fixed` (fixed.py): every request the same prompt and output length;
- `trace` (trace.py): a window of an Azure inference trace, its lengths and arrival gaps scaled;
- `prompts` (prompts.py, lines parsed by jsonl.py): a JSONL file of prompts with their own sampling;
- `multiturn` (multiturn.py): chat sessions, each turn's prompt the whole conversation so far;
- `agent` (agent.py): agents sharing one long context, each with its own growing trajectory.

The first three are length-only: lengths.py turns their lengths into requests (shared prefixes,
picked as popularity.py says, clipping to the scheduler's `max_model_len`, token ids from a corpus
or seeded at random). The last two are closed-loop: a later turn is a follow-up item
(`WorkloadItem.follows`), sent by the runner once the turn it follows has its reply. What
every source shares, the `WorkloadItem` record, Poisson arrivals, the client and priority draws
(each from its own seeded stream) and the workload's sampling keys, is in records.py; kinds.py maps
each kind to its source. The same seed gives the same requests, in the same order.
"""

from paged.workload.jsonl import parse_prompt_line
from paged.workload.kinds import check_inputs, load_workload
from paged.workload.prompts import prompt_file
from paged.workload.records import Tokenizer, WorkloadItem

__all__ = ["Tokenizer", "WorkloadItem", "check_inputs", "load_workload", "parse_prompt_line", "prompt_file"]
