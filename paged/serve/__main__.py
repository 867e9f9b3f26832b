"""`python -m paged.serve [group=option ...] [key=value ...]`: an OpenAI-compatible server over the
config tree `run.py` composes (docs/serving.md). `server.host` (127.0.0.1) and `server.port` (8000)
say where it listens; Ctrl-C or SIGTERM stops it, writes summary.json and requests.jsonl into the
Hydra run folder and exits 130 / 143, as `run.py` does."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from paged.config import CONF_DIR, ConfigError, check_command_line, register_configs
from paged.utils.atomic_file import OutputError
from paged.utils.interrupt import Interrupt

register_configs()
log = logging.getLogger("paged")


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    hc = HydraConfig.get()
    try:
        if hc.mode.name == "MULTIRUN":
            raise ConfigError(
                "python -m paged.serve runs one server: sweep from the client's side, one server per configuration "
                "(docs/serving.md, 'Sweeps from a client')"
            )
        # imported here: it loads torch, which --help and a bad command line need not wait for
        from paged.serve.server import serve

        interrupt = Interrupt()
        out = Path(hc.runtime.output_dir)
        serve(cfg, out, interrupt)
    except (ConfigError, FileNotFoundError, OutputError) as e:
        log.error("%s", e)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if interrupt.requested:
        print(f"stopped by {interrupt.signal_name}: results in {out}", file=sys.stderr)
        sys.exit(interrupt.exit_code)


if __name__ == "__main__":
    try:
        check_command_line(sys.argv[1:])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    main()
