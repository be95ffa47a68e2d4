#!/usr/bin/env bash
# `make test`: the whole suite, in the order that leaves the fewest cores idle on a small machine.
#   1. The end-to-end tests that start stacks (marked slow; not tests/reliability) on PYTEST_WORKERS
#      pytest-xdist workers: they keep both cores busy.
#   2. tests/reliability by itself (marked alone): it times how fast a stack recovers from faults, and
#      other stacks starting beside it would stretch those times. On two workers: its shared stack's
#      tests on one, the NATS-cluster module (its own stack, started at once) on the other. It leaves
#      most of a core idle,
#   3. so the unit tests (neither slow nor alone) run beside it at nice 19, on PYTEST_WORKERS workers too:
#      the scheduler gives them only the CPU that the stacks under test do not want, which does not
#      stretch their recoveries (on one worker they took longer than tests/reliability).
#      Started at the beginning instead, beside the end-to-end tests too (that phase leaves some of the
#      cores idle while stacks start and stop), they stretched it from 227 to 286 s, and a fresh clone's
#      `make test` took 718 s against 723 (2026-12-07, the 2-core VM): not kept.
# Every part runs whatever another's outcome; the exit status is non-zero if any failed.
set -u
# Let Python keep the bytecode it compiles, and pytest its assertion-rewritten test modules (both in the
# tree's __pycache__, ignored by git). Some machines set PYTHONDONTWRITEBYTECODE (this one does): then
# every Python process the suite starts (services, Ray actors, pytest workers) compiles the sources it
# imports again, and every pytest worker rewrites every test module again (collecting the end-to-end
# tests took a worker 12.9 s here without the cache, 8.4 s with it).
unset PYTHONDONTWRITEBYTECODE
PY=${PYTHON:-.venv/bin/python}
WORKERS=${PYTEST_WORKERS:-2}
unit_log=$(mktemp -t orca-unit-tests.XXXXXX)
unit_pid=
# A background job ignores Ctrl-C; and pytest, interrupted, exits with a status, which would go on to the next part.
trap '[ -n "$unit_pid" ] && kill "$unit_pid" 2> /dev/null; rm -f "$unit_log"' EXIT
trap 'echo "make test: interrupted"; exit 130' INT TERM

"$PY" -m pytest -q -n "$WORKERS" --no-loadscope-reorder -m 'slow and not alone' --durations=25
stacks=$?

nice -n 19 "$PY" -m pytest -q -n "$WORKERS" --no-loadscope-reorder -m 'not slow and not alone' --durations=10 > "$unit_log" 2>&1 &
unit_pid=$!
echo "unit tests: running beside tests/reliability at nice 19, output in $unit_log (shown when they end)"
# Only tests/reliability is collected (the tests marked alone are those: tests/conftest.py ALONE): its
# workers then collect in 1.3 s, not 6.8 (importing every other test module, openai and transformers too).
"$PY" -m pytest -q -n 2 --no-loadscope-reorder -m alone --durations=15 tests/reliability
alone=$?
wait "$unit_pid"
unit=$?
echo "---- unit tests (not slow, not tests/reliability), run at nice 19 ----"
unit_pid=
cat "$unit_log"
echo "make test: stacks rc=$stacks, tests/reliability rc=$alone, unit tests rc=$unit"
exit $((stacks || alone || unit))
