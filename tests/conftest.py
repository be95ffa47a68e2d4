import os
import sys
from collections.abc import Iterator

# Triton reads this when its kernels are first defined: set it before any test imports kernels/,
# so the Triton kernels run under the interpreter on this CPU machine whatever the collection order.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory) -> str:
    """The tiny demo Llama (random weights, locally trained tokenizer), made once per session."""
    from model.demo import make_demo_model

    return str(make_demo_model(tmp_path_factory.mktemp("demo") / "demo-llama", arch="llama", size="tiny"))


@pytest.fixture(scope="session")
def demo_gpt2(tmp_path_factory) -> str:
    """The tiny demo GPT-2 (random weights, locally trained tokenizer), made once per session."""
    from model.demo import make_demo_model

    return str(make_demo_model(tmp_path_factory.mktemp("demo") / "demo-gpt2", arch="gpt2", size="tiny"))


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    """A real nats-server on a free loopback port, one per test module that asks for it."""
    from services.nats_server import LocalNatsServer

    server = LocalNatsServer().start()
    yield server.url
    server.cleanup()


def xdist_group_of(item: pytest.Item) -> str:
    """The pytest-xdist group a test runs in (`make test` runs two workers, `--dist loadgroup`): the
    tests that share a session's `orca serve` in one group each (the reliability stack, which its drain
    test stops last; the gateway stack), tests/deploy whole (its NATS clusters elect JetStream leaders,
    slow enough under load without a second cluster starting beside them), every other module whole,
    so that a module's own stack starts once."""
    path = item.path.relative_to(ROOT).as_posix()
    fixtures = getattr(item, "fixturenames", ())
    if path.startswith("tests/reliability/") and "stack" in fixtures:
        return "reliability"
    if "gateway" in fixtures:
        return "gateway"
    if path.startswith("tests/deploy/"):
        return "deploy"
    return path


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Group every test (above), and put the reliability stack's group first: it is the longest
    (about 6 minutes), so one worker starts it at once while the other takes everything else."""
    for item in items:
        item.add_marker(pytest.mark.xdist_group(xdist_group_of(item)))
    items.sort(key=lambda item: xdist_group_of(item) != "reliability")
