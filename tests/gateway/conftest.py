import pytest

from tests.gateway.helpers import GatewayServe

MODEL_NAME = "demo"


@pytest.fixture(scope="package")
def gateway(demo_model):
    """One `orca serve` (real nats-server, real local Ray, Ray Serve gateway) for the gateway tests
    that do not need a special configuration; stopped once they have run, not left idle (its Ray
    and Serve processes cost CPU) while the rest of the suite runs."""
    serve = GatewayServe(["--model", demo_model, "--max-num-seqs", "4", "--kv-cache-tokens", "16384",
                          "--worker-threads", "1", "--served-model-name", MODEL_NAME])
    yield serve
    assert serve.stop() == 0
    # what a user reads: no Ray Serve INFO line naming its unused proxy's port as if it served, no
    # "graceful_shutdown failed ... will be retried" from serve.shutdown on a cluster ray.shutdown ends
    noise = [line for line in serve.log if "is ready at http" in line or "will be retried" in line]
    assert not noise, noise
