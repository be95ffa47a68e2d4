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
