"""Reading, converting, the command line and exploration work without PyTorch (the ``torch`` extra).

tests/no_torch_check.py does the work in a subprocess where ``import torch`` fails as it does
without torch installed; ``.ci/run`` also runs it in a fresh environment that has no torch.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

CHECK = pathlib.Path(__file__).with_name("no_torch_check.py")


@pytest.mark.slow
def test_everything_but_training_works_without_torch(tmp_path: pathlib.Path) -> None:
    done = subprocess.run([sys.executable, str(CHECK), "--block-torch"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == "no-torch check passed"

