"""`orca generate`'s output as the run goes: every record written, and flushed, as soon as every line
before it has been (input order kept), so an interrupted or crashed run keeps every record up to its first
unfinished line; Ctrl-C ends in one line with status 130; a run that stops at start-up leaves an existing
output file alone."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def orca(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=ROOT, input=stdin,
                          capture_output=True, text=True, timeout=300)


def ids_in(path: Path) -> list[str | None]:
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


class SteppedEngine:
    """LLMEngine's surface that run_batch uses; request `id` finishes at step `finish_at[id]`. Before each
    step it notes which records the output file on disk holds; step `crash_at` raises."""

    def __init__(self, finish_at: dict[str, int], output: Path, crash_at: int | None = None) -> None:
        self.finish_at = finish_at
        self.output = output
        self.crash_at = crash_at
        self.running: set[str] = set()
        self.steps = 0
        self.on_disk: list[list[str | None]] = []

    def prompt_ids(self, request) -> list[int]:
        return [1, 2]

    def add_request(self, request_id, prompt_token_ids, params, priority=0, cache_salt=None) -> None:
        if request_id in self.running:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.running.add(request_id)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.running)

    def step(self):
        from engine.llm_engine import Completion, Delta
        from shared.outputs import FinishReason

        self.on_disk.append(ids_in(self.output))
        self.steps += 1
        if self.steps == self.crash_at:
            raise RuntimeError("worker died")
        deltas = []
        for request_id in sorted(r for r in self.running if self.finish_at[r] == self.steps):
            completion = Completion(request_id, [1, 2], [7], "x", finish_reason=FinishReason.LENGTH)
            deltas.append(Delta(completion, (7,), "x"))
            self.running.discard(request_id)
        return deltas


LINES = ["{not json", json.dumps({"id": "a", "prompt": "x"}), json.dumps({"id": "b", "prompt": "x"}),
         json.dumps({"id": "c", "prompt": "x"}), json.dumps({"id": "a", "prompt": "duplicate"}),
         json.dumps({"id": "d", "prompt": "x"}), json.dumps({"id": "e", "prompt": "x"})]
FINISH_AT = {"a": 1, "b": 3, "c": 1, "d": 2, "e": 4}


def run_stepped(tmp_path: Path, crash_at: int | None = None, lazy: bool = False):
    """Run LINES on a SteppedEngine into tmp_path/out.jsonl, which holds an earlier run's record; `lazy`: hand
    run_batch a function that opens the output, which notes what was in the engine and on disk by then."""
    from engine.batch_job import run_batch

    output = tmp_path / "out.jsonl"
    output.write_text('{"id": "from an earlier run"}\n')
    engine = SteppedEngine(FINISH_AT, output, crash_at)
    opened_after: list[tuple[int, list[str | None]]] = []

    def open_output():
        opened_after.append((len(engine.running), ids_in(output)))
        return open(output, "w", encoding="utf-8")

    with contextlib.ExitStack() as files:
        out = open_output if lazy else files.enter_context(open(output, "w", encoding="utf-8"))
        try:
            return engine, opened_after, run_batch(engine, LINES, out, progress=False)
        except RuntimeError as exc:
            return engine, opened_after, exc


def test_records_are_written_in_input_order_as_soon_as_every_line_before_them_is(tmp_path):
    engine, _, counts = run_stepped(tmp_path)
    assert engine.on_disk == [
        [None],                             # before the first step: the bad first line's error record
        [None, "a"],                        # a and c done; c waits for b
        [None, "a"],                        # d done, still behind b
        [None, "a", "b", "c", "a", "d"],    # b done: b, c, the duplicate's error record, d
    ]
    assert ids_in(tmp_path / "out.jsonl") == [None, "a", "b", "c", "a", "d", "e"]
    assert counts == {"requests": 7, "errors": 2}


def test_a_crash_mid_batch_leaves_every_record_up_to_the_first_unfinished_line(tmp_path):
    engine, _, error = run_stepped(tmp_path, crash_at=3)
    assert isinstance(error, RuntimeError) and str(error) == "worker died"
    assert ids_in(tmp_path / "out.jsonl") == [None, "a"]


def test_the_output_is_opened_once_the_input_is_in_the_engine(tmp_path):
    engine, opened_after, counts = run_stepped(tmp_path, lazy=True)
    assert opened_after == [(5, ["from an earlier run"])]  # every valid line added, the earlier output intact
    assert engine.on_disk[1] == [None, "a"]
    assert ids_in(tmp_path / "out.jsonl") == [None, "a", "b", "c", "a", "d", "e"]


def test_ctrl_c_mid_batch_keeps_the_finished_prefix_and_says_so_in_one_line(demo_model, tmp_path):
    """Two requests at a time: the short lines after `long0` finish beside it and must wait for it, and the
    seven long lines after them keep the run going for thousands of steps, so the signal lands mid-batch
    however slowly this test's own polling runs on a loaded machine."""
    short = {"prompt": "hi", "max_tokens": 4, "ignore_eos": True}
    long = {"prompt": "hi", "max_tokens": 1000, "ignore_eos": True}
    lines = ["{not json"] + [json.dumps({"id": f"r{i}", **short}) for i in range(4)]
    lines.append(json.dumps({"id": "long0", **long}))
    lines += [json.dumps({"id": f"s{i}", **short}) for i in range(5)]
    lines += [json.dumps({"id": f"long{i}", **long}) for i in range(1, 8)]
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    output.write_text("earlier results\n")
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "generate", "--model", demo_model,
                             "--max-num-seqs", "2", "--input", str(source), "--output", str(output)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # as from a terminal: `make test` runs the unit tests as a background job, whose
                            # SIGINT is ignored, and Python then keeps it ignored (the run went to its end)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            text = output.read_text()
            if text.endswith("\n") and text.count("\n") >= 5 and not text.startswith("earlier"):
                break
            time.sleep(0.02)
        time.sleep(0.3)  # the short lines after long0 finish meanwhile, and must wait for it
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    written = ids_in(output)
    assert len(written) >= 5 and written == [None, "r0", "r1", "r2", "r3", "long0", "s0", "s1", "s2", "s3", "s4",
                                             *(f"long{i}" for i in range(1, 8))][:len(written)]
    assert len(written) < len(lines), "interrupted mid-batch"
    assert stderr.strip().splitlines()[-1] == (f"orca: interrupted: {len(written)} of {len(lines)} records written "
                                               f"to {output} (input order, up to the first unfinished line)")
    assert all(json.loads(line)["finish_reason"] == "length" for line in output.read_text().splitlines()[1:])


