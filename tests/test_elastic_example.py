"""The elastic SGD example runs to the end: a worker dies, the group shrinks and grows back."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_elastic_sgd_example_shrinks_grows_and_ends_with_identical_replicas() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "elastic_sgd.py")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    out = result.stdout
    assert result.returncode == 0, out[-4000:] + result.stderr[-4000:]
    assert "driver: killed rank 2" in out
    shrunk = re.findall(r"shrunk to 3 workers in [\d.]+ s, now rank (\d)", out)
    assert sorted(shrunk) == ["0", "1", "2"], out
    assert out.count("grew to 4 workers") == 3, out
    assert "rank 3 joined; took rank 0's weights at step 300" in out
    assert re.search(r"step 600: loss [\d.]+ on 4 workers", out), out
    losses = [float(x) for x in re.findall(r"loss ([\d.]+) on", out)]
    assert losses[-1] < losses[0] / 10, losses
    assert "the parameters of the 4 replicas are identical" in out
