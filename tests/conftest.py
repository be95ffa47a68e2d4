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


ALONE = "tests/reliability/"
"""Tests that `make test` runs after the end-to-end ones, alone (`-m alone`; only the unit tests beside
them, at nice 19): they time how fast the stack recovers from a fault (a restarted engine master must
serve again within 30 s), and other tests' stacks starting on the same two cores stretch those times
past their limits."""
NATS_CLUSTER = "tests/reliability/test_nats_cluster.py"
"""The one reliability module with its own stack (on a NATS cluster): `-m alone` runs it on a second
worker beside the shared stack's tests. Both stacks start together, at the start; it is done in about a
minute, while the shared stack runs its light tests (tests/reliability/conftest.py LIGHT) and before the
chaos matrix's tight /health limits. Run one after the other, the phase kept the two cores 22% busy."""
BACKPRESSURE = "tests/gateway/test_backpressure.py"
GROUPS: dict[str, tuple[str, ...]] = {
    NATS_CLUSTER: (NATS_CLUSTER,),
    "reliability": (ALONE,),
    BACKPRESSURE: (BACKPRESSURE,),
    "gateway": ("tests/gateway/",),
    "deploy": ("tests/deploy/",),
}
"""Tests that must run in one pytest-xdist worker, by the path their ids start with: tests/reliability
(but NATS_CLUSTER) shares one `orca serve` (its drain test stops it, last); tests/gateway another
(test_backpressure, which starts its own, is a group by itself); tests/deploy starts NATS
clusters whose JetStream leader elections are slow enough under load without a second cluster electing
beside them. Every other module is a group of its own (a module's own stack starts once)."""
LONGEST_FIRST = ("reliability", NATS_CLUSTER, "gateway", "tests/parallel/test_parallel_serve.py", BACKPRESSURE,
                 "tests/observability/test_end_to_end.py", "deploy",
                 "tests/services/test_pipeline.py", "tests/model/test_compiled_step.py",
                 "tests/model/test_hf_equivalence.py")
"""The groups that take longest (each starts a stack, or compiles), handed out first so that no worker
is left with a long one at the end; the rest follow as collected."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "alone: run after the other tests, by themselves (tests/conftest.py ALONE)")


def group_of(nodeid: str) -> str:
    """The group of a test id: a name of GROUPS, or its module."""
    path = nodeid.split("::", 1)[0]
    return next((name for name, prefixes in GROUPS.items() if path.startswith(prefixes)), path)


@pytest.hookimpl(tryfirst=True)  # before -m selects by it
def pytest_itemcollected(item: pytest.Item) -> None:
    if item.nodeid.startswith(ALONE):
        item.add_marker(pytest.mark.alone)


@pytest.hookimpl(trylast=True)  # after tests/reliability's, which puts its drain test last
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest groups first, the rest as collected."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(group_of(item.nodeid), len(LONGEST_FIRST)))


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`make test`'s two workers (-n 2) take whole groups (`group_of`), in collection order.
    pytest-xdist's own --dist loadgroup reads its groups into test ids that pytest 9 no longer uses."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return GroupScheduling(config, log)