def test_a_run_that_stops_at_start_up_leaves_the_output_alone(demo_model, tmp_path):
    output, fresh = tmp_path / "out.jsonl", tmp_path / "fresh.jsonl"
    output.write_text("earlier results\n")
    bad_flag = orca("generate", "--model", demo_model, "--input", "-", "--output", str(output),
                    "--max-model-len", "99999", stdin="{}\n")
    bad_model = orca("generate", "--model", str(tmp_path / "no-model"), "--input", "-", "--output", str(output),
                     stdin="{}\n")
    nothing_made = orca("generate", "--model", str(tmp_path / "no-model"), "--input", "-", "--output", str(fresh),
                        stdin="{}\n")
    assert bad_flag.returncode == bad_model.returncode == nothing_made.returncode == 2
    assert "Traceback" not in bad_flag.stderr + bad_model.stderr
    assert output.read_text() == "earlier results\n"
    assert not fresh.exists()


def test_output_to_stdout_still_works(demo_model):
    lines = [json.dumps({"id": "a", "prompt": "hi", "max_tokens": 2}), "{not json"]
    result = orca("generate", "--model", demo_model, "--input", "-", "--output", "-", "--no-progress",
                  stdin="\n".join(lines) + "\n")
    assert result.returncode == 0, result.stderr
    assert [json.loads(line)["id"] for line in result.stdout.splitlines()] == ["a", None]
    assert result.stderr.strip().splitlines()[-1] == "2 requests, 1 errors -> -"

