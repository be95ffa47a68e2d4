"""benchmarks/nats_floor.py runs end to end on a real nats-server and prints both rows."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "nats_floor.py"


def test_the_floor_prints_one_way_and_round_trip_times_for_both_rows():
    done = subprocess.run([sys.executable, str(SCRIPT), "--count", "5", "--gap-ms", "1"], capture_output=True,
                          text=True, timeout=60, cwd=SCRIPT.parents[1])
    assert done.returncode == 0, done.stderr
    rows = {label: [float(x) for x in re.findall(r"\d+\.\d+", rest)]
            for label, rest in re.findall(r"^(back to back|after 1 ms idle)\s+(.*)$", done.stdout, re.M)}
    assert set(rows) == {"back to back", "after 1 ms idle"}, done.stdout
    for one_way_median, _, _, round_trip_median, _, _ in rows.values():
        assert 0 < one_way_median < round_trip_median
