"""``python -m spmdrl.train`` with the scripted policy registered as ``rollout.engine: scripted``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from scripted_policy import ScriptedRollout  # noqa: E402

from spmdrl.rollout import ROLLOUT_ENGINES  # noqa: E402

ROLLOUT_ENGINES["scripted"] = lambda: ScriptedRollout

if __name__ == "__main__":
    from spmdrl.train import main

    sys.exit(main())
