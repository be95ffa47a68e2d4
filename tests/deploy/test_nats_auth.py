"""deploy/nats/nats.conf on the real nats-server: each service's user may publish and subscribe
where that service needs to and nowhere else, producers reach only the public API, and
passwords stay out of logs."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client

from services.bus import auth_options, synced  # what flush() promises; the why is there
from services.jobs.service import ensure_streams
from services.nats_server import LocalNatsServer, nats_server_binary
from shared import subjects

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "deploy" / "nats" / "nats.conf"
USERS = ("gateway", "tokenizer", "admission", "engine", "jobs", "client")
PASSWORDS = {user: f"{user}-{secrets.token_hex(8)}" for user in USERS}


def password_environ(passwords: dict[str, str]) -> dict[str, str]:
    """What deploy/nats/nats.conf reads: ORCA_NATS_<USER>_PASSWORD."""
    return {f"ORCA_NATS_{user.upper()}_PASSWORD": password for user, password in passwords.items()}


@pytest.fixture(scope="module")
def server():
    server = LocalNatsServer(config=CONF, environ=password_environ(PASSWORDS)).start()
    yield server
    server.cleanup()


def test_config_parses_and_needs_every_password():
    env = {**os.environ, **password_environ(PASSWORDS)}
    ok = subprocess.run([nats_server_binary(), "-t", "-c", str(CONF)], env=env, capture_output=True, text=True,
                        timeout=30)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    env.pop("ORCA_NATS_JOBS_PASSWORD")
    missing = subprocess.run([nats_server_binary(), "-t", "-c", str(CONF)], env=env, capture_output=True,
                             text=True, timeout=30)
    assert missing.returncode != 0 and "ORCA_NATS_JOBS_PASSWORD" in missing.stdout + missing.stderr


def test_every_subject_of_the_project_is_in_the_config():
    """A subject added to shared/subjects.py without a permission would be refused in every
    secured deployment: each one (functions with a wildcard token) is named in nats.conf."""
    conf = CONF.read_text()
    prefixes = (subjects.PREFIX, subjects.JOBS_RESULT_PREFIX)  # not subjects themselves
    names = [v for k, v in vars(subjects).items()
             if k.isupper() and isinstance(v, str) and v.startswith("orca.") and v not in prefixes]
    names += [subjects.engine_admit("*"), subjects.engine_step("*"), subjects.engine_result("*"),
              subjects.engine_replay("*"), subjects.engine_resync("*"), subjects.detok("*"),
              subjects.placed("*"), f"{subjects.JOBS_RESULT_PREFIX}.>"]
    functions = [k for k, v in vars(subjects).items() if callable(v) and getattr(v, "__module__", "") == subjects.__name__
                 and not k.startswith(("is_valid_", "_"))]  # the subject makers, not the checks of ids
    assert sorted(functions) == ["detok", "engine_admit", "engine_replay", "engine_result", "engine_resync",
                                 "engine_step", "jobs_result", "placed"]
    assert [n for n in names if f'"{n}"' not in conf] == []


class User:
    """A connection as one user, made the way services connect (credentials from the environment,
    the user's own inbox prefix), that keeps the server's permission errors."""

    def __init__(self) -> None:
        self.nc: Client | None = None
        self.errors: list[str] = []

    @classmethod
    async def connect(cls, server: LocalNatsServer, user: str, monkeypatch: pytest.MonkeyPatch) -> User:
        self = cls()
        monkeypatch.setenv("ORCA_NATS_USER", user)
        monkeypatch.setenv("ORCA_NATS_PASSWORD", PASSWORDS[user])

        async def on_error(exc: Exception) -> None:
            self.errors.append(str(exc))

        self.nc = await nats.connect(server.url, error_cb=on_error, allow_reconnect=False, **auth_options(server.url))
        return self

    def denied(self) -> bool:
        return any("permissions violation" in e.lower() for e in self.errors)

    async def refused(self) -> bool:
        """Whether the server refused something this connection sent: it answers a refused SUB or
        PUB with -ERR before it answers the PING behind it, so once `synced` it has said so."""
        await synced(self.nc)
        return self.denied()


async def published(server, monkeypatch, publisher: str, subject: str, observer: str) -> tuple[bool, bool]:
    """Whether `observer` (a user allowed to subscribe there) receives what `publisher` publishes
    once to `subject`, and whether the server refused the publisher. Both connections are fresh.
    No waiting for a message that may never come: once the server has processed the PUB, a delivery
    is already queued to the observer, ahead of the PONG that answers the observer's PING."""
    watcher = await User.connect(server, observer, monkeypatch)
    sender = await User.connect(server, publisher, monkeypatch)
    try:
        sub = await watcher.nc.subscribe(subject)
        assert not await watcher.refused(), watcher.errors  # the subscription is in place
        await sender.nc.publish(subject, b"probe")
        denied = await sender.refused()  # the PUB was processed: delivered, or refused
        await synced(watcher.nc)  # so a delivery, if any, has reached the subscription's queue
        got = sub.pending_msgs > 0
        return got, denied
    finally:
        await sender.nc.close()
        await watcher.nc.close()


# (publisher, subject, a user that subscribes there): what each service does (shared/subjects.py).
ALLOWED = [
    ("client", subjects.GENERATE, "tokenizer"),
    ("client", subjects.GENERATE_REPLAY, "tokenizer"),  # events it missed, again (shared/client.py)
    ("client", subjects.ABORT, "admission"),
    ("gateway", subjects.GENERATE, "tokenizer"),
    ("gateway", subjects.GENERATE_REPLAY, "tokenizer"),
    ("gateway", subjects.ABORT, "admission"),
    ("jobs", subjects.GENERATE, "tokenizer"),
    ("jobs", subjects.GENERATE_REPLAY, "tokenizer"),  # a job follows the client rule too
    ("tokenizer", subjects.ADMISSION_SUBMIT, "admission"),
    ("tokenizer", subjects.CANCEL, "engine"),
    ("tokenizer", subjects.ABORT, "admission"),  # ends what it held when NATS came back or at a drain
    ("admission", subjects.engine_admit("0"), "engine"),
    ("admission", subjects.ADMISSION_STATUS, "gateway"),
    ("admission", subjects.CANCEL, "engine"),
    ("admission", subjects.detok("t1"), "tokenizer"),
    ("engine", subjects.engine_step("0"), "engine"),
    ("engine", subjects.engine_result("0"), "engine"),
    ("engine", subjects.engine_resync("0"), "engine"),  # a worker back on NATS tells its master
    ("tokenizer", subjects.engine_replay("0"), "engine"),  # asks a master for the outputs it missed
    ("engine", subjects.ENGINE_STATUS, "admission"),
    ("engine", subjects.ENGINE_STATUS, "gateway"),
    ("engine", subjects.ENGINE_PROGRESS, "admission"),
    ("engine", subjects.detok("t1"), "tokenizer"),
    ("tokenizer", subjects.METRICS, "gateway"),
    # A stream's events, on a connection that never received its request (the tokenizer reconnected,
    # or NATS failed over): every inbox prefix a producer or a service may use.
    ("tokenizer", "_INBOX.abc", "client"),
    ("tokenizer", "_INBOX_client.abc", "client"),
    ("tokenizer", "_INBOX_gateway.abc", "gateway"),
    ("tokenizer", "_INBOX_jobs.abc", "jobs"),
    ("admission", subjects.METRICS, "gateway"),
    ("engine", subjects.METRICS, "gateway"),
    ("jobs", subjects.METRICS, "gateway"),
]
DENIED = [
    ("tokenizer", subjects.engine_step("0"), "engine"),
    ("tokenizer", subjects.engine_admit("0"), "engine"),
    ("tokenizer", subjects.ENGINE_STATUS, "admission"),
    ("client", subjects.ADMISSION_SUBMIT, "admission"),
    ("client", subjects.engine_admit("0"), "engine"),
    ("client", subjects.engine_step("0"), "engine"),
    ("client", subjects.CANCEL, "engine"),
    ("client", subjects.detok("t1"), "tokenizer"),
    ("client", subjects.ENGINE_STATUS, "admission"),
    ("client", subjects.ENGINE_PROGRESS, "admission"),
    ("tokenizer", subjects.ENGINE_PROGRESS, "admission"),
    ("client", subjects.engine_replay("0"), "engine"),
    ("gateway", subjects.ADMISSION_SUBMIT, "admission"),
    ("gateway", subjects.engine_replay("0"), "engine"),
    ("admission", subjects.engine_resync("0"), "engine"),
    ("gateway", subjects.engine_admit("0"), "engine"),
    ("jobs", subjects.engine_admit("0"), "engine"),
    ("engine", subjects.ADMISSION_SUBMIT, "admission"),
    ("admission", subjects.engine_step("0"), "engine"),
    ("client", subjects.METRICS, "gateway"),
    ("tokenizer", "_INBOX_admission.abc", "admission"),  # no service's own inbox but those that send it requests
    ("tokenizer", "_INBOX_engine.abc", "engine"),
]


@pytest.mark.parametrize("publisher,subject,observer", ALLOWED)
def test_service_user_may_publish_what_it_needs(server, monkeypatch, publisher, subject, observer):
    got, denied = asyncio.run(published(server, monkeypatch, publisher, subject, observer))
    assert got and not denied


@pytest.mark.parametrize("publisher,subject,observer", DENIED)
def test_user_may_not_publish_elsewhere(server, monkeypatch, publisher, subject, observer):
    got, denied = asyncio.run(published(server, monkeypatch, publisher, subject, observer))
    assert denied and not got


@pytest.mark.parametrize("user,subject", [
    ("client", "_INBOX_gateway.>"),  # another user's replies: a gateway's token events
    ("client", subjects.detok("t1")),
    ("client", subjects.ADMISSION_SUBMIT),
    ("tokenizer", subjects.engine_step("0")),
    ("gateway", "_INBOX.>"),
    ("jobs", subjects.GENERATE),
])
def test_user_may_not_subscribe_elsewhere(server, monkeypatch, user, subject):
    async def run() -> bool:
        u = await User.connect(server, user, monkeypatch)
        try:
            await u.nc.subscribe(subject)
            return await u.refused()
        finally:
            await u.nc.close()
    assert asyncio.run(run())


def test_wrong_or_missing_password_is_refused(server):
    async def run(url: str) -> None:
        nc = await nats.connect(url, allow_reconnect=False, connect_timeout=2, max_reconnect_attempts=0)
        await nc.close()
    with pytest.raises(Exception):
        asyncio.run(run(server.url_for("engine", "not-the-password")))
    with pytest.raises(Exception):
        asyncio.run(run(server.url))
    asyncio.run(run(server.url_for("engine", PASSWORDS["engine"])))


@pytest.mark.parametrize("responder, subject, asker, events, queue, unsolicited", [
    # The tokenizer answers a request's reply subject many times (one event per iteration), and also
    # after a reconnect, when the server no longer knows which request named it: so on any inbox.
    ("tokenizer", subjects.GENERATE, "client", 20, subjects.TOKENIZER_QUEUE, True),
    # An engine master answers a tokenizer's replay question once, on the question's reply subject.
    ("engine", subjects.engine_replay("0"), "tokenizer", 1, "", False),
])
def test_answers_go_to_reply_subjects(server, monkeypatch, responder, subject, asker, events, queue, unsolicited):
    """A service may answer on the reply subject a request gave it; only the tokenizer on an inbox nobody gave it."""
    async def run() -> tuple[int, bool, bool]:
        answering = await User.connect(server, responder, monkeypatch)
        asking = await User.connect(server, asker, monkeypatch)
        try:
            count, denied = await streamed(answering, subject, asking, events, queue=queue)
            await answering.nc.publish(asking.nc.new_inbox(), b"unsolicited")
            return count, denied, await answering.refused()
        finally:
            await asking.nc.close()
            await answering.nc.close()
    count, denied_while_answering, unsolicited_denied = asyncio.run(run())
    assert count == events and not denied_while_answering and unsolicited_denied is not unsolicited


async def streamed(responder: User, subject: str, asker: User, events: int, queue: str = "") -> tuple[int, bool]:
    """How many of the `events` that `responder` sends to the reply subject of a request on
    `subject` reach `asker`, in order (the request published once, on the asker's fresh
    connection; a request nobody listened to would get the server's "no responders" status there
    instead), and whether the server refused either of them anything."""
    async def on_request(msg) -> None:
        for i in range(events):
            await responder.nc.publish(msg.reply, str(i).encode())

    sub = await responder.nc.subscribe(subject, queue=queue, cb=on_request)
    try:
        assert not await responder.refused(), responder.errors  # it listens before anyone asks
        inbox = asker.nc.new_inbox()
        replies = await asker.nc.subscribe(inbox)  # the same connection as the request: the server has it first
        await asker.nc.publish(subject, b"{}", reply=inbox)
        received = 0
        try:
            while received < events and (await replies.next_msg(timeout=5)).data == str(received).encode():
                received += 1
        except nats.errors.TimeoutError:
            pass
        await replies.unsubscribe()
        return received, responder.denied() or asker.denied()
    finally:
        await sub.unsubscribe()


def test_producer_submits_jobs_and_reads_results_but_cannot_manage_streams(server, monkeypatch):
    async def run() -> None:
        jobs = await User.connect(server, "jobs", monkeypatch)
        client = await User.connect(server, "client", monkeypatch)
        try:
            await ensure_streams(jobs.nc)  # as the jobs service does at start
            result = await job_round_trip(jobs, client, "j1")
            assert result == b'{"id": "j1"}'
            with pytest.raises(nats.errors.TimeoutError):
                await client.nc.request(f"$JS.API.STREAM.DELETE.{subjects.JOBS_STREAM}", b"", timeout=0.5)
            assert await client.refused()
            assert (await jobs.nc.jetstream().stream_info(subjects.JOBS_STREAM)).config.name == subjects.JOBS_STREAM
        finally:
            await client.nc.close()
            await jobs.nc.close()
    asyncio.run(run())


async def job_round_trip(jobs: User, client: User, job_id: str) -> bytes:
    """The client submits a job (acked by JetStream, deduplicated by id), the jobs user stores its
    result, the client reads it back: each a single JetStream request, none asked twice."""
    body = f'{{"id": "{job_id}"}}'.encode()
    ack = await client.nc.jetstream().publish(subjects.JOBS_SUBMIT, body, headers={"Nats-Msg-Id": job_id})
    assert ack.stream == subjects.JOBS_STREAM
    await jobs.nc.jetstream().publish(subjects.jobs_result(job_id), body)
    result = await client.nc.jetstream().get_last_msg(subjects.JOBS_RESULTS_STREAM, subjects.jobs_result(job_id))
    return result.data


FRESH_CONNECTIONS = 300


def test_every_fresh_connection_gets_its_first_message(server, monkeypatch):
    """300 fresh connection pairs in a row through each path above (a subscriber and a publisher of
    ALLOWED, a request answered on its reply subject, a job submitted and its result read): every
    first message arrives, sent once. With a plain nats.py flush() instead of `synced`, 5-10 of
    these 900 pairs lose their first message."""
    async def run() -> list[str]:
        lost = []
        for i in range(FRESH_CONNECTIONS):
            publisher, subject, observer = ALLOWED[i % len(ALLOWED)]
            got, denied = await published(server, monkeypatch, publisher, subject, observer)
            if not got or denied:
                lost.append(f"{i}: {publisher} -> {subject} -> {observer} (got={got}, denied={denied})")
        for i in range(FRESH_CONNECTIONS):
            tokenizer = await User.connect(server, "tokenizer", monkeypatch)
            client = await User.connect(server, "client", monkeypatch)
            try:
                count, denied = await streamed(tokenizer, subjects.GENERATE, client, 2, queue=subjects.TOKENIZER_QUEUE)
            finally:
                await client.nc.close()
                await tokenizer.nc.close()
            if count != 2 or denied:
                lost.append(f"{i}: request -> tokenizer -> reply ({count} of 2 events, denied={denied})")
        for i in range(FRESH_CONNECTIONS):
            jobs = await User.connect(server, "jobs", monkeypatch)
            client = await User.connect(server, "client", monkeypatch)
            job_id = f"fresh-{i}-{secrets.token_hex(4)}"
            try:
                await ensure_streams(jobs.nc)  # there already: JetStream answers with the stream
                if await job_round_trip(jobs, client, job_id) != f'{{"id": "{job_id}"}}'.encode():
                    lost.append(f"{i}: job {job_id}: another result")
            except nats.errors.TimeoutError:
                lost.append(f"{i}: job {job_id}: a JetStream request timed out")
            finally:
                await client.nc.close()
                await jobs.nc.close()
        return lost
    assert asyncio.run(run()) == []


def test_service_logs_do_not_show_the_password(server):
    """A NATS URL with a password is logged without it."""
    password = PASSWORDS["admission"]
    process = subprocess.Popen(
        [sys.executable, "-m", "services.admission", "--nats-url", server.url_for("admission", password),
         "--log-level", "DEBUG"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        lines = []
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "ready on" in line:
                break
    finally:
        process.terminate()
        lines.append(process.communicate(timeout=30)[0])
    output = "".join(lines)
    assert "ready on nats://admission:***@127.0.0.1" in output, output[-2000:]
    assert password not in output


@pytest.mark.parametrize("service", ["admission", "tokenizer", "jobs", "engine"])
@pytest.mark.parametrize("wrong", ["password", "none"])
def test_a_service_given_wrong_or_no_credentials_says_so_and_exits_at_once(server, demo_model, service, wrong):
    """Refused credentials never start working: one line naming the fix and status 1, not a retry for ever
    (compose and Kubernetes restart the container and show the line again)."""
    password = PASSWORDS[service]
    url = server.url_for(service, "not-the-password") if wrong == "password" else server.url
    args = ["--model", demo_model] if service in ("tokenizer", "engine") else []  # the engine: before Ray starts
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ORCA_NATS")}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", f"services.{service}", "--nats-url", url, *args], cwd=ROOT,
                          env=environ, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    what = "refused the credentials of" if wrong == "password" else "wants credentials from"
    assert last.startswith(f"NATS at {server.url.split('//')[0]}//") and what in last, done.stderr[-2000:]
    assert "ORCA_NATS_USER" in last and "Traceback" not in done.stderr
    assert password not in done.stderr and "not-the-password" not in done.stderr
    assert time.monotonic() - started < 30


def test_a_refusal_after_the_first_connect_is_one_more_reconnect_to_wait_through(server):
    """Only the first connect gives up: a connected service whose server comes back refusing it (accounts
    being changed) keeps its requests and tries again, as it does for a server that is away."""
    from services.bus import CredentialsRefused, connect

    async def run() -> None:
        nc = await connect(server.url_for("engine", PASSWORDS["engine"]), "orca-test")
        assert nc.is_connected
        await nc._error_cb(nats.errors.AuthorizationError())  # what nats.py reports on a refused reconnect
        assert nc.is_connected
        await nc.close()
        with pytest.raises(CredentialsRefused):
            await connect(server.url_for("engine", "not-the-password"), "orca-test")
    asyncio.run(run())


def test_orca_serve_with_refused_credentials_is_one_line(server):
    from services.serve import _connect_until

    async def run() -> None:
        await _connect_until(server.url_for("engine", "not-the-password"), time.monotonic() + 30, 30,
                             lambda: False)
    with pytest.raises(ValueError, match="refused the credentials of orca-serve-probe"):
        asyncio.run(run())
