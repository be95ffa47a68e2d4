import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory) -> str:
    """The tiny demo Llama (random weights, locally trained tokenizer), made once per session."""
    from model.demo import make_demo_model

    return str(make_demo_model(tmp_path_factory.mktemp("demo") / "demo-llama", arch="llama", size="tiny"))
