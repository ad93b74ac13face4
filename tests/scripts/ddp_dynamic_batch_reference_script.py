"""Run by test_dynamic_batch_ddp.py: the same 2-process DDP run as ddp_dynamic_batch_script.py, without the callback."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.scripts.ddp_dynamic_batch_script import main  # noqa: E402

if __name__ == "__main__":
    main(Path(sys.argv[1]), with_callback=False)
