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


STACK_GROUPS = ("tests/reliability/", "tests/gateway/", "tests/deploy/")
"""Folders whose tests run in one pytest-xdist worker each, in this order, before everything else:
tests/reliability shares one `orca serve` (its drain test stops it, last) and is the longest group
(about 7 minutes), so one worker starts it at once while the other takes the rest; tests/gateway
shares another stack; tests/deploy starts NATS clusters whose JetStream leader elections are slow
enough under load without a second cluster electing beside them."""


def group_of(nodeid: str) -> str:
    """The group of a test id: one of STACK_GROUPS, or its module (a module's own stack starts once)."""
    path = nodeid.split("::", 1)[0]
    return next((folder for folder in STACK_GROUPS if path.startswith(folder)), path)


@pytest.hookimpl(trylast=True)  # after tests/reliability's, which puts its drain test last
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The stack groups first, in STACK_GROUPS' order; the rest as collected."""
    rank = {folder: i for i, folder in enumerate(STACK_GROUPS)}
    items.sort(key=lambda item: rank.get(group_of(item.nodeid), len(STACK_GROUPS)))


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`make test`'s two workers (-n 2) take whole groups (`group_of`), in collection order.
    pytest-xdist's own --dist loadgroup reads its groups into test ids that pytest 9 no longer uses."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return GroupScheduling(config, log)
